// `ess bench indexer`: the lightning indexer of one layer on the GPU for a decode batch,
// FP8 logits over every request's whole indexer cache (64-token pages scattered through a
// device arena by a shuffled page table) and the top-k of every query token, timed with
// CUDA events: logits alone, top-k alone and both back to back. One step is first checked
// against the CPU references (ess::ref::indexer_logits within test::kIndexerLogitsTolerance,
// ess::ref::topk bit for bit on the GPU's logits) for two query tokens.
#pragma once

#include <cstdint>
#include <string>

#include "testing/stats.h"

namespace ess::cuda {

struct IndexerBenchConfig {
  int batch = 64;
  int query_tokens = 2;         // MTP T: query token t of a request sees context - T + 1 + t keys
  std::int64_t context = 32768;
  int heads = 64;
  int topk = 2048;
  int repeats = 50;
  int warmup = 5;
  std::uint64_t seed = 1;
  int device = 0;
};

struct IndexerBenchResult {
  std::string device;
  std::string date;
  bool verified = false;
  std::string verify_note;          // what disagreed, when not verified
  double worst_error_over_bound = 0;  // of the checked logits
  test::Summary logits_us;                // per layer
  test::Summary topk_us;
  test::Summary indexer_us;               // logits then top-k, back to back
  double keys = 0;                  // (query token, key) pairs scored per layer
  double bytes_read = 0;            // per layer: every needed key page once per request, q, w
  double page_bytes = 0;            //   of which key pages
  double bytes_written = 0;         // per layer: the logits
  double flops = 0;                 // per layer (indexer_flops)
  double hbm_peak_gbps = 0;         // from the memory clock and bus width
  double logits_gbps = 0;           // bytes_read / median logits time
  double logits_tflops = 0;         // flops / median logits time
};

IndexerBenchResult run_indexer_bench(const IndexerBenchConfig& config);

}  // namespace ess::cuda
