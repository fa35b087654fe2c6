// The deterministic top-k's program for one row (design: topk.cu), written against a policy `P`
// that supplies the GPU primitives:
//   p.tid(), p.block(), p.sync()                       thread, row, __syncthreads
//   p.ballot(pred), p.match_any(mask, value)           __ballot_sync(full), __match_any_sync
//   p.atomic_add_shared(int*, v), p.atomic_min_global(unsigned*, v)
//   p.exclusive_sum(value, before, total)              cub BlockScan<int> (storage reused after p.sync())
//   p.sort_descending(keys[kItems], idx[kItems])       cub BlockRadixSort<uint32, kThreads, kItems, int32>
//                                                      ::SortDescending: stable, blocked arrangement
// topk.cu instantiates it with CUDA's; topk_emulation_test.cc runs the same code on the CPU
// (cta_emulator.h).
#pragma once

#include "runtime/cuda/device_inline.h"

#include <cstdint>
#include <cstring>

namespace ess::cuda::topk_row {

inline constexpr int kThreads = 1024;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kMaxK = 2048;
inline constexpr int kItems = kMaxK / kThreads;  // sort items per thread
inline constexpr int kCacheKeys = 32768;         // keys of a row cached in shared memory (128 KiB)
inline constexpr int kChunkTiles = 32;           // tiles per ordered-collection chunk
inline constexpr int kUnroll = 4;                // independent loads in flight per thread in pass 0

static_assert(kChunkTiles * kWarps == kThreads, "one (tile, warp) count per thread");

// The program's shared state (the policy keeps its scan and sort storage itself); the key
// cache follows it.
struct Shared {
  int hist[2048];
  int counts[kChunkTiles * kWarps];  // pack(> T, == T) per (tile, warp)
  std::uint32_t cand_key[kMaxK];
  std::int32_t cand_idx[kMaxK];
  int bin;
  int want;
  int nan;
};

// Keys of a row of `stride` logits cached in shared memory (the launch's dynamic part).
inline int cache_keys(std::int64_t stride) { return static_cast<int>(stride < kCacheKeys ? stride : kCacheKeys); }

// Counts of one chunk, packed into an int for one block scan: the elements above the
// threshold number < k <= 2048 in the whole row (11 bits), those equal to it at most
// kChunkTiles * kThreads = 32,768 in a chunk (16 bits), so sums never carry across.
ESS_DEVICE_INLINE int pack(int gt, int eq) { return (gt << 16) | eq; }
static_assert(kMaxK <= (1 << 15) && kChunkTiles * kThreads < (1 << 16), "packed counts must not carry");

ESS_DEVICE_INLINE std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// Order-preserving key: a > b as floats (with -0 == +0) iff key(a) > key(b).
ESS_DEVICE_INLINE std::uint32_t order_key(float x) {
  std::uint32_t u = float_bits(x);
  if (u == 0x80000000u) u = 0u;  // -0 -> +0
  return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}

ESS_DEVICE_INLINE bool is_nan_bits(float x) { return (float_bits(x) & 0x7fffffffu) > 0x7f800000u; }

ESS_DEVICE_INLINE int popc(unsigned x) {
  int n = 0;
  for (; x != 0u; x &= x - 1u) ++n;
  return n;
}
ESS_DEVICE_INLINE int lowest_lane(unsigned x) {  // __ffs(x) - 1 for x != 0
  int i = 0;
  while ((x & 1u) == 0u) {
    x >>= 1;
    ++i;
  }
  return i;
}

// hist[bin] += 1 for every active lane, one shared atomic per distinct bin of the warp.
// Every lane of the warp must call it (active or not).
template <class P>
ESS_DEVICE_INLINE void hist_add(P& p, int* hist, bool active, std::uint32_t bin, int lane) {
  const unsigned act = p.ballot(active);
  if (active) {
    const unsigned peers = p.match_any(act, bin);
    if (lane == lowest_lane(peers)) p.atomic_add_shared(&hist[bin], popc(peers));
  }
}

// Among the counted elements, the bin holding the `want`-th largest (bins scanned from the
// top): sets sh.bin and sh.want (what is left to take inside that bin). Block-wide.
template <class P>
ESS_DEVICE_INLINE void find_bin(P& p, Shared& sh, int bins, int want) {
  const int tid = p.tid();
  const int per = bins / kThreads;  // 1 or 2 bins per thread, owned in descending order
  const int top = bins - 1 - tid * per;
  int local = 0;
  for (int i = 0; i < per; ++i) local += sh.hist[top - i];
  int above = 0;
  int total = 0;
  p.exclusive_sum(local, above, total);
  for (int i = 0; i < per; ++i) {
    const int h = sh.hist[top - i];
    if (above < want && want <= above + h) {
      sh.bin = top - i;
      sh.want = want - above;
    }
    above += h;
  }
  p.sync();
}

// One row = p.block() of logits [rows][stride] (its first lengths[row]): out[row][0..k) the
// min(k, length) largest by logit descending, ties to the lower index, then -1.
template <class P>
ESS_DEVICE_INLINE void topk_cta(const float* logits, std::int64_t stride, const std::int32_t* lengths, int k,
                              std::int32_t* out, int* nan_row, int cache_n, Shared& sh, std::uint32_t* cache, P& p) {
  const int tid = p.tid();
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const std::int64_t row = p.block();
  const float* x = logits + row * stride;
  const std::int64_t len = lengths[row];
  const int n = static_cast<int>(len < 0 ? 0 : (len > stride ? stride : len));
  const bool select = n > k;  // otherwise every element is taken

  if (tid == 0) sh.nan = 0;
  for (int i = tid; i < 2048; i += kThreads) sh.hist[i] = 0;
  p.sync();

  const auto key_at = [&](int j) { return j < cache_n ? cache[j] : order_key(x[j]); };

  // 1. Keys into the cache, NaN check, histogram of bits 31..21.
  bool saw_nan = false;
  for (int base = 0; base < n; base += kUnroll * kThreads) {
    float v[kUnroll];
    ESS_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kThreads + tid;
      v[u] = j < n ? x[j] : 0.0f;
    }
    ESS_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kThreads + tid;
      const bool active = j < n;
      const std::uint32_t key = order_key(v[u]);
      if (active) {
        saw_nan |= is_nan_bits(v[u]);
        if (j < cache_n) cache[j] = key;
      }
      if (select) hist_add(p, sh.hist, active, key >> 21, lane);
    }
  }
  if (saw_nan) sh.nan = 1;
  p.sync();
  // nan_row starts at -1: as unsigned it is above every row, so the minimum is the smallest
  // NaN row (a signed minimum would keep the -1).
  if (tid == 0 && sh.nan != 0 && nan_row != nullptr) {
    p.atomic_min_global(reinterpret_cast<unsigned*>(nan_row), static_cast<unsigned>(row));
  }

  // 2. Radix select: the exact key `thr` of the k-th largest, and how many keys equal to it
  //    are taken.
  std::uint32_t thr = 0;
  int want = k;
  if (select) {
    find_bin(p, sh, 2048, want);
    thr = static_cast<std::uint32_t>(sh.bin);
    want = sh.want;
    constexpr int kShift[2] = {10, 0};
    constexpr int kBits[2] = {11, 10};
    ESS_UNROLL
    for (int pass = 0; pass < 2; ++pass) {
      const int shift = kShift[pass];
      const int bins = 1 << kBits[pass];
      const int prefix_shift = shift + kBits[pass];
      for (int i = tid; i < bins; i += kThreads) sh.hist[i] = 0;
      p.sync();
      for (int base = 0; base < n; base += kThreads) {
        const int j = base + tid;
        const std::uint32_t key = j < n ? key_at(j) : 0u;
        const bool active = j < n && (key >> prefix_shift) == thr;
        hist_add(p, sh.hist, active, (key >> shift) & static_cast<std::uint32_t>(bins - 1), lane);
      }
      p.sync();
      find_bin(p, sh, bins, want);
      thr = (thr << kBits[pass]) | static_cast<std::uint32_t>(sh.bin);
      want = sh.want;
    }
  }

  // 3. Candidates in index order.
  const int count = select ? k : n;
  if (!select) {
    for (int j = tid; j < n; j += kThreads) {
      sh.cand_key[j] = key_at(j);
      sh.cand_idx[j] = j;
    }
  } else {
    const unsigned lt_mask = (1u << lane) - 1u;
    int gt_run = 0;  // elements > T and == T before the chunk
    int eq_run = 0;
    for (int chunk = 0; chunk < n; chunk += kChunkTiles * kThreads) {
      const int remaining_tiles = (n - chunk + kThreads - 1) / kThreads;
      const int tiles = remaining_tiles < kChunkTiles ? remaining_tiles : kChunkTiles;
      for (int tl = 0; tl < tiles; ++tl) {
        const int j = chunk + tl * kThreads + tid;
        const std::uint32_t key = j < n ? key_at(j) : 0u;
        const unsigned gt = p.ballot(j < n && key > thr);
        const unsigned eq = p.ballot(j < n && key == thr);
        if (lane == 0) sh.counts[tl * kWarps + warp] = pack(popc(gt), popc(eq));
      }
      p.sync();
      const int mine = tid < tiles * kWarps ? sh.counts[tid] : 0;
      int before = 0;
      int total = 0;
      p.exclusive_sum(mine, before, total);
      sh.counts[tid] = before;
      p.sync();
      for (int tl = 0; tl < tiles; ++tl) {
        const int j = chunk + tl * kThreads + tid;
        const std::uint32_t key = j < n ? key_at(j) : 0u;
        const bool is_gt = j < n && key > thr;
        const bool is_eq = j < n && key == thr;
        const unsigned gt = p.ballot(is_gt);
        const unsigned eq = p.ballot(is_eq);
        const int pre = sh.counts[tl * kWarps + warp];
        const int gt_before = gt_run + (pre >> 16) + popc(gt & lt_mask);
        const int eq_before = eq_run + (pre & 0xffff) + popc(eq & lt_mask);
        int pos = -1;
        if (is_gt) {
          pos = gt_before + (eq_before < want ? eq_before : want);
        } else if (is_eq && eq_before < want) {
          pos = gt_before + eq_before;
        }
        if (pos >= 0) {
          sh.cand_key[pos] = key;
          sh.cand_idx[pos] = j;
        }
      }
      gt_run += total >> 16;
      eq_run += total & 0xffff;
      p.sync();  // counts and the scan storage are reused by the next chunk
    }
  }
  p.sync();

  // 4. Sort by key descending; stable, so ties stay in index order.
  std::uint32_t keys[kItems];
  std::int32_t idx[kItems];
  ESS_UNROLL
  for (int i = 0; i < kItems; ++i) {
    const int q = tid * kItems + i;
    keys[i] = q < count ? sh.cand_key[q] : 0u;  // 0 is below every non-NaN key
    idx[i] = q < count ? sh.cand_idx[q] : -1;
  }
  p.sort_descending(keys, idx);
  std::int32_t* o = out + row * k;
  ESS_UNROLL
  for (int i = 0; i < kItems; ++i) {
    const int q = tid * kItems + i;
    if (q < k) o[q] = q < count ? idx[i] : -1;
  }
}

}  // namespace ess::cuda::topk_row
