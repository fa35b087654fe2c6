// The ops of a DeepSeek-V3.2 decode step by name: the simulator's op tables, the rig
// executor's stand-ins and `ess bench profile` all use these names, so that what the rig
// measures feeds the simulator table for table.
#pragma once

#include <string>
#include <string_view>

namespace ess {
namespace op {

// The GEMMs of a layer.
inline constexpr std::string_view kProj0 = "attn.norm+proj0 (q_a kv_a idx_k idx_w)";
inline constexpr std::string_view kIndexerWqB = "indexer.wq_b";
inline constexpr std::string_view kQbProj = "preattn.q_b_proj";
inline constexpr std::string_view kAbsorbBmm = "preattn.absorb_bmm";
inline constexpr std::string_view kOutBmm = "postattn.out_bmm";
inline constexpr std::string_view kOProj = "postattn.o_proj";
inline constexpr std::string_view kGate = "moe.norm+gate";
inline constexpr std::string_view kSharedExpert = "moe.shared_expert";
inline constexpr std::string_view kRoutedExperts = "moe.routed_experts";
// The attention stack.
inline constexpr std::string_view kIndexerLogits = "indexer.logits";
inline constexpr std::string_view kIndexerTopk = "indexer.topk";
inline constexpr std::string_view kSwap = "swap.lru+split";
inline constexpr std::string_view kQueryGroups = "swap.query_groups";  // the extra calls of split steps
inline constexpr std::string_view kSparseMla = "attn.sparse_mla";
inline constexpr std::string_view kAttn0 = "attn.attn0 (resident)";
inline constexpr std::string_view kAttn1 = "attn.attn1 (fetched)";
inline constexpr std::string_view kMerge = "attn.merge_lse";
inline constexpr std::string_view kGqa = "attn.gqa";  // grouped-query attention over K / V (MiniMax-M3)
// Transfers and communication.
inline constexpr std::string_view kD2HNewEntries = "d2h new-token entries";
inline constexpr std::string_view kH2DMisses = "h2d misses";
inline constexpr std::string_view kH2DMissesHalf0 = "h2d misses (half 0)";  // DBA's two copies
inline constexpr std::string_view kH2DMissesHalf1 = "h2d misses (half 1)";
inline constexpr std::string_view kH2DPrefetch = "h2d prefetch";  // a shared-index follower's, at its leader
inline constexpr std::string_view kDispatch = "moe.dispatch";
inline constexpr std::string_view kCombine = "moe.combine";
inline constexpr std::string_view kAllReduce = "tp.all_reduce";  // attention tensor parallel's sum of outputs

}  // namespace op

// Every op name above (what an op table may name).
bool is_op_name(std::string_view name);
std::string op_names_list();  // comma-separated, for messages

// The GEMMs of a layer, as the rig's stand-ins run them.
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
std::string_view op_name(GemmOp op);

}  // namespace ess
