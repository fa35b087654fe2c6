// `ess bench attention`: the sparse MLA decode (sparse_mla.h) at decode-batch shapes, timed
// with CUDA events, after one call is checked against the CPU reference. Entries are random
// valid 656-byte latents in a device slot array (one region of `slots` entries per request);
// each query token selects `topk` distinct random slots. Issue target: >= 150 TFLOP/s at
// batch 128, T 2, 128 heads, top-k 2048 (FlashMLA's FP8 sparse decode: 410 on H800).
//
// Also here: the accuracy contract of the decode against ess::ref, shared by the benchmark's
// verification and tests/cuda/sparse_mla_test.cc.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ess/core/stats.h"
#include "ess/kernels/ref/reference.h"

namespace ess::cuda {

struct AttentionBenchConfig {
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

struct AttentionBenchPoint {
  int batch = 0;
  Summary us;                 // per call
  double tflops = 0;          // at the median time (sparse_mla_flops convention)
  double tflops_best = 0;     // at the minimum time
  double bytes_per_call = 0;  // entries (each selected entry once per query token) + q + out + lse
  double gbps = 0;            // bytes_per_call at the median time
};

struct AttentionBenchResult {
  std::string device;
  std::string date;
  float softmax_scale = 0;     // the one used
  bool verified = false;       // the checked tokens are within the accuracy contract
  double verify_worst = 0;     // worst |error| / bound over the checked outputs (<= 1 passes)
  int verified_tokens = 0;
  double flops_per_call = 0;   // at config.batch
  std::vector<AttentionBenchPoint> points;  // one per batch size, in the order asked
};

// `batches`: the batch sizes to time (empty: config.batch alone); the largest sets the
// allocation, the check runs at config.batch.
AttentionBenchResult run_attention_bench(const AttentionBenchConfig& config, const std::vector<int>& batches = {});

// ---- accuracy contract ------------------------------------------------------------------------
// The GPU decode of one query token against ess::ref::sparse_mla_decode_f32 (which sums in
// double). With q . k exact products summed in fp32 over 576 dims, P rounded to bf16 and
// fp32 accumulation over n valid entries (sparse_mla.cu), per head h and value dim d:
//   score error   Delta_h = scale * 577 * 2^-23 * max_j sum_d |q_hd| |k_jd|
//                           + 2^-20 max_j |s_hj| + 2^-21
//                 (fp32 sums with up to one rounding per term, exchange add included; the
//                 prescale, the subtraction of the running max and exp2's 2-ulp error)
//   eps_h         = 2^-8                (P rounded to bf16: relative 2^-8)
//                 + expm1(2 Delta_h)    (softmax weights of perturbed scores: w'_j / w_j in
//                                        [e^-2Delta, e^2Delta])
//                 + 2 n 2^-23           (fp32 accumulation of O and of l over n entries)
//                 + 2^-20               (final division, rescale factors, slack)
//   |o - o_ref|   <= eps_h * V_d + 1e-30,  V_d = max over valid j of |v_jd|
//   bf16 output:  <= eps_h V_d + 2^-8 (|o_ref| + eps_h V_d) + 1e-30   (one more rounding)
//   |lse - ref|   <= Delta_h + 2 n 2^-23 + 2^-20 (1 + |lse_ref|)
// plus `slack` * V_d (o) and `slack` (lse) for callers that add rounding of their own. With
// `merged`, the output is a merge of partial decodes over disjoint parts of the ids, whose
// lse values carry the error above: the merge weights exp(lse_part - lse) are then off by up
// to a factor e^(2 x lse bound), so eps_h gains expm1(2 x lse bound). A query token with no
// valid entry must give lse = -inf and o = 0 exactly; NaN or infinities anywhere else fail
// the check.
struct DecodeCheck {
  double worst = 0;         // max |error| / bound over o and lse (<= 1 passes)
  std::string worst_at;     // "head h dim d" / "head h lse" of the worst
  std::string structural;   // the first non-finite / emptiness mismatch, empty if none
  bool ok() const { return structural.empty() && worst <= 1.0; }
};
// q: [heads][576] bf16 bits; entries: K pointers (nullptr = masked); out: [heads][512] as
// floats (the bf16 output converted when out_is_bf16); lse: [heads].
DecodeCheck check_decode_token(const ref::SparseMlaParams& p, std::span<const std::uint16_t> q,
                               std::span<const std::uint8_t* const> entries, std::span<const float> out,
                               bool out_is_bf16, std::span<const float> lse, double slack = 0.0,
                               bool merged = false);

}  // namespace ess::cuda
