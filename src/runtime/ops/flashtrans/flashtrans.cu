#include <cuda_runtime.h>

#include <cstdint>

#include "ess/ops/flashtrans.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/ops/flashtrans/flashtrans_cta.h"
#include "runtime/ops/launch_args.h"

namespace ess::cuda {
namespace {

// The CUDA primitives of the block program (flashtrans_cta.h).
struct DevicePrims {
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ int threads() const { return static_cast<int>(blockDim.x); }
  __device__ unsigned block() const { return blockIdx.x; }
  __device__ unsigned blocks() const { return gridDim.x; }
  __device__ flashtrans::Chunk load(const flashtrans::Chunk* p) const {
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));  // streamed: read once
    return {v.x, v.y, v.z, v.w};
  }
  __device__ void store(flashtrans::Chunk* p, const flashtrans::Chunk& v) const {
    __stcs(reinterpret_cast<uint4*>(p), make_uint4(v.x, v.y, v.z, v.w));
  }
};

__global__ void __launch_bounds__(kFlashTransDefaultThreads) copy_entries(const flashtrans::Chunk* __restrict__ src_base,
                                                                          flashtrans::Chunk* __restrict__ dst_base,
                                                                          const std::uint64_t* __restrict__ src_off,
                                                                          const std::uint64_t* __restrict__ dst_off,
                                                                          std::int64_t total_chunks, int chunks_per_entry,
                                                                          const std::int64_t* __restrict__ device_count) {
  DevicePrims prims;
  flashtrans::copy_entries_cta(src_base, dst_base, src_off, dst_off, total_chunks, chunks_per_entry, device_count, prims);
}

int launch(const EntryCopy& c, Stream stream) {
  if (!check_args(c).empty()) return cudaErrorInvalidValue;
  if (c.count <= 0) return cudaSuccess;
  const FlashTransGrid g = flashtrans_grid(c);
  copy_entries<<<g.blocks, g.threads, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const flashtrans::Chunk*>(c.src_base), reinterpret_cast<flashtrans::Chunk*>(c.dst_base), c.src_offsets,
      c.dst_offsets,
      c.count * (c.entry_bytes / 16), c.entry_bytes / 16, c.device_count);
  return cudaGetLastError();
}

}  // namespace

int flashtrans_cuda(const EntryCopy& copy, Stream stream) { return launch(copy, stream); }

}  // namespace ess::cuda
