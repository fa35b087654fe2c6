// Pinned host memory for the host data a stream-ordered call hands the device (tables, id
// lists), kept until the stream has consumed it: a copy from pageable memory may synchronize
// with its stream, one from pinned memory does not, but then the bytes must stay as they are
// until the copy runs. Blocks are taken, then retired on the stream that reads them (an event
// recorded after that work); a retired block is taken again only once its event has passed
// (cudaEventQuery: never a wait). The takes between two retires share a block while it has room
// (one block per lifecycle call, as a rule). Blocks are kept until destruction (a cudaFreeHost
// may synchronize the device): what is held is the most the stream ever lagged behind, as with a
// caching host allocator. The host code of the CUDA target.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "ess/ops/flashtrans.h"

namespace ess::cuda {

class PinnedStaging {
 public:
  PinnedStaging() = default;
  ~PinnedStaging();  // waits for every retired block's event, then frees the blocks
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  // `bytes` of pinned host memory (256-byte aligned), untouched by anyone else until retired and passed.
  void* take(std::size_t bytes);
  template <typename T>
  T* take(std::size_t n) {
    return static_cast<T*>(take(n * sizeof(T)));
  }
  // Every block taken since the last retire is free again once the work enqueued on `stream` so
  // far has run.
  void retire(Stream stream);
  // Pinned bytes held, and blocks (for tests).
  std::size_t bytes() const;
  std::size_t blocks() const { return blocks_.size(); }

  static constexpr std::size_t kAlign = 256, kMinBlock = 64 * 1024;

 private:
  struct Block {
    void* data = nullptr;
    std::size_t bytes = 0, used = 0;
    cudaEvent_t event = nullptr;
    enum class State { kFree, kTaken, kRetired } state = State::kFree;
  };
  std::vector<Block> blocks_;
};

}  // namespace ess::cuda
