#include "ess/cache/policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <functional>
#include <map>
#include <random>
#include <set>

#include "ess/cache/layer_cache.h"
#include "ess/core/error.h"
#include "testing/cache_fixtures.h"

namespace ess {
namespace {

// Runs one step of a LayerCache with T = 1 over `ids`; returns slot ids.
std::vector<std::int32_t> run(LayerCache& c, std::vector<std::int32_t> ids, StepCounts* counts = nullptr) {
  std::vector<std::int32_t> slots(ids.size());
  std::vector<Fill> fills;
  const StepCounts sc = c.access(ids, 1, static_cast<int>(ids.size()), slots, fills);
  if (counts != nullptr) *counts = sc;
  c.check_invariants();
  return slots;
}

TEST(Lru, EmptySlotsFirstThenLeastRecentTiesToLowerSlot) {
  LayerCache c(4, std::make_unique<LruPolicy>(4));
  c.reserve_tokens(100);
  EXPECT_EQ(run(c, {10, 11}), (std::vector<std::int32_t>{0, 1}));  // step 0: empty slots in order
  EXPECT_EQ(run(c, {11, 12}), (std::vector<std::int32_t>{1, 2}));  // step 1: hit 11, 12 -> slot 2
  // Step 2: slot 3 is empty (-1), slot 0 last used at step 0 -> victims 3 then 0.
  EXPECT_EQ(run(c, {13, 14}), (std::vector<std::int32_t>{3, 0}));
  EXPECT_EQ(c.slot_of(10), -1);
  EXPECT_EQ(c.policy().recency(), (std::vector<std::int64_t>{2, 1, 1, 2}));
  // Step 3: one miss; slots 1 and 2 both last used at step 1 -> the lower slot, 1.
  EXPECT_EQ(run(c, {15}), (std::vector<std::int32_t>{1}));
  EXPECT_EQ(c.slot_of(11), -1);
  EXPECT_EQ(c.slot_of(12), 2);
}

TEST(Lru, HitsRefreshRecencyAndTheWorkingSetIsNeverEvicted) {
  LayerCache c(3, std::make_unique<LruPolicy>(3));
  c.reserve_tokens(100);
  run(c, {1, 2, 3});            // step 0: slots 0, 1, 2
  run(c, {1});                  // step 1: token 1 (slot 0) refreshed
  StepCounts sc;
  // Step 2: {2, 9}: 2 hits; the victim must be slot 2 (token 3, step 0), not slot 1 (token 2,
  // in the working set) nor slot 0 (refreshed at step 1).
  EXPECT_EQ(run(c, {2, 9}, &sc), (std::vector<std::int32_t>{1, 2}));
  EXPECT_EQ(sc.hits, 1);
  EXPECT_EQ(sc.misses, 1);
  EXPECT_EQ(c.slot_of(3), -1);
}

TEST(Lru, MtpQueryTokensOfOneStepShareOneRecency) {
  LayerCache c(6, std::make_unique<LruPolicy>(6));
  c.reserve_tokens(100);
  std::vector<std::int32_t> ids = {5, 6, 6, 7};  // T = 2, K = 2: {5, 6} and {6, 7}
  std::vector<std::int32_t> slots(4);
  std::vector<Fill> fills;
  const StepCounts sc = c.access(ids, 2, 2, slots, fills);
  EXPECT_EQ(sc.misses, 3);  // distinct tokens
  EXPECT_EQ(sc.hits, 0);
  EXPECT_EQ(slots, (std::vector<std::int32_t>{0, 1, 1, 2}));
  ASSERT_EQ(fills.size(), 3u);
  EXPECT_EQ(fills[2].token, 7);
  EXPECT_EQ(c.policy().recency(), (std::vector<std::int64_t>{0, 0, 0, -1, -1, -1}));
  // A hit selected by both query tokens counts once.
  std::vector<std::int32_t> again = {6, -1, 6, 8};
  const StepCounts sc2 = c.access(again, 2, 2, slots, fills);
  EXPECT_EQ(sc2.hits, 1);
  EXPECT_EQ(sc2.misses, 1);
  EXPECT_EQ(slots, (std::vector<std::int32_t>{1, -1, 1, 3}));
}

TEST(Lru, MatchesTheNaiveSpecificationOnRandomSteps) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 20; ++trial) {
    const int T = 1 + trial % 3;
    const int K = 1 + static_cast<int>(rng() % 9);
    const std::int32_t S = T * K + static_cast<std::int32_t>(rng() % 7);
    const std::int32_t universe = S * 3;
    LayerCache c(S, std::make_unique<LruPolicy>(S));
    c.reserve_tokens(universe);
    test::NaiveLru naive(S);
    for (int step = 0; step < 300; ++step) {
      std::vector<std::int32_t> ids;
      for (int t = 0; t < T; ++t) {
        std::set<std::int32_t> q;
        while (static_cast<int>(q.size()) < K) q.insert(static_cast<std::int32_t>(rng() % universe));
        std::vector<std::int32_t> row(q.begin(), q.end());
        std::shuffle(row.begin(), row.end(), rng);
        if (rng() % 4 == 0) row[rng() % K] = -1;
        ids.insert(ids.end(), row.begin(), row.end());
      }
      std::vector<std::int32_t> slots(ids.size());
      std::vector<Fill> fills;
      c.access(ids, T, K, slots, fills);
      std::vector<std::pair<std::int32_t, std::int32_t>> naive_fills;
      ASSERT_EQ(slots, naive.step(ids, naive_fills)) << "trial " << trial << " step " << step;
      ASSERT_EQ(fills.size(), naive_fills.size());
      for (std::size_t i = 0; i < fills.size(); ++i) {
        ASSERT_EQ(fills[i].token, naive_fills[i].first);
        ASSERT_EQ(fills[i].slot, naive_fills[i].second);
      }
      ASSERT_EQ(c.policy().recency(), naive.stamps());
    }
    c.check_invariants();
  }
}

