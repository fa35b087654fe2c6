#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "ess/pipeline/kernels.h"

namespace ess::pipeline {
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

__global__ void __launch_bounds__(kThreads) split_kernel(SplitArgs a) {
  const int b = static_cast<int>(blockIdx.x);
  const std::size_t P = static_cast<std::size_t>(a.positions);
  const int misses = a.counts[2 * b + 1];
  const std::int64_t base = a.miss_offsets[b];
  const std::uint64_t kv = a.kv_offsets[b];
  const std::int32_t* fs = a.fill_slots + static_cast<std::size_t>(b) * P;
  const std::uint64_t* fh = a.fill_host_offsets + static_cast<std::size_t>(b) * P;
  for (int m = static_cast<int>(threadIdx.x); m < misses; m += kThreads) {
    a.src_offsets[base + m] = fh[m];
    a.dst_offsets[base + m] = kv + static_cast<std::uint64_t>(fs[m]) * static_cast<std::uint64_t>(a.entry_bytes);
  }
  if (a.hit_ids == nullptr) return;
  // The slots filled this step; every other selected slot was resident before it.
  std::uint8_t* flag = a.flags + static_cast<std::size_t>(b) * static_cast<std::size_t>(a.slots);
  for (int s = static_cast<int>(threadIdx.x); s < a.slots; s += kThreads) flag[s] = 0;
  __syncthreads();
  for (int m = static_cast<int>(threadIdx.x); m < misses; m += kThreads) flag[fs[m]] = 1;
  __syncthreads();
  // Per query row: stable compaction of the resident and the fetched slot ids.
  __shared__ typename Scan::TempStorage scan;
  const int K = a.positions / a.query_tokens;
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
        if (is_hit[u]) hit[n_hit + rank_hit[u]] = sl[u];
        if (is_miss[u]) miss[n_miss + rank_miss[u]] = sl[u];
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

__device__ inline std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

__device__ inline float unit(std::uint64_t i, std::uint64_t seed) {  // [0, 1)
  return static_cast<float>(mix(i * 0x9E3779B97F4A7C15ULL + seed) >> 40) * (1.0f / 16777216.0f);
}

__global__ void fill_bf16_kernel(std::uint16_t* p, std::size_t n, float scale, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float v = (2.0f * unit(i, seed) - 1.0f) * scale;
    p[i] = static_cast<std::uint16_t>(__float_as_uint(v) >> 16);  // truncation is fine for stand-ins
  }
}

__global__ void fill_fp8_kernel(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    // e4m3 with exponent field <= 8 (|x| < 4) and a random sign and mantissa: never NaN.
    const auto r = static_cast<std::uint32_t>(mix(i + seed * 0x632BE59BD9B4E019ULL));
    p[i] = static_cast<std::uint8_t>((r & 0x80u) | (((r >> 8) % 9u) << 3) | ((r >> 16) & 7u));
  }
}

__global__ void fill_f32_kernel(float* p, std::size_t n, float lo, float hi, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    p[i] = lo + (hi - lo) * unit(i, seed);
  }
}

int grid_for(std::size_t n) {
  const std::size_t g = (n + 255) / 256;
  return static_cast<int>(g < 4096 ? (g > 0 ? g : 1) : 4096);
}

}  // namespace

int split_misses(const SplitArgs& a, cuda::Stream stream) {
  if (!check_args(a).empty()) return cudaErrorInvalidValue;
  if (a.batch == 0) return cudaSuccess;
  const auto st = static_cast<cudaStream_t>(stream);
  miss_offsets_kernel<<<1, kScanThreads, 0, st>>>(a.counts, a.batch, a.miss_offsets, a.total);
  split_kernel<<<a.batch, kThreads, 0, st>>>(a);
  return cudaGetLastError();
}

int fill_bf16(std::uint16_t* p, std::size_t n, float scale, std::uint64_t seed, cuda::Stream stream) {
  if (n == 0) return cudaSuccess;
  fill_bf16_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(p, n, scale, seed);
  return cudaGetLastError();
}

int fill_fp8(std::uint8_t* p, std::size_t n, std::uint64_t seed, cuda::Stream stream) {
  if (n == 0) return cudaSuccess;
  fill_fp8_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(p, n, seed);
  return cudaGetLastError();
}

int fill_f32(float* p, std::size_t n, float lo, float hi, std::uint64_t seed, cuda::Stream stream) {
  if (n == 0) return cudaSuccess;
  fill_f32_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(p, n, lo, hi, seed);
  return cudaGetLastError();
}

}  // namespace ess::pipeline
