// The split of a swap decision (split.h) on the device: an exclusive block scan of the miss
// counts gives each position its place in the FlashTrans list, then one block per position
// writes its list entries and, for DA / DBA, each query row's resident and fetched rows.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "runtime/cuda/backend_impl.h"
#include "runtime/offload/split.h"

namespace ess::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kItems = 4;  // positions per thread per tile of the compaction scan
using Scan = cub::BlockScan<int, kThreads>;
constexpr int kScanThreads = 1024;
using OffsetScan = cub::BlockScan<std::int64_t, kScanThreads>;

// Exclusive scan of the miss counts in tiles of kScanThreads: miss_offsets[b] = the misses
// of the requests before b, *total = all of them. O(batch) for any batch.
__global__ void __launch_bounds__(kScanThreads) miss_offsets_kernel(const std::int32_t* counts, int batch,
                                                                     std::int64_t* miss_offsets, std::int64_t* total) {
  __shared__ typename OffsetScan::TempStorage tmp;
  std::int64_t running = 0;
  for (int base = 0; base < batch; base += kScanThreads) {
    const int b = base + static_cast<int>(threadIdx.x);
    const std::int64_t m = b < batch ? counts[2 * b + 1] : 0;
    std::int64_t before = 0, tile = 0;
    OffsetScan(tmp).ExclusiveSum(m, before, tile);
    if (b < batch) miss_offsets[b] = running + before;
    running += tile;
    __syncthreads();  // tmp is reused by the next tile
  }
  if (threadIdx.x == 0) *total = running;
}

__global__ void __launch_bounds__(kThreads) split_kernel(ess::SplitArgs a) {
  const int b = static_cast<int>(blockIdx.x);
  const std::size_t P = static_cast<std::size_t>(a.positions);
  const std::int32_t pool_row = a.rows[b];
  const int K = a.positions / a.query_tokens;
  if (pool_row < 0) {  // a padded position: nothing to list, empty halves
    if (a.hit_ids == nullptr) return;
    for (std::size_t i = threadIdx.x; i < P; i += kThreads) {
      a.hit_ids[static_cast<std::size_t>(b) * P + i] = -1;
      a.miss_ids[static_cast<std::size_t>(b) * P + i] = -1;
    }
    for (int t = static_cast<int>(threadIdx.x); t < a.query_tokens; t += kThreads) {
      a.hit_count[b * a.query_tokens + t] = 0;
      a.miss_count[b * a.query_tokens + t] = 0;
    }
    return;
  }
  const std::int64_t row_base = static_cast<std::int64_t>(pool_row) * a.rows_per_request;
  const int misses = a.counts[2 * b + 1];
  const std::int64_t base = a.miss_offsets[b];
  const std::int32_t* fs = a.fill_slots + static_cast<std::size_t>(b) * P;
  const std::uint64_t* fh = a.fill_host_offsets + static_cast<std::size_t>(b) * P;
  for (int m = static_cast<int>(threadIdx.x); m < misses; m += kThreads) {
    a.src_offsets[base + m] = fh[m];
    a.dst_offsets[base + m] = a.buffer.offset(row_base + fs[m]);
  }
  if (a.hit_ids == nullptr) return;
  // The slots filled this step; every other selected slot was resident before it.
  std::uint8_t* flag = a.flags + static_cast<std::size_t>(b) * static_cast<std::size_t>(a.rows_per_request);
  for (int s = static_cast<int>(threadIdx.x); s < a.rows_per_request; s += kThreads) flag[s] = 0;
  __syncthreads();
  for (int m = static_cast<int>(threadIdx.x); m < misses; m += kThreads) flag[fs[m]] = 1;
  __syncthreads();
  // Per query row: stable compaction of the resident and the fetched rows.
  __shared__ typename Scan::TempStorage scan;
  for (int t = 0; t < a.query_tokens; ++t) {
    const std::size_t row = static_cast<std::size_t>(b) * P + static_cast<std::size_t>(t) * K;
    const std::int32_t* ids = a.slot_ids + row;
    std::int32_t* hit = a.hit_ids + row;
    std::int32_t* miss = a.miss_ids + row;
    int n_hit = 0, n_miss = 0;  // running totals (identical in every thread)
    for (int tile0 = 0; tile0 < K; tile0 += kThreads * kItems) {
      int is_hit[kItems], is_miss[kItems];
      std::int32_t sl[kItems];
      for (int u = 0; u < kItems; ++u) {
        const int i = tile0 + static_cast<int>(threadIdx.x) * kItems + u;  // blocked: thread-contiguous
        sl[u] = i < K ? ids[i] : -1;
        const bool fetched = sl[u] >= 0 && flag[sl[u]] != 0;
        is_hit[u] = sl[u] >= 0 && !fetched ? 1 : 0;
        is_miss[u] = fetched ? 1 : 0;
      }
      int rank_hit[kItems], rank_miss[kItems], tile_hit = 0, tile_miss = 0;
      Scan(scan).ExclusiveSum(is_hit, rank_hit, tile_hit);
      __syncthreads();
      Scan(scan).ExclusiveSum(is_miss, rank_miss, tile_miss);
      __syncthreads();
      for (int u = 0; u < kItems; ++u) {
        if (is_hit[u]) hit[n_hit + rank_hit[u]] = static_cast<std::int32_t>(row_base + sl[u]);
        if (is_miss[u]) miss[n_miss + rank_miss[u]] = static_cast<std::int32_t>(row_base + sl[u]);
      }
      n_hit += tile_hit;
      n_miss += tile_miss;
    }
    for (int i = n_hit + static_cast<int>(threadIdx.x); i < K; i += kThreads) hit[i] = -1;
    for (int i = n_miss + static_cast<int>(threadIdx.x); i < K; i += kThreads) miss[i] = -1;
    if (threadIdx.x == 0) {
      a.hit_count[b * a.query_tokens + t] = n_hit;
      a.miss_count[b * a.query_tokens + t] = n_miss;
    }
  }
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
