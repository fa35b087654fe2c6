// The GPU swap engine's contract, against the CPU engine bit for bit: slot ids, the miss plan
// in its order, hit / miss counts, recency and residency, over seeded awkward shapes, and
// LRU-Warmup against SwapEngine::warmup; on a backend (backend.h): the device's
// GpuSwapEngine in swap_engine_test.cc, the cache tests' independent naive LRU model in
// swap_engine_host_test.cc. Include in exactly one source file per binary.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "ess/cache/swap_engine.h"
#include "runtime/ops/gpu_swap/swap_engine_gpu.h"
#include "runtime/ops/launch_args.h"
#include "testing/backend.h"
#include "testing/cache_fixtures.h"

namespace ess::swap_test {

// A swap engine under test, driven through GpuSwapEngine's host interface.
class EngineUnderTest {
 public:
  virtual ~EngineUnderTest() = default;
  virtual cuda::GpuSwapEngine::HostResult step(int layer, const std::vector<std::int32_t>& rows, int T, int K,
                                               const std::vector<std::int32_t>& ids) = 0;
  virtual std::vector<MissEntry> warmup(int row, int layer, int K, const std::vector<std::int32_t>& windows) = 0;
  virtual cuda::GpuSwapEngine::HostState download(int row, int layer) = 0;
};

struct SwapBackend {
  test::BackendInfo info;
  std::unique_ptr<EngineUnderTest> (*make)(const cuda::GpuSwapConfig& config);
};
const SwapBackend& swap_backend();  // defined by the including binary

// The CPU engine on pools of the test layout (144-byte entries, a valid LatentLayout: the
// Total Memory Pool refuses layouts that are not whole 16-byte chunks).
struct CpuEngine {
  CpuEngine(int requests, int layers, std::int32_t slots, int T, int K, std::int64_t len)
      : total(layers, test::small_layout(),
              static_cast<std::uint64_t>(requests) * layers * ((len + 63) / 64) * 64 * test::small_layout().bytes()),
        sparse(pool_config(requests, layers, slots, T, K)),
        engine(total, sparse) {
    for (int b = 0; b < requests; ++b) {
      total.admit(b, len);
      engine.admit(b);
    }
  }
  static SparsePoolConfig pool_config(int requests, int layers, std::int32_t slots, int T, int K) {
    SparsePoolConfig sc;
    sc.num_layers = layers;
    sc.layout = test::small_layout();
    sc.max_requests = requests;
    sc.slots = slots;
    sc.query_tokens = T;
    sc.topk = K;
    return sc;
  }
  TotalPool total;
  SparsePool sparse;
  SwapEngine engine;
};

// The GPU engine's shared memory for a shape fits the devices ESS targets.
inline void expect_fits_the_device(const cuda::GpuSwapConfig& gc) {
  EXPECT_EQ(cuda::check_args(gc), "");
  EXPECT_LE(cuda::swap_step_smem_bytes(gc.max_positions, gc.slots) + cuda::kSwapStepStaticSmemBound,
            cuda::kHopperSmemOptin)
      << gc.max_positions << " positions, " << gc.slots << " slots";
}

// (batch, T, K, extra slots, blocks per request: GpuSwapConfig::cluster, 0 = by the step)
class GpuSwapShapes : public testing::TestWithParam<std::tuple<int, int, int, int, int>> {};

TEST_P(GpuSwapShapes, MatchesTheCpuEngineBitForBit) {
  ESS_REQUIRE_BACKEND(swap_backend().info);
  const auto [B, T, K, extra, cluster] = GetParam();
  const std::int32_t S = T * K + extra;
  const std::int64_t len = std::max<std::int64_t>(4 * S, 64);
  const int layers = 2;
  CpuEngine cpu(B, layers, S, T, K, len);
  cuda::GpuSwapConfig gc;
  gc.rows = B;
  gc.layers = layers;
  gc.slots = S;
  gc.max_positions = T * K;
  gc.cluster = cluster;
  expect_fits_the_device(gc);
  const std::unique_ptr<EngineUnderTest> gpu = swap_backend().make(gc);
  std::vector<RequestId> batch;
  std::vector<std::int32_t> rows;
  std::vector<std::int64_t> lengths;
  for (int b = 0; b < B; ++b) {
    batch.push_back(b);
    rows.push_back(cpu.sparse.row(b));
    lengths.push_back(len);
  }
  std::mt19937 rng(static_cast<std::uint32_t>(B * 7919 + T * 31 + K));
  std::vector<std::vector<std::int32_t>> prev(static_cast<std::size_t>(B * layers));
  for (int step = 0; step < 40; ++step) {
    const int layer = step % layers;
    const int fresh = (step / 10) % 2 == 0 ? std::max(1, K / 10) : K;  // calm and churning phases
    std::vector<std::int32_t> ids;
    for (int b = 0; b < B; ++b) {
      const auto v = test::decode_like_ids(prev[static_cast<std::size_t>(b * layers + layer)], T, K, len, fresh, rng);
      ids.insert(ids.end(), v.begin(), v.end());
    }
    const SwapResult want = cpu.engine.step({layer, batch, ids, lengths});
    const auto got = gpu->step(layer, rows, T, K, ids);
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
      const auto st = gpu->download(rows[static_cast<std::size_t>(b)], l);
      const LayerCache& c = cpu.engine.layer_cache(b, l);
      EXPECT_EQ(st.recency, c.policy().recency()) << "request " << b << " layer " << l;
      EXPECT_TRUE(std::equal(st.token_of_slot.begin(), st.token_of_slot.end(), c.token_of_slot().begin()));
    }
  }
}

