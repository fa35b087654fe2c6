#include "runtime/cuda/runtime.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace ess::cuda {

int device_count() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky "no driver / no device" error
      return 0;
    }
    return n;
  }();
  return count;
}

void* host_alloc_pinned(std::size_t bytes) {
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return p;
}

void host_free_pinned(void* p) { (void)cudaFreeHost(p); }

const std::uint8_t* device_view_cuda(const std::uint8_t* host) {
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, const_cast<std::uint8_t*>(host), 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return static_cast<const std::uint8_t*>(dev);
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  if (device < 0 || device >= device_count() || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  return prop.name;
}

}  // namespace ess::cuda
