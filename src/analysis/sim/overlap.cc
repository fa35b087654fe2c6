#include "ess/sim/overlap.h"

#include "ess/core/error.h"

namespace ess {

std::string_view to_string(OverlapMode mode) {
  switch (mode) {
    case OverlapMode::kNone: return "none";
    case OverlapMode::kDualAttention: return "da";
    case OverlapMode::kDualBatchAttention: return "dba";
    case OverlapMode::kLayerWise: return "layerwise";
  }
  return "?";
}

OverlapMode parse_overlap_mode(std::string_view text) {
  if (text == "none") return OverlapMode::kNone;
  if (text == "da") return OverlapMode::kDualAttention;
  if (text == "dba") return OverlapMode::kDualBatchAttention;
  if (text == "layerwise" || text == "layer-wise") return OverlapMode::kLayerWise;
  ESS_THROW("unknown overlap mode '{}': expected none, da, dba or layerwise", text);
}

}  // namespace ess
