// The GPU swap engine against the CPU engine, bit for bit: slot ids, the miss plan in its
// order, hit / miss counts, recency and residency, over seeded awkward shapes; and
// LRU-Warmup on the device against SwapEngine::warmup. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <tuple>

#include "ess/cache/swap_engine.h"
#include "testing.h"
#include "ess/cuda/swap_engine_gpu.h"

namespace ess {
namespace {

// [T][K] ids with decode-like locality: each query keeps most of its previous selection.
std::vector<std::int32_t> next_ids(std::vector<std::int32_t>& prev, int T, int K, std::int64_t len, int fresh,
                                   std::mt19937& rng) {
  std::set<std::int32_t> q;
  const auto want = static_cast<std::size_t>(std::min<std::int64_t>(K, len));
  for (std::int32_t t : prev) {
    if (q.size() + static_cast<std::size_t>(fresh) < want) q.insert(t);
  }
  while (q.size() < want) q.insert(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(len)));
  prev.assign(q.begin(), q.end());
  std::vector<std::int32_t> out;
  for (int t = 0; t < T; ++t) {
    std::vector<std::int32_t> row(prev);
    std::shuffle(row.begin(), row.end(), rng);
    if (t > 0 && !row.empty()) row[0] = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(len));
    std::set<std::int32_t> uniq;
    for (auto& x : row) {
      if (!uniq.insert(x).second) x = -1;  // keep rows duplicate-free
    }
    row.resize(static_cast<std::size_t>(K), -1);
    if (rng() % 5 == 0) row[rng() % static_cast<std::uint64_t>(K)] = -1;
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

// (batch, T, K, extra slots)
class GpuSwapShapes : public testing::TestWithParam<std::tuple<int, int, int, int>> {};

TEST_P(GpuSwapShapes, MatchesTheCpuEngineBitForBit) {
  ESS_SKIP_WITHOUT_GPU();
  const auto [B, T, K, extra] = GetParam();
  const std::int32_t S = T * K + extra;
  const std::int64_t len = std::max<std::int64_t>(4 * S, 64);
  const int layers = 2;
  TotalPool total(layers, LatentLayout{128, 8}, static_cast<std::uint64_t>(B) * layers * ((len + 63) / 64) * 64 * 144);
  SparsePoolConfig sc;
  sc.num_layers = layers;
  sc.layout = LatentLayout{128, 8};
  sc.max_requests = B;
  sc.slots = S;
  sc.query_tokens = T;
  sc.topk = K;
  SparsePool sparse(sc);
  SwapEngine cpu(total, sparse);
  cuda::GpuSwapConfig gc;
  gc.rows = B;
  gc.layers = layers;
  gc.slots = S;
  gc.max_positions = T * K;
  cuda::GpuSwapEngine gpu(gc);
  std::vector<RequestId> batch;
  std::vector<std::int32_t> rows;
  std::vector<std::int64_t> lengths;
  for (int b = 0; b < B; ++b) {
    total.admit(b, len);
    cpu.admit(b);
    batch.push_back(b);
    rows.push_back(sparse.row(b));
    lengths.push_back(len);
  }
  std::mt19937 rng(static_cast<std::uint32_t>(B * 7919 + T * 31 + K));
  std::vector<std::vector<std::int32_t>> prev(static_cast<std::size_t>(B * layers));
  for (int step = 0; step < 40; ++step) {
    const int layer = step % layers;
    const int fresh = (step / 10) % 2 == 0 ? std::max(1, K / 10) : K;  // calm and churning phases
    std::vector<std::int32_t> ids;
    for (int b = 0; b < B; ++b) {
      const auto v = next_ids(prev[static_cast<std::size_t>(b * layers + layer)], T, K, len, fresh, rng);
      ids.insert(ids.end(), v.begin(), v.end());
    }
    const SwapResult want = cpu.step({layer, batch, ids, lengths});
    const auto got = gpu.step(layer, rows, T, K, ids);
    ASSERT_EQ(got.slot_ids, want.slot_ids) << "step " << step;
    std::size_t next = 0;
    for (int b = 0; b < B; ++b) {
      ASSERT_EQ(got.counts[static_cast<std::size_t>(b)], want.per_request[static_cast<std::size_t>(b)]) << "step " << step << " b " << b;
      for (const MissEntry& m : got.fills[static_cast<std::size_t>(b)]) {
        ASSERT_LT(next, want.plan.entries.size());
        const MissEntry& w = want.plan.entries[next++];
        ASSERT_EQ(m.batch, w.batch);
        ASSERT_EQ(m.row, w.row);
        ASSERT_EQ(m.token, w.token) << "step " << step << " b " << b;
        ASSERT_EQ(m.slot, w.slot) << "step " << step << " b " << b;
      }
    }
    ASSERT_EQ(next, want.plan.entries.size());
  }
  for (int b = 0; b < B; ++b) {
    for (int l = 0; l < layers; ++l) {
      const auto st = gpu.download(rows[static_cast<std::size_t>(b)], l);
      const LayerCache& c = cpu.layer_cache(b, l);
      EXPECT_EQ(st.recency, c.policy().recency()) << "request " << b << " layer " << l;
      EXPECT_TRUE(std::equal(st.token_of_slot.begin(), st.token_of_slot.end(), c.token_of_slot().begin()));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Awkward, GpuSwapShapes,
                         testing::Values(std::make_tuple(1, 1, 1, 0), std::make_tuple(3, 2, 41, 7), std::make_tuple(127, 1, 41, 0),
                                         std::make_tuple(3, 2, 256, 300), std::make_tuple(127, 2, 2048, 2458)));

TEST(GpuSwapEngine, WarmupMatchesTheCpuEngine) {
  ESS_SKIP_WITHOUT_GPU();
  const int K = 64;
  const std::int32_t S = 200;
  const std::int64_t len = 5000;
  TotalPool total(1, LatentLayout{128, 8}, ((len + 63) / 64) * 64 * 144);
  SparsePoolConfig sc;
  sc.num_layers = 1;
  sc.layout = LatentLayout{128, 8};
  sc.max_requests = 1;
  sc.slots = S;
  sc.query_tokens = 1;
  sc.topk = K;
  SparsePool sparse(sc);
  SwapEngine cpu(total, sparse);
  total.admit(0, len);
  cpu.admit(0);
  cuda::GpuSwapConfig gc;
  gc.rows = 1;
  gc.layers = 1;
  gc.slots = S;
  gc.max_positions = K;
  cuda::GpuSwapEngine gpu(gc);
  std::mt19937 rng(5);
  std::vector<std::int32_t> prev, windows;
  for (int w = 0; w < 32; ++w) {
    const auto v = next_ids(prev, 1, K, len, 20, rng);
    windows.insert(windows.end(), v.begin(), v.end());
  }
  const WarmupResult want = cpu.warmup(0, 0, windows, len);
  const auto got = gpu.warmup(0, 0, K, windows);
  ASSERT_EQ(got.size(), want.plan.entries.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].token, want.plan.entries[i].token);
    EXPECT_EQ(got[i].slot, want.plan.entries[i].slot);
  }
  EXPECT_EQ(gpu.download(0, 0).recency, cpu.layer_cache(0, 0).policy().recency());
}

}  // namespace
}  // namespace ess
