#include "ess/cache/query_groups.h"

#include <algorithm>

#include "ess/core/error.h"

namespace ess {

void QueryGrouper::next_epoch() {
  if (++epoch_ == 0) {  // wrapped: clear so that no stale stamp matches
    std::fill(stamp_.begin(), stamp_.end(), 0);
    epoch_ = 1;
  }
}

void QueryGrouper::grow(std::size_t id) { stamp_.resize(std::max(id + 1, stamp_.size() * 2), 0); }

GroupStarts QueryGrouper::split(std::span<const std::int32_t> ids, int T, int K, std::int64_t capacity) {
  ESS_ASSERT(T >= 1 && T <= kMaxQueryTokens && K >= 1 && ids.size() == static_cast<std::size_t>(T) * K,
             "query groups: {} ids for T {} x K {}", ids.size(), T, K);
  GroupStarts starts = 0;
  next_epoch();
  std::int64_t size = 0;
  for (int t = 0; t < T; ++t) {
    const auto row = ids.subspan(static_cast<std::size_t>(t) * K, static_cast<std::size_t>(K));
    // The row's ids not yet in the group, counted without marking them (the row may not fit).
    std::int64_t added = 0;
    for (const std::int32_t id : row) {
      if (id >= 0 && (static_cast<std::size_t>(id) >= stamp_.size() || stamp_[static_cast<std::size_t>(id)] != epoch_)) {
        ++added;
      }
    }
    if (t > 0 && size + added > capacity) {  // the row starts a new group
      starts |= GroupStarts{1} << t;
      next_epoch();
      size = 0;
    }
    for (const std::int32_t id : row) {
      if (id >= 0 && mark(id)) ++size;
    }
  }
  return starts;
}

std::int64_t QueryGrouper::union_size(std::span<const std::int32_t> ids, int K, int first, int last) {
  next_epoch();
  std::int64_t n = 0;
  for (std::size_t i = static_cast<std::size_t>(first) * K; i < static_cast<std::size_t>(last) * K; ++i) {
    if (ids[i] >= 0 && mark(ids[i])) ++n;
  }
  return n;
}

std::vector<int> group_bounds(GroupStarts starts, int T) {
  std::vector<int> b{0};
  for (int t = 1; t < T; ++t) {
    if ((starts >> t) & 1u) b.push_back(t);
  }
  b.push_back(T);
  return b;
}

}  // namespace ess