// By the step (0): one block per request at these sizes but MTP 3 at K = 2048 (a cluster of 8 at
// batch 2); clusters forced on small shapes (parts of a block empty: 1 slot over 4 blocks), on MTP
// 4 at K = 2048 (the paper's MTP-4 deployment) and over scans of two tiles (17,064 slots on 2
// blocks of 8,192 items each).
INSTANTIATE_TEST_SUITE_P(Awkward, GpuSwapShapes,
                         testing::Values(std::make_tuple(1, 1, 1, 0, 4), std::make_tuple(3, 2, 41, 7, 2),
                                         std::make_tuple(127, 1, 41, 0, 0), std::make_tuple(3, 2, 256, 300, 2),
                                         std::make_tuple(127, 2, 2048, 2458, 0), std::make_tuple(2, 3, 2048, 0, 0),
                                         std::make_tuple(3, 4, 2048, 1000, 2), std::make_tuple(1, 1, 64, 17000, 2)));

// The blocks per request the engine picks: many at a small batch of a production-size step, one
// at a large batch or a small step.
TEST(GpuSwapEngine, ClusterSizeFollowsTheBatchAndTheStep) {
  constexpr int kSms = 132;  // H100 SXM
  EXPECT_EQ(cuda::swap_cluster_size(1, 2 * 2048, 6554, kSms, 8), 8);
  EXPECT_EQ(cuda::swap_cluster_size(2, 2 * 2048, 6554, kSms, 8), 8);  // 10,650 items: over 1,024 per block
  EXPECT_EQ(cuda::swap_cluster_size(1, 2 * 2048, 2000, kSms, 8), 4);  // 6,096 items: 8 blocks would hold fewer
  EXPECT_EQ(cuda::swap_cluster_size(16, 4 * 2048, 9192, kSms, 8), 8);
  EXPECT_EQ(cuda::swap_cluster_size(17, 4 * 2048, 9192, kSms, 8), 4);   // 17 x 8 > 132 SMs
  EXPECT_EQ(cuda::swap_cluster_size(66, 4 * 2048, 9192, kSms, 8), 2);
  EXPECT_EQ(cuda::swap_cluster_size(67, 4 * 2048, 9192, kSms, 8), 1);
  EXPECT_EQ(cuda::swap_cluster_size(128, 2 * 2048, 6554, kSms, 8), 1);
  EXPECT_EQ(cuda::swap_cluster_size(1, 2 * 41, 89, kSms, 8), 1);        // fewer items than one block's threads
  EXPECT_EQ(cuda::swap_cluster_size(1, 2 * 2048, 6554, kSms, 2), 2);    // at most max_cluster
  cuda::GpuSwapConfig gc;
  gc.rows = 1;
  gc.layers = 1;
  gc.slots = 64;
  gc.cluster = 3;
  EXPECT_NE(cuda::check_args(gc).find("cluster = 3"), std::string::npos);
  gc.cluster = 16;
  EXPECT_NE(cuda::check_args(gc).find("cluster = 16"), std::string::npos);
}

