// The CUDA runtime services the backend registers (register.cc): device count and names,
// pinned mapped host memory. CUDA target only; plain declarations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ess::cuda {

// Number of visible CUDA devices; 0 when the driver or a device is missing (never throws).
int device_count();
// Pinned, mapped, portable host memory (cudaHostAlloc); nullptr on failure.
void* host_alloc_pinned(std::size_t bytes);
void host_free_pinned(void* p);
// The device pointer of mapped pinned host memory; nullptr when `host` is none.
const std::uint8_t* device_view_cuda(const std::uint8_t* host);
// The device's name, or "" when there is none.
std::string device_name(int device);

}  // namespace ess::cuda
