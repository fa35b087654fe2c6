#include "ess/pipeline/ops.h"

namespace ess::pipeline {

std::string_view sim_name(GemmOp op) {
  switch (op) {
    case GemmOp::kProj0: return "attn.norm+proj0 (q_a kv_a idx_k idx_w)";
    case GemmOp::kIndexerWqB: return "indexer.wq_b";
    case GemmOp::kQbProj: return "preattn.q_b_proj";
    case GemmOp::kAbsorbBmm: return "preattn.absorb_bmm";
    case GemmOp::kOutBmm: return "postattn.out_bmm";
    case GemmOp::kOProj: return "postattn.o_proj";
    case GemmOp::kGate: return "moe.norm+gate";
    case GemmOp::kSharedExpert: return "moe.shared_expert";
    case GemmOp::kRoutedExperts: return "moe.routed_experts";
  }
  return "?";
}

}  // namespace ess::pipeline
