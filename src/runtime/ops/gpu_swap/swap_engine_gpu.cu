#include <cuda_runtime.h>

#include <climits>
#include <cooperative_groups.h>
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

// The CUDA primitives of the CTA programs (swap_engine_cta.h), for launches without clusters:
// a request's step is one block's.
struct DevicePrims {
  BlockScan::TempStorage* scan;  // kThreads-thread blocks only
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ int threads() const { return static_cast<int>(blockDim.x); }
  __device__ unsigned block() const { return blockIdx.x; }
  __device__ unsigned blocks() const { return gridDim.x; }
  __device__ void exclusive_sum(int (&items)[swap::kScanItems], int (&ranks)[swap::kScanItems], int& total) const {
    BlockScan(*scan).ExclusiveSum(items, ranks, total);
  }
  __device__ std::int32_t atomic_cas(std::int32_t* p, std::int32_t compare, std::int32_t value) const {
    return atomicCAS(p, compare, value);
  }
  __device__ void atomic_min(std::int32_t* p, std::int32_t value) const { atomicMin(p, value); }
  __device__ int rank() const { return 0; }
  __device__ constexpr int ranks() const { return 1; }
  __device__ void cluster_sync() const { __syncthreads(); }
  template <typename T>
  __device__ T* remote(T* p, int) const {
    return p;
  }
};

// Launches in thread-block clusters (sm_90): a request's step shared by the cluster's blocks,
// their shared memories one distributed array (atomics included).
struct ClusterPrims : DevicePrims {
  __device__ int rank() const { return static_cast<int>(cooperative_groups::this_cluster().block_rank()); }
  __device__ int ranks() const { return static_cast<int>(cooperative_groups::this_cluster().num_blocks()); }
  __device__ void cluster_sync() const { cooperative_groups::this_cluster().sync(); }
  template <typename T>
  __device__ T* remote(T* p, int rank) const {
    return cooperative_groups::this_cluster().map_shared_rank(p, static_cast<unsigned>(rank));
  }
};

template <class Prims>
__global__ void __launch_bounds__(kThreads, 1) swap_step_kernel(GpuSwapStep p, int S, int layers, int hash_cap,
                                                                std::int32_t* order_all, std::int32_t* stamp_all,
                                                                std::int32_t* token_all, std::int32_t* clock_all) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ BlockScan::TempStorage scan_tmp;
  Prims prims{&scan_tmp};
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
  static DynamicSmemLimit plain, cluster;
  if (const int e = plain.raise(swap_step_kernel<DevicePrims>); e != cudaSuccess) return e;
  return cluster.raise(swap_step_kernel<ClusterPrims>);
}

// A launch of `blocks` step blocks in clusters of `ranks` (the attribute lives in `cluster`).
static cudaLaunchConfig_t cluster_launch(int blocks, int ranks, std::size_t smem, Stream stream, cudaLaunchAttribute& cluster) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = static_cast<cudaStream_t>(stream);
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(ranks);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  return config;
}

int swap_step_cluster_limit(int positions, std::int32_t slots) {
  for (int ranks = kSwapMaxCluster; ranks > 1; ranks /= 2) {
    cudaLaunchAttribute cluster;
    const cudaLaunchConfig_t config =
        cluster_launch(ranks, ranks, swap_step_smem_bytes(positions, slots, ranks), nullptr, cluster);
    int active = 0;
    if (cudaOccupancyMaxActiveClusters(&active, swap_step_kernel<ClusterPrims>, &config) == cudaSuccess && active >= 1) {
      return ranks;
    }
    (void)cudaGetLastError();  // a size the device cannot hold is not an error of the next call
  }
  return 1;
}

int launch_swap_step(const GpuSwapStep& step, const SwapState& state, int ranks, Stream stream) {
  const int positions = step.query_tokens * step.topk;
  const int hash_cap = swap_hash_capacity(positions);
  const std::size_t smem = swap_step_smem_bytes(positions, state.slots, ranks);
  if (ranks == 1) {
    swap_step_kernel<DevicePrims><<<step.batch, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(
        step, state.slots, state.layers, hash_cap, state.order, state.stamp, state.token, state.clock);
    return cudaGetLastError();
  }
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t config = cluster_launch(step.batch * ranks, ranks, smem, stream, cluster);
  return cudaLaunchKernelEx(&config, swap_step_kernel<ClusterPrims>, step, state.slots, state.layers, hash_cap, state.order,
                            state.stamp, state.token, state.clock);
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
