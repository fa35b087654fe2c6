// RAII device memory for the host code of the CUDA target.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "runtime/cuda/check.h"

namespace ess::cuda {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    ESS_CUDA_CHECK(cudaMalloc(&p_, n * sizeof(T) + 1), "allocating {} bytes of device memory", n * sizeof(T));
  }
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (p_ != nullptr) cudaFree(p_);
      p_ = o.p_;
      n_ = o.n_;
      o.p_ = nullptr;
      o.n_ = 0;
    }
    return *this;
  }

  T* get() const { return p_; }
  std::size_t size() const { return n_; }
  // What was asked of cudaMalloc for it (one byte more than its elements: never a 0-byte call).
  std::size_t bytes() const { return p_ != nullptr ? n_ * sizeof(T) + 1 : 0; }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

}  // namespace ess::cuda
