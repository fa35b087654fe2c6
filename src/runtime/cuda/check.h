// CUDA error checks for the host code of the CUDA target: ESS_CUDA_CHECK(call, "what")
// throws ess::DeviceError (ess::OutOfMemory when memory ran out) naming the call's purpose and
// CUDA's own message; ESS_LAUNCH(launcher(...), "what") does the same for an ESS launcher,
// which returns its cudaError_t as an int.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>

#include "ess/core/error.h"

#define ESS_CUDA_CHECK(call, ...)                                                          \
  do {                                                                                     \
    const cudaError_t ess_cuda_status_ = (call);                                           \
    if (ess_cuda_status_ != cudaSuccess) [[unlikely]] {                                    \
      (void)cudaGetLastError();                                                            \
      auto ess_cuda_message_ = ::fmt::format("{}: CUDA error {} ({})", ::fmt::format(__VA_ARGS__), \
                                             static_cast<int>(ess_cuda_status_),           \
                                             cudaGetErrorString(ess_cuda_status_));        \
      if (ess_cuda_status_ == cudaErrorMemoryAllocation) {                                 \
        ::ess::throw_out_of_memory(std::move(ess_cuda_message_));                          \
      }                                                                                    \
      ::ess::throw_device_error(std::move(ess_cuda_message_));                             \
    }                                                                                      \
  } while (0)

#define ESS_LAUNCH(call, ...) ESS_CUDA_CHECK(static_cast<cudaError_t>(call), __VA_ARGS__)
