// The lightning-indexer logits on FP8 tensor cores (see indexer.h for the definition):
//
//     I[b][t][j] = scale_j * sum_h w[b][t][h] * ReLU( q[b][t][h] . k8_j )
//
// Design (the public reference is DeepGEMM's fp8_paged_mqa_logits; this is the same data
// flow with warp-level mma.sync instead of warpgroup wgmma):
//   - Grid (page chunks, B). A CTA of 4 warps serves one request b and a run of its 64-key
//     pages; all T query tokens of b are computed from one read of each page, so every key
//     byte leaves HBM once per request and step. Each warp takes every 4th page of the run.
//   - The CTA first stages q[b] (T x heads x 128 FP8 bytes) and w[b] (T x heads fp32) in
//     shared memory. Each warp then streams its pages through a private two-stage
//     shared-memory ring with cp.async (16-byte chunks, L2-only .cg): while it computes page
//     i, page i + 1 is in flight. No CTA-wide barrier after the prologue.
//   - Both operands sit in shared memory as 128-byte rows (a key's 128 dims; a query head's
//     128 dims) with the 16-byte chunks XOR-swizzled by (row & 7), so the ldmatrix loads
//     that build the fragments are free of bank conflicts.
//   - Math: mma.sync.m16n8k32.row.col.f32.e4m3.e4m3.f32 with A = 16 keys x 32 dims (a key
//     row is K-contiguous: "row") and B = 32 dims x 8 heads (a head is K-contiguous:
//     "col"). A warp holds the A fragments of its whole page in registers (4 m-tiles x 4
//     k-steps x 4 regs = 64) and walks (token t, 8-head n-tile): 2 ldmatrix.x4 for B, then
//     4 x 4 chained MMAs, one 4-MMA chain per 16-key m-tile. C[key][head] is ReLU'd (NaN
//     propagates, as in the reference's std::max), weighted with w[t][head] and summed
//     over the thread's heads in fp32; two quad shuffles finish the sum over all heads.
//     Each lane then writes two logits (times the key's scale) where j < lengths[b*T + t].
//   - Work per page and token: 128 MMAs (64 keys x 64 heads x 128 dims); bytes per page
//     8,448. At T = 2 that is 248 FLOP/B: memory-bound on H100 / H200 when mma.sync
//     reaches about half of the wgmma FP8 peak.
//
// Numerics. FP8 x FP8 products are exact. The tensor core does not accumulate them in full
// fp32, though: on Hopper (and Ada) the FP8 MMA aligns the products and the accumulator to
// the largest exponent and keeps about 13 fraction bits, truncating (DeepSeek-V3 technical
// report, sec. 3.3.2: "around 14 bits"; bit-level models of the H100 tensor cores measure
// 13 bits, round toward zero). This is the same arithmetic DeepGEMM's kernel performs; the
// test tolerance is derived from it (indexer_problem.h). The head sum is fp32.
#include <cuda_runtime.h>

#include <cstdint>

#include "ess/ops/indexer.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/cuda/ptx.cuh"
#include "runtime/cuda/smem_limit.h"
#include "runtime/ops/indexer/indexer_cta.h"
#include "runtime/ops/launch_args.h"

namespace ess::cuda {
namespace {

using indexer::kThreads;
using indexer::Params;
using indexer::smem_bytes;

// The PTX primitives of the CTA program (indexer_cta.h).
struct DevicePrims {
  __device__ __forceinline__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ void sync_cta() const { __syncthreads(); }
  __device__ __forceinline__ void sync_warp() const { __syncwarp(); }
  __device__ __forceinline__ std::uint32_t smem_u32(const void* ptr) const { return ptx::smem_u32(ptr); }
  __device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src, bool) const { ptx::cp_async_16(dst, src); }
  __device__ __forceinline__ void cp_async_commit() const { ptx::cp_async_commit(); }
  __device__ __forceinline__ void cp_async_wait_all_but_one() const { ptx::cp_async_wait<1>(); }
  __device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], std::uint32_t addr) const { ptx::ldmatrix_x4(r, addr); }
  // c += A (16 x 32, e4m3, row) * B (32 x 8, e4m3, col), fp32 accumulators.
  __device__ __forceinline__ void mma_e4m3(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                           std::uint32_t b1) const {
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ float shfl_xor(float v, int m) const { return __shfl_xor_sync(0xffffffffu, v, m); }
  __device__ __forceinline__ float fma(float x, float y, float z) const { return fmaf(x, y, z); }
};

__global__ void __launch_bounds__(kThreads) indexer_logits_kernel(const Params p) {
  extern __shared__ __align__(128) std::uint8_t smem[];
  DevicePrims prims;
  indexer::indexer_cta(p, blockIdx.x, blockIdx.y, smem, prims);
}

}  // namespace

int indexer_logits_cuda(const IndexerArgs& a, Stream stream) {
  // Arguments first (launch_args.cc), whether or not there is work: a caller's bad pointer
  // shows on its first call, not on the first call that happens to have keys.
  if (!check_args(a).empty()) return cudaErrorInvalidValue;
  if (a.batch == 0 || a.max_pages == 0) return cudaSuccess;  // no keys: nothing to write
  int device = 0;
  int sms = 0;
  int optin = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return e;
  const std::size_t smem = smem_bytes(a.query_tokens, a.heads);
  if (smem > static_cast<std::size_t>(optin)) return cudaErrorInvalidValue;  // too many query tokens
  static DynamicSmemLimit limit;
  e = limit.raise(indexer_logits_kernel);
  if (e != cudaSuccess) return e;

  const indexer::Launch l = indexer::launch_params(a, sms);
  indexer_logits_kernel<<<dim3(l.grid_x, l.grid_y), kThreads, smem, static_cast<cudaStream_t>(stream)>>>(l.params);
  return cudaGetLastError();
}

}  // namespace ess::cuda
