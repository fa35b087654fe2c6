// Host memory for the Total Memory Pool, through an allocator a host engine can replace.
//
// The default allocator gives pinned, mapped, portable memory (cudaHostAlloc) when the CUDA
// backend is built and a device is present, so that GPU kernels read it zero-copy through
// Unified Virtual Addressing; ordinary 4 KiB-aligned memory otherwise. An engine that already
// owns a pinned host buffer (registered with cudaHostRegister, mapped) hands ESS an allocator
// that returns that buffer, so the host pool is not allocated twice. The rest of the code
// sees only HostBuffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ess {

enum class HostMemoryKind { kAligned, kPinned };

std::string_view to_string(HostMemoryKind kind);

// One allocation: its bytes and what kind of memory they are.
struct HostBlock {
  std::uint8_t* data = nullptr;
  std::size_t bytes = 0;
  HostMemoryKind kind = HostMemoryKind::kAligned;
};

class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  // At least `bytes` bytes (a multiple of 4 KiB), 4 KiB-aligned; `prefer` is a wish, the
  // block says what it is. {nullptr} when the memory is not there. Pinned blocks must be
  // mapped into the device address space (GPU kernels read them zero-copy).
  virtual HostBlock allocate(std::size_t bytes, HostMemoryKind prefer) = 0;
  virtual void deallocate(const HostBlock& block) noexcept = 0;
};

// Pinned when the CUDA backend and a device are present, else aligned (prefer = kAligned:
// always aligned). Lives as long as the program.
HostAllocator& default_host_allocator();

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

  // Allocates `bytes` (rounded up to 4 KiB) from `allocator`. Throws ess::Error when the
  // allocator cannot.
  static HostBuffer allocate(std::size_t bytes, HostMemoryKind prefer = HostMemoryKind::kPinned,
                             HostAllocator& allocator = default_host_allocator());

  std::uint8_t* data() { return block_.data; }
  const std::uint8_t* data() const { return block_.data; }
  std::size_t size() const { return block_.bytes; }
  HostMemoryKind kind() const { return block_.kind; }

  void swap(HostBuffer& o) noexcept {
    std::swap(block_, o.block_);
    std::swap(allocator_, o.allocator_);
  }

 private:
  HostBlock block_;
  HostAllocator* allocator_ = nullptr;
};

}  // namespace ess
