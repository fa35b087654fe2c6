// The emulated CUDA target's own checks can fail (poison, copies out of range, frees, handles,
// kernel writes out of range), and the CUDA backend's whole step runs every kernel of its
// launchers there without leaking device memory.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "device.h"
#include "ess/ops/flashtrans.h"
#include "ess/runtime/offload.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/cuda/device_buffer.h"
#include "runtime/offload/offload_launch.h"
#include "testing/cache_fixtures.h"
#include "testing/emulator/cta_emulator.h"
#include "testing/offload_io.h"

namespace ess::emu {
namespace {

TEST(EmulatedCuda, DeviceMemoryIsPoisonedAndCopiesStayInside) {
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 100), cudaSuccess);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u);
  std::vector<std::uint8_t> h(100);
  ASSERT_EQ(cudaMemcpy(h.data(), p, 100, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h, std::vector<std::uint8_t>(100, Device::kPoisonByte));
  std::vector<std::uint8_t> big(101);
  cudaError_t e = cudaSuccess;
  EXPECT_NONFATAL_FAILURE(e = cudaMemcpy(p, big.data(), 101, cudaMemcpyHostToDevice), "is not inside one device allocation");
  EXPECT_EQ(e, cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_NONFATAL_FAILURE(e = cudaMemcpy(h.data(), static_cast<std::uint8_t*>(p) + 1, 100, cudaMemcpyDeviceToHost),
                          "is not inside one device allocation");
  (void)cudaGetLastError();
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_NONFATAL_FAILURE(e = cudaFree(p), "freed twice, or never allocated");
  EXPECT_NONFATAL_FAILURE(e = cudaFreeHost(h.data()), "freed twice, or never allocated");
}

TEST(EmulatedCuda, StreamsAndEventsAreCheckedHandles) {
  cudaStream_t s = nullptr;
  cudaEvent_t ev = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(ev, s), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(cudaStreamLegacy, ev, 0), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(ev), cudaSuccess);
  cudaError_t e = cudaSuccess;
  EXPECT_NONFATAL_FAILURE(e = cudaStreamSynchronize(s), "not a live stream");
  EXPECT_EQ(e, cudaErrorInvalidResourceHandle);
  EXPECT_NONFATAL_FAILURE(e = cudaEventRecord(ev, nullptr), "not a live event");
  (void)cudaGetLastError();
}

