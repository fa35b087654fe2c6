// `ess bench attention`: the sparse MLA decode (sparse_mla.h) at decode-batch shapes, timed
// with CUDA events, after one call is checked against the CPU reference. Entries are random
// valid 656-byte latents in a device slot array (one region of `slots` entries per request);
// each query token selects `topk` distinct random slots. Issue target: >= 150 TFLOP/s at
// batch 128, T 2, 128 heads, top-k 2048 (FlashMLA's FP8 sparse decode: 410 on H800).
//
// The benchmark's check uses the decode's accuracy contract (testing/accuracy.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "testing/stats.h"

namespace ess::cuda {

struct SparseMlaBenchConfig {
  int batch = 128;          // requests (B)
  int query_tokens = 2;     // T (MTP)
  int heads = 128;
  int topk = 2048;          // K
  std::int32_t slots = 6554;  // Sparse Memory Pool slots per request
  float softmax_scale = 0.0f;  // 0: 1 / sqrt(192), DeepSeek-V3.2's (qk_nope 128 + qk_rope 64)
  int repeats = 20;
  int warmup = 5;
  int verify_tokens = 3;    // query tokens (first, last, ...) checked against the CPU reference
  std::uint64_t seed = 1;
  int device = 0;
};

struct SparseMlaBenchPoint {
  int batch = 0;
  test::Summary us;                 // per call
  double tflops = 0;          // at the median time (sparse_mla_flops convention)
  double tflops_best = 0;     // at the minimum time
  double bytes_per_call = 0;  // entries (each selected entry once per query token) + q + out + lse
  double gbps = 0;            // bytes_per_call at the median time
};

struct SparseMlaBenchResult {
  std::string device;
  std::string date;
  float softmax_scale = 0;     // the one used
  bool verified = false;       // the checked tokens are within the accuracy contract
  double verify_worst = 0;     // worst |error| / bound over the checked outputs (<= 1 passes)
  int verified_tokens = 0;
  double flops_per_call = 0;   // at config.batch
  std::vector<SparseMlaBenchPoint> points;  // one per batch size, in the order asked
};

// `batches`: the batch sizes to time (empty: config.batch alone); the largest sets the
// allocation, the check runs at config.batch.
SparseMlaBenchResult run_sparse_mla_bench(const SparseMlaBenchConfig& config, const std::vector<int>& batches = {});

}  // namespace ess::cuda