TEST(GpuSwapEngine, WarmupMatchesTheCpuEngine) {
  ESS_REQUIRE_BACKEND(swap_backend().info);
  const int K = 64;
  const std::int32_t S = 200;
  const std::int64_t len = 5000;
  CpuEngine cpu(1, 1, S, 1, K, len);
  cuda::GpuSwapConfig gc;
  gc.rows = 1;
  gc.layers = 1;
  gc.slots = S;
  gc.max_positions = K;
  expect_fits_the_device(gc);
  const std::unique_ptr<EngineUnderTest> gpu = swap_backend().make(gc);
  std::mt19937 rng(5);
  std::vector<std::int32_t> prev, windows;
  for (int w = 0; w < 32; ++w) {
    const auto v = test::decode_like_ids(prev, 1, K, len, 20, rng);
    windows.insert(windows.end(), v.begin(), v.end());
  }
  const WarmupResult want = cpu.engine.warmup(0, 0, windows, len);
  const auto got = gpu->warmup(0, 0, K, windows);
  ASSERT_EQ(got.size(), want.plan.entries.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].token, want.plan.entries[i].token);
    EXPECT_EQ(got[i].slot, want.plan.entries[i].slot);
  }
  EXPECT_EQ(gpu->download(0, 0).recency, cpu.engine.layer_cache(0, 0).policy().recency());
}

// Engines of different sizes coexist: a smaller one made after a larger one (which lowers
// nothing the larger one relies on, such as the kernel's shared-memory limit) leaves the
// larger one working, bit for bit.
TEST(GpuSwapEngine, ASmallerEngineMadeLaterLeavesALargerOneWorking) {
  ESS_REQUIRE_BACKEND(swap_backend().info);
  const int T = 2, K = 2048;
  const std::int32_t S = 6554;
  const std::int64_t len = 32768;
  CpuEngine cpu(2, 1, S, T, K, len);
  cuda::GpuSwapConfig big;
  big.rows = 2;
  big.layers = 1;
  big.slots = S;
  big.max_positions = T * K;
  const std::unique_ptr<EngineUnderTest> large = swap_backend().make(big);
  cuda::GpuSwapConfig tiny = big;
  tiny.slots = 64;
  tiny.max_positions = 32;
  const std::unique_ptr<EngineUnderTest> small = swap_backend().make(tiny);
  std::mt19937 rng(11);
  std::vector<std::vector<std::int32_t>> prev(2);
  const std::vector<RequestId> requests = {0, 1};
  const std::vector<std::int64_t> lengths = {len, len};
  for (int step = 0; step < 3; ++step) {
    std::vector<std::int32_t> ids;
    for (int b = 0; b < 2; ++b) {
      const auto v = test::decode_like_ids(prev[static_cast<std::size_t>(b)], T, K, len, 300, rng);
      ids.insert(ids.end(), v.begin(), v.end());
    }
    const SwapResult want = cpu.engine.step({0, requests, ids, lengths});
    ASSERT_EQ(large->step(0, {cpu.sparse.row(0), cpu.sparse.row(1)}, T, K, ids).slot_ids, want.slot_ids) << "step " << step;
    const std::vector<std::int32_t> few(32, -1);
    EXPECT_EQ(small->step(0, {0}, 1, 32, few).slot_ids, few);  // the small engine works too
  }
}

}  // namespace ess::swap_test
