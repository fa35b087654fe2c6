// PinnedStaging (pinned_staging.h) on the emulated CUDA target in a lazy stream order, where work
// on a stream runs only when a synchronization needs it: a retired block is not handed out again
// before the stream has passed its event, and the takes between two retires share one block.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "runtime/cuda/pinned_staging.h"
#include "testing/emulated_cuda/streams.h"

namespace ess::cuda {
namespace {

class LazyStream : public ::testing::Test {
 protected:
  void SetUp() override {
    before_ = emu::stream_order();
    emu::set_stream_order({true, 3});
    ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "test stream");
  }
  void TearDown() override {
    cudaStreamSynchronize(s_);
    cudaStreamDestroy(s_);
    emu::set_stream_order(before_);
  }
  emu::StreamOrder before_;
  cudaStream_t s_ = nullptr;
};

std::uintptr_t at(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

TEST_F(LazyStream, TakesBetweenRetiresShareABlockAlignedAndApart) {
  PinnedStaging staging;
  std::vector<std::uint8_t*> p;
  for (const std::size_t n : {100, 256, 1000, 4}) p.push_back(static_cast<std::uint8_t*>(staging.take(n)));
  EXPECT_EQ(staging.blocks(), 1u);
  EXPECT_EQ(staging.bytes(), PinnedStaging::kMinBlock);
  for (std::size_t i = 0; i < p.size(); ++i) {
    EXPECT_EQ(at(p[i]) % PinnedStaging::kAlign, 0u) << "take " << i;
    if (i > 0) {
      EXPECT_GE(at(p[i]), at(p[i - 1]) + 100) << "take " << i << " overlaps the one before";
    }
  }
  EXPECT_EQ(at(p[1]) - at(p[0]), 256u);
  EXPECT_EQ(at(p[2]) - at(p[1]), 256u);
  EXPECT_EQ(at(p[3]) - at(p[2]), 1024u);
  // A take larger than the room left opens a block of its own.
  void* big = staging.take(PinnedStaging::kMinBlock + 1);
  EXPECT_EQ(staging.blocks(), 2u);
  EXPECT_EQ(staging.bytes(), 3 * PinnedStaging::kMinBlock);
  EXPECT_NE(big, nullptr);
}

TEST_F(LazyStream, ARetiredBlockIsTakenAgainOnlyOnceTheStreamPassedIt) {
  PinnedStaging staging;
  DeviceBuffer<std::uint8_t> d(64);
  auto* a = static_cast<std::uint8_t*>(staging.take(64));
  std::memset(a, 7, 64);
  ESS_CUDA_CHECK(cudaMemcpyAsync(d.get(), a, 64, cudaMemcpyHostToDevice, s_), "upload");
  staging.retire(s_);
  // The copy has not run (lazy order): the next take must not reuse a's block, whose bytes it reads.
  auto* b = static_cast<std::uint8_t*>(staging.take(64));
  EXPECT_TRUE(at(b) < at(a) || at(b) >= at(a) + PinnedStaging::kMinBlock) << "a block the stream still reads";
  EXPECT_EQ(staging.blocks(), 2u);
  std::memset(b, 9, 64);
  staging.retire(s_);
  std::vector<std::uint8_t> got(64);
  ESS_CUDA_CHECK(cudaMemcpyAsync(got.data(), d.get(), 64, cudaMemcpyDeviceToHost, s_), "download");
  ESS_CUDA_CHECK(cudaStreamSynchronize(s_), "stream");
  EXPECT_EQ(got, std::vector<std::uint8_t>(64, 7)) << "the upload read staging bytes written after it was retired";
  // Both passed: taken again, no new block.
  staging.take(64);
  staging.take(PinnedStaging::kMinBlock - 256);  // the rest of that block
  staging.retire(s_);
  staging.take(64);
  EXPECT_EQ(staging.blocks(), 2u);
}

}  // namespace
}  // namespace ess::cuda