// A kernel that writes one element past its output (a batch larger than the buffer it was
// given) damages the allocation's guard: the launch fails the test and returns an error.
TEST(EmulatedCuda, AKernelWritingPastItsAllocationFails) {
  const int B = 2, K = 8;
  cuda::DeviceBuffer<std::int32_t> rows(B), lengths(B), ids(B * K), lru_ids(B * K - 1);
  ASSERT_EQ(cudaMemset(rows.get(), 0, B * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(lengths.get(), 0x01, B * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(ids.get(), 0, B * K * 4), cudaSuccess);
  cuda::StepShape s;
  s.batch = B;
  s.topk = K;
  s.query_end = 1;
  s.slots = K;
  s.pool.rows_per_request = K;
  s.rows = rows.get();
  s.topk_ids = ids.get();
  s.lengths = lengths.get();
  int e = 0;
  // In issue order the launch reports it; in a lazy one the synchronization that runs it.
  EXPECT_NONFATAL_FAILURE(
      {
        e = cuda::launch_mask_ids(s, lru_ids.get(), nullptr);
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
      },
      "was written out of range");
  EXPECT_EQ(e, cudaErrorIllegalAddress);
  (void)cudaGetLastError();
  std::memset(static_cast<void*>(lru_ids.get() + B * K - 1), Device::kGuardByte, 4);  // mend the guard for the free
}

TEST(EmulatedCuda, FlashTransAccessesOutsideEveryAllocationFail) {
  cuda::DeviceBuffer<std::uint8_t> src(64), dst(64);
  cuda::DeviceBuffer<std::uint64_t> so(1), dof(1);
  const std::uint64_t zero = 0, far = 1 << 20;
  ASSERT_EQ(cudaMemcpy(so.get(), &zero, 8, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dof.get(), &far, 8, cudaMemcpyHostToDevice), cudaSuccess);
  cuda::EntryCopy c{src.get(), dst.get(), so.get(), dof.get(), 1, 32, nullptr, 1};
  std::vector<std::uint8_t> keep(1 << 21);  // the stray address is host memory the test owns
  c.dst_base = keep.data();
  c.dst_offsets = dof.get();
  EXPECT_NONFATAL_FAILURE(
      {
        (void)cuda::flashtrans_cuda(c, nullptr);
        (void)cudaDeviceSynchronize();
      },
      "lies outside every allocation");
}

// One Offload on the CUDA backend: admit, warm-up, a step with the DA split on the copy
// stream, the write-back, release. Every kernel of the backend's launchers ran, and the
// backend frees all it allocated.
TEST(EmulatedCuda, TheCudaBackendsStepRunsEveryKernelAndFreesItsMemory) {
  const std::size_t before = Device::get().live_allocations();
  {
    const int T = 2, K = 16;
    OffloadConfig c;
    c.layers = 2;
    c.layout = test::small_layout();
    c.max_requests = 2;
    c.query_tokens = T;
    c.topk = K;
    c.slots = 24;
    c.reserve_newest = true;
    c.max_context = 256;
    c.backend = Backend::kCuda;
    Offload o(c);
    o.admit(5, 100);
    std::vector<std::int32_t> windows;
    for (int i = 0; i < c.layers * K; ++i) windows.push_back(i % 90);
    o.warmup(5, windows, 1);
    o.extend(5, T);
    const auto& io = test::offload_io(Backend::kCuda);
    test::OffloadStepIn in;
    in.batch = 1;
    in.rows = {o.row(5)};
    in.lengths = {static_cast<std::int32_t>(o.length(5))};
    for (int i = 0; i < T * K; ++i) in.topk.push_back((i * 7) % 101);
    in.split = true;
    (void)io.step(o, in);
    io.write_back(o, 0, in.rows, in.lengths, {});
    o.release(5);
  }
  for (const char* k : {"swap_step", "swap_reset", "swap_diff", "offload_mask", "offload_finalize", "offload_write_back_list",
                        "split_miss_offsets", "split", "flashtrans"}) {
    EXPECT_TRUE(Coverage::has(k)) << k << " never ran";
  }
  EXPECT_EQ(Device::get().live_allocations(), before) << "the CUDA backend left device or pinned memory allocated";
}

// Offload::device_bytes is what the CUDA backend holds: every live device byte it allocated,
// with ESS's own layer buffers and with the caller's.
TEST(EmulatedCuda, TheCudaBackendsDeviceBytesAreWhatItHolds) {
  for (const bool own : {true, false}) {
    for (const int T : {1, 3}) {
      OffloadConfig c;
      c.layers = 3;
      c.layout = test::small_layout();
      c.max_requests = 4;
      c.query_tokens = T;
      c.topk = 16;
      c.slots = 40;
      c.reserve_newest = T > 1;
      c.max_context = 300;
      c.backend = Backend::kCuda;
      std::vector<cuda::DeviceBuffer<std::uint8_t>> theirs;
      LatentBuffer buffer;
      if (!own) {
        const std::size_t bytes = static_cast<std::size_t>(c.max_requests) * c.rows_per_request() * c.layout.bytes();
        for (int l = 0; l < c.layers; ++l) {
          theirs.emplace_back(bytes);
          buffer.layer_base.push_back(theirs.back().get());
        }
      }
      const std::size_t before = Device::get().live_device_bytes();
      Offload o(c, std::move(buffer));
      o.admit(1, 100);  // a lifecycle call's own allocations are gone when it returns
      EXPECT_EQ(Device::get().live_device_bytes() - before, o.device_bytes()) << "own buffer " << own << ", T " << T;
      EXPECT_GT(o.device_bytes(), 0u);
    }
  }
}

TEST(EmulatedCuda, TheCpuBackendHoldsNoDeviceBytes) {
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 2;
  c.topk = 16;
  c.slots = 24;
  c.max_context = 256;
  const std::size_t before = Device::get().live_device_bytes();
  const Offload o(c);
  EXPECT_EQ(o.device_bytes(), 0u);
  EXPECT_EQ(Device::get().live_device_bytes(), before);
}

}  // namespace
}  // namespace ess::emu
