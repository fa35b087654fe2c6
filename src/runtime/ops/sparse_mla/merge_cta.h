// The merge of two partial attention states (contract: ref::merge_states; launch:
// sparse_mla.cu) as a block program, written against a policy `P` that supplies the GPU
// primitives: p.tid(), p.threads(), p.block(), p.blocks(), p.sync_warp(), p.exp(x),
// p.log1p(x) (expf / log1pf on the GPU) and p.pack_bf16(lo, hi) (round to nearest even).
// sparse_mla.cu instantiates it with CUDA's; merge_emulation_test.cc runs the same code on
// the CPU (cta_emulator.h).
#pragma once

#include <cstdint>
#include <limits>

#include "ess/ops/sparse_mla.h"
#include "runtime/cuda/device_inline.h"

namespace ess::cuda::merge {

inline constexpr int kThreads = 256;  // 8 warps: one row per warp at a time

struct alignas(16) F4 {
  float x, y, z, w;
};
struct alignas(8) U2 {
  std::uint32_t x, y;
};

ESS_DEVICE_INLINE bool is_nan(float x) { return x != x; }
ESS_DEVICE_INLINE bool is_inf(float x) { return x == std::numeric_limits<float>::infinity() || x == -std::numeric_limits<float>::infinity(); }
ESS_DEVICE_INLINE float abs_of(float x) { return x < 0.0f ? -x : x; }

// Warp w of the grid merges rows w, w + warps, ...; lane j takes float4 groups j, j + 32, ...
template <class P>
ESS_DEVICE_INLINE void merge_cta(const MergeArgs& a, P& p) {
  const int lane = p.tid() & 31;
  const int warps_per_block = p.threads() / 32;
  const long long warps = static_cast<long long>(p.blocks()) * warps_per_block;
  const int n4 = a.dim / 4;
  for (long long r = static_cast<long long>(p.block()) * warps_per_block + (p.tid() >> 5); r < a.rows; r += warps) {
    const float la = a.lse_a[r];
    const float lb = a.lse_b[r];
    const bool ea = is_inf(la);
    const bool eb = is_inf(lb);
    float wa = 0.0f, wb = 0.0f, l = -std::numeric_limits<float>::infinity();
    if (is_nan(la) || is_nan(lb)) {  // invalid input (the reference rejects it): a NaN row
      wa = wb = l = std::numeric_limits<float>::quiet_NaN();
    } else if (!ea && !eb) {
      const float m = la > lb ? la : lb;
      l = m + p.log1p(p.exp(-abs_of(la - lb)));
      wa = p.exp(la - l);
      wb = p.exp(lb - l);
    } else if (!ea) {
      l = la;
      wa = 1.0f;
    } else if (!eb) {
      l = lb;
      wb = 1.0f;
    }
    const F4* oa = reinterpret_cast<const F4*>(a.o_a) + r * n4;
    const F4* ob = reinterpret_cast<const F4*>(a.o_b) + r * n4;
    for (int j = lane; j < n4; j += 32) {
      F4 v{0.0f, 0.0f, 0.0f, 0.0f};
      if (wa != 0.0f) {
        const F4 x = oa[j];
        v = F4{wa * x.x, wa * x.y, wa * x.z, wa * x.w};
      }
      if (wb != 0.0f) {
        const F4 x = ob[j];
        v = F4{v.x + wb * x.x, v.y + wb * x.y, v.z + wb * x.z, v.w + wb * x.w};
      }
      if (a.out_f32 != nullptr) reinterpret_cast<F4*>(a.out_f32)[r * n4 + j] = v;
      if (a.out != nullptr) reinterpret_cast<U2*>(a.out)[r * n4 + j] = U2{p.pack_bf16(v.x, v.y), p.pack_bf16(v.z, v.w)};
    }
    p.sync_warp();  // every lane has read lse_a[r] / lse_b[r] before it may be overwritten
    if (lane == 0 && a.lse != nullptr) a.lse[r] = l;
  }
}

}  // namespace ess::cuda::merge
