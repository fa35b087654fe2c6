// Launchers of the GPU swap engine's kernels (swap_engine_gpu.cu): plain C++ declarations,
// each returning a cudaError_t value. Used by GpuSwapEngine (swap_engine_gpu.cc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/ops/gpu_swap/swap_engine_gpu.h"
#include "runtime/ops/launch_args.h"

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

// Raises the step kernel's dynamic shared-memory limit to the device's maximum (once per
// device; smem_limit.h), so that engines of any size coexist.
int swap_step_raise_smem_limit();

// The largest cluster (1, 2, 4 or 8 blocks of the step kernel with the shared memory of
// `positions` and `slots`) of which the device can hold one at a time (cudaOccupancyMaxActiveClusters).
int swap_step_cluster_limit(int positions, std::int32_t slots);
// One request's step on `ranks` blocks (a cluster; swap_cluster_size), step.batch x ranks in all.
int launch_swap_step(const GpuSwapStep& step, const SwapState& state, int ranks, Stream stream);
int launch_swap_reset(const SwapState& state, int row, Stream stream);
int launch_swap_diff(const std::int32_t* before, const std::int32_t* after, std::int32_t slots, std::int32_t* out_tokens,
                     std::int32_t* out_slots, std::int32_t* count, Stream stream);

}  // namespace ess::cuda
