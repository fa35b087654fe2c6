// Internal to ess_trace: the per request-layer kernels of analyze() besides replay_layer()
// (declared in analyzer.h): the similarity counts and the inter-layer prefetch replay.
#pragma once

#include <cstdint>
#include <vector>

#include "ess/trace/format.h"

namespace ess::trace::detail {

// Overlap counts of one request-layer (see analyzer.h for the definitions).
struct Similarity {
  std::int64_t intra_overlap = 0, intra_total = 0, inter_overlap = 0, inter_total = 0;

  Similarity& operator+=(const Similarity& o) {
    intra_overlap += o.intra_overlap;
    intra_total += o.intra_total;
    inter_overlap += o.inter_overlap;
    inter_total += o.inter_total;
    return *this;
  }
};

// Intra-layer (vs the previous step) and inter-layer (vs layer - 1, same step) overlap counts.
Similarity similarity_of(const RequestView& r, int layer);

struct PrefetchLayer {
  std::vector<std::int32_t> prefetched, useful, wasted, misses;  // [steps]
  // The layer selects exactly layer l-1's ids at every step and prefill window (index sharing), and
  // some step's queries saw more than top-k tokens (else every layer selects them all).
  bool same_selection = false;
};

// LRU + warm-up replay of layer `layer` with the first-order inter-layer prefetch counted.
PrefetchLayer prefetch_of(const RequestView& r, int layer, std::int32_t slots, bool warmup);

}  // namespace ess::trace::detail
