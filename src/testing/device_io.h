// Host <-> device copies for the device runs of the kernel tests (CUDA target only).
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"

namespace ess::test {

template <typename T>
cuda::DeviceBuffer<T> upload(const std::vector<T>& v) {
  cuda::DeviceBuffer<T> d(v.size());
  if (!v.empty()) ESS_CUDA_CHECK(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return d;
}

// The first n values (default: all of them).
template <typename T>
std::vector<T> download(const cuda::DeviceBuffer<T>& d, std::size_t n = static_cast<std::size_t>(-1)) {
  std::vector<T> v(n == static_cast<std::size_t>(-1) ? d.size() : n);
  if (!v.empty()) ESS_CUDA_CHECK(cudaMemcpy(v.data(), d.get(), v.size() * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return v;
}

inline void sync(const char* what) { ESS_CUDA_CHECK(cudaDeviceSynchronize(), "{}", what); }

}  // namespace ess::test
