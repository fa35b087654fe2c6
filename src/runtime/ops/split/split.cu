// The split of a swap decision (split.h) on the device: an exclusive block scan of the miss
// counts gives each position its place in the FlashTrans list, then one block per position
// writes its list entries and, for DA / DBA, each query row's resident and fetched rows.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "runtime/cuda/backend_impl.h"
#include "runtime/ops/split/split.h"
#include "runtime/ops/split/split_cta.h"

namespace ess::cuda {
namespace {

using split::kItems;
using split::kScanThreads;
using split::kThreads;
using Scan = cub::BlockScan<int, kThreads>;
using OffsetScan = cub::BlockScan<std::int64_t, kScanThreads>;

// The CUDA primitives of the block programs (split_cta.h); S is the block's scan.
template <class S>
struct DevicePrims {
  typename S::TempStorage* scan;
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ int threads() const { return static_cast<int>(blockDim.x); }
  __device__ unsigned block() const { return blockIdx.x; }
  __device__ void sync() const { __syncthreads(); }
  template <typename T>
  __device__ void exclusive_sum(T value, T& rank, T& total) const {
    S(*scan).ExclusiveSum(value, rank, total);
  }
  template <typename T, int N>
  __device__ void exclusive_sum(T (&in)[N], T (&out)[N], T& total) const {
    S(*scan).ExclusiveSum(in, out, total);
  }
};

__global__ void __launch_bounds__(kScanThreads) miss_offsets_kernel(const std::int32_t* counts, int batch,
                                                                     std::int64_t* miss_offsets, std::int64_t* total) {
  __shared__ typename OffsetScan::TempStorage tmp;
  DevicePrims<OffsetScan> prims{&tmp};
  split::miss_offsets_cta(counts, batch, miss_offsets, total, prims);
}

__global__ void __launch_bounds__(kThreads) split_kernel(ess::SplitArgs a) {
  __shared__ typename Scan::TempStorage scan;
  DevicePrims<Scan> prims{&scan};
  split::split_cta(a, prims);
}

}  // namespace

int split_misses_cuda(const ess::SplitArgs& a, Stream stream) {
  if (!check_args(a).empty()) return cudaErrorInvalidValue;
  if (a.batch == 0) return cudaSuccess;
  const auto st = static_cast<cudaStream_t>(stream);
  miss_offsets_kernel<<<1, kScanThreads, 0, st>>>(a.counts, a.batch, a.miss_offsets, a.total);
  split_kernel<<<a.batch, kThreads, 0, st>>>(a);
  return cudaGetLastError();
}

}  // namespace ess::cuda
