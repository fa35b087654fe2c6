#include "ess/cache/host_memory.h"

#include <cstdlib>

#include "ess/core/error.h"
#include "ess/runtime/backend.h"
#include "runtime/backend/cuda_backend.h"

namespace ess {
namespace {

constexpr std::size_t kAlign = 4096;

class DefaultHostAllocator final : public HostAllocator {
 public:
  HostBlock allocate(std::size_t bytes, HostMemoryKind prefer) override {
    const auto* cuda = detail::cuda_backend();
    if (prefer == HostMemoryKind::kPinned && cuda != nullptr && cuda->device_count() > 0) {
      return {static_cast<std::uint8_t*>(cuda->host_alloc_pinned(bytes)), bytes, HostMemoryKind::kPinned};
    }
    return {static_cast<std::uint8_t*>(std::aligned_alloc(kAlign, bytes)), bytes, HostMemoryKind::kAligned};
  }
  void deallocate(const HostBlock& block) noexcept override {
    if (block.kind == HostMemoryKind::kPinned) {
      detail::cuda_backend()->host_free_pinned(block.data);
    } else {
      std::free(block.data);
    }
  }
};

}  // namespace

std::string_view to_string(HostMemoryKind kind) {
  return kind == HostMemoryKind::kPinned ? "pinned" : "aligned";
}

HostAllocator& default_host_allocator() {
  static DefaultHostAllocator allocator;
  return allocator;
}

HostBuffer HostBuffer::allocate(std::size_t bytes, HostMemoryKind prefer, HostAllocator& allocator) {
  HostBuffer b;
  const std::size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  if (rounded == 0) return b;
  const HostBlock block = allocator.allocate(rounded, prefer);
  if (block.data == nullptr) {
    throw_out_of_memory(fmt::format("cannot allocate {} bytes of {} host memory", rounded, to_string(prefer)));
  }
  b.block_ = block;  // owned from here: a block refused below goes back to its allocator
  b.allocator_ = &allocator;
  ESS_CHECK(block.bytes >= rounded && reinterpret_cast<std::uintptr_t>(block.data) % kAlign == 0,
            "host allocator: asked for {} bytes aligned to {}, got {} at {}", rounded, kAlign, block.bytes,
            static_cast<const void*>(block.data));
  return b;
}

HostBuffer::~HostBuffer() {
  if (block_.data != nullptr) allocator_->deallocate(block_);
}

}  // namespace ess
