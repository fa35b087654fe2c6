#include "ess/sim/op_names.h"

namespace ess {
namespace {

constexpr std::string_view kAll[] = {
    op::kProj0,       op::kIndexerWqB,    op::kQbProj,         op::kAbsorbBmm,      op::kOutBmm,
    op::kOProj,       op::kGate,          op::kSharedExpert,   op::kRoutedExperts,  op::kIndexerLogits,
    op::kIndexerTopk, op::kSwap,          op::kQueryGroups,    op::kSparseMla,      op::kAttn0,          op::kAttn1,
    op::kMerge,       op::kGqa,           op::kD2HNewEntries, op::kH2DMisses,      op::kH2DMissesHalf0, op::kH2DMissesHalf1,
    op::kH2DPrefetch,
    op::kDispatch,    op::kCombine,       op::kAllReduce};

}  // namespace

bool is_op_name(std::string_view name) {
  for (std::string_view n : kAll) {
    if (n == name) return true;
  }
  return false;
}

std::string op_names_list() {
  std::string out;
  for (std::string_view n : kAll) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

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
