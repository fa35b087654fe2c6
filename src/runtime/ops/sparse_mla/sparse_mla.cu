// Sparse MLA decode on tensor cores (mma.sync m16n8k16 bf16 -> fp32) and the merge of two
// partial attention states. Definitions in sparse_mla.h; the CTA program in
// sparse_mla_cta.h (instantiated here with the PTX primitives, and on the CPU by
// sparse_mla_emulation_test.cc); index math in mma_layout.h.
//
// ---- Design ---------------------------------------------------------------------------------
// One CTA per (query token, block of 64 heads), 8 warps, one CTA per SM (207,872 bytes of
// dynamic shared memory). The CTA walks the token's K ids in tiles of 32 entries:
//
//   shared memory: Q            64 x 576 bf16 (loaded once)
//                  K tile x 2   32 x 576 bf16, dequantized (tile i being used, tile i+1 being built)
//                  raw tile x 2 32 x 656 B, the gathered entries as stored (tile i+1, tile i+2)
//                  exchange     8 warps x 16 x 32 fp32 partial scores
//   (Q and K rows padded to 1168 bytes so that ldmatrix is free of bank conflicts)
//
//   iteration i:  wait for raw tile i+1; __syncthreads
//                 cp.async gather of tile i+2 into the free raw buffer (masked ids zero-filled,
//                   never read)
//                 dequantize raw tile i+1 -> bf16 K tile (fp8 x power-of-two scale: exact)
//                 S = Q K^T on tile i, then softmax and O += P V (below)
//
// so the gather of a tile has a whole iteration to land, and the ids of tile i+3 are loaded
// into registers one iteration before they are needed.
//
// Warp w = (row group r = w % 4, half c = w / 4) owns heads 16r .. 16r+15 of the block:
//   scores: the warp computes the partial S (16 heads x 32 entries) over dims [288c, 288c+288)
//     (18 k-steps x 4 n-tiles of mma), writes it to the exchange buffer, syncs with its
//     partner warp (w ^ 4) on a named barrier and adds the partner's half. Both warps of a
//     pair then hold the same full scores (a + b == b + a exactly) and run the same online
//     softmax, so no softmax state is ever exchanged.
//   softmax: per head row, running max m (log2 domain: scores are pre-scaled by
//     softmax_scale * log2 e) and running sum l of the un-rounded fp32 probabilities;
//     masked / out-of-range / past-K columns are -inf; a row with no valid column so far keeps
//     m = -inf and uses 0 as the exponent base, so exp2 never sees -inf - (-inf).
//   values: P (rounded to bf16, FlashMLA does the same) is taken from the score accumulators
//     as the A operand (the C layout of two n-tiles is the A layout of one k-step) and
//     O[16 x 256] += P V over the warp's 256 output dims (V = the tile's nope part, loaded
//     with ldmatrix.trans): 128 fp32 accumulators per thread. O is rescaled only when some
//     row's maximum moved (warp-uniform test; a factor of exactly 1 is skipped).
//   epilogue: o = O / l (l = 0: o = 0, lse = -inf), lse = m ln 2 + ln l (natural log).
//   bad ids: warp 0 of head block 0 reports them with an unsigned atomicMin (the caller's -1
//     is 0xffffffff, larger than any position) and treats them as masked.
//
// Resources (ptxas -v, sm_90a): 246 registers per thread, no spills, no local memory; 16
// hardware barriers reserved (the named-barrier id is a register); 207,872 bytes of dynamic
// shared memory: one CTA (8 warps) per SM. Cost per tile per SM (32 entries x 64 heads,
// 4.46 MFLOP): 1,088 mma.m16n8k16, 688 ldmatrix.x4 (352 KB of shared-memory reads, ~2,750
// cycles at 128 B/clk), dequantization ~58 KB of shared traffic and ~0.5k issue cycles. The
// shared-memory bandwidth is the bound: a ceiling near 290 TFLOP/s at B 128, T 2, 128 heads,
// K 2048 on an H100 (issue target 150; FlashMLA's wgmma + FP8 kernel: 410 on H800). The
// next steps if it falls short: two accumulator sets in the score loop (its 4 mma chains are
// 18 deep), Q fragments kept across tiles, wgmma.
//
// ---- Accuracy (the tests' tolerance comes from this) ----------------------------------------
// Dequantization is exact and rope is bf16 already, so Q K^T is exact products summed in fp32
// (the score error is the fp32 summation error of 576 terms). The dominant error is P rounded
// to bf16 (relative 2^-8) before the P V product: |o - o_ref| <= 2^-8 max_j |v_j| plus the
// effect of the score error and the fp32 accumulation over K entries (the complete bound:
// test::check_decode_token in testing/accuracy.h, used by the tests and the benchmark).
//
// ---- Merge ----------------------------------------------------------------------------------
// One warp per row (head): reads both lse values, computes the two weights exactly as
// ess::ref::merge_states (an lse of -inf or +inf is an empty partial; empty partials' o is
// never read), then float4 loads/stores over the row; the row's lse is written after a
// __syncwarp, so out / lse may alias o_a / lse_a (or o_b / lse_b).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ess/ops/sparse_mla.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/cuda/ptx.cuh"
#include "runtime/cuda/smem_limit.h"
#include "runtime/ops/launch_args.h"
#include "runtime/ops/sparse_mla/merge_cta.h"
#include "runtime/ops/sparse_mla/mma_layout.h"
#include "runtime/ops/sparse_mla/sparse_mla_cta.h"

