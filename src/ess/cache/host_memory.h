// Host memory for the Total Memory Pool: pinned (page-locked, cudaHostAlloc with the
// portable and mapped flags) when the CUDA target is built and a device is present, so that
// GPU kernels can read it zero-copy through Unified Virtual Addressing; ordinary 4 KiB-aligned
// memory otherwise. The rest of the code sees only HostBuffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

namespace ess {

enum class HostMemoryKind { kAligned, kPinned };

std::string_view to_string(HostMemoryKind kind);

class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& o) noexcept { swap(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    HostBuffer(std::move(o)).swap(*this);
    return *this;
  }
  ~HostBuffer();

  // Allocates `bytes` (rounded up to 4 KiB). `prefer` is honoured when possible: kPinned falls
  // back to kAligned when no CUDA device is present. Throws ess::Error when the allocation fails.
  static HostBuffer allocate(std::size_t bytes, HostMemoryKind prefer = HostMemoryKind::kPinned);

  std::uint8_t* data() { return data_; }
  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  HostMemoryKind kind() const { return kind_; }

  void swap(HostBuffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(kind_, o.kind_);
  }

 private:
  std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  HostMemoryKind kind_ = HostMemoryKind::kAligned;
};

// True when the CUDA target is built and at least one device is visible.
bool cuda_device_present();

}  // namespace ess
