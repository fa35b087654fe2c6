#include "runtime/cuda/pinned_staging.h"

#include <algorithm>
#include <bit>
#include <cstdint>

#include "runtime/cuda/check.h"

namespace ess::cuda {

PinnedStaging::~PinnedStaging() {
  for (Block& b : blocks_) {
    if (b.event != nullptr) {
      if (b.state == Block::State::kRetired) cudaEventSynchronize(b.event);
      cudaEventDestroy(b.event);
    }
    cudaFreeHost(b.data);
  }
}

void* PinnedStaging::take(std::size_t bytes) {
  bytes = (std::max<std::size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
  for (Block& b : blocks_) {  // room left in a block taken since the last retire
    if (b.state == Block::State::kTaken && b.bytes - b.used >= bytes) {
      void* p = static_cast<std::uint8_t*>(b.data) + b.used;
      b.used += bytes;
      return p;
    }
  }
  Block* pick = nullptr;
  for (Block& b : blocks_) {
    if (b.state == Block::State::kRetired) {
      const cudaError_t e = cudaEventQuery(b.event);
      if (e == cudaSuccess) {
        b.state = Block::State::kFree;
      } else if (e != cudaErrorNotReady) {
        ESS_CUDA_CHECK(e, "pinned staging: querying a block's event");
      }
    }
    if (b.state == Block::State::kFree && b.bytes >= bytes && (pick == nullptr || b.bytes < pick->bytes)) pick = &b;
  }
  if (pick == nullptr) {
    blocks_.reserve(blocks_.size() + 1);  // no throw once the memory is taken
    Block b;
    b.bytes = std::bit_ceil(std::max(bytes, kMinBlock));
    ESS_CUDA_CHECK(cudaHostAlloc(&b.data, b.bytes, cudaHostAllocDefault), "pinned staging: {} bytes of pinned host memory",
                   b.bytes);
    if (const cudaError_t e = cudaEventCreateWithFlags(&b.event, cudaEventDisableTiming); e != cudaSuccess) {
      cudaFreeHost(b.data);
      ESS_CUDA_CHECK(e, "pinned staging: an event");
    }
    blocks_.push_back(b);
    pick = &blocks_.back();
  }
  pick->state = Block::State::kTaken;
  pick->used = bytes;
  return pick->data;
}

void PinnedStaging::retire(Stream stream) {
  for (Block& b : blocks_) {
    if (b.state != Block::State::kTaken) continue;
    ESS_CUDA_CHECK(cudaEventRecord(b.event, static_cast<cudaStream_t>(stream)), "pinned staging: recording a block's event");
    b.state = Block::State::kRetired;
  }
}

std::size_t PinnedStaging::bytes() const {
  std::size_t n = 0;
  for (const Block& b : blocks_) n += b.bytes;
  return n;
}

}  // namespace ess::cuda