namespace ess::cuda {
namespace {

using namespace mla;  // NOLINT: the layout constants of this kernel

constexpr unsigned kFull = 0xffffffffu;

static_assert(kSmemBytes <= 227 * 1024, "the CTA must fit the H100's shared memory");
static_assert(kThreads == 256);

// Two floats -> packed bf16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ std::uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  std::uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

// The PTX primitives of sparse_mla_cta (sparse_mla_cta.h).
struct DevicePrims {
  __device__ __forceinline__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ void sync_cta() const { __syncthreads(); }
  // Barrier of the two warps (64 threads) of row group r; id 0 is __syncthreads'.
  __device__ __forceinline__ void sync_pair(int r) const { asm volatile("bar.sync %0, 64;\n" ::"r"(r + 1) : "memory"); }
  __device__ __forceinline__ long long shfl(long long v, int src) const { return __shfl_sync(kFull, v, src); }
  __device__ __forceinline__ float shfl_xor(float v, int m) const { return __shfl_xor_sync(kFull, v, m); }
  __device__ __forceinline__ std::uint32_t ballot(bool b) const { return __ballot_sync(kFull, b); }
  __device__ __forceinline__ bool any(bool b) const { return __any_sync(kFull, b) != 0; }
  __device__ __forceinline__ std::int32_t ldg(const std::int32_t* ptr) const { return __ldg(ptr); }
  __device__ __forceinline__ void atomic_min_u32(unsigned* ptr, unsigned v) const { atomicMin(ptr, v); }
  __device__ __forceinline__ float exp2(float x) const { return exp2f(x); }
  __device__ __forceinline__ float log(float x) const { return logf(x); }
  __device__ __forceinline__ std::uint32_t smem_u32(const void* ptr) const { return ptx::smem_u32(ptr); }
  // 16-byte global -> shared copy; with fill = false the 16 bytes are zero-filled and nothing
  // is read (src must still be a valid address).
  __device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src, bool fill) const {
    ptx::cp_async_16_zfill(dst, src, fill ? 16 : 0);
  }
  __device__ __forceinline__ void cp_async_commit() const { ptx::cp_async_commit(); }
  __device__ __forceinline__ void cp_async_wait_all() const { ptx::cp_async_wait<0>(); }
  __device__ __forceinline__ void cp_async_wait_all_but_one() const { ptx::cp_async_wait<1>(); }
  __device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], std::uint32_t addr) const { ptx::ldmatrix_x4(r, addr); }
  __device__ __forceinline__ void ldsm_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) const {
    ptx::ldmatrix_x4_trans(r, addr);
  }
  // d += A (16x16 bf16) * B (16x8 bf16), fp32 accumulators.
  __device__ __forceinline__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) const {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) const { return pack_bf16x2(lo, hi); }
  // Two FP8 e4m3 values (bits 0-7 and 8-15) times a power-of-two scale -> bf16x2. Exact:
  // e4m3 -> f16 is exact (every e4m3 value, subnormals included, is an f16 value), f16 -> f32
  // is exact, the product by a power of two is exact (results stay normal: |fp8| >= 2^-9 and
  // scale >= 2^-14), and a value with <= 4 significant bits is a bf16 value.
  __device__ __forceinline__ std::uint32_t fp8x2_to_bf16x2(std::uint32_t two, float scale) const {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    return pack_bf16x2(f.x * scale, f.y * scale);
  }
};

__global__ void __launch_bounds__(kThreads, 1) sparse_mla_kernel(SparseMlaArgs a, float scale_log2, int head_blocks) {
  extern __shared__ __align__(128) unsigned char smem[];
  DevicePrims prims;
  sparse_mla_cta(a, scale_log2, head_blocks, blockIdx.x, smem, prims);
}

// ---- merge ---------------------------------------------------------------------------------------
struct MergePrims {
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ int threads() const { return static_cast<int>(blockDim.x); }
  __device__ unsigned block() const { return blockIdx.x; }
  __device__ unsigned blocks() const { return gridDim.x; }
  __device__ void sync_warp() const { __syncwarp(); }
  __device__ float exp(float x) const { return expf(x); }
  __device__ float log1p(float x) const { return log1pf(x); }
  __device__ std::uint32_t pack_bf16(float lo, float hi) const { return pack_bf16x2(lo, hi); }
};

__global__ void __launch_bounds__(merge::kThreads) merge_kernel(MergeArgs a) {
  MergePrims prims;
  merge::merge_cta(a, prims);
}

}  // namespace

int sparse_mla_decode_cuda(const SparseMlaArgs& a, Stream stream) {
  if (!check_args(a).empty()) return cudaErrorInvalidValue;
  const long long tokens = static_cast<long long>(a.batch) * a.query_tokens;
  if (tokens == 0) return cudaSuccess;
  const int head_blocks = a.heads / kHeadsPerCta;
  static DynamicSmemLimit limit;
  const cudaError_t err = limit.raise(sparse_mla_kernel);
  if (err != cudaSuccess) return err;
  const float scale_log2 = a.softmax_scale * kLog2e;
  sparse_mla_kernel<<<static_cast<unsigned>(tokens * head_blocks), kThreads, kSmemBytes, static_cast<cudaStream_t>(stream)>>>(
      a, scale_log2, head_blocks);
  return cudaGetLastError();
}

int merge_states_cuda(const MergeArgs& a, Stream stream) {
  if (!check_args(a).empty()) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  int device = 0;
  int sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const long long rows_per_block = merge::kThreads / 32;
  const long long want = (a.rows + rows_per_block - 1) / rows_per_block;
  const long long cap = static_cast<long long>(sms > 0 ? sms : 1) * 16;
  merge_kernel<<<static_cast<unsigned>(want < cap ? want : cap), merge::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  return cudaGetLastError();
}

}  // namespace ess::cuda
