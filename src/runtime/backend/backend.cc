// The registry of the CUDA backend's device services and the CPU-side entry points that
// dispatch to it.
#include "ess/runtime/backend.h"

#include "runtime/backend/cuda_backend.h"

namespace ess {
namespace detail {
namespace {
// Constant-initialized, so it is null before any dynamic initializer (the backend's
// registration included) runs.
const CudaBackend* g_cuda = nullptr;
}  // namespace

const CudaBackend* cuda_backend() { return g_cuda; }
void register_cuda_backend(const CudaBackend* backend) { g_cuda = backend; }

}  // namespace detail

bool cuda_backend_built() { return detail::cuda_backend() != nullptr; }

int cuda_device_count() {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->device_count() : 0;
}

bool cuda_device_present() { return cuda_device_count() > 0; }

std::string cuda_device_name(int device) {
  const auto* b = detail::cuda_backend();
  return b != nullptr && device >= 0 && device < b->device_count() ? b->device_name(device) : std::string();
}

namespace cuda {

const std::uint8_t* device_view(const std::uint8_t* host) {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->device_view(host) : nullptr;
}

}  // namespace cuda
}  // namespace ess
