// A step's query tokens in consecutive groups whose working sets fit a pool.
//
// With MTP a step has T query tokens of up to K ids each. Their union (the step's working
// set) is usually far below T x K, because consecutive positions select overlapping sets, so
// a pool sized for the union, not for T x K, serves most steps whole. When a step's union
// exceeds the pool's S slots, its query tokens are served in consecutive groups whose unions
// fit: each group is one step of the LRU (its misses loaded, its attention run) before the
// next group's fetch may evict them. A pool of at least K slots (one query token's top-k)
// serves any step this way, losslessly. See docs/architecture.md, "Split steps".
//
// Grouping is greedy: a group grows while its union fits. That gives the fewest consecutive
// groups (a sub-range of a range that fits also fits), and it depends only on the ids and S,
// not on the pool's state, so every policy and every replay splits a step the same way.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ess {

// Query tokens per step are at most this many (one bit each in a group mask).
inline constexpr int kMaxQueryTokens = 32;

// Bit t (t in [1, T)) set: a group starts at query token t. 0: the whole step is one group.
using GroupStarts = std::uint32_t;

class QueryGrouper {
 public:
  // The greedy groups of one request's step: `ids` is [T][K], -1 (any negative) = padding,
  // each other id distinct within its row and below the bound it was reserved for.
  // `capacity` is the pool's slots; a row with more distinct ids than that is a group alone.
  GroupStarts split(std::span<const std::int32_t> ids, int T, int K, std::int64_t capacity);
  // Distinct non-padding ids of query rows [first, last) of `ids` ([T][K]).
  std::int64_t union_size(std::span<const std::int32_t> ids, int K, int first, int last);

 private:
  void next_epoch();
  // True when `id` is new in this epoch. Inline: it runs once per id of every step.
  bool mark(std::int32_t id) {
    const auto i = static_cast<std::size_t>(id);
    if (i >= stamp_.size()) [[unlikely]] grow(i);
    if (stamp_[i] == epoch_) return false;
    stamp_[i] = epoch_;
    return true;
  }
  void grow(std::size_t id);  // makes stamp_ cover `id`
  std::vector<std::uint32_t> stamp_;
  std::uint32_t epoch_ = 0;
};

// The groups of a start mask as half-open ranges [bounds[g], bounds[g + 1]), bounds.back() = T.
std::vector<int> group_bounds(GroupStarts starts, int T);
inline int group_count(GroupStarts starts) { return 1 + __builtin_popcount(starts); }

}  // namespace ess
