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
#include "runtime/cuda/smem_limit.h"
#include "runtime/ops/launch_args.h"

namespace ess::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kDim = 128;                           // index_head_dim
constexpr int kPageKeys = 64;                       // tokens per indexer page
constexpr int kKeyBytes = kPageKeys * kDim;         // 8,192: the FP8 keys of a page
constexpr int kPageBytes = kKeyBytes + 4 * kPageKeys;  // 8,448: then 64 fp32 scales
constexpr int kPageChunks = kPageBytes / 16;        // 528 16-byte chunks
constexpr int kKeyChunks = kKeyBytes / 16;          // 512
constexpr int kMaxPagesPerWarp = 16;                // pages of one warp in one CTA, at most

static_assert(kPageBytes % 16 == 0, "pages move in 16-byte chunks");

__device__ __forceinline__ std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(std::uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8 x 16-byte matrices; lane l supplies the row address of matrix l / 8, row l % 8, and
// receives 4 bytes (bytes 4 * (l % 4) ..) of row l / 4 of each matrix.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t addr, std::uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// c += A (16 x 32, e4m3, row) * B (32 x 8, e4m3, col), fp32 accumulators.
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                         std::uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte chunk c (0..7) of 128-byte row r in a swizzled tile.
__device__ __forceinline__ std::uint32_t swz(int r, int c) {
  return static_cast<std::uint32_t>(r * kDim + ((c ^ (r & 7)) << 4));
}

// ReLU that keeps NaN (std::max(x, 0.0) of the reference: x < 0 ? 0 : x).
__device__ __forceinline__ float relu_keep_nan(float x) { return x < 0.0f ? 0.0f : x; }

struct Params {
  int T;
  int heads;
  const std::uint8_t* q;
  const float* weights;
  const std::uint8_t* pages;
  const std::int32_t* page_table;
  int max_pages;
  const std::int32_t* lengths;
  float* logits;
  std::int64_t stride;
  int pages_per_cta;
};

// One warp copies one page into its stage: keys swizzled, the 64 scales as they are.
__device__ __forceinline__ void load_page(std::uint32_t stage, const std::uint8_t* src, int lane) {
  for (int c = lane; c < kPageChunks; c += 32) {
    const std::uint32_t off = c < kKeyChunks ? swz(c >> 3, c & 7) : static_cast<std::uint32_t>(c * 16);
    cp_async16(stage + off, src + static_cast<std::size_t>(c) * 16);
  }
}

__global__ void __launch_bounds__(kThreads) indexer_logits_kernel(const Params p) {
  extern __shared__ __align__(128) std::uint8_t smem[];
  const int T = p.T;
  const int H = p.heads;
  const int rows = T * H;  // query rows of the request: (t, h)
  const int b = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;

  // Pages this request needs: enough for its longest query token.
  const std::int64_t cap = static_cast<std::int64_t>(p.max_pages) * kPageKeys;
  std::int64_t max_len = 0;
  for (int t = 0; t < T; ++t) {
    const std::int64_t len = p.lengths[static_cast<std::int64_t>(b) * T + t];
    max_len = len > max_len ? len : max_len;
  }
  max_len = max_len < cap ? max_len : cap;
  const int n_pages = static_cast<int>((max_len + kPageKeys - 1) / kPageKeys);
  const int first = static_cast<int>(blockIdx.x) * p.pages_per_cta;
  const int end = n_pages < first + p.pages_per_cta ? n_pages : first + p.pages_per_cta;
  if (first >= end) return;  // uniform over the CTA

  std::uint8_t* q_s = smem;                                           // [rows][128], swizzled
  float* w_s = reinterpret_cast<float*>(smem + rows * kDim);          // [rows]
  std::uint8_t* ring = smem + rows * kDim + ((rows * 4 + 127) & ~127);  // [warps][2][kPageBytes]
  std::uint8_t* my_ring = ring + warp * 2 * kPageBytes;
  const std::uint32_t q_addr = smem_u32(q_s);
  const std::uint32_t stage0 = smem_u32(my_ring);

  // Prologue: q and w of request b; the first page of each warp.
  const std::uint8_t* q_g = p.q + static_cast<std::size_t>(b) * rows * kDim;
  for (int c = tid; c < rows * 8; c += kThreads) {
    cp_async16(q_addr + swz(c >> 3, c & 7), q_g + static_cast<std::size_t>(c) * 16);
  }
  cp_async_commit();
  for (int i = tid; i < rows; i += kThreads) w_s[i] = p.weights[static_cast<std::size_t>(b) * rows + i];
  const std::int32_t* table = p.page_table + static_cast<std::size_t>(b) * p.max_pages;
  const auto page_src = [&](int page) {
    return p.pages + static_cast<std::size_t>(table[page]) * kPageBytes;
  };
  int page = first + warp;
  if (page < end) load_page(stage0, page_src(page), lane);
  cp_async_commit();
  cp_async_wait<1>();  // q and w have landed (the page group may still be in flight)
  __syncthreads();

  // Fragment coordinates: C/A/B row group g and quad index t4; ldmatrix matrix mi, row r8.
  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int mi = lane >> 3;
  const int r8 = lane & 7;
  const std::int64_t out_row0 = static_cast<std::int64_t>(b) * T;

  for (int it = 0; page < end; page += kWarps, ++it) {
    const int cur = (it & 1) * kPageBytes;
    const std::uint32_t stage = stage0 + static_cast<std::uint32_t>(cur);
    const float* scale_s = reinterpret_cast<const float*>(my_ring + cur + kKeyBytes);
    const int next = page + kWarps;
    if (next < end) load_page(stage0 + static_cast<std::uint32_t>(kPageBytes - cur), page_src(next), lane);
    cp_async_commit();
    cp_async_wait<1>();  // this page's group is complete
    __syncwarp();

    // A fragments of the page: m-tile m = keys 16m .. 16m + 15, k-step s = dims 32s .. 32s + 31.
    std::uint32_t a[4][4][4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        ldmatrix_x4(stage + swz(16 * m + 8 * (mi & 1) + r8, 2 * s + (mi >> 1)), a[m][s]);
      }
    }

    for (int t = 0; t < T; ++t) {
      float part[4][2] = {};
#pragma unroll 2
      for (int n = 0; n < H / 8; ++n) {
        // B fragments of heads 8n .. 8n + 7 of token t, all four k-steps.
        std::uint32_t bq[2][4];
        const int qrow = t * H + 8 * n + r8;
        ldmatrix_x4(q_addr + swz(qrow, mi), bq[0]);      // k-steps 0, 1
        ldmatrix_x4(q_addr + swz(qrow, 4 + mi), bq[1]);  // k-steps 2, 3
        const float2 w = *reinterpret_cast<const float2*>(w_s + t * H + 8 * n + 2 * t4);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int s = 0; s < 4; ++s) mma_e4m3(c, a[m][s], bq[s >> 1][2 * (s & 1)], bq[s >> 1][2 * (s & 1) + 1]);
          // c0, c1: key 16m + g, heads 8n + 2 t4 (+1); c2, c3: key 16m + g + 8.
          part[m][0] = fmaf(w.x, relu_keep_nan(c[0]), part[m][0]);
          part[m][0] = fmaf(w.y, relu_keep_nan(c[1]), part[m][0]);
          part[m][1] = fmaf(w.x, relu_keep_nan(c[2]), part[m][1]);
          part[m][1] = fmaf(w.y, relu_keep_nan(c[3]), part[m][1]);
        }
      }
      // Sum over the quad (the other heads of each n-tile).
#pragma unroll
      for (int m = 0; m < 4; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          part[m][h] += __shfl_xor_sync(0xffffffffu, part[m][h], 1);
          part[m][h] += __shfl_xor_sync(0xffffffffu, part[m][h], 2);
        }
      }
      // Lane (g, t4) writes keys 16 t4 + g and 16 t4 + g + 8 of the page.
      float v0 = 0.0f;
      float v1 = 0.0f;
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        if (m == t4) {
          v0 = part[m][0];
          v1 = part[m][1];
        }
      }
      const int key0 = 16 * t4 + g;
      const std::int64_t len = p.lengths[out_row0 + t];
      const std::int64_t j0 = static_cast<std::int64_t>(page) * kPageKeys + key0;
      float* out = p.logits + (out_row0 + t) * p.stride;
      if (j0 < len) out[j0] = v0 * scale_s[key0];
      if (j0 + 8 < len) out[j0 + 8] = v1 * scale_s[key0 + 8];
    }
    __syncwarp();  // every lane is done with this stage before the next iteration refills it
  }
}

