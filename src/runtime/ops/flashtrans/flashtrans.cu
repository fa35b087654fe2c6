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
  __device__ std::uint64_t load8(const std::uint64_t* p) const {
    return static_cast<std::uint64_t>(__ldcs(reinterpret_cast<const unsigned long long*>(p)));
  }
  __device__ void store8(std::uint64_t* p, std::uint64_t v) const {
    __stcs(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
  }
};

__global__ void __launch_bounds__(kFlashTransDefaultThreads) copy_entries(const flashtrans::CopyPlan plan) {
  DevicePrims prims;
  flashtrans::copy_entries_cta(plan, prims);
}

int launch(const EntryCopy& c, Stream stream) {
  if (!check_args(c).empty()) return cudaErrorInvalidValue;
  if (c.count <= 0) return cudaSuccess;
  const FlashTransGrid g = flashtrans_grid(c);
  copy_entries<<<g.blocks, g.threads, 0, static_cast<cudaStream_t>(stream)>>>(flashtrans::copy_plan(c));
  return cudaGetLastError();
}

}  // namespace

int flashtrans_cuda(const EntryCopy& copy, Stream stream) { return launch(copy, stream); }

}  // namespace ess::cuda
