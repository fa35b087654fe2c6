// The alternative replacement policies (policies.h): the ReplacementPolicy contract on random
// workloads, each policy's defining behaviour on small hand-made cases, the factory, and
// Belady's MIN as a lower bound for all of them.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "ess/cache/layer_cache.h"
#include "ess/cache/policies.h"
#include "ess/core/digest.h"
#include "ess/core/error.h"

namespace ess {
namespace {

StepCounts step(LayerCache& c, const std::vector<std::int32_t>& ids, int T = 1) {
  const int K = static_cast<int>(ids.size()) / T;
  std::vector<std::int32_t> slots(ids.size());
  std::vector<Fill> fills;
  const auto counts = c.access(ids, T, K, slots, fills);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0) {
      EXPECT_EQ(slots[i], -1);
    } else {
      EXPECT_EQ(c.token_in(slots[i]), ids[i]) << "position " << i;
    }
  }
  EXPECT_EQ(static_cast<std::int64_t>(fills.size()), counts.misses);
  return counts;
}

std::unique_ptr<ReplacementPolicy> make(const std::string& name, std::int32_t slots) {
  return make_policy_factory(name, {.lfu_aging_period = 8})(0, 0, slots);
}

// Random MTP workloads over a small universe: drifting sets, duplicates across query tokens,
// padding. Returns the per-step working sets (distinct, canonical order) and the raw ids.
struct Workload {
  std::vector<std::vector<std::int32_t>> ids;  // per step, T x K
  std::vector<std::vector<std::int32_t>> sets;
};
Workload random_workload(std::mt19937& rng, int steps, int T, int K, std::int32_t universe) {
  Workload w;
  std::vector<std::int32_t> base;
  for (int k = 0; k < K; ++k) base.push_back(static_cast<std::int32_t>(rng() % universe));
  for (int s = 0; s < steps; ++s) {
    for (auto& b : base) {
      if (rng() % 4 == 0) b = static_cast<std::int32_t>(rng() % universe);
    }
    std::vector<std::int32_t> ids;
    for (int t = 0; t < T; ++t) {
      std::set<std::int32_t> row;
      for (auto b : base) {
        if (rng() % 8 == 0) b = static_cast<std::int32_t>(rng() % universe);
        row.insert(b);
      }
      std::vector<std::int32_t> r(row.begin(), row.end());
      std::shuffle(r.begin(), r.end(), rng);
      while (static_cast<int>(r.size()) < K) r.push_back(-1);
      ids.insert(ids.end(), r.begin(), r.end());
    }
    std::vector<std::int32_t> set;
    std::set<std::int32_t> seen;
    for (auto x : ids) {
      if (x >= 0 && seen.insert(x).second) set.push_back(x);
    }
    w.ids.push_back(std::move(ids));
    w.sets.push_back(std::move(set));
  }
  return w;
}

class EveryPolicy : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryPolicy, KeepsTheContractOnRandomWorkloads) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 30; ++trial) {
    const int T = 1 + static_cast<int>(rng() % 3);
    const int K = 1 + static_cast<int>(rng() % 12);
    const auto S = static_cast<std::int32_t>(T * K + rng() % 10);
    const auto universe = static_cast<std::int32_t>(S + 1 + rng() % 40);
    const auto w = random_workload(rng, 60, T, K, universe);
    LayerCache a(S, make(GetParam(), S));
    LayerCache b(S, make(GetParam(), S));
    a.reserve_tokens(universe);
    b.reserve_tokens(universe);
    for (const auto& ids : w.ids) {
      const auto ca = step(a, ids, T);
      const auto cb = step(b, ids, T);
      EXPECT_EQ(ca, cb);
      a.check_invariants();
    }
    Digest da, db;
    a.hash(da);
    b.hash(db);
    EXPECT_EQ(da.get(), db.get()) << "policy " << GetParam() << " is not deterministic";
    EXPECT_EQ(a.policy().name(), GetParam());
    EXPECT_EQ(a.policy().recency().size(), static_cast<std::size_t>(S));
  }
}

