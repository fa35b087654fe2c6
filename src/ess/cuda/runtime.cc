#include "ess/cuda/runtime.h"

#include <cuda_runtime_api.h>

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

const char* device_name() {
  static const std::string name = [] {
    if (device_count() == 0) return std::string();
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return std::string();
    return std::string(prop.name);
  }();
  return name.c_str();
}

}  // namespace ess::cuda
