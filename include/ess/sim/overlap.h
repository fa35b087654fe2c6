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

// What runs when in one layer's attention block under a mode (DA, DBA or None: a layer-wise
// layer's own choice): the one description the simulator's LayerBuilder and the rig's executor
// both follow, and the order the SGLang adapter runs (python/ess/integrations/sglang/overlap.py,
// indexer_split.py).
struct AttentionSchedule {
  bool preattn_first = true;      // PreAttn before the indexer (else after it, inside the copy window)
  int indexer_parts = 1;          // 2: DBA's halves, the first half's copy under the second's indexer
  bool split_attention = false;   // Attn0 over the resident rows beside the copy, Attn1 after it, merge
};
// mode: kNone, kDualAttention or kDualBatchAttention; fetch: whether the layer copies anything
// (offloaded, with misses); requests: the batch the indexer sees (DBA splits two or more only);
// preattn_in_copy_window: the paper's placement (false: SGLang's, q computed before the indexer).
AttentionSchedule attention_schedule(OverlapMode mode, bool fetch, double requests, bool preattn_in_copy_window);

}  // namespace ess
