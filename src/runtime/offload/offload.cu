// The CUDA backend's own kernels of the per-layer step (offload_kernels.h).
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "runtime/offload/offload_kernels.h"

namespace ess::cuda {
namespace {

constexpr int kThreads = 256;

// Whether id is one of position b's T newest tokens (reserve_newest), and which.
__device__ inline int newest_index(const StepShape& s, std::int32_t id, std::int32_t len) {
  return s.reserve_newest && id >= 0 && id >= len - s.query_tokens && id < len ? id - (len - s.query_tokens) : -1;
}

__device__ inline bool valid_id(std::int32_t id, std::int32_t len) { return id >= -1 && id < len; }

// Whether position i of a [T][K] row block belongs to the query group.
__device__ inline bool in_group(const StepShape& s, std::int64_t i) {
  const auto t = static_cast<int>(i / s.topk);
  return t >= s.query_begin && t < s.query_end;
}

__global__ void __launch_bounds__(kThreads) mask_kernel(StepShape s, std::int32_t* masked) {
  const int b = static_cast<int>(blockIdx.x);
  const std::int64_t P = static_cast<std::int64_t>(s.query_tokens) * s.topk;
  const std::int32_t row = s.rows[b];
  const std::int32_t len = s.lengths[b];
  for (std::int64_t i = threadIdx.x; i < P; i += kThreads) {
    const std::int32_t id = s.topk_ids[b * P + i];
    const bool keep = row >= 0 && in_group(s, i) && valid_id(id, len) && newest_index(s, id, len) < 0;
    masked[b * P + i] = keep ? id : -1;
  }
}

__global__ void __launch_bounds__(kThreads) finalize_kernel(StepShape s, const std::int32_t* lru_slots, std::int32_t* merged,
                                                            std::int32_t* physical) {
  const int b = static_cast<int>(blockIdx.x);
  const std::int64_t P = static_cast<std::int64_t>(s.query_tokens) * s.topk;
  const std::int32_t row = s.rows[b];
  const std::int32_t len = s.lengths[b];
  for (std::int64_t i = threadIdx.x; i < P; i += kThreads) {
    const std::int32_t id = s.topk_ids[b * P + i];
    std::int32_t slot = -1;
    if (row >= 0 && id >= 0 && in_group(s, i) && valid_id(id, len)) {
      const int newest = newest_index(s, id, len);
      slot = newest >= 0 ? s.slots + newest : lru_slots[b * P + i];
    }
    merged[b * P + i] = slot;
    physical[b * P + i] = slot >= 0 ? row * s.rows_per_request + slot : -1;
  }
}

constexpr int kListThreads = 1024;
using ListScan = cub::BlockScan<std::int64_t, kListThreads>;

__global__ void __launch_bounds__(kListThreads) write_back_list_kernel(WriteBackList w) {
  __shared__ typename ListScan::TempStorage tmp;
  std::int64_t running = 0;
  const int T = w.query_tokens;
  for (int base = 0; base < w.batch; base += kListThreads) {
    const int b = base + static_cast<int>(threadIdx.x);
    const std::int32_t row = b < w.batch ? w.rows[b] : -1;
    const std::int64_t n = row >= 0 ? T : 0;
    std::int64_t before = 0, tile = 0;
    ListScan(tmp).ExclusiveSum(n, before, tile);
    for (int t = 0; t < n; ++t) {
      const std::int64_t token = static_cast<std::int64_t>(w.lengths[b]) - T + t;
      const std::int32_t src = w.source_rows != nullptr ? w.source_rows[b * T + t] : row * w.rows_per_request + w.slots + t;
      const std::int32_t page =
          w.page_table[(static_cast<std::int64_t>(row) * w.max_pages + token / 64) * w.layers + w.layer];
      const std::int64_t at = running + before + t;
      w.src_offsets[at] = w.buffer.offset(src);
      w.dst_offsets[at] = static_cast<std::uint64_t>(page) * w.page_bytes + static_cast<std::uint64_t>(token % 64) * w.entry_bytes;
    }
    running += tile;
    __syncthreads();  // tmp is reused by the next tile
  }
  if (threadIdx.x == 0) *w.total = running;
}

}  // namespace

int launch_mask_ids(const StepShape& s, std::int32_t* masked, Stream stream) {
  if (s.batch <= 0) return cudaSuccess;
  mask_kernel<<<s.batch, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(s, masked);
  return cudaGetLastError();
}

int launch_finalize_rows(const StepShape& s, const std::int32_t* lru_slots, std::int32_t* merged, std::int32_t* physical,
                         Stream stream) {
  if (s.batch <= 0) return cudaSuccess;
  finalize_kernel<<<s.batch, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(s, lru_slots, merged, physical);
  return cudaGetLastError();
}

int launch_write_back_list(const WriteBackList& w, Stream stream) {
  if (w.batch <= 0) return cudaSuccess;
  write_back_list_kernel<<<1, kListThreads, 0, static_cast<cudaStream_t>(stream)>>>(w);
  return cudaGetLastError();
}

}  // namespace ess::cuda
