// Accuracy contracts of the GPU kernels against the CPU references: how far a GPU result may
// lie from ess::ref's, derived from the kernel's arithmetic. Shared by the tests (CPU halves
// and GPU halves) and the benchmarks' verification; plain C++, built without CUDA.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "ess/ops/reference.h"

namespace ess::test {

// ---- Sparse MLA decode (runtime/ops/sparse_mla) --------------------------------------------
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

// ---- Lightning indexer logits (runtime/ops/indexer/indexer.cu) --------------------------------------------
// Relative error bound of the GPU logits: |gpu - ref| <= tolerance * scale_j * sum_h |w_h|
// * sum_d |q_hd k_jd|. 160 units of 2^-13 for the FP8 tensor core's truncating ~13-bit
// accumulator over 4 chained k = 32 steps, 24 units of 2^-24 for the fp32 head sum and the
// final roundings; derived in src/runtime/ops/indexer/indexer_problem.h.
inline constexpr double kIndexerLogitsTolerance = 160.0 / 8192.0 + 24.0 / 16777216.0;

// The CPU reference of one query token, shared by the benchmark's check and the tests:
// logits[j] = ess::ref::indexer_logits over the first `length` keys of `pages` with q decoded
// from its FP8 bytes ([heads][128]), and bound[j] = kIndexerLogitsTolerance * scale_j *
// sum_h |w_h| sum_d |q_hd k_jd|, the error a GPU logit is allowed. Both spans hold `length`.
void indexer_reference(std::span<const std::uint8_t> q_fp8, std::span<const float> w, int heads,
                       std::span<const std::uint8_t* const> pages, std::int64_t length, std::span<float> logits,
                       std::span<double> bound);

}  // namespace ess::test
