#include "ess/cache/swap_engine.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "ess/core/error.h"
#include "testing/cache_fixtures.h"
#include "testing/testing.h"

namespace ess {
namespace {

using test::error_of;

// Two layers, up to 3 requests, T query tokens x K ids, S slots; requests 0..n-1 admitted
// with `length` tokens whose bytes identify (request, layer, token).
struct Rig {
  Rig(std::int32_t S, int T, int K, int n, std::int64_t length)
      : total(2, test::small_layout(), 64 * 64 * 144),
        sparse([&] {
          SparsePoolConfig c;
          c.num_layers = 2;
          c.layout = test::small_layout();
          c.max_requests = 3;
          c.slots = S;
          c.query_tokens = T;
          c.topk = K;
          return c;
        }()),
        engine(total, sparse) {
    for (RequestId id = 0; id < n; ++id) {
      total.admit(id, length);
      for (int l = 0; l < 2; ++l) test::write_pattern(total, id, l, 0, length);
      engine.admit(id);
    }
  }
  std::uint64_t state() const {
    return engine.digest() ^ (total.digest() * 3) ^ (sparse.digest() * 7);
  }
  TotalPool total;
  SparsePool sparse;
  SwapEngine engine;
};

TEST(SwapEngine, HandComputedStepsSlotIdsAndMissPlan) {
  Rig rig(4, 1, 2, 1, 100);
  const std::vector<RequestId> batch = {0};
  const std::vector<std::int64_t> len = {100};

  std::vector<std::int32_t> ids = {10, 11};
  SwapResult r = rig.engine.step({0, batch, ids, len});
  EXPECT_EQ(r.slot_ids, (std::vector<std::int32_t>{0, 1}));
  EXPECT_EQ(r.total, (StepCounts{0, 2}));
  ASSERT_EQ(r.plan.entries.size(), 2u);
  EXPECT_EQ(r.plan.layer, 0);
  EXPECT_EQ(r.plan.entries[0], (MissEntry{0, rig.sparse.row(0), 10, 0, rig.total.offset(0, 0, 10)}));
  EXPECT_EQ(r.plan.entries[1], (MissEntry{0, rig.sparse.row(0), 11, 1, rig.total.offset(0, 0, 11)}));
  rig.sparse.storage().fill(r.plan, rig.total);

  ids = {11, 12};
  r = rig.engine.step({0, batch, ids, len});
  EXPECT_EQ(r.slot_ids, (std::vector<std::int32_t>{1, 2}));
  EXPECT_EQ(r.total, (StepCounts{1, 1}));
  rig.sparse.storage().fill(r.plan, rig.total);

  ids = {13, 14};  // victims: slot 3 (never used), then slot 0 (token 10, step 0)
  r = rig.engine.step({0, batch, ids, len});
  EXPECT_EQ(r.slot_ids, (std::vector<std::int32_t>{3, 0}));
  rig.sparse.storage().fill(r.plan, rig.total);
  EXPECT_EQ(rig.engine.layer_cache(0, 0).slot_of(10), -1);
  // Layer 1 is independent and still empty.
  EXPECT_EQ(rig.engine.layer_cache(0, 1).resident(), 0);

  // Every slot attention will read holds exactly the Total Memory Pool's bytes.
  std::vector<std::uint8_t> out(rig.total.entry_bytes());
  for (std::int32_t tok : {11, 12, 13, 14}) {
    rig.sparse.storage().read(rig.sparse.row(0), 0, rig.engine.layer_cache(0, 0).slot_of(tok), out);
    EXPECT_TRUE(std::equal(out.begin(), out.end(), rig.total.entry(0, 0, tok).begin())) << "token " << tok;
  }
  rig.engine.check_invariants();
}

TEST(SwapEngine, BatchPlanIsOrderedByBatchPositionAndCarriesRows) {
  Rig rig(4, 2, 2, 3, 50);
  const std::vector<RequestId> batch = {2, 0};
  const std::vector<std::int64_t> len = {50, 40};
  const std::vector<std::int32_t> ids = {1, 2, 2, 3,  /* request 2 */ 7, -1, -1, -1 /* request 0 */};
  const SwapResult r = rig.engine.step({1, batch, ids, len});
  EXPECT_EQ(r.slot_ids, (std::vector<std::int32_t>{0, 1, 1, 2, 0, -1, -1, -1}));
  ASSERT_EQ(r.per_request.size(), 2u);
  EXPECT_EQ(r.per_request[0], (StepCounts{0, 3}));
  EXPECT_EQ(r.per_request[1], (StepCounts{0, 1}));
  EXPECT_EQ(r.total, (StepCounts{0, 4}));
  ASSERT_EQ(r.plan.entries.size(), 4u);
  EXPECT_EQ(r.plan.entries[0].batch, 0);
  EXPECT_EQ(r.plan.entries[0].row, rig.sparse.row(2));
  EXPECT_EQ(r.plan.entries[3].batch, 1);
  EXPECT_EQ(r.plan.entries[3].row, rig.sparse.row(0));
  EXPECT_EQ(r.plan.entries[3].host_offset, rig.total.offset(0, 1, 7));
}

TEST(SwapEngine, BadInputThrowsWithContextAndChangesNothing) {
  Rig rig(4, 2, 2, 2, 30);
  const std::vector<RequestId> batch = {0, 1};
  const std::vector<std::int64_t> len = {30, 20};
  // One good step first so that there is state to preserve.
  const std::vector<std::int32_t> good = {1, 2, 2, 3, 4, 5, 5, 6};
  SwapResult r = rig.engine.step({0, batch, good, len});
  rig.sparse.storage().fill(r.plan, rig.total);
  const std::uint64_t before = rig.state();

  struct Case {
    const char* name;
    std::function<void()> call;
    std::vector<std::string> words;
  };
  std::vector<std::int32_t> ids;
  const auto step = [&](std::vector<std::int32_t> v, std::vector<RequestId> b = {0, 1},
                        std::vector<std::int64_t> l = {30, 20}, int layer = 0) {
    return [=, &rig] { (void)rig.engine.step({layer, b, v, l}); };
  };
  const std::vector<Case> cases = {
      {"id == length", step({1, 2, 2, 3, 4, 20, 5, 6}), {"request 1", "layer 0", "query token 0", "position 1", "token 20", "[0, 20)"}},
      {"id < -1", step({1, -2, 2, 3, 4, 5, 5, 6}), {"request 0", "token -2"}},
      {"duplicate in one query", step({1, 2, 2, 3, 4, 5, 6, 6}), {"request 1", "query token 1", "token 6 twice"}},
      {"wrong top-k size", step({1, 2, 2, 3}), {"4 values", "[B=2][T=2][K=2] = 8"}},
      {"lengths mismatch", step(good, {0, 1}, {30}), {"1 lengths", "batch of 2"}},
      {"unknown request", step(good, {0, 9}), {"unknown request 9", "batch position 1"}},
      {"request twice", step(good, {1, 1}, {20, 20}), {"request 1 appears twice"}},
      {"longer than the host pool", step(good, {0, 1}, {31, 20}), {"request 0", "length 31", "[0, 30]"}},
      {"layer out of range", step(good, {0, 1}, {30, 20}, 2), {"layer 2"}},
      {"release unknown", [&] { rig.engine.release(5); }, {"unknown request 5"}},
      {"admit twice", [&] { rig.engine.admit(0); }, {"request 0", "already admitted"}},
      {"admit without host entries", [&] { rig.engine.admit(8); }, {"request 8", "total pool first"}},
  };
  for (const Case& c : cases) {
    const std::string msg = error_of(c.call);
    for (const std::string& w : c.words) EXPECT_NE(msg.find(w), std::string::npos) << c.name << ": " << msg;
    EXPECT_EQ(rig.state(), before) << c.name << " changed the state";
  }
  rig.engine.check_invariants();
}

TEST(SwapEngine, AdmissionWhenTheSparsePoolIsFullChangesNothing) {
  Rig rig(4, 1, 2, 3, 10);  // 3 rows, all taken
  rig.total.admit(3, 10);
  const std::uint64_t before = rig.state();
  const std::string msg = error_of([&] { rig.engine.admit(3); });
  EXPECT_NE(msg.find("sparse pool full"), std::string::npos) << msg;
  EXPECT_EQ(rig.state(), before);
  rig.engine.release(1);
  EXPECT_NO_THROW(rig.engine.admit(3));
  EXPECT_EQ(rig.engine.layer_cache(3, 0).resident(), 0);  // a fresh LRU, not request 1's
}

}  // namespace
}  // namespace ess
