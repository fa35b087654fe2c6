#include <cuda_runtime_api.h>

#include "runtime/cuda/check.h"
#include "testing/device.h"

namespace ess::test {

std::string use_device(int device, const char* who) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess) {
    (void)cudaGetLastError();
    n_dev = 0;
  }
  ESS_CHECK(device >= 0 && device < n_dev, "{}: no CUDA device {} (found {})", who, device, n_dev);
  ESS_CUDA_CHECK(cudaSetDevice(device), "{}: selecting device {}", who, device);
  cudaDeviceProp prop{};
  ESS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), "{}: reading device properties", who);
  return prop.name;
}

}  // namespace ess::test