std::size_t smem_bytes(int T, int heads) {
  const std::size_t rows = static_cast<std::size_t>(T) * heads;
  return rows * kDim + ((rows * 4 + 127) & ~static_cast<std::size_t>(127)) +
         static_cast<std::size_t>(kWarps) * 2 * kPageBytes;
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

  // Pages per warp: enough CTAs for about eight per SM over the batch (several waves, to
  // balance requests of different lengths), but at most kMaxPagesPerWarp, so that a CTA's
  // one-off load of q amortizes over up to 64 pages (540 KB) of keys.
  const std::int64_t total_pages = static_cast<std::int64_t>(a.batch) * a.max_pages;
  const std::int64_t target_ctas = static_cast<std::int64_t>(sms > 0 ? sms : 1) * 8;
  std::int64_t per_warp = (total_pages + target_ctas * kWarps - 1) / (target_ctas * kWarps);
  per_warp = per_warp < 1 ? 1 : (per_warp > kMaxPagesPerWarp ? kMaxPagesPerWarp : per_warp);
  Params p{};
  p.T = a.query_tokens;
  p.heads = a.heads;
  p.q = a.q;
  p.weights = a.weights;
  p.pages = a.pages;
  p.page_table = a.page_table;
  p.max_pages = a.max_pages;
  p.lengths = a.lengths;
  p.logits = a.logits;
  p.stride = a.logits_stride;
  p.pages_per_cta = static_cast<int>(per_warp) * kWarps;
  const dim3 grid(static_cast<unsigned>((a.max_pages + p.pages_per_cta - 1) / p.pages_per_cta),
                  static_cast<unsigned>(a.batch));
  indexer_logits_kernel<<<grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  return cudaGetLastError();
}

}  // namespace ess::cuda
