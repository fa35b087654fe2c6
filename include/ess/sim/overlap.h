// Where the H2D copy of the misses goes in the attention block (the ESS paper's overlap
// strategies): the vocabulary the simulator, the planner and the rig executor share.
#pragma once

#include <string_view>

namespace ess {

enum class OverlapMode {
  kNone,                // PreAttn, Indexer, H2D, Attn: serial
  kDualAttention,       // DA: Indexer, then H2D || (PreAttn + Attn0), then Attn1, merge
  kDualBatchAttention,  // DBA: the indexer split in two halves along the batch as well
  kLayerWise,           // per layer DA or DBA by a miss threshold
};
std::string_view to_string(OverlapMode mode);
OverlapMode parse_overlap_mode(std::string_view text);  // none | da | dba | layerwise

}  // namespace ess
