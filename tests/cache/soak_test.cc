// Soak: >= 100,000 engine steps of churn -- requests admitted, grown by decode, finished and
// replaced, pools near full -- with the invariants checked throughout.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "ess/cache/swap_engine.h"
#include "ess/core/error.h"
#include "testing/cache_fixtures.h"

namespace ess {
namespace {

TEST(Soak, HundredThousandStepsOfChurn) {
  constexpr int kLayers = 2;
  constexpr int kT = 2;
  constexpr int kK = 6;
  constexpr std::int32_t kSlots = 16;
  constexpr int kRows = 6;
  constexpr std::int64_t kSteps = 100000;
  TotalPool total(kLayers, test::small_layout(), 72ull * 64 * 144);  // 72 pages: admission and growth can fail
  SparsePoolConfig sc;
  sc.num_layers = kLayers;
  sc.layout = test::small_layout();
  sc.max_requests = kRows;
  sc.slots = kSlots;
  sc.query_tokens = kT;
  sc.topk = kK;
  SparsePool sparse(sc);
  SwapEngine engine(total, sparse);
  std::mt19937 rng(2024);
  std::vector<RequestId> live;
  RequestId next_id = 0;
  std::int64_t steps = 0, refused = 0, finished = 0, hits = 0, misses = 0;
  std::vector<std::uint8_t> buf(total.entry_bytes());

  while (steps < kSteps) {
    // Admit new requests while rows are free (host admission may be refused when full).
    while (static_cast<int>(live.size()) < kRows && rng() % 3 != 0) {
      const std::int64_t len = 1 + static_cast<std::int64_t>(rng() % 700);
      const RequestId id = next_id++;
      const std::uint64_t before = total.digest();
      try {
        total.admit(id, len);
      } catch (const Error&) {
        ++refused;
        ASSERT_EQ(total.digest(), before);
        break;
      }
      engine.admit(id);
      live.push_back(id);
    }
    if (live.empty()) continue;
    // One decode step: every live request appends T tokens, then each layer swaps.
    std::vector<RequestId> batch;
    std::vector<std::int64_t> len;
    for (RequestId id : live) {
      try {
        total.extend(id, kT);
      } catch (const Error&) {
        ++refused;  // host pool full: this request sits the step out
      }
      batch.push_back(id);
      len.push_back(total.length(id));
    }
    for (int layer = 0; layer < kLayers && steps < kSteps; ++layer, ++steps) {
      std::vector<std::int32_t> ids;
      for (std::int64_t l : len) {
        for (int t = 0; t < kT; ++t) {
          std::set<std::int32_t> q;
          const auto want = static_cast<std::size_t>(std::min<std::int64_t>(kK, l));
          // Recent tokens are popular: locality without a model.
          while (q.size() < want) {
            const auto span = std::max<std::int64_t>(1, std::min<std::int64_t>(l, 24));
            const bool recent = rng() % 4 != 0;
            q.insert(static_cast<std::int32_t>(recent ? l - 1 - static_cast<std::int64_t>(rng() % span)
                                                      : static_cast<std::int64_t>(rng() % l)));
          }
          std::vector<std::int32_t> row(q.begin(), q.end());
          row.resize(kK, -1);
          ids.insert(ids.end(), row.begin(), row.end());
        }
      }
      const SwapResult r = engine.step({layer, batch, ids, len});
      for (const MissEntry& m : r.plan.entries) {
        // Host entries are written lazily: the first time a token is fetched.
        total.write(batch[static_cast<std::size_t>(m.batch)], layer, m.token,
                    std::vector<std::uint8_t>(total.entry_bytes(),
                                              static_cast<std::uint8_t>(m.token * 7 + layer + batch[static_cast<std::size_t>(m.batch)])));
      }
      sparse.storage().fill(r.plan, total);
      hits += r.total.hits;
      misses += r.total.misses;
      const std::size_t per = static_cast<std::size_t>(kT) * kK;
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const LayerCache& c = engine.layer_cache(batch[b], layer);
        for (std::size_t i = 0; i < per; ++i) {
          const std::int32_t tok = ids[b * per + i];
          if (tok < 0) continue;
          const std::int32_t slot = r.slot_ids[b * per + i];
          ASSERT_EQ(c.token_in(slot), tok);
          sparse.storage().read(sparse.row(batch[b]), layer, slot, buf);
          ASSERT_TRUE(std::equal(buf.begin(), buf.end(), total.entry(batch[b], layer, tok).begin()));
        }
      }
      if (steps % 5000 == 0) engine.check_invariants();
    }
    // Finish some requests.
    for (std::size_t i = 0; i < live.size();) {
      if (rng() % 40 == 0 || total.length(live[i]) > 4000) {
        engine.release(live[i]);
        total.release(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        ++finished;
      } else {
        ++i;
      }
    }
  }
  engine.check_invariants();
  EXPECT_GE(steps, kSteps);
  EXPECT_GT(finished, 100);
  EXPECT_GT(refused, 0) << "the soak should also exercise a full host pool";
  EXPECT_GT(hits, 0);
  EXPECT_GT(misses, 0);
  RecordProperty("hits", static_cast<int>(hits));
  RecordProperty("misses", static_cast<int>(misses));
}

}  // namespace
}  // namespace ess
