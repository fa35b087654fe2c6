// Vocabulary shared by the cache engine's parts.
#pragma once

#include <cstdint>
#include <vector>

namespace ess {

using RequestId = std::int64_t;

// One miss of one step of one layer: copy the latent entry of `token` of the request at
// batch position `batch` (Sparse Memory Pool row `row`) from the Total Memory Pool, at
// `host_offset` bytes from TotalPool::base(), into slot `slot`. FlashTrans executes these.
struct MissEntry {
  std::int32_t batch = 0;
  std::int32_t row = 0;
  std::int32_t token = 0;
  std::int32_t slot = 0;
  std::uint64_t host_offset = 0;

  friend bool operator==(const MissEntry&, const MissEntry&) = default;
};

// The misses of one step of one layer, ordered by batch position, then by the canonical
// order of the step's working set (query token 0..T-1, then position 0..K-1, first
// occurrence). Within one plan every (row, slot) appears at most once, so the copies may run
// in any order or all at once.
struct MissPlan {
  int layer = 0;
  std::vector<MissEntry> entries;
};

// Hits and misses of one request (or a whole batch) in one step of one layer. Counts are of
// distinct tokens: a token selected by several MTP query tokens counts once.
struct StepCounts {
  std::int64_t hits = 0;
  std::int64_t misses = 0;
  std::int64_t working_set() const { return hits + misses; }

  StepCounts& operator+=(const StepCounts& o) {
    hits += o.hits;
    misses += o.misses;
    return *this;
  }
  friend bool operator==(const StepCounts&, const StepCounts&) = default;
};

}  // namespace ess
