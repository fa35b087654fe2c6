// The ops of the executor's step by the simulator's names (src/ess/sim/step_model.cc), so
// that what `ess bench profile` measures feeds `ess sim` table for table. Host code.
#pragma once

#include <string_view>

namespace ess::pipeline {

// The stand-in GEMMs of a layer (gemm.h runs them).
enum class GemmOp {
  kProj0,          // q_a, kv_a, indexer k / weights: hidden -> q_lora + kv_lora + rope + 128 + 64
  kIndexerWqB,     // q_lora -> index heads x index dim
  kQbProj,         // q_lora -> heads x (nope + rope)
  kAbsorbBmm,      // per head: nope -> kv_lora (q absorbed into the latent space)
  kOutBmm,         // per head: kv_lora -> v_head_dim
  kOProj,          // heads x v_head_dim -> hidden
  kGate,           // hidden -> routed experts
  kSharedExpert,   // hidden -> 2 x moe_inter -> hidden
  kRoutedExperts,  // ceil(E / EP) local experts, n x top-8 / local rows each
};
inline constexpr GemmOp kAllGemmOps[] = {GemmOp::kProj0,  GemmOp::kIndexerWqB, GemmOp::kQbProj,
                                          GemmOp::kAbsorbBmm, GemmOp::kOutBmm, GemmOp::kOProj,
                                          GemmOp::kGate, GemmOp::kSharedExpert, GemmOp::kRoutedExperts};
std::string_view sim_name(GemmOp op);

// The other ops `StepExecutor::time_op` measures.
inline constexpr std::string_view kOpIndexerLogits = "indexer.logits";
inline constexpr std::string_view kOpIndexerTopk = "indexer.topk";
inline constexpr std::string_view kOpSwap = "swap.lru+split";
inline constexpr std::string_view kOpSparseMla = "attn.sparse_mla";
inline constexpr std::string_view kOpMerge = "attn.merge_lse";

}  // namespace ess::pipeline
