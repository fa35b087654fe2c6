#include <cuda_runtime.h>

#include <cstdint>

#include "ess/ops/flashtrans.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/ops/launch_args.h"

namespace ess::cuda {
namespace {

constexpr int kChunks = kFlashTransChunksPerThread;

// Thread i of the grid copies chunks i, i + stride, ... of the flattened (entry, chunk)
// space; consecutive threads copy consecutive 16-byte chunks of one entry, so each warp's
// reads and writes are contiguous runs. Loads are issued before stores to keep kChunks
// PCIe reads in flight per thread.
__global__ void __launch_bounds__(kFlashTransDefaultThreads) copy_entries(const uint4* __restrict__ src_base,
                                                                          uint4* __restrict__ dst_base,
                                                                          const std::uint64_t* __restrict__ src_off,
                                                                          const std::uint64_t* __restrict__ dst_off,
                                                                          std::int64_t total_chunks, int chunks_per_entry,
                                                                          const std::int64_t* __restrict__ device_count) {
  if (device_count != nullptr) {
    const std::int64_t n = *device_count * chunks_per_entry;
    total_chunks = n < total_chunks ? (n > 0 ? n : 0) : total_chunks;
  }
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i < total_chunks; i += stride * kChunks) {
    uint4 v[kChunks];
    std::int64_t dst[kChunks];
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
      const std::int64_t c = i + u * stride;
      dst[u] = -1;
      if (c < total_chunks) {
        const std::int64_t e = c / chunks_per_entry;
        const std::int64_t k = c - e * chunks_per_entry;
        v[u] = __ldcs(src_base + src_off[e] / 16 + k);  // streamed: read once
        dst[u] = static_cast<std::int64_t>(dst_off[e] / 16) + k;
      }
    }
#pragma unroll
    for (int u = 0; u < kChunks; ++u) {
      if (dst[u] >= 0) __stcs(dst_base + dst[u], v[u]);
    }
  }
}

int launch(const EntryCopy& c, Stream stream) {
  if (!check_args(c).empty()) return cudaErrorInvalidValue;
  if (c.count <= 0) return cudaSuccess;
  const FlashTransGrid g = flashtrans_grid(c);
  copy_entries<<<g.blocks, g.threads, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const uint4*>(c.src_base), reinterpret_cast<uint4*>(c.dst_base), c.src_offsets, c.dst_offsets,
      c.count * (c.entry_bytes / 16), c.entry_bytes / 16, c.device_count);
  return cudaGetLastError();
}

}  // namespace

int flashtrans_cuda(const EntryCopy& copy, Stream stream) { return launch(copy, stream); }

const std::uint8_t* device_view_cuda(const std::uint8_t* host) {
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, const_cast<std::uint8_t*>(host), 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return static_cast<const std::uint8_t*>(dev);
}

}  // namespace ess::cuda
