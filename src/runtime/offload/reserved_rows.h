// The reserved rows of a pool row (reserve_newest): the T rows after its slots hold the step's
// newest tokens, reserved row t token length - T + t. What the CPU backend (offload_cpu.cc) and
// the CUDA backend's kernels (offload_cta.h) share.
#pragma once

#include <cstdint>

#include "runtime/cuda/device_inline.h"

namespace ess {

// The first of a position's T reserved rows that holds a token: a request shorter than T tokens
// leaves its first T - len rows unused.
ESS_DEVICE_INLINE int first_newest(std::int64_t len, int T) { return len >= T ? 0 : T - static_cast<int>(len); }

}  // namespace ess
