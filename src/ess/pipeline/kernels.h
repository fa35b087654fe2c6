// Small kernels of the decode-step executor (CUDA target only): turning the swap engine's
// per-request miss lists into one FlashTrans list, splitting the selected slots into the
// resident and the fetched ones for the DA / DBA schedules, and filling stand-in tensors.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ess/cuda/flashtrans.h"
#include "ess/pipeline/split.h"

namespace ess::pipeline {

// Two launches, no host synchronization: an exclusive scan of the requests' miss counts
// (one block; each request's place in the list and the total), then one block per request.
// Returns a cudaError_t value; cudaErrorInvalidValue when check_args(args) fails.
int split_misses(const SplitArgs& args, cuda::Stream stream);

// n bf16 values of a fixed pseudo-random pattern in [-scale, scale] (stand-in weights and
// activations: tensor cores run at data-dependent power, so they must not be zeros).
int fill_bf16(std::uint16_t* p, std::size_t n, float scale, std::uint64_t seed, cuda::Stream stream);
// n bytes of random FP8 e4m3 values of magnitude <= 2 (indexer queries).
int fill_fp8(std::uint8_t* p, std::size_t n, std::uint64_t seed, cuda::Stream stream);
// n floats uniform in [lo, hi).
int fill_f32(float* p, std::size_t n, float lo, float hi, std::uint64_t seed, cuda::Stream stream);

}  // namespace ess::pipeline