TEST_P(EveryPolicy, NeverBeatsBelady) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 30; ++trial) {
    const int T = 1 + static_cast<int>(rng() % 2);
    const int K = 2 + static_cast<int>(rng() % 10);
    const auto S = static_cast<std::int32_t>(T * K + rng() % 8);
    const auto universe = static_cast<std::int32_t>(S + 1 + rng() % 30);
    const auto w = random_workload(rng, 50, T, K, universe);
    LayerCache online(S, make(GetParam(), S));
    LayerCache opt(S, std::make_unique<BeladyPolicy>(S, w.sets));
    online.reserve_tokens(universe);
    opt.reserve_tokens(universe);
    std::int64_t m_online = 0, m_opt = 0;
    for (const auto& ids : w.ids) {
      m_online += step(online, ids, T).misses;
      m_opt += step(opt, ids, T).misses;
      opt.check_invariants();
    }
    EXPECT_LE(m_opt, m_online) << GetParam() << " trial " << trial;
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, EveryPolicy, ::testing::Values("lru", "fifo", "clock", "lfu", "s3fifo"));

TEST(Fifo, HitsDoNotRefresh) {
  LayerCache c(3, std::make_unique<FifoPolicy>(3));
  c.reserve_tokens(10);
  step(c, {1});
  step(c, {2});
  step(c, {3});
  step(c, {1, 4});  // 1 hits; the oldest fill not in use is 2
  EXPECT_EQ(c.slot_of(2), -1);
  step(c, {2});  // 1 is now the oldest fill (a hit does not refresh it); LRU would evict 3
  EXPECT_EQ(c.slot_of(1), -1);
  EXPECT_GE(c.slot_of(3), 0);
}

TEST(Clock, GivesReferencedSlotsASecondChance) {
  LayerCache c(2, std::make_unique<ClockPolicy>(2));
  c.reserve_tokens(10);
  step(c, {1});
  step(c, {2});
  step(c, {1});  // sets 1's reference bit
  step(c, {3});  // the hand clears 1's bit and moves on to 2
  EXPECT_GE(c.slot_of(1), 0);
  EXPECT_EQ(c.slot_of(2), -1);
}

TEST(Lfu, EvictsTheLeastFrequentAndAgesCounts) {
  LayerCache c(2, std::make_unique<LfuPolicy>(2, 1000));
  c.reserve_tokens(10);
  step(c, {1});
  step(c, {1});
  step(c, {1});
  step(c, {2});
  step(c, {3});  // 2 was used once, 1 three times
  EXPECT_GE(c.slot_of(1), 0);
  EXPECT_EQ(c.slot_of(2), -1);
  // With aging every 2 steps, an old burst fades: counts halve (never below 1).
  LayerCache d(3, std::make_unique<LfuPolicy>(3, 2));
  d.reserve_tokens(10);
  for (int i = 0; i < 6; ++i) step(d, {1});
  const auto counts = d.policy().recency();
  EXPECT_LE(counts[static_cast<std::size_t>(d.slot_of(1))], 3);
  d.check_invariants();
}

TEST(S3Fifo, ResistsScansBetterThanFifo) {
  // A hot set used every other step plus a scan of never-repeated tokens every step.
  auto run = [](std::unique_ptr<ReplacementPolicy> p) {
    LayerCache c(20, std::move(p));
    c.reserve_tokens(100000);
    std::int64_t hot_misses = 0;
    std::int32_t next = 100;
    for (int s = 0; s < 300; ++s) {
      std::vector<std::int32_t> ids{next, next + 1, next + 2};
      if (s % 2 == 0) ids.insert(ids.end(), {0, 1, 2, 3, 4});
      next += 3;
      std::vector<std::int32_t> slots(ids.size());
      std::vector<Fill> fills;
      c.access(ids, 1, static_cast<int>(ids.size()), slots, fills);
      for (const auto& f : fills) hot_misses += f.token < 5 ? 1 : 0;
      c.check_invariants();
    }
    return hot_misses;
  };
  const auto s3 = run(std::make_unique<S3FifoPolicy>(20));
  const auto fifo = run(std::make_unique<FifoPolicy>(20));
  EXPECT_LE(s3, 10);  // about the first use of each hot token
  EXPECT_GT(fifo, 5 * 10);
}

TEST(PolicyFactory, KnowsTheOnlinePoliciesByName) {
  for (const auto& name : online_policy_names()) {
    auto p = make_policy_factory(name)(1, 2, 16);
    EXPECT_EQ(p->name(), name);
  }
  EXPECT_THROW(make_policy_factory("mru"), Error);
  try {
    make_policy_factory("belady");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("offline"), std::string::npos);
  }
  EXPECT_THROW(FifoPolicy(0), Error);
  EXPECT_THROW(LfuPolicy(4, 0), Error);
}

}  // namespace
}  // namespace ess
