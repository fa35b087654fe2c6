// The CUDA backend's own kernels of the per-layer step (offload_launch.h).
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "runtime/offload/offload_cta.h"
#include "runtime/offload/offload_launch.h"

namespace ess::cuda {
namespace {

using offload::kListThreads;
using offload::kThreads;
using ListScan = cub::BlockScan<std::int64_t, kListThreads>;
using RowScan = cub::BlockScan<std::int64_t, kThreads>;

// The CUDA primitives of the block programs (offload_cta.h), with the block scan of `Scan`.
template <class Scan>
struct DevicePrims {
  typename Scan::TempStorage* scan;  // the write-back list's and the whole halves' blocks only
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ int threads() const { return static_cast<int>(blockDim.x); }
  __device__ unsigned block() const { return blockIdx.x; }
  __device__ void sync() const { __syncthreads(); }
  __device__ void exclusive_sum(std::int64_t value, std::int64_t& rank, std::int64_t& total) const {
    Scan(*scan).ExclusiveSum(value, rank, total);
  }
};

__global__ void __launch_bounds__(kThreads) mask_kernel(StepShape s, std::int32_t* lru_ids) {
  DevicePrims<RowScan> prims{nullptr};
  offload::mask_cta(s, lru_ids, prims);
}

__global__ void __launch_bounds__(kThreads) finalize_kernel(StepShape s, const std::int32_t* lru_slots, std::int32_t* slot_ids,
                                                            std::int32_t* physical) {
  DevicePrims<RowScan> prims{nullptr};
  offload::finalize_cta(s, lru_slots, slot_ids, physical, prims);
}

__global__ void __launch_bounds__(kListThreads) write_back_list_kernel(WriteBackList w) {
  __shared__ typename ListScan::TempStorage tmp;
  DevicePrims<ListScan> prims{&tmp};
  offload::write_back_list_cta(w, prims);
}

__global__ void __launch_bounds__(kListThreads) host_fill_list_kernel(HostFillList f) {
  DevicePrims<ListScan> prims{nullptr};
  offload::host_fill_list_cta(f, prims);
}

__global__ void __launch_bounds__(kThreads) whole_halves_kernel(StepShape s, WholeHalves h) {
  __shared__ typename RowScan::TempStorage tmp;
  DevicePrims<RowScan> prims{&tmp};
  offload::whole_halves_cta(s, h, prims);
}

}  // namespace

int launch_mask_ids(const StepShape& s, std::int32_t* lru_ids, Stream stream) {
  if (s.batch <= 0) return cudaSuccess;
  mask_kernel<<<s.batch, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(s, lru_ids);
  return cudaGetLastError();
}

int launch_finalize_rows(const StepShape& s, const std::int32_t* lru_slots, std::int32_t* slot_ids, std::int32_t* physical,
                         Stream stream) {
  if (s.batch <= 0) return cudaSuccess;
  finalize_kernel<<<s.batch, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(s, lru_slots, slot_ids, physical);
  return cudaGetLastError();
}

int launch_whole_halves(const StepShape& s, const WholeHalves& h, Stream stream) {
  if (s.batch <= 0) return cudaSuccess;
  whole_halves_kernel<<<s.batch, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(s, h);
  return cudaGetLastError();
}

int launch_write_back_list(const WriteBackList& w, Stream stream) {
  if (w.batch <= 0) return cudaSuccess;
  write_back_list_kernel<<<1, kListThreads, 0, static_cast<cudaStream_t>(stream)>>>(w);
  return cudaGetLastError();
}

int launch_host_fill_list(const HostFillList& f, Stream stream) {
  if (f.units == nullptr && !f.reserved ? f.max_count <= 0 : f.length <= f.first) {
    return cudaMemsetAsync(f.total, 0, 8, static_cast<cudaStream_t>(stream));
  }
  host_fill_list_kernel<<<1, kListThreads, 0, static_cast<cudaStream_t>(stream)>>>(f);
  return cudaGetLastError();
}

}  // namespace ess::cuda
