// Query groups (ess/cache/query_groups.h) against brute force: every group fits, no group
// could take the next query token, and no consecutive split has fewer groups.
#include "ess/cache/query_groups.h"

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

namespace ess {
namespace {

std::size_t distinct(const std::vector<std::int32_t>& ids, int K, int first, int last) {
  std::set<std::int32_t> d;
  for (std::size_t i = static_cast<std::size_t>(first) * K; i < static_cast<std::size_t>(last) * K; ++i) {
    if (ids[i] >= 0) d.insert(ids[i]);
  }
  return d.size();
}

// The fewest consecutive groups whose unions fit, by dynamic programming over split points.
int fewest_groups(const std::vector<std::int32_t>& ids, int T, int K, std::int64_t capacity) {
  std::vector<int> best(static_cast<std::size_t>(T) + 1, 1 << 20);
  best[0] = 0;
  for (int last = 1; last <= T; ++last) {
    for (int first = 0; first < last; ++first) {
      if (last - first == 1 || static_cast<std::int64_t>(distinct(ids, K, first, last)) <= capacity) {
        best[static_cast<std::size_t>(last)] = std::min(best[static_cast<std::size_t>(last)], best[static_cast<std::size_t>(first)] + 1);
      }
    }
  }
  return best[static_cast<std::size_t>(T)];
}

TEST(QueryGroups, GreedyGroupsFitAreMaximalAndFewest) {
  std::mt19937 rng(7);
  QueryGrouper g;
  int splits = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int T = 1 + static_cast<int>(rng() % 8);
    const int K = 1 + static_cast<int>(rng() % 24);
    const int range = K + static_cast<int>(rng() % (3 * K + 1));
    const std::int64_t capacity = K + static_cast<std::int64_t>(rng() % (2 * K + 1));
    std::vector<std::int32_t> ids;
    for (int t = 0; t < T; ++t) {
      std::set<std::int32_t> row;
      while (static_cast<int>(row.size()) < K) row.insert(static_cast<std::int32_t>(rng() % range));
      std::vector<std::int32_t> r(row.begin(), row.end());
      std::shuffle(r.begin(), r.end(), rng);
      if (rng() % 4 == 0) r[rng() % r.size()] = -1;
      ids.insert(ids.end(), r.begin(), r.end());
    }
    const GroupStarts starts = g.split(ids, T, K, capacity);
    const std::vector<int> b = group_bounds(starts, T);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " T " << T << " K " << K << " capacity " << capacity);
    ASSERT_EQ(b.front(), 0);
    ASSERT_EQ(b.back(), T);
    ASSERT_EQ(static_cast<int>(b.size()) - 1, group_count(starts));
    for (std::size_t i = 0; i + 1 < b.size(); ++i) {
      EXPECT_LE(static_cast<std::int64_t>(distinct(ids, K, b[i], b[i + 1])), capacity);
      EXPECT_EQ(g.union_size(ids, K, b[i], b[i + 1]), static_cast<std::int64_t>(distinct(ids, K, b[i], b[i + 1])));
      if (b[i + 1] < T) {
        EXPECT_GT(static_cast<std::int64_t>(distinct(ids, K, b[i], b[i + 1] + 1)), capacity);
      }
    }
    EXPECT_EQ(group_count(starts), fewest_groups(ids, T, K, capacity));
    splits += group_count(starts) > 1;
  }
  EXPECT_GT(splits, 50);  // the draw exercises splitting
}

TEST(QueryGroups, AStepThatFitsIsOneGroup) {
  QueryGrouper g;
  const std::vector<std::int32_t> ids = {0, 1, 2, 2, 1, 0, -1, 3, 0};  // T 3, K 3: 4 distinct
  EXPECT_EQ(g.split(ids, 3, 3, 4), GroupStarts{0});
  EXPECT_EQ(group_bounds(g.split(ids, 3, 3, 3), 3), (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(g.union_size(ids, 3, 0, 3), 4);
}

}  // namespace
}  // namespace ess
