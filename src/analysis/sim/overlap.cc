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

AttentionSchedule attention_schedule(OverlapMode mode, bool fetch, double requests, bool preattn_in_copy_window) {
  ESS_CHECK(mode != OverlapMode::kLayerWise, "attention_schedule: a layer-wise layer runs DA or DBA; pass its choice");
  AttentionSchedule s;
  if (!fetch || mode == OverlapMode::kNone) return s;  // serial: PreAttn, indexer, copy, attention
  s.preattn_first = !preattn_in_copy_window;
  s.split_attention = true;
  s.indexer_parts = mode == OverlapMode::kDualBatchAttention && requests >= 2 ? 2 : 1;
  return s;
}

}  // namespace ess
