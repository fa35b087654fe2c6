// Fills of the rig's stand-in tensors (CUDA target only).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ess/ops/flashtrans.h"

namespace ess::rig {

// n bf16 values of a fixed pseudo-random pattern in [-scale, scale] (stand-in weights and
// activations: tensor cores run at data-dependent power, so they must not be zeros).
int fill_bf16(std::uint16_t* p, std::size_t n, float scale, std::uint64_t seed, cuda::Stream stream);
// n bytes of random FP8 e4m3 values of magnitude <= 2 (indexer queries).
int fill_fp8(std::uint8_t* p, std::size_t n, std::uint64_t seed, cuda::Stream stream);
// n floats uniform in [lo, hi).
int fill_f32(float* p, std::size_t n, float lo, float hi, std::uint64_t seed, cuda::Stream stream);

}  // namespace ess::rig
