// FlashTrans and the device Sparse Memory Pool backend against the CPU backend, byte for
// byte, over seeded awkward shapes. Skipped without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <tuple>

#include "ess/cache/sparse_pool.h"
#include "ess/cache/total_pool.h"
#include "ess/core/error.h"
#include "testing.h"
#include "ess/cuda/device_slot_storage.h"
#include "ess/cuda/flashtrans.h"

namespace ess {
namespace {

constexpr std::int32_t kSlots = 64;

SparsePoolConfig config(int rows) {
  SparsePoolConfig c;
  c.num_layers = 2;
  c.max_requests = rows;
  c.slots = kSlots;
  c.query_tokens = 1;
  c.topk = 8;
  return c;
}

// (batch, misses per request; -1 = every slot)
class FlashTransShapes : public testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(FlashTransShapes, DeviceSlotsEqualTheCpuBackend) {
  ESS_SKIP_WITHOUT_GPU();
  const auto [batch, misses_arg] = GetParam();
  const int misses = misses_arg < 0 ? kSlots : misses_arg;
  const std::int64_t len = 300;
  TotalPool total(2, LatentLayout{}, static_cast<std::uint64_t>(batch) * 2 * 5 * 64 * 656);
  ASSERT_EQ(total.memory_kind(), HostMemoryKind::kPinned);
  SparsePool gpu(config(batch), std::make_unique<cuda::DeviceSlotStorage>());
  SparsePool cpu(config(batch));
  std::mt19937 rng(static_cast<std::uint32_t>(batch * 1000 + misses));
  std::vector<std::uint8_t> e(656);
  MissPlan plan;
  plan.layer = 1;
  for (int b = 0; b < batch; ++b) {
    total.admit(b, len);
    for (int l = 0; l < 2; ++l) {
      for (std::int64_t t = 0; t < len; ++t) {
        for (auto& x : e) x = static_cast<std::uint8_t>(rng());
        total.write(b, l, t, e);
      }
    }
    const std::int32_t row = gpu.admit(b);
    ASSERT_EQ(cpu.admit(b), row);
    std::set<std::int32_t> toks, slots;
    while (static_cast<int>(toks.size()) < misses) toks.insert(static_cast<std::int32_t>(rng() % len));
    while (static_cast<int>(slots.size()) < misses) slots.insert(static_cast<std::int32_t>(rng() % kSlots));
    auto ti = toks.begin();
    auto si = slots.begin();
    for (int m = 0; m < misses; ++m, ++ti, ++si) plan.entries.push_back({b, row, *ti, *si, total.offset(b, 1, *ti)});
  }
  gpu.storage().fill(plan, total);
  cpu.storage().fill(plan, total);
  std::vector<std::uint8_t> a(656), c(656);
  for (int b = 0; b < batch; ++b) {
    for (int l = 0; l < 2; ++l) {
      for (std::int32_t s = 0; s < kSlots; ++s) {
        gpu.storage().read(gpu.row(b), l, s, a);
        cpu.storage().read(cpu.row(b), l, s, c);
        ASSERT_EQ(a, c) << "request " << b << " layer " << l << " slot " << s;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Awkward, FlashTransShapes,
                         testing::Combine(testing::Values(1, 3, 127), testing::Values(0, 1, 41, -1)));

TEST(FlashTrans, ScatterWritesDeviceEntriesBackToPinnedHostMemory) {
  ESS_SKIP_WITHOUT_GPU();
  const int n = 1000;
  const std::size_t E = 656;
  std::uint8_t* host = nullptr;
  std::uint8_t* dev = nullptr;
  std::uint64_t* offs = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), 2 * n * E, cudaHostAllocMapped), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), n * E), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&offs), 2 * n * sizeof(std::uint64_t)), cudaSuccess);
  std::vector<std::uint8_t> src(n * E);
  std::mt19937 rng(3);
  for (auto& x : src) x = static_cast<std::uint8_t>(rng());
  ASSERT_EQ(cudaMemcpy(dev, src.data(), src.size(), cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<std::uint64_t> o(2 * n);
  for (int i = 0; i < n; ++i) {
    o[i] = static_cast<std::uint64_t>(i) * E;                          // from device entry i
    o[n + i] = static_cast<std::uint64_t>(2 * n - 1 - 2 * i) * E;      // to host entry 2n-1-2i
  }
  ASSERT_EQ(cudaMemcpy(offs, o.data(), o.size() * 8, cudaMemcpyHostToDevice), cudaSuccess);
  std::memset(host, 0, 2 * n * E);
  cuda::EntryCopy c{dev, const_cast<std::uint8_t*>(cuda::device_view(host)), offs, offs + n, n, static_cast<int>(E)};
  ASSERT_EQ(cuda::flashtrans_scatter(c, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(std::memcmp(host + o[n + i], src.data() + o[i], E), 0) << "entry " << i;
    ASSERT_EQ(host[(2 * n - 2 - 2 * i) * E], 0) << "wrote between entries";
  }
  cuda::EntryCopy bad = c;
  bad.entry_bytes = 650;  // not a multiple of 16
  EXPECT_NE(cuda::flashtrans_scatter(bad, nullptr), 0);
  cudaFree(offs);
  cudaFree(dev);
  cudaFreeHost(host);
}

// The executor sizes a launch for the largest list and lets an earlier kernel write the real
// count: exactly min(*device_count, count) entries move, the rest stay untouched.
TEST(FlashTrans, DeviceCountBoundsTheCopy) {
  ESS_SKIP_WITHOUT_GPU();
  const int n = 300;
  const std::size_t E = 656;
  std::uint8_t *src = nullptr, *dst = nullptr;
  std::uint64_t* offs = nullptr;
  std::int64_t* count = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&src), n * E), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dst), n * E), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&offs), 2 * n * sizeof(std::uint64_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&count), sizeof(std::int64_t)), cudaSuccess);
  std::vector<std::uint8_t> h(n * E);
  std::mt19937 rng(5);
  for (auto& x : h) x = static_cast<std::uint8_t>(rng() | 1u);  // never zero
  ASSERT_EQ(cudaMemcpy(src, h.data(), h.size(), cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<std::uint64_t> o(2 * n);
  for (int i = 0; i < n; ++i) o[i] = o[n + i] = static_cast<std::uint64_t>(i) * E;
  ASSERT_EQ(cudaMemcpy(offs, o.data(), o.size() * 8, cudaMemcpyHostToDevice), cudaSuccess);
  for (const std::int64_t k : {std::int64_t{0}, std::int64_t{1}, std::int64_t{41}, std::int64_t{n}, std::int64_t{n + 50}}) {
    ASSERT_EQ(cudaMemset(dst, 0, n * E), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(count, &k, sizeof k, cudaMemcpyHostToDevice), cudaSuccess);
    cuda::EntryCopy c{src, dst, offs, offs + n, n, static_cast<int>(E), count};
    ASSERT_EQ(cuda::flashtrans_gather(c, nullptr), 0);
    std::vector<std::uint8_t> got(n * E);
    ASSERT_EQ(cudaMemcpy(got.data(), dst, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    const std::size_t moved = static_cast<std::size_t>(std::min<std::int64_t>(k, n)) * E;
    EXPECT_EQ(std::memcmp(got.data(), h.data(), moved), 0) << "count " << k;
    EXPECT_TRUE(std::all_of(got.begin() + static_cast<std::ptrdiff_t>(moved), got.end(), [](std::uint8_t x) { return x == 0; }))
        << "count " << k << ": copied past the device count";
  }
  cudaFree(count);
  cudaFree(offs);
  cudaFree(dst);
  cudaFree(src);
}

TEST(DeviceSlotStorage, RefusesAnUnpinnedTotalPoolAndOutOfRangeMisses) {
  ESS_SKIP_WITHOUT_GPU();
  TotalPool aligned(2, LatentLayout{}, 4 * 64 * 656, HostMemoryKind::kAligned);
  aligned.admit(0, 10);
  SparsePool gpu(config(1), std::make_unique<cuda::DeviceSlotStorage>());
  gpu.admit(0);
  MissPlan plan;
  plan.layer = 0;
  plan.entries.push_back({0, 0, 1, 2, aligned.offset(0, 0, 1)});
  EXPECT_THROW(gpu.storage().fill(plan, aligned), Error);
  TotalPool pinned(2, LatentLayout{}, 4 * 64 * 656);
  pinned.admit(0, 10);
  plan.entries[0].slot = kSlots;  // out of range
  EXPECT_THROW(gpu.storage().fill(plan, pinned), Error);
}

}  // namespace
}  // namespace ess
