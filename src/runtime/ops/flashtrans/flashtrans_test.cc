// FlashTrans and the device Sparse Memory Pool backend on the device (flashtrans_cases.h; the
// host run of the same cases is flashtrans_host_test.cc). Skipped without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "ess/core/error.h"
#include "ess/ops/flashtrans.h"
#include "ess/runtime/backend.h"
#include "flashtrans_cases.h"
#include "runtime/cuda/device_slot_storage.h"
#include "testing/device_io.h"

namespace ess::flashtrans_test {
namespace {

using test::download;
using test::upload;

// Pinned, mapped host memory holding a copy of `bytes`.
struct PinnedBytes {
  explicit PinnedBytes(const std::vector<std::uint8_t>& bytes) : n(bytes.size()) {
    ESS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&p), n, cudaHostAllocMapped), "pinning {} bytes", n);
    std::memcpy(p, bytes.data(), n);
  }
  ~PinnedBytes() { cudaFreeHost(p); }
  PinnedBytes(const PinnedBytes&) = delete;
  PinnedBytes& operator=(const PinnedBytes&) = delete;
  std::uint8_t* p = nullptr;
  std::size_t n = 0;
};

std::vector<std::uint8_t> device_copy(const CopyProblem& pr) {
  const auto offsets = upload(pr.src_offsets), dst_offsets = upload(pr.dst_offsets);
  const auto count = upload(std::vector<std::int64_t>{pr.device_count});
  cuda::EntryCopy c;
  c.src_offsets = offsets.get();
  c.dst_offsets = dst_offsets.get();
  c.count = pr.count;
  c.entry_bytes = pr.entry_bytes;
  c.device_count = pr.device_count >= 0 ? count.get() : nullptr;
  c.blocks = pr.blocks;
  c.src_tail = pr.src_tail;
  c.dst_tail = pr.dst_tail;
  if (pr.host_to_device) {
    const PinnedBytes src(pr.src);
    auto dst = upload(pr.dst);
    c.src_base = cuda::device_view(src.p);
    c.dst_base = dst.get();
    EXPECT_EQ(cuda::flashtrans_gather(c, nullptr), 0);
    test::sync("FlashTrans gather");
    return download(dst);
  }
  const auto src = upload(pr.src);
  PinnedBytes dst(pr.dst);
  c.src_base = src.get();
  c.dst_base = const_cast<std::uint8_t*>(cuda::device_view(dst.p));
  EXPECT_EQ(cuda::flashtrans_scatter(c, nullptr), 0);
  test::sync("FlashTrans scatter");
  return {dst.p, dst.p + dst.n};
}

std::vector<std::uint8_t> device_fill(const SparsePoolConfig& config, int rows, const MissPlan& plan, const TotalPool& total) {
  SparsePool pool(config, std::make_unique<cuda::DeviceSlotStorage>());
  for (int b = 0; b < rows; ++b) EXPECT_EQ(pool.admit(b), b);
  pool.storage().fill(plan, total);
  const std::size_t E = config.layout.bytes();
  std::vector<std::uint8_t> out(static_cast<std::size_t>(rows) * config.num_layers * config.slots * E);
  for (int b = 0; b < rows; ++b) {
    for (int l = 0; l < config.num_layers; ++l) {
      for (std::int32_t s = 0; s < config.slots; ++s) {
        const std::size_t at = ((static_cast<std::size_t>(b) * config.num_layers + static_cast<std::size_t>(l)) * config.slots + static_cast<std::size_t>(s)) * E;
        pool.storage().read(b, l, s, {out.data() + at, E});
      }
    }
  }
  return out;
}

bool device_present() { return cuda_device_present(); }

TEST(DeviceSlotStorage, RefusesAnUnpinnedTotalPoolAndOutOfRangeMisses) {
  if (!device_present()) GTEST_SKIP() << "no CUDA device present";
  TotalPool aligned(2, LatentLayout{}, 4 * 64 * 656, HostMemoryKind::kAligned);
  aligned.admit(0, 10);
  SparsePool gpu(pool_config(1), std::make_unique<cuda::DeviceSlotStorage>());
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

// The launchers refuse what check_args refuses, before any CUDA call (no device needed).
TEST(FlashTransLauncher, RefusesWhatCheckArgsRefuses) {
  alignas(16) static std::uint8_t bytes[64];
  static const std::uint64_t offsets[1] = {0};
  cuda::EntryCopy c{bytes, bytes + 16, offsets, offsets, 1, 656};
  const int kInvalid = static_cast<int>(cudaErrorInvalidValue);
  cuda::EntryCopy bad = c;
  bad.entry_bytes = 650;  // not a multiple of 16
  EXPECT_EQ(cuda::flashtrans_scatter(bad, nullptr), kInvalid);
  bad = c;
  bad.src_base = bytes + 8;  // not 16-byte aligned
  EXPECT_EQ(cuda::flashtrans_gather(bad, nullptr), kInvalid);
  bad = c;
  bad.threads = 100;
  EXPECT_EQ(cuda::flashtrans_gather(bad, nullptr), kInvalid);
  bad = c;
  bad.count = 0;
  bad.entry_bytes = 650;
  EXPECT_EQ(cuda::flashtrans_gather(bad, nullptr), 0);  // nothing to copy
}

}  // namespace

const FlashTransBackend& flashtrans_backend() {
  static const FlashTransBackend b{{"cuda", device_present}, HostMemoryKind::kPinned, device_copy, device_fill};
  return b;
}

}  // namespace ess::flashtrans_test
