// The lightning-indexer logits' program for one CTA (design and numerics: indexer.cu),
// written against a policy `P` that supplies the GPU primitives: p.tid(), p.sync_cta(),
// p.sync_warp(), p.smem_u32(smem) (the shared window's address of the block's shared memory),
// p.cp_async_16(dst, src, true) / p.cp_async_commit() / p.cp_async_wait_all_but_one()
// (cp.async.cg), p.ldsm_x4(regs, addr) (ldmatrix.x4), p.mma_e4m3(c, a, b0, b1)
// (mma.m16n8k32 e4m3 -> f32), p.shfl_xor(v, m) and p.fma(a, b, c). indexer.cu instantiates it
// with the PTX primitives; indexer_emulation_test.cc runs the same code on the CPU's warp
// emulator (warp_emulator.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ess/ops/indexer.h"
#include "runtime/cuda/device_inline.h"

namespace ess::cuda::indexer {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kDim = 128;                               // index_head_dim
inline constexpr int kPageKeys = 64;                           // tokens per indexer page
inline constexpr int kKeyBytes = kPageKeys * kDim;             // 8,192: the FP8 keys of a page
inline constexpr int kPageBytes = kKeyBytes + 4 * kPageKeys;   // 8,448: then 64 fp32 scales
inline constexpr int kPageChunks = kPageBytes / 16;            // 528 16-byte chunks
inline constexpr int kKeyChunks = kKeyBytes / 16;              // 512
inline constexpr int kMaxPagesPerWarp = 16;                    // pages of one warp in one CTA, at most

static_assert(kPageBytes % 16 == 0, "pages move in 16-byte chunks");

struct alignas(8) F2 {
  float x, y;
};

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

// Dynamic shared memory of a CTA: q [rows][128] swizzled, w [rows] (padded to 128 bytes), and
// each warp's two-stage page ring.
inline std::size_t smem_bytes(int T, int heads) {
  const std::size_t rows = static_cast<std::size_t>(T) * heads;
  return rows * kDim + ((rows * 4 + 127) & ~static_cast<std::size_t>(127)) + static_cast<std::size_t>(kWarps) * 2 * kPageBytes;
}

// The launch of `args` on a device of `sms` multiprocessors (indexer_logits_cuda's, and the
// emulation test's): pages per warp for about eight CTAs per SM over the batch (several waves,
// to balance requests of different lengths), but at most kMaxPagesPerWarp, so that a CTA's
// one-off load of q amortizes over up to 64 pages (540 KB) of keys; the grid is (page chunks,
// batch). For a batch with pages.
struct Launch {
  Params params;
  unsigned grid_x, grid_y;
};
inline Launch launch_params(const IndexerArgs& args, int sms) {
  const std::int64_t total_pages = static_cast<std::int64_t>(args.batch) * args.max_pages;
  const std::int64_t target_ctas = static_cast<std::int64_t>(sms > 0 ? sms : 1) * 8;
  std::int64_t per_warp = (total_pages + target_ctas * kWarps - 1) / (target_ctas * kWarps);
  per_warp = per_warp < 1 ? 1 : (per_warp > kMaxPagesPerWarp ? kMaxPagesPerWarp : per_warp);
  Launch l{};
  l.params = Params{args.query_tokens, args.heads,    args.q,      args.weights,      args.pages,
                    args.page_table,   args.max_pages, args.lengths, args.logits,       args.logits_stride,
                    static_cast<int>(per_warp) * kWarps};
  l.grid_x = static_cast<unsigned>((args.max_pages + l.params.pages_per_cta - 1) / l.params.pages_per_cta);
  l.grid_y = static_cast<unsigned>(args.batch);
  return l;
}

// Byte offset of 16-byte chunk c (0..7) of 128-byte row r in a swizzled tile.
ESS_DEVICE_INLINE std::uint32_t swz(int r, int c) { return static_cast<std::uint32_t>(r * kDim + ((c ^ (r & 7)) << 4)); }

// ReLU that keeps NaN (std::max(x, 0.0) of the reference: x < 0 ? 0 : x).
ESS_DEVICE_INLINE float relu_keep_nan(float x) { return x < 0.0f ? 0.0f : x; }

// One warp copies one page into its stage: keys swizzled, the 64 scales as they are.
template <class P>
ESS_DEVICE_INLINE void load_page(P& p, std::uint32_t stage, const std::uint8_t* src, int lane) {
  for (int c = lane; c < kPageChunks; c += 32) {
    const std::uint32_t off = c < kKeyChunks ? swz(c >> 3, c & 7) : static_cast<std::uint32_t>(c * 16);
    p.cp_async_16(stage + off, src + static_cast<std::size_t>(c) * 16, true);
  }
}

// CTA (block_x, block_y): request b = block_y, pages [block_x x pages_per_cta, +pages_per_cta).
template <class P>
ESS_DEVICE_INLINE void indexer_cta(const Params& a, unsigned block_x, unsigned block_y, std::uint8_t* smem, P& p) {
  const int T = a.T;
  const int H = a.heads;
  const int rows = T * H;  // query rows of the request: (t, h)
  const int b = static_cast<int>(block_y);
  const int tid = p.tid();
  const int lane = tid & 31;
  const int warp = tid >> 5;

  // Pages this request needs: enough for its longest query token.
  const std::int64_t cap = static_cast<std::int64_t>(a.max_pages) * kPageKeys;
  std::int64_t max_len = 0;
  for (int t = 0; t < T; ++t) {
    const std::int64_t len = a.lengths[static_cast<std::int64_t>(b) * T + t];
    max_len = len > max_len ? len : max_len;
  }
  max_len = max_len < cap ? max_len : cap;
  const int n_pages = static_cast<int>((max_len + kPageKeys - 1) / kPageKeys);
  const int first = static_cast<int>(block_x) * a.pages_per_cta;
  const int end = n_pages < first + a.pages_per_cta ? n_pages : first + a.pages_per_cta;
  if (first >= end) return;  // uniform over the CTA

  const std::size_t w_at = static_cast<std::size_t>(rows) * kDim;
  const std::size_t ring_at = w_at + ((static_cast<std::size_t>(rows) * 4 + 127) & ~static_cast<std::size_t>(127));
  float* w_s = reinterpret_cast<float*>(smem + w_at);                          // [rows]
  std::uint8_t* my_ring = smem + ring_at + static_cast<std::size_t>(warp) * 2 * kPageBytes;  // [2][kPageBytes]
  const std::uint32_t q_addr = p.smem_u32(smem);                               // [rows][128], swizzled
  const std::uint32_t stage0 = q_addr + static_cast<std::uint32_t>(ring_at + static_cast<std::size_t>(warp) * 2 * kPageBytes);

  // Prologue: q and w of request b; the first page of each warp.
  const std::uint8_t* q_g = a.q + static_cast<std::size_t>(b) * rows * kDim;
  for (int c = tid; c < rows * 8; c += kThreads) p.cp_async_16(q_addr + swz(c >> 3, c & 7), q_g + static_cast<std::size_t>(c) * 16, true);
  p.cp_async_commit();
  for (int i = tid; i < rows; i += kThreads) w_s[i] = a.weights[static_cast<std::size_t>(b) * rows + i];
  const std::int32_t* table = a.page_table + static_cast<std::size_t>(b) * a.max_pages;
  const auto page_src = [&](int pg) { return a.pages + static_cast<std::size_t>(table[pg]) * kPageBytes; };
  int page = first + warp;
  if (page < end) load_page(p, stage0, page_src(page), lane);
  p.cp_async_commit();
  p.cp_async_wait_all_but_one();  // q and w have landed (the page group may still be in flight)
  p.sync_cta();

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
    if (next < end) load_page(p, stage0 + static_cast<std::uint32_t>(kPageBytes - cur), page_src(next), lane);
    p.cp_async_commit();
    p.cp_async_wait_all_but_one();  // this page's group is complete
    p.sync_warp();

    // A fragments of the page: m-tile m = keys 16m .. 16m + 15, k-step s = dims 32s .. 32s + 31.
    std::uint32_t af[4][4][4];
    ESS_UNROLL
    for (int m = 0; m < 4; ++m) {
      ESS_UNROLL
      for (int s = 0; s < 4; ++s) p.ldsm_x4(af[m][s], stage + swz(16 * m + 8 * (mi & 1) + r8, 2 * s + (mi >> 1)));
    }

    for (int t = 0; t < T; ++t) {
      float part[4][2] = {};
      ESS_UNROLL_2
      for (int n = 0; n < H / 8; ++n) {
        // B fragments of heads 8n .. 8n + 7 of token t, all four k-steps.
        std::uint32_t bq[2][4];
        const int qrow = t * H + 8 * n + r8;
        p.ldsm_x4(bq[0], q_addr + swz(qrow, mi));      // k-steps 0, 1
        p.ldsm_x4(bq[1], q_addr + swz(qrow, 4 + mi));  // k-steps 2, 3
        const F2 w = *reinterpret_cast<const F2*>(w_s + t * H + 8 * n + 2 * t4);
        const float wx = w.x;
        const float wy = w.y;
        ESS_UNROLL
        for (int m = 0; m < 4; ++m) {
          float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          ESS_UNROLL
          for (int s = 0; s < 4; ++s) p.mma_e4m3(c, af[m][s], bq[s >> 1][2 * (s & 1)], bq[s >> 1][2 * (s & 1) + 1]);
          // c0, c1: key 16m + g, heads 8n + 2 t4 (+1); c2, c3: key 16m + g + 8.
          part[m][0] = p.fma(wx, relu_keep_nan(c[0]), part[m][0]);
          part[m][0] = p.fma(wy, relu_keep_nan(c[1]), part[m][0]);
          part[m][1] = p.fma(wx, relu_keep_nan(c[2]), part[m][1]);
          part[m][1] = p.fma(wy, relu_keep_nan(c[3]), part[m][1]);
        }
      }
      // Sum over the quad (the other heads of each n-tile).
      ESS_UNROLL
      for (int m = 0; m < 4; ++m) {
        ESS_UNROLL
        for (int h = 0; h < 2; ++h) {
          part[m][h] += p.shfl_xor(part[m][h], 1);
          part[m][h] += p.shfl_xor(part[m][h], 2);
        }
      }
      // Lane (g, t4) writes keys 16 t4 + g and 16 t4 + g + 8 of the page.
      float v0 = 0.0f;
      float v1 = 0.0f;
      ESS_UNROLL
      for (int m = 0; m < 4; ++m) {
        if (m == t4) {
          v0 = part[m][0];
          v1 = part[m][1];
        }
      }
      const int key0 = 16 * t4 + g;
      const std::int64_t len = a.lengths[out_row0 + t];
      const std::int64_t j0 = static_cast<std::int64_t>(page) * kPageKeys + key0;
      float* out = a.logits + (out_row0 + t) * a.stride;
      if (j0 < len) out[j0] = v0 * scale_s[key0];
      if (j0 + 8 < len) out[j0 + 8] = v1 * scale_s[key0 + 8];
    }
    p.sync_warp();  // every lane is done with this stage before the next iteration refills it
  }
}

}  // namespace ess::cuda::indexer
