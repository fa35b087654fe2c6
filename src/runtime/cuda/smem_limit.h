// One way to raise a kernel's dynamic shared-memory limit, shared by every launcher of the
// CUDA target: to the most the current device allows (its opt-in maximum less the kernel's
// static shared memory), once per device. The limit then never depends on the size of an
// earlier launch or object, so a smaller launch or engine made later cannot break a larger
// one still in use, and the setting (idempotent) is harmless when first launches race.
// CUDA target only.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace ess::cuda {

class DynamicSmemLimit {
 public:
  // Raises `kernel`'s limit on the current device; returns a cudaError_t.
  template <typename Kernel>
  cudaError_t raise(Kernel* kernel) {
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess) return e;
    const bool cached = device >= 0 && device < kMaxDevices;
    if (cached && done_[device].load(std::memory_order_acquire)) return cudaSuccess;
    int optin = 0;
    e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaFuncAttributes attr{};
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, kernel);
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               optin - static_cast<int>(attr.sharedSizeBytes));
    }
    if (e == cudaSuccess && cached) done_[device].store(true, std::memory_order_release);
    return e;
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::atomic<bool> done_[kMaxDevices] = {};
};

}  // namespace ess::cuda
