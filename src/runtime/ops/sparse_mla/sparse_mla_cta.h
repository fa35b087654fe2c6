// The program of one sparse MLA decode CTA (design: sparse_mla.cu), written against a policy
// `P` that supplies the GPU primitives: thread index, barriers, warp shuffles / votes,
// cp.async, ldmatrix, mma, fp8 / bf16 conversions. sparse_mla.cu instantiates it with the
// PTX primitives; sparse_mla_emulation_test.cc instantiates it on the CPU with a
// warp emulator (one fiber per thread, the PTX semantics of each primitive), so the very code
// that runs on the GPU is exercised without one.
//
// Shared memory is addressed two ways, as on the GPU: `smem` (generic pointer) for plain loads
// and stores, and 32-bit shared-window addresses (P::smem_u32(smem) + byte offset) for
// cp.async and ldmatrix.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "ess/ops/sparse_mla.h"
#include "runtime/cuda/device_inline.h"
#include "runtime/ops/sparse_mla/mma_layout.h"

namespace ess::cuda::mla {

// Plain vector types (16 / 8 bytes, aligned) for vectorized shared and global accesses.
struct alignas(16) U32x4 {
  std::uint32_t x, y, z, w;
};
struct alignas(8) U32x2 {
  std::uint32_t x, y;
};
struct alignas(16) F32x4 {
  float x, y, z, w;
};
struct alignas(8) F32x2 {
  float x, y;
};

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// One CTA: query token `block / head_blocks`, heads [64 hb, 64 hb + 64) with hb = block % head_blocks.
template <class P>
ESS_DEVICE_INLINE void sparse_mla_cta(const SparseMlaArgs& a, float scale_log2, int head_blocks, unsigned block,
                                   unsigned char* smem, P& p) {
  const int tid = p.tid();
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int rg = warp & 3;     // row group: heads 16 rg .. 16 rg + 15 of the block
  const int half = warp >> 2;  // score dims [288 half, +288), output dims [256 half, +256)

  const long long token = static_cast<long long>(block) / head_blocks;  // b * T + t
  const int head_block = static_cast<int>(static_cast<long long>(block) - token * head_blocks);
  const int b = static_cast<int>(token / a.query_tokens);
  const int K = a.topk;
  // Ids read: the row's length when given (at least one tile runs, so a row with no id takes
  // the all-masked path: o = 0, lse = -inf).
  int K_row = K;
  if (a.row_lengths != nullptr) {
    const int len = p.ldg(a.row_lengths + token);
    K_row = len < 0 ? 0 : (len < K ? len : K);
  }
  const int n_tiles = K_row > 0 ? (K_row + kTileEntries - 1) / kTileEntries : 1;
  const std::int32_t* ids = a.indices + token * K;
  const std::uint8_t* kv_req = a.kv + a.kv_offsets[b];
  const bool report_bad = a.bad_index != nullptr && warp == 0 && head_block == 0;

  // Buffers by index (computed, not looked up in an array: that would live in local memory).
  const std::uint32_t s_base = p.smem_u32(smem);
  const std::uint32_t q_s = s_base + kSmemQ;
  const auto k_s = [&](int buf) { return s_base + static_cast<std::uint32_t>(kSmemK + buf * kKTileBytes); };
  const auto raw_s = [&](int buf) { return s_base + static_cast<std::uint32_t>(kSmemRaw + buf * kRawTileBytes); };
  F32x4* xchg = reinterpret_cast<F32x4*>(smem + kSmemExchange);

  // The id at position `pos` of the token's list, -1 past the end.
  const auto load_id = [&](int pos) -> std::int32_t { return pos < K_row ? p.ldg(ids + pos) : -1; };

  // Issues the cp.async gather of tile `tile` into the raw buffer at `dst`; lane j of every
  // warp passes the id of the tile's entry j. Returns the tile's validity mask (bit j: entry
  // j is read); masked, out-of-range and past-K entries are zero-filled, never read.
  const auto gather = [&](int tile, std::int32_t id, std::uint32_t dst) -> std::uint32_t {
    long long off = -1;  // byte offset of the entry within the request's slots
    if (id >= 0 && id < a.slots) {
      off = static_cast<long long>(id) * kEntryBytes;
    } else if (id != -1 && report_bad) {
      // Unsigned minimum: the caller's -1 (0xffffffff) is larger than every position.
      const long long flat = token * K + static_cast<long long>(tile) * kTileEntries + lane;
      p.atomic_min_u32(reinterpret_cast<unsigned*>(a.bad_index), static_cast<unsigned>(flat < INT_MAX ? flat : INT_MAX));
    }
    const std::uint32_t mask = p.ballot(off >= 0);
    ESS_UNROLL
    for (int u = 0; u < kGatherSteps; ++u) {
      const int c = tid + u * kThreads;  // chunk c % 41 of entry c / 41
      const int e = c / kEntryChunks < kTileEntries ? c / kEntryChunks : kTileEntries - 1;
      const long long e_off = p.shfl(off, e);
      if (c < kRawChunks) {
        const bool valid = e_off >= 0;
        const std::uint8_t* src = valid ? kv_req + e_off + (c - e * kEntryChunks) * 16 : a.kv;
        p.cp_async_16(dst + static_cast<std::uint32_t>(c) * 16u, src, valid);
      }
    }
    return mask;
  };

  // Raw tile -> bf16 K tile: nope = fp8 x its tile's scale (exact), rope copied.
  const auto dequant = [&](int buf) {
    const unsigned char* raw = smem + kSmemRaw + buf * kRawTileBytes;
    std::uint16_t* kt = reinterpret_cast<std::uint16_t*>(smem + kSmemK + buf * kKTileBytes);
    ESS_UNROLL
    for (int u = 0; u < kDequantSteps; ++u) {
      const int w = tid + u * kThreads;
      const int e = w >> 6;
      const int g = w & 63;
      const unsigned char* ent = raw + e * kEntryBytes;
      const U32x2 v = *reinterpret_cast<const U32x2*>(ent + g * 8);
      const float scale = *reinterpret_cast<const float*>(ent + kScaleOffset + (g >> 4) * 4);
      U32x4 o;
      o.x = p.fp8x2_to_bf16x2(v.x & 0xffffu, scale);
      o.y = p.fp8x2_to_bf16x2(v.x >> 16, scale);
      o.z = p.fp8x2_to_bf16x2(v.y & 0xffffu, scale);
      o.w = p.fp8x2_to_bf16x2(v.y >> 16, scale);
      *reinterpret_cast<U32x4*>(kt + tile_offset(e, g * 8)) = o;
    }
    const int e = tid >> 3;
    const int ch = tid & 7;
    *reinterpret_cast<U32x4*>(kt + tile_offset(e, kNopeDim + ch * 8)) =
        *reinterpret_cast<const U32x4*>(raw + e * kEntryBytes + kRopeOffset + ch * 16);
  };

  // ---- prologue: Q and tiles 0, 1 in flight, ids of tile 2 loaded ----
  {
    const std::uint16_t* q_g = a.q + (token * a.heads + static_cast<long long>(head_block) * kHeadsPerCta) * kQkDim;
    for (int c = tid; c < kHeadsPerCta * (kQkDim / 8); c += kThreads) {
      const int row = c / (kQkDim / 8);
      const int ch = c - row * (kQkDim / 8);
      p.cp_async_16(q_s + static_cast<std::uint32_t>(tile_offset(row, ch * 8)) * 2u, q_g + row * kQkDim + ch * 8, true);
    }
  }
  std::uint32_t mask_cur = gather(0, load_id(lane), raw_s(0));
  p.cp_async_commit();  // group: Q + tile 0
  std::uint32_t mask_next = 0;
  if (n_tiles > 1) mask_next = gather(1, load_id(kTileEntries + lane), raw_s(1));
  p.cp_async_commit();  // group: tile 1 (possibly empty)
  std::int32_t id_ahead = load_id(2 * kTileEntries + lane);  // tile 2's
  p.cp_async_wait_all_but_one();
  p.sync_cta();
  dequant(0);

  // ---- state ----
  float o[kOutDimsPerWarp / 8][4];
  ESS_UNROLL
  for (int j = 0; j < kOutDimsPerWarp / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max (log2 units) of rows g, g + 8
  float l0 = 0.0f, l1 = 0.0f;            // this lane's part of the running sums

  // Per-lane ldmatrix addresses (bytes).
  const std::uint32_t q_lane =
      q_s + static_cast<std::uint32_t>(tile_offset(16 * rg + ldsm_a_row(lane), kScoreDimsPerWarp * half + ldsm_a_col(lane))) * 2u;
  const std::uint32_t kb_lane =
      static_cast<std::uint32_t>(tile_offset(ldsm_b_row(lane), kScoreDimsPerWarp * half + ldsm_b_col(lane))) * 2u;
  const std::uint32_t vb_lane =
      static_cast<std::uint32_t>(tile_offset(ldsm_bt_row(lane), kOutDimsPerWarp * half + ldsm_bt_col(lane))) * 2u;

  for (int i = 0; i < n_tiles; ++i) {
    const int cur = i & 1;
    p.cp_async_wait_all();  // this thread's copies of tile i+1
    p.sync_cta();           // everyone's: raw tile i+1 landed, K tile i built, tile i-1 consumed

    const std::int32_t id_next = load_id((i + 3) * kTileEntries + lane);
    std::uint32_t mask_after = 0;
    if (i + 2 < n_tiles) mask_after = gather(i + 2, id_ahead, raw_s(cur));
    p.cp_async_commit();
    id_ahead = id_next;
    if (i + 1 < n_tiles) dequant(cur ^ 1);

    // ---- partial scores over this warp's 288 dims: 16 heads x 32 entries ----
    float s[4][4];
    ESS_UNROLL
    for (int j = 0; j < 4; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    const std::uint32_t k_lane = k_s(cur) + kb_lane;
    ESS_UNROLL
    for (int kk = 0; kk < kScoreDimsPerWarp / 16; ++kk) {
      std::uint32_t af[4];
      std::uint32_t bf[4];
      p.ldsm_x4(af, q_lane + static_cast<std::uint32_t>(kk * 32));
      p.ldsm_x4(bf, k_lane + static_cast<std::uint32_t>(kk * 32));  // entries 0-15
      p.mma(s[0], af, bf[0], bf[1]);
      p.mma(s[1], af, bf[2], bf[3]);
      p.ldsm_x4(bf, k_lane + static_cast<std::uint32_t>(16 * kRowBytes + kk * 32));  // entries 16-31
      p.mma(s[2], af, bf[0], bf[1]);
      p.mma(s[3], af, bf[2], bf[3]);
    }
    // ---- full scores: add the partner warp's half (a + b == b + a: both get the same) ----
    {
      F32x4* mine = xchg + warp * 128;
      const F32x4* theirs = xchg + (warp ^ 4) * 128;
      ESS_UNROLL
      for (int j = 0; j < 4; ++j) mine[j * 32 + lane] = F32x4{s[j][0], s[j][1], s[j][2], s[j][3]};
      p.sync_pair(rg);
      ESS_UNROLL
      for (int j = 0; j < 4; ++j) {
        const F32x4 q4 = theirs[j * 32 + lane];
        s[j][0] += q4.x;
        s[j][1] += q4.y;
        s[j][2] += q4.z;
        s[j][3] += q4.w;
      }
    }
    // ---- online softmax (rows g = lane / 4 and g + 8; a row's 32 columns on 4 lanes) ----
    float mx0 = -INFINITY, mx1 = -INFINITY;
    ESS_UNROLL
    for (int j = 0; j < 4; ++j) {
      ESS_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + frag_c_col(lane, e);
        const float v = ((mask_cur >> col) & 1u) != 0 ? s[j][e] * scale_log2 : -INFINITY;
        s[j][e] = v;
        if (e < 2) {
          mx0 = fmaxf(mx0, v);
        } else {
          mx1 = fmaxf(mx1, v);
        }
      }
    }
    mx0 = fmaxf(mx0, p.shfl_xor(mx0, 1));
    mx0 = fmaxf(mx0, p.shfl_xor(mx0, 2));
    mx1 = fmaxf(mx1, p.shfl_xor(mx1, 1));
    mx1 = fmaxf(mx1, p.shfl_xor(mx1, 2));
    const float new0 = fmaxf(m0, mx0);
    const float new1 = fmaxf(m1, mx1);
    const float base0 = new0 == -INFINITY ? 0.0f : new0;  // no valid column yet: any finite base
    const float base1 = new1 == -INFINITY ? 0.0f : new1;
    const float alpha0 = p.exp2(m0 - base0);  // m = -inf: 0 (nothing accumulated yet)
    const float alpha1 = p.exp2(m1 - base1);
    m0 = new0;
    m1 = new1;
    float rs0 = 0.0f, rs1 = 0.0f;
    ESS_UNROLL
    for (int j = 0; j < 4; ++j) {
      s[j][0] = p.exp2(s[j][0] - base0);
      s[j][1] = p.exp2(s[j][1] - base0);
      s[j][2] = p.exp2(s[j][2] - base1);
      s[j][3] = p.exp2(s[j][3] - base1);
      rs0 += s[j][0] + s[j][1];
      rs1 += s[j][2] + s[j][3];
    }
    l0 = l0 * alpha0 + rs0;
    l1 = l1 * alpha1 + rs1;
    if (p.any(alpha0 != 1.0f || alpha1 != 1.0f)) {
      ESS_UNROLL
      for (int j = 0; j < kOutDimsPerWarp / 8; ++j) {
        o[j][0] *= alpha0;
        o[j][1] *= alpha0;
        o[j][2] *= alpha1;
        o[j][3] *= alpha1;
      }
    }
    // ---- O += P V over this warp's 256 output dims (P in bf16, from the accumulators) ----
    ESS_UNROLL
    for (int kk = 0; kk < kTileEntries / 16; ++kk) {
      std::uint32_t pa[4];
      ESS_UNROLL
      for (int r = 0; r < 4; ++r) pa[r] = p.pack_bf16(s[p_tile(kk, r)][p_elem(r)], s[p_tile(kk, r)][p_elem(r) + 1]);
      const std::uint32_t v_lane = k_s(cur) + vb_lane + static_cast<std::uint32_t>(16 * kk * kRowBytes);
      ESS_UNROLL
      for (int np = 0; np < kOutDimsPerWarp / 16; ++np) {
        std::uint32_t bf[4];
        p.ldsm_x4_trans(bf, v_lane + static_cast<std::uint32_t>(np * 32));
        p.mma(o[2 * np], pa, bf[0], bf[1]);
        p.mma(o[2 * np + 1], pa, bf[2], bf[3]);
      }
    }
    mask_cur = mask_next;
    mask_next = mask_after;
  }
  p.cp_async_wait_all();  // nothing is outstanding (the last groups were empty)

  // ---- epilogue: o = O / l, lse = m ln 2 + ln l; a row with no valid id: o = 0, lse = -inf ----
  l0 += p.shfl_xor(l0, 1);
  l0 += p.shfl_xor(l0, 2);
  l1 += p.shfl_xor(l1, 1);
  l1 += p.shfl_xor(l1, 2);
  const int h0 = head_block * kHeadsPerCta + 16 * rg + frag_c_row(lane, 0);
  const int h1 = head_block * kHeadsPerCta + 16 * rg + frag_c_row(lane, 2);
  const long long row0 = token * a.heads + h0;
  const long long row1 = token * a.heads + h1;
  const int col0 = kOutDimsPerWarp * half + frag_c_col(lane, 0);
  const bool any0 = l0 > 0.0f;
  const bool any1 = l1 > 0.0f;
  ESS_UNROLL
  for (int j = 0; j < kOutDimsPerWarp / 8; ++j) {
    const float x0 = any0 ? o[j][0] / l0 : 0.0f;
    const float x1 = any0 ? o[j][1] / l0 : 0.0f;
    const float y0 = any1 ? o[j][2] / l1 : 0.0f;
    const float y1 = any1 ? o[j][3] / l1 : 0.0f;
    const long long c = col0 + 8 * j;
    if (a.out_f32 != nullptr) {
      *reinterpret_cast<F32x2*>(a.out_f32 + row0 * kNopeDim + c) = F32x2{x0, x1};
      *reinterpret_cast<F32x2*>(a.out_f32 + row1 * kNopeDim + c) = F32x2{y0, y1};
    }
    if (a.out != nullptr) {
      *reinterpret_cast<std::uint32_t*>(a.out + row0 * kNopeDim + c) = p.pack_bf16(x0, x1);
      *reinterpret_cast<std::uint32_t*>(a.out + row1 * kNopeDim + c) = p.pack_bf16(y0, y1);
    }
  }
  if (half == 0 && (lane & 3) == 0) {
    a.lse[row0] = any0 ? m0 * kLn2 + p.log(l0) : -INFINITY;
    a.lse[row1] = any1 ? m1 * kLn2 + p.log(l1) : -INFINITY;
  }
}

}  // namespace ess::cuda::mla
