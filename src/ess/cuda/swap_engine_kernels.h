// Launchers of the GPU swap engine's kernels (swap_engine_gpu.cu): plain C++ declarations,
// each returning a cudaError_t value. Used by GpuSwapEngine (swap_engine_gpu.cc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ess/cuda/swap_engine_gpu.h"

namespace ess::cuda {

// Device state of every request-layer: arrays of rows x layers x slots, clocks rows x layers.
struct SwapState {
  std::int32_t* order = nullptr;
  std::int32_t* stamp = nullptr;
  std::int32_t* token = nullptr;
  std::int32_t* clock = nullptr;
  std::int32_t slots = 0;
  int layers = 0;
};

int swap_hash_capacity(int positions);
// Dynamic shared memory of one step block for T x K = positions and `slots` slots.
std::size_t swap_step_smem_bytes(int positions, std::int32_t slots);
std::size_t swap_step_static_smem_bytes();
int swap_step_set_smem_limit(std::size_t bytes);

int launch_swap_step(const GpuSwapStep& step, const SwapState& state, Stream stream);
int launch_swap_reset(const SwapState& state, int row, Stream stream);
int launch_swap_diff(const std::int32_t* before, const std::int32_t* after, std::int32_t slots, std::int32_t* out_tokens,
                     std::int32_t* out_slots, std::int32_t* count, Stream stream);

}  // namespace ess::cuda