// Exhaustive optimum for tiny instances: the fewest misses over every choice of victims.
std::int64_t brute_force_min_misses(std::int32_t S, const std::vector<std::vector<std::int32_t>>& steps) {
  std::map<std::pair<std::size_t, std::vector<std::int32_t>>, std::int64_t> memo;
  std::function<std::int64_t(std::size_t, std::vector<std::int32_t>)> go = [&](std::size_t i, std::vector<std::int32_t> resident) {
    if (i == steps.size()) return std::int64_t{0};
    std::sort(resident.begin(), resident.end());
    const auto key = std::make_pair(i, resident);
    if (auto it = memo.find(key); it != memo.end()) return it->second;
    const auto& ws = steps[i];
    std::vector<std::int32_t> misses;
    for (std::int32_t t : ws) {
      if (!std::binary_search(resident.begin(), resident.end(), t)) misses.push_back(t);
    }
    std::vector<std::int32_t> evictable;
    for (std::int32_t t : resident) {
      if (std::find(ws.begin(), ws.end(), t) == ws.end()) evictable.push_back(t);
    }
    const std::int64_t free_slots = S - static_cast<std::int64_t>(resident.size());
    const std::int64_t must_evict = std::max<std::int64_t>(0, static_cast<std::int64_t>(misses.size()) - free_slots);
    std::int64_t best = std::numeric_limits<std::int64_t>::max();
    // Every subset of evictable tokens of size >= must_evict (evicting more is never better,
    // but enumerate exactly must_evict to keep it small: extra evictions cannot help).
    const std::size_t n = evictable.size();
    for (std::uint32_t mask = 0; mask < (1u << n); ++mask) {
      if (std::popcount(mask) != must_evict) continue;
      std::vector<std::int32_t> next;
      for (std::size_t j = 0; j < n; ++j) {
        if (!(mask & (1u << j))) next.push_back(evictable[j]);
      }
      for (std::int32_t t : ws) next.push_back(t);
      best = std::min(best, static_cast<std::int64_t>(misses.size()) + go(i + 1, next));
    }
    memo[key] = best;
    return best;
  };
  return go(0, {});
}

TEST(Belady, IsOptimalOnTinyInstancesAndNeverWorseThanLru) {
  std::mt19937 rng(9);
  for (int trial = 0; trial < 60; ++trial) {
    const std::int32_t S = 2 + static_cast<std::int32_t>(rng() % 3);
    const int K = 1 + static_cast<int>(rng() % S);
    const std::int32_t universe = S + 3;
    std::vector<std::vector<std::int32_t>> steps;
    for (int i = 0; i < 9; ++i) {
      std::set<std::int32_t> q;
      while (static_cast<int>(q.size()) < K) q.insert(static_cast<std::int32_t>(rng() % universe));
      steps.emplace_back(q.begin(), q.end());
    }
    LayerCache belady(S, std::make_unique<BeladyPolicy>(S, steps));
    LayerCache lru(S, std::make_unique<LruPolicy>(S));
    belady.reserve_tokens(universe);
    lru.reserve_tokens(universe);
    std::int64_t mb = 0, ml = 0;
    for (const auto& ws : steps) {
      StepCounts cb, cl;
      run(belady, ws, &cb);
      run(lru, ws, &cl);
      mb += cb.misses;
      ml += cl.misses;
    }
    EXPECT_EQ(mb, brute_force_min_misses(S, steps)) << "trial " << trial;
    EXPECT_LE(mb, ml);
  }
}

TEST(Belady, RefusesAFutureThatDoesNotFitOrRepeatsATokenAndDetectsDivergence) {
  EXPECT_THROW(BeladyPolicy(2, {{1, 2, 3}}), Error);
  EXPECT_THROW(BeladyPolicy(4, {{1, 1}}), Error);
  LayerCache c(2, std::make_unique<BeladyPolicy>(2, std::vector<std::vector<std::int32_t>>{{1, 2}}));
  c.reserve_tokens(10);
  run(c, {1, 2});
  std::vector<std::int32_t> slots(1);
  std::vector<Fill> fills;
  std::vector<std::int32_t> beyond = {3};
  EXPECT_THROW(c.access(beyond, 1, 1, slots, fills), Error);  // no future for step 1
}

}  // namespace
}  // namespace ess
