// Plain C++ declarations of the few CUDA runtime services the host library uses. Defined in
// the ess_cuda target (built only when nvcc is found); nothing here needs a CUDA header.
#pragma once

#include <cstddef>

namespace ess::cuda {

// Number of visible CUDA devices; 0 when the driver or a device is missing (never throws).
int device_count();
// Pinned, mapped, portable host memory (cudaHostAlloc); nullptr on failure.
void* host_alloc_pinned(std::size_t bytes);
void host_free_pinned(void* p);
// Name of device 0, or "" when there is none.
const char* device_name();

}  // namespace ess::cuda
