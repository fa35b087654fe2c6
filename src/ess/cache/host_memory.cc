#include "ess/cache/host_memory.h"

#include <cstdlib>
#include <new>

#include "ess/core/error.h"

#if ESS_WITH_CUDA
#include "ess/cuda/runtime.h"
#endif

namespace ess {
namespace {
constexpr std::size_t kAlign = 4096;
}

std::string_view to_string(HostMemoryKind kind) {
  return kind == HostMemoryKind::kPinned ? "pinned" : "aligned";
}

bool cuda_device_present() {
#if ESS_WITH_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

HostBuffer HostBuffer::allocate(std::size_t bytes, HostMemoryKind prefer) {
  HostBuffer b;
  const std::size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  if (rounded == 0) return b;
#if ESS_WITH_CUDA
  if (prefer == HostMemoryKind::kPinned && cuda_device_present()) {
    b.data_ = static_cast<std::uint8_t*>(cuda::host_alloc_pinned(rounded));
    ESS_CHECK(b.data_ != nullptr, "cannot allocate {} bytes of pinned host memory", rounded);
    b.size_ = rounded;
    b.kind_ = HostMemoryKind::kPinned;
    return b;
  }
#else
  (void)prefer;
#endif
  b.data_ = static_cast<std::uint8_t*>(std::aligned_alloc(kAlign, rounded));
  ESS_CHECK(b.data_ != nullptr, "cannot allocate {} bytes of host memory", rounded);
  b.size_ = rounded;
  b.kind_ = HostMemoryKind::kAligned;
  return b;
}

HostBuffer::~HostBuffer() {
  if (data_ == nullptr) return;
#if ESS_WITH_CUDA
  if (kind_ == HostMemoryKind::kPinned) {
    cuda::host_free_pinned(data_);
    return;
  }
#endif
  std::free(data_);
}

}  // namespace ess
