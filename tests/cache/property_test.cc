// Property tests over thousands of random steps: the invariants of the cache engine.
//   1. resident tokens <-> occupied slots is a bijection per request-layer;
//   2. the bytes in every occupied slot equal the Total Memory Pool's bytes for its token;
//   3. hits + misses equal the distinct working set; every slot id holds its token;
//   4. the engine equals an independently written LRU, bit for bit (slots, plan, recency);
//   5. Belady-optimal misses <= LRU misses on every input.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "ess/cache/swap_engine.h"
#include "testing/cache_fixtures.h"

namespace ess {
namespace {

// Top-k ids with temporal locality: each query keeps most of its previous selection.
class Selector {
 public:
  Selector(int K, std::uint32_t seed) : K_(K), rng_(seed) {}
  std::vector<std::int32_t> next(std::int64_t length, double keep) {
    std::set<std::int32_t> q;
    const auto want = static_cast<std::size_t>(std::min<std::int64_t>(K_, length));
    for (std::int32_t t : prev_) {
      if (q.size() < want && t < length && std::bernoulli_distribution(keep)(rng_)) q.insert(t);
    }
    while (q.size() < want) q.insert(static_cast<std::int32_t>(rng_() % static_cast<std::uint64_t>(length)));
    prev_.assign(q.begin(), q.end());
    std::vector<std::int32_t> row(prev_);
    std::shuffle(row.begin(), row.end(), rng_);
    row.resize(static_cast<std::size_t>(K_), -1);
    return row;
  }

