// The CTA emulator itself (cta_emulator.h): what it must catch in a kernel's device code
// fails a test (a scan's storage reused without a barrier, a deadlock, a shared or global write
// out of range), its block scan is cub's exclusive sum, and seeds change the order threads run.
#include "testing/emulator/cta_emulator.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace ess::emu {
namespace {

TEST(CtaEmulator, BlockScanIsAnExclusiveSum) {
  std::vector<int> in(1024), rank(1024, -1), total(1024, -1);
  std::mt19937 rng(3);
  for (int& v : in) v = static_cast<int>(rng() % 3);
  launch("test_scan", 1, 1024, 0, 7, [&](Cta& p, std::uint8_t*) {
    p.exclusive_sum(in[static_cast<std::size_t>(p.tid())], rank[static_cast<std::size_t>(p.tid())],
                    total[static_cast<std::size_t>(p.tid())]);
    p.sync();
  });
  int run = 0;
  for (std::size_t t = 0; t < in.size(); ++t) {
    ASSERT_EQ(rank[t], run) << "thread " << t;
    run += in[t];
  }
  for (const int t : total) ASSERT_EQ(t, run);
  EXPECT_TRUE(Coverage::has("test_scan"));
}

TEST(CtaEmulator, TheBlockedScanRanksThreadContiguousItems) {
  std::vector<std::int64_t> out(256 * 4, -1);
  std::int64_t total = -1;
  launch("test_blocked_scan", 1, 256, 0, 5, [&](Cta& p, std::uint8_t*) {
    std::int64_t in[4], o[4], t = 0;
    for (int u = 0; u < 4; ++u) in[u] = (p.tid() * 4 + u) % 3;
    p.exclusive_sum(in, o, t);
    for (int u = 0; u < 4; ++u) out[static_cast<std::size_t>(p.tid() * 4 + u)] = o[u];
    if (p.tid() == 0) total = t;
  });
  std::int64_t run = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i], run) << "item " << i;
    run += static_cast<std::int64_t>(i % 3);
  }
  EXPECT_EQ(total, run);
}

// A cluster: each block writes its rank into every block's shared memory (distributed shared
// memory), a cluster barrier, then each reads what the others wrote.
TEST(CtaEmulator, AClusterBarrierMakesEveryBlocksWritesVisible) {
  constexpr int kBlocks = 8, kCluster = 4, kThreads = 32;
  std::vector<int> seen(kBlocks * kCluster, -1);
  launch_clusters("test_cluster", kBlocks, kCluster, kThreads, kCluster * 4, 9, [&](Cta& p, std::uint8_t* smem) {
    auto* slot = reinterpret_cast<std::int32_t*>(smem);
    EXPECT_EQ(p.ranks(), kCluster);
    EXPECT_EQ(static_cast<int>(p.block()) % kCluster, p.rank());
    if (p.tid() < kCluster) *p.remote(slot + p.rank(), p.tid()) = p.rank();
    p.cluster_sync();
    if (p.tid() == 0) {
      for (int q = 0; q < kCluster; ++q) seen[p.block() * kCluster + static_cast<unsigned>(q)] = slot[q];
    }
  });
  for (int b = 0; b < kBlocks; ++b) {
    for (int q = 0; q < kCluster; ++q) EXPECT_EQ(seen[static_cast<std::size_t>(b * kCluster + q)], q) << b;
  }
}

// Without the cluster barrier (a block barrier in its place), a block that runs ahead reads
// another's shared memory unwritten: some seed's schedule shows it.
TEST(CtaEmulator, ABlockBarrierInPlaceOfTheClustersLetsABlockReadAheadOfTheOthers) {
  int stale = 0;
  for (std::uint64_t seed = 0; seed < 16 && stale == 0; ++seed) {
    launch_clusters("test_cluster_race", 2, 2, 32, 4, seed, [&](Cta& p, std::uint8_t* smem) {
      auto* slot = reinterpret_cast<std::int32_t*>(smem);
      if (p.tid() == 0) *slot = 1;
      p.sync();  // not p.cluster_sync()
      if (p.tid() == 0 && *p.remote(slot, 1 - p.rank()) != 1) ++stale;
      p.cluster_sync();  // no block exits while the other may read its shared memory
    });
  }
  EXPECT_GT(stale, 0);
}

TEST(CtaEmulator, AClusterAddressOutsideSharedMemoryFails) {
  int outside = 0;
  EXPECT_NONFATAL_FAILURE(launch_clusters("test_cluster_range", 2, 2, 1, 4, 1,
                                          [&](Cta& p, std::uint8_t*) {
                                            if (p.rank() == 0) (void)p.remote(&outside, 1);
                                          }),
                          "outside the block's shared memory");
}

TEST(CtaEmulator, AScanReusedWithoutABarrierFails) {
  EXPECT_NONFATAL_FAILURE(launch("test_reuse", 1, 64, 0, 1,
                                 [](Cta& p, std::uint8_t*) {
                                   int r = 0, t = 0;
                                   p.exclusive_sum(1, r, t);
                                   p.exclusive_sum(1, r, t);  // cub requires a __syncthreads in between
                                 }),
                          "reused its storage without a __syncthreads");
}

TEST(CtaEmulator, ABarrierNotEveryThreadReachesFails) {
  EXPECT_NONFATAL_FAILURE(launch("test_deadlock", 1, 64, 0, 1,
                                 [](Cta& p, std::uint8_t*) {
                                   if (p.tid() != 5) p.sync();
                                 }),
                          "deadlocked");
}

TEST(CtaEmulator, SharedMemoryIsPoisonedAndGuarded) {
  std::vector<std::uint8_t> seen(32);
  launch("test_poison", 1, 32, 32, 1, [&](Cta& p, std::uint8_t* smem) { seen[static_cast<std::size_t>(p.tid())] = smem[p.tid()]; });
  for (const std::uint8_t b : seen) EXPECT_EQ(b, kPoisonByte);
  EXPECT_NONFATAL_FAILURE(launch("test_overflow", 1, 32, 32, 1,
                                 [](Cta& p, std::uint8_t* smem) {
                                   if (p.tid() == 0) smem[32 + 3] = 1;
                                 }),
                          "shared memory written 3 bytes past its end");
}

TEST(CtaEmulator, GuardedBuffersSeeWritesOutsideThem) {
  Guarded<std::int32_t> g(10);
  EXPECT_EQ(g.damage(), "");
  g.data()[10] = 0;
  EXPECT_EQ(g.damage(), "written 0 bytes past its end");
  Guarded<std::int32_t> h(10);
  h.data()[-1] = 0;
  EXPECT_NE(h.damage().find("before it"), std::string::npos);
}

TEST(CtaEmulator, SeedsChangeTheOrderThreadsRun) {
  const auto order = [](std::uint64_t seed) {
    std::vector<int> ran;
    launch("test_order", 1, 64, 0, seed, [&](Cta& p, std::uint8_t*) {
      p.sync();
      ran.push_back(p.tid());  // fibers never run concurrently
    });
    return ran;
  };
  EXPECT_EQ(order(1), order(1));
  EXPECT_NE(order(1), order(2));
}

}  // namespace
}  // namespace ess::emu
