#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "runtime/cuda/smem_limit.h"
#include "runtime/ops/gpu_swap/swap_engine_cta.h"
#include "runtime/ops/gpu_swap/swap_engine_launch.h"

namespace ess::cuda {
namespace {

constexpr int kThreads = swap::kStepThreads;
using BlockScan = cub::BlockScan<int, kThreads>;
static_assert(sizeof(BlockScan::TempStorage) <= kSwapStepStaticSmemBound, "launch_args.h bounds the static shared memory");

// The CUDA primitives of the CTA programs (swap_engine_cta.h).
struct DevicePrims {
  BlockScan::TempStorage* scan;  // kThreads-thread blocks only
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ int threads() const { return static_cast<int>(blockDim.x); }
  __device__ unsigned block() const { return blockIdx.x; }
  __device__ unsigned blocks() const { return gridDim.x; }
  __device__ void sync() const { __syncthreads(); }
  __device__ void exclusive_sum(int (&items)[swap::kScanItems], int (&ranks)[swap::kScanItems], int& total) const {
    BlockScan(*scan).ExclusiveSum(items, ranks, total);
  }
  __device__ std::int32_t atomic_cas(std::int32_t* p, std::int32_t compare, std::int32_t value) const {
    return atomicCAS(p, compare, value);
  }
  __device__ void atomic_min(std::int32_t* p, std::int32_t value) const { atomicMin(p, value); }
};

__global__ void __launch_bounds__(kThreads, 1) swap_step_kernel(GpuSwapStep p, int S, int layers, int hash_cap,
                                                                std::int32_t* order_all, std::int32_t* stamp_all,
                                                                std::int32_t* token_all, std::int32_t* clock_all) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ BlockScan::TempStorage scan_tmp;
  DevicePrims prims{&scan_tmp};
  swap::swap_step_cta(p, S, layers, hash_cap, order_all, stamp_all, token_all, clock_all, smem, prims);
}

__global__ void reset_kernel(std::int32_t* order, std::int32_t* stamp, std::int32_t* token, std::int32_t* clock, int S,
                             int layers, int row) {
  DevicePrims prims{nullptr};  // no scan here
  swap::swap_reset_cta(order, stamp, token, clock, S, layers, row, prims);
}

__global__ void __launch_bounds__(kThreads, 1) diff_kernel(const std::int32_t* before, const std::int32_t* after, int S,
                                                           std::int32_t* out_tokens, std::int32_t* out_slots,
                                                           std::int32_t* count) {
  __shared__ BlockScan::TempStorage tmp;
  DevicePrims prims{&tmp};
  swap::swap_diff_cta(before, after, S, out_tokens, out_slots, count, prims);
}

}  // namespace

int swap_step_raise_smem_limit() {
  static DynamicSmemLimit limit;
  return limit.raise(swap_step_kernel);
}

int launch_swap_step(const GpuSwapStep& step, const SwapState& state, Stream stream) {
  const int positions = step.query_tokens * step.topk;
  swap_step_kernel<<<step.batch, kThreads, swap_step_smem_bytes(positions, state.slots), static_cast<cudaStream_t>(stream)>>>(
      step, state.slots, state.layers, swap_hash_capacity(positions), state.order, state.stamp, state.token, state.clock);
  return cudaGetLastError();
}

int launch_swap_reset(const SwapState& state, int row, Stream stream) {
  reset_kernel<<<swap::kResetBlocks, swap::kResetThreads, 0, static_cast<cudaStream_t>(stream)>>>(state.order, state.stamp, state.token, state.clock,
                                                                   state.slots, state.layers, row);
  return cudaGetLastError();
}

int launch_swap_diff(const std::int32_t* before, const std::int32_t* after, std::int32_t slots, std::int32_t* out_tokens,
                     std::int32_t* out_slots, std::int32_t* count, Stream stream) {
  diff_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(before, after, slots, out_tokens, out_slots, count);
  return cudaGetLastError();
}

}  // namespace ess::cuda
