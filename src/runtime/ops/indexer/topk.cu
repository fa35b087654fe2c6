// Deterministic top-k on the GPU, exactly ess::ref::topk (see indexer.h): per row the
// min(k, length) largest logits, by logit descending, ties (including -0 / +0) to the lower
// index, the rest of the row's k outputs -1.
//
// Design: one CTA of 1,024 threads per row, everything in one kernel (no host
// synchronization, no allocation: graph-capturable).
//   1. Keys. Each logit becomes an order-preserving uint32 (sign-flipped float bits; -0 is
//      first made +0, so the two tie). The first 32,768 keys of the row are cached in shared
//      memory; longer rows re-read (and re-convert) their tail from global memory / L2.
//      A NaN anywhere in j < length sets the row's flag (atomicMin into nan_row).
//   2. Radix select (rows longer than k): three histogram passes over 11 / 11 / 10 bits,
//      from the top, find the exact key T of the k-th largest element and `want`, how many
//      elements equal to T belong to the top k (the elements above T all do). Histograms
//      live in shared memory; a warp first groups equal bins with __match_any_sync, so one
//      atomic per distinct bin per warp (logits of similar magnitude share their top bits).
//   3. Ordered collection: in index order, take every key > T and the first `want` keys
//      == T. Per chunk of 32 tiles x 1,024 elements: ballots count (> T, == T) per
//      (tile, warp); one block scan over the 1,024 (tile, warp) counts (the pair packed
//      into one int) gives each element its rank; the selected element lands at its rank in
//      the candidate list, which is thus in index order (exactly k entries; all of a short
//      row's elements when length <= k).
//   4. Sort the <= 2,048 candidates by key descending with cub::BlockRadixSort (stable, so
//      equal keys keep index order: ties go to the lower index), write the indices, pad -1.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "ess/ops/indexer.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/cuda/smem_limit.h"
#include "runtime/ops/indexer/topk_cta.h"
#include "runtime/ops/launch_args.h"

namespace ess::cuda {
namespace {

using topk_row::kCacheKeys;
using topk_row::kItems;
using topk_row::kThreads;

using SortT = cub::BlockRadixSort<std::uint32_t, kThreads, kItems, std::int32_t>;
using ScanInt = cub::BlockScan<int, kThreads>;

// cub's storage (the program's sort and scan never overlap: a __syncthreads separates them),
// then the program's shared state, then the key cache.
union CubStorage {
  SortT::TempStorage sort;
  ScanInt::TempStorage scan;
};
constexpr std::size_t kCubBytes = (sizeof(CubStorage) + 15) / 16 * 16;
constexpr std::size_t kFixedBytes = kCubBytes + (sizeof(topk_row::Shared) + 15) / 16 * 16;

// The CUDA primitives of the row program (topk_cta.h).
struct DevicePrims {
  CubStorage& cub;
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ unsigned block() const { return blockIdx.x; }
  __device__ void sync() const { __syncthreads(); }
  __device__ unsigned ballot(bool v) const { return __ballot_sync(0xffffffffu, v); }
  __device__ unsigned match_any(unsigned mask, std::uint32_t v) const { return __match_any_sync(mask, v); }
  __device__ void atomic_add_shared(int* p, int v) const { atomicAdd(p, v); }
  __device__ void atomic_min_global(unsigned* p, unsigned v) const { atomicMin(p, v); }
  __device__ void exclusive_sum(int v, int& before, int& total) const { ScanInt(cub.scan).ExclusiveSum(v, before, total); }
  __device__ void sort_descending(std::uint32_t (&keys)[kItems], std::int32_t (&idx)[kItems]) const {
    SortT(cub.sort).SortDescending(keys, idx);
  }
};

__global__ void __launch_bounds__(kThreads, 1)
    topk_kernel(const float* __restrict__ logits, std::int64_t stride, const std::int32_t* __restrict__ lengths, int k,
                std::int32_t* __restrict__ out, int* nan_row, int cache_n) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  DevicePrims prims{*reinterpret_cast<CubStorage*>(smem)};
  topk_row::Shared& sh = *reinterpret_cast<topk_row::Shared*>(smem + kCubBytes);
  std::uint32_t* cache = reinterpret_cast<std::uint32_t*>(smem + kFixedBytes);
  topk_row::topk_cta(logits, stride, lengths, k, out, nan_row, cache_n, sh, cache, prims);
}

// The most shared memory a launch asks for fits every device ESS targets.
static_assert(kFixedBytes + static_cast<std::size_t>(kCacheKeys) * 4 <= kHopperSmemOptin, "top-k shared memory");

}  // namespace

int topk_cuda(const TopkArgs& a, Stream stream) {
  if (!check_args(a).empty()) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  const int cache_n = topk_row::cache_keys(a.stride);
  const std::size_t smem = kFixedBytes + static_cast<std::size_t>(cache_n) * 4;
  static DynamicSmemLimit limit;
  const cudaError_t e = limit.raise(topk_kernel);
  if (e != cudaSuccess) return e;
  topk_kernel<<<static_cast<unsigned>(a.rows), kThreads, smem, static_cast<cudaStream_t>(stream)>>>(
      a.logits, a.stride, a.lengths, a.k, a.out, a.nan_row, cache_n);
  return cudaGetLastError();
}

}  // namespace ess::cuda
