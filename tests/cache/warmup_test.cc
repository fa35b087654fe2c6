#include <gtest/gtest.h>

#include "ess/cache/swap_engine.h"
#include "ess/core/error.h"
#include "testing/cache_fixtures.h"

namespace ess {
namespace {

struct Rig {
  explicit Rig(int warmup_windows)
      : total(1, test::small_layout(), 8 * 64 * 144),
        sparse([] {
          SparsePoolConfig c;
          c.num_layers = 1;
          c.layout = test::small_layout();
          c.max_requests = 1;
          c.slots = 4;
          c.query_tokens = 1;
          c.topk = 2;
          return c;
        }()),
        engine(total, sparse, [&] {
          SwapEngine::Config c;
          c.warmup_windows = warmup_windows;
          return c;
        }()) {
    total.admit(0, 64);
    test::write_pattern(total, 0, 0, 0, 64);
    engine.admit(0);
  }
  TotalPool total;
  SparsePool sparse;
  SwapEngine engine;
};

TEST(LruWarmup, InsertsTheWindowsInOrderAndLoadsTheFinalResidency) {
  Rig rig(32);
  const std::vector<std::int32_t> windows = {0, 1, /**/ 2, 3, /**/ 4, 5};
  const WarmupResult w = rig.engine.warmup(0, 0, windows, 64);
  EXPECT_EQ(w.windows_used, 3);
  EXPECT_EQ(w.counts, (StepCounts{0, 6}));
  const LayerCache& c = rig.engine.layer_cache(0, 0);
  // Window 2 evicts the oldest window: tokens 0 and 1 (slots 0 and 1).
  EXPECT_EQ(c.slot_of(0), -1);
  EXPECT_EQ(c.slot_of(1), -1);
  EXPECT_EQ(c.slot_of(4), 0);
  EXPECT_EQ(c.slot_of(5), 1);
  EXPECT_EQ(c.policy().recency(), (std::vector<std::int64_t>{2, 2, 1, 1}));
  // One fill per occupied slot, in slot order, with the host offsets of the final tokens.
  ASSERT_EQ(w.plan.entries.size(), 4u);
  for (std::int32_t s = 0; s < 4; ++s) {
    EXPECT_EQ(w.plan.entries[static_cast<std::size_t>(s)].slot, s);
    EXPECT_EQ(w.plan.entries[static_cast<std::size_t>(s)].token, c.token_in(s));
    EXPECT_EQ(w.plan.entries[static_cast<std::size_t>(s)].host_offset, rig.total.offset(0, 0, c.token_in(s)));
  }
  // The first decode step that selects the last window hits entirely.
  const std::vector<RequestId> batch = {0};
  const std::vector<std::int64_t> len = {64};
  const std::vector<std::int32_t> ids = {5, 4};
  EXPECT_EQ(rig.engine.step({0, batch, ids, len}).total, (StepCounts{2, 0}));
}

TEST(LruWarmup, UsesOnlyTheLastConfiguredWindows) {
  Rig rig(2);
  const std::vector<std::int32_t> windows = {0, 1, /**/ 2, 3, /**/ 4, 5};
  const WarmupResult w = rig.engine.warmup(0, 0, windows, 64);
  EXPECT_EQ(w.windows_used, 2);
  const LayerCache& c = rig.engine.layer_cache(0, 0);
  EXPECT_EQ(c.slot_of(0), -1);
  EXPECT_EQ(c.slot_of(2), 0);
  EXPECT_EQ(c.slot_of(5), 3);
}

TEST(LruWarmup, BadWindowsChangeNothing) {
  Rig rig(32);
  const std::uint64_t before = rig.engine.digest();
  const std::vector<std::int32_t> odd = {0, 1, 2};
  EXPECT_THROW(rig.engine.warmup(0, 0, odd, 64), Error);
  const std::vector<std::int32_t> out_of_range = {0, 1, 2, 64};
  EXPECT_THROW(rig.engine.warmup(0, 0, out_of_range, 64), Error);
  const std::vector<std::int32_t> dup = {0, 1, 3, 3};
  EXPECT_THROW(rig.engine.warmup(0, 0, dup, 64), Error);
  EXPECT_THROW(rig.engine.warmup(0, 0, std::vector<std::int32_t>{0, 1}, 65), Error);
  EXPECT_THROW(rig.engine.warmup(0, 1, std::vector<std::int32_t>{0, 1}, 64), Error);
  EXPECT_THROW(rig.engine.warmup(7, 0, std::vector<std::int32_t>{0, 1}, 64), Error);
  EXPECT_EQ(rig.engine.digest(), before);
}

}  // namespace
}  // namespace ess