 private:
  int K_;
  std::mt19937 rng_;
  std::vector<std::int32_t> prev_;
};

struct Params {
  int T, K, extra_slots, requests, layers;
};

class CacheProperties : public testing::TestWithParam<Params> {};

TEST_P(CacheProperties, InvariantsHoldOverRandomSteps) {
  const Params p = GetParam();
  const std::int32_t S = p.T * p.K + p.extra_slots;
  const int steps = 1500;
  TotalPool total(p.layers, test::small_layout(), 4096ull * 64 * 144);
  SparsePoolConfig sc;
  sc.num_layers = p.layers;
  sc.layout = test::small_layout();
  sc.max_requests = p.requests;
  sc.slots = S;
  sc.query_tokens = p.T;
  sc.topk = p.K;
  SparsePool sparse(sc);
  SwapEngine engine(total, sparse);
  std::mt19937 rng(static_cast<std::uint32_t>(p.T * 1000 + p.K));
  std::vector<RequestId> batch;
  std::vector<std::int64_t> len;
  std::map<std::pair<RequestId, int>, test::NaiveLru> naive;
  std::map<std::pair<RequestId, int>, std::vector<Selector>> selectors;
  for (RequestId id = 0; id < p.requests; ++id) {
    const std::int64_t l0 = 1 + static_cast<std::int64_t>(rng() % 300);
    total.admit(id, l0);
    for (int l = 0; l < p.layers; ++l) {
      test::write_pattern(total, id, l, 0, l0);
      naive.emplace(std::make_pair(id, l), test::NaiveLru(S));
      for (int t = 0; t < p.T; ++t) selectors[{id, l}].emplace_back(p.K, static_cast<std::uint32_t>(id * 100 + l * 10 + t));
    }
    engine.admit(id);
    batch.push_back(id);
    len.push_back(l0);
  }
  std::int64_t lookups = 0;
  for (int s = 0; s < steps; ++s) {
    const int layer = s % p.layers;
    if (layer == 0) {
      for (std::size_t b = 0; b < batch.size(); ++b) {  // decode appends T tokens
        total.extend(batch[b], p.T);
        for (int l = 0; l < p.layers; ++l) test::write_pattern(total, batch[b], l, len[b], len[b] + p.T);
        len[b] += p.T;
      }
    }
    const double keep = (s / 100) % 2 == 0 ? 0.9 : 0.3;  // phases of high and low locality
    std::vector<std::int32_t> ids;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      for (int t = 0; t < p.T; ++t) {
        const auto row = selectors[{batch[b], layer}][static_cast<std::size_t>(t)].next(len[b], keep);
        ids.insert(ids.end(), row.begin(), row.end());
      }
    }
    const SwapResult r = engine.step({layer, batch, ids, len});
    sparse.storage().fill(r.plan, total);
    lookups += static_cast<std::int64_t>(ids.size());

    std::set<std::pair<std::int32_t, std::int32_t>> plan_slots;
    for (const MissEntry& m : r.plan.entries) ASSERT_TRUE(plan_slots.insert({m.row, m.slot}).second) << "slot filled twice";
    ASSERT_EQ(static_cast<std::int64_t>(r.plan.entries.size()), r.total.misses);
    const std::size_t per = static_cast<std::size_t>(p.T) * p.K;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const LayerCache& c = engine.layer_cache(batch[b], layer);
      const auto req_ids = std::span<const std::int32_t>(ids).subspan(b * per, per);
      const auto req_slots = std::span<const std::int32_t>(r.slot_ids).subspan(b * per, per);
      std::set<std::int32_t> ws;
      for (std::size_t i = 0; i < per; ++i) {
        if (req_ids[i] < 0) {
          ASSERT_EQ(req_slots[i], -1);
          continue;
        }
        ws.insert(req_ids[i]);
        ASSERT_EQ(c.token_in(req_slots[i]), req_ids[i]) << "slot id does not hold its token";
      }
      ASSERT_EQ(r.per_request[b].working_set(), static_cast<std::int64_t>(ws.size()));
      // The independent LRU model agrees bit for bit.
      std::vector<std::pair<std::int32_t, std::int32_t>> nf;
      auto& model = naive.at({batch[b], layer});
      const auto expect = model.step(req_ids, nf);
      ASSERT_TRUE(std::equal(expect.begin(), expect.end(), req_slots.begin())) << "step " << s << " request " << b;
      ASSERT_EQ(c.policy().recency(), model.stamps());
      ASSERT_EQ(static_cast<std::int64_t>(nf.size()), r.per_request[b].misses);
    }
    if (s % 50 == 0 || s == steps - 1) {
      engine.check_invariants();
      std::vector<std::uint8_t> buf(total.entry_bytes());
      for (RequestId id : batch) {
        for (int l = 0; l < p.layers; ++l) {
          const LayerCache& c = engine.layer_cache(id, l);
          for (std::int32_t slot = 0; slot < S; ++slot) {
            if (c.token_in(slot) < 0) continue;
            sparse.storage().read(sparse.row(id), l, slot, buf);
            ASSERT_TRUE(std::equal(buf.begin(), buf.end(), total.entry(id, l, c.token_in(slot)).begin()))
                << "slot " << slot << " of request " << id << " layer " << l << " differs from the host entry";
          }
        }
      }
    }
  }
  EXPECT_GT(lookups, 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CacheProperties,
                         testing::Values(Params{1, 8, 0, 3, 2}, Params{2, 8, 5, 2, 2}, Params{3, 5, 17, 3, 1},
                                         Params{2, 16, 40, 1, 3}, Params{1, 1, 0, 2, 1}));

TEST(BeladyProperty, NeverMoreMissesThanLruOnAnyInput) {
  std::mt19937 rng(21);
  for (int trial = 0; trial < 40; ++trial) {
    const int K = 2 + static_cast<int>(rng() % 12);
    const std::int32_t S = K + static_cast<std::int32_t>(rng() % (3 * K));
    const std::int64_t length = S + static_cast<std::int64_t>(rng() % 200);
    Selector sel(K, static_cast<std::uint32_t>(trial));
    std::vector<std::vector<std::int32_t>> rows;
    std::vector<std::vector<std::int32_t>> future;
    for (int s = 0; s < 400; ++s) {
      auto row = sel.next(length, trial % 2 == 0 ? 0.8 : 0.4);
      rows.push_back(row);
      std::vector<std::int32_t> ws;
      for (std::int32_t t : row) {
        if (t >= 0) ws.push_back(t);
      }
      future.push_back(ws);
    }
    LayerCache lru(S, std::make_unique<LruPolicy>(S));
    LayerCache opt(S, std::make_unique<BeladyPolicy>(S, future));
    lru.reserve_tokens(length);
    opt.reserve_tokens(length);
    std::int64_t ml = 0, mo = 0;
    std::vector<std::int32_t> slots(static_cast<std::size_t>(K));
    std::vector<Fill> fills;
    for (const auto& row : rows) {
      ml += lru.access(row, 1, K, slots, fills).misses;
      mo += opt.access(row, 1, K, slots, fills).misses;
    }
    opt.check_invariants();
    EXPECT_LE(mo, ml) << "trial " << trial;
  }
}

}  // namespace
}  // namespace ess
