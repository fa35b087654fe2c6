// The CUDA backend's device services as the runtime's CPU part reaches them: a table the
// backend registers when the program starts (src/runtime/cuda/register.cc). Internal to the
// runtime; the public face is ess/runtime/backend.h. The ops reach their kernels through a table
// of their own (runtime/ops/cuda_ops.h), and the per-layer step its CUDA backend through a
// factory that backend registers (runtime/offload/offload_impl.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ess::detail {

struct CudaBackend {
  int (*device_count)();
  std::string (*device_name)(int device);
  void* (*host_alloc_pinned)(std::size_t bytes);  // pinned, mapped, portable; nullptr on failure
  void (*host_free_pinned)(void* p);
  const std::uint8_t* (*device_view)(const std::uint8_t* host);
};

// nullptr when the backend is not part of this build.
const CudaBackend* cuda_backend();
// Called once by the backend, before main.
void register_cuda_backend(const CudaBackend* backend);

}  // namespace ess::detail
