// CUDA error checks for the host code of the CUDA target: ESS_CUDA_CHECK(call, "what")
// throws ess::Error naming the call's purpose and CUDA's own message.
#pragma once

#include <cuda_runtime_api.h>

#include "ess/core/error.h"

#define ESS_CUDA_CHECK(call, ...)                                                          \
  do {                                                                                     \
    const cudaError_t ess_cuda_status_ = (call);                                           \
    if (ess_cuda_status_ != cudaSuccess) [[unlikely]] {                                    \
      (void)cudaGetLastError();                                                            \
      ::ess::throw_error(::fmt::format("{}: CUDA error {} ({})", ::fmt::format(__VA_ARGS__), \
                                       static_cast<int>(ess_cuda_status_),                 \
                                       cudaGetErrorString(ess_cuda_status_)));             \
    }                                                                                      \
  } while (0)
