#include "ess/core/op_names.h"

namespace ess {

std::string_view op_name(GemmOp g) {
  switch (g) {
    case GemmOp::kProj0: return op::kProj0;
    case GemmOp::kIndexerWqB: return op::kIndexerWqB;
    case GemmOp::kQbProj: return op::kQbProj;
    case GemmOp::kAbsorbBmm: return op::kAbsorbBmm;
    case GemmOp::kOutBmm: return op::kOutBmm;
    case GemmOp::kOProj: return op::kOProj;
    case GemmOp::kGate: return op::kGate;
    case GemmOp::kSharedExpert: return op::kSharedExpert;
    case GemmOp::kRoutedExperts: return op::kRoutedExperts;
  }
  return "?";
}

}  // namespace ess
