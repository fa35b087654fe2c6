// Deterministic top-k on the GPU, exactly ess::ref::topk (see indexer.h): per row the
// min(k, length) largest logits, by logit descending, ties (including -0 / +0) to the lower
// index, the rest of the row's k outputs -1.
//
// Design: one CTA of 1,024 threads per row, everything in one kernel (no host
// synchronization, no allocation: graph-capturable).
//   1. Keys. Each logit becomes an order-preserving uint32 (sign-flipped float bits; -0 is
//      first made +0, so the two tie). The first 32,768 keys of the row are cached in shared
//      memory; longer rows re-read (and re-convert) their tail from global memory / L2.
//      A NaN anywhere in j < length sets the row's flag (atomicMin into nan_row).
//   2. Radix select (rows longer than k): three histogram passes over 11 / 11 / 10 bits,
//      from the top, find the exact key T of the k-th largest element and `want`, how many
//      elements equal to T belong to the top k (the elements above T all do). Histograms
//      live in shared memory; a warp first groups equal bins with __match_any_sync, so one
//      atomic per distinct bin per warp (logits of similar magnitude share their top bits).
//   3. Ordered collection: in index order, take every key > T and the first `want` keys
//      == T. Per chunk of 32 tiles x 1,024 elements: ballots count (> T, == T) per
//      (tile, warp); one block scan over the 1,024 (tile, warp) counts (the pair packed
//      into one int) gives each element its rank; the selected element lands at its rank in
//      the candidate list, which is thus in index order (exactly k entries; all of a short
//      row's elements when length <= k).
//   4. Sort the <= 2,048 candidates by key descending with cub::BlockRadixSort (stable, so
//      equal keys keep index order: ties go to the lower index), write the indices, pad -1.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "ess/ops/indexer.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/cuda/smem_limit.h"
#include "runtime/ops/launch_args.h"

namespace ess::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxK = 2048;
constexpr int kItems = kMaxK / kThreads;  // sort items per thread
constexpr int kCacheKeys = 32768;         // keys of a row cached in shared memory (128 KiB)
constexpr int kChunkTiles = 32;           // tiles per ordered-collection chunk
constexpr int kUnroll = 4;                // independent loads in flight per thread in pass 0

static_assert(kChunkTiles * kWarps == kThreads, "one (tile, warp) count per thread");

using SortT = cub::BlockRadixSort<std::uint32_t, kThreads, kItems, std::int32_t>;
using ScanInt = cub::BlockScan<int, kThreads>;

// The fixed part of the shared memory; the key cache follows it.
struct Shared {
  union {
    SortT::TempStorage sort;
    ScanInt::TempStorage scan;
  } tmp;
  int hist[2048];
  int counts[kChunkTiles * kWarps];  // pack(> T, == T) per (tile, warp)
  std::uint32_t cand_key[kMaxK];
  std::int32_t cand_idx[kMaxK];
  int bin;
  int want;
  int nan;
};

constexpr std::size_t kFixedBytes = (sizeof(Shared) + 15) / 16 * 16;

// Counts of one chunk, packed into an int for one block scan: the elements above the
// threshold number < k <= 2048 in the whole row (11 bits), those equal to it at most
// kChunkTiles * kThreads = 32,768 in a chunk (16 bits), so sums never carry across.
__device__ __forceinline__ int pack(int gt, int eq) { return (gt << 16) | eq; }
static_assert(kMaxK <= (1 << 15) && kChunkTiles * kThreads < (1 << 16), "packed counts must not carry");

// Order-preserving key: a > b as floats (with -0 == +0) iff key(a) > key(b).
__device__ __forceinline__ std::uint32_t order_key(float x) {
  std::uint32_t u = __float_as_uint(x);
  if (u == 0x80000000u) u = 0u;  // -0 -> +0
  return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ bool is_nan_bits(float x) { return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u; }

// hist[bin] += 1 for every active lane, one shared atomic per distinct bin of the warp.
// Every lane of the warp must call it (active or not).
__device__ __forceinline__ void hist_add(int* hist, bool active, std::uint32_t bin, int lane) {
  const unsigned act = __ballot_sync(0xffffffffu, active);
  if (active) {
    const unsigned peers = __match_any_sync(act, bin);
    if (lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
  }
}

// Among the counted elements, the bin holding the `want`-th largest (bins scanned from the
// top): sets sh.bin and sh.want (what is left to take inside that bin). Block-wide.
__device__ void find_bin(Shared& sh, int bins, int want) {
  const int tid = static_cast<int>(threadIdx.x);
  const int per = bins / kThreads;  // 1 or 2 bins per thread, owned in descending order
  const int top = bins - 1 - tid * per;
  int local = 0;
  for (int i = 0; i < per; ++i) local += sh.hist[top - i];
  int above = 0;
  ScanInt(sh.tmp.scan).ExclusiveSum(local, above);
  for (int i = 0; i < per; ++i) {
    const int h = sh.hist[top - i];
    if (above < want && want <= above + h) {
      sh.bin = top - i;
      sh.want = want - above;
    }
    above += h;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1)
    topk_kernel(const float* __restrict__ logits, std::int64_t stride, const std::int32_t* __restrict__ lengths, int k,
                std::int32_t* __restrict__ out, int* nan_row, int cache_n) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  std::uint32_t* cache = reinterpret_cast<std::uint32_t*>(smem + kFixedBytes);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const std::int64_t row = blockIdx.x;
  const float* x = logits + row * stride;
  const std::int64_t len = lengths[row];
  const int n = static_cast<int>(len < 0 ? 0 : (len > stride ? stride : len));
  const bool select = n > k;  // otherwise every element is taken

  if (tid == 0) sh.nan = 0;
  for (int i = tid; i < 2048; i += kThreads) sh.hist[i] = 0;
  __syncthreads();

  const auto key_at = [&](int j) { return j < cache_n ? cache[j] : order_key(x[j]); };

  // 1. Keys into the cache, NaN check, histogram of bits 31..21.
  bool saw_nan = false;
  for (int base = 0; base < n; base += kUnroll * kThreads) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kThreads + tid;
      v[u] = j < n ? x[j] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kThreads + tid;
      const bool active = j < n;
      const std::uint32_t key = order_key(v[u]);
      if (active) {
        saw_nan |= is_nan_bits(v[u]);
        if (j < cache_n) cache[j] = key;
      }
      if (select) hist_add(sh.hist, active, key >> 21, lane);
    }
  }
  if (saw_nan) sh.nan = 1;
  __syncthreads();
  if (tid == 0 && sh.nan != 0 && nan_row != nullptr) atomicMin(nan_row, static_cast<int>(row));

  // 2. Radix select: the exact key `thr` of the k-th largest, and how many keys equal to it
  //    are taken.
  std::uint32_t thr = 0;
  int want = k;
  if (select) {
    find_bin(sh, 2048, want);
    thr = static_cast<std::uint32_t>(sh.bin);
    want = sh.want;
    constexpr int kShift[2] = {10, 0};
    constexpr int kBits[2] = {11, 10};
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      const int shift = kShift[pass];
      const int bins = 1 << kBits[pass];
      const int prefix_shift = shift + kBits[pass];
      for (int i = tid; i < bins; i += kThreads) sh.hist[i] = 0;
      __syncthreads();
      for (int base = 0; base < n; base += kThreads) {
        const int j = base + tid;
        const std::uint32_t key = j < n ? key_at(j) : 0u;
        const bool active = j < n && (key >> prefix_shift) == thr;
        hist_add(sh.hist, active, (key >> shift) & static_cast<std::uint32_t>(bins - 1), lane);
      }
      __syncthreads();
      find_bin(sh, bins, want);
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
        const unsigned gt = __ballot_sync(0xffffffffu, j < n && key > thr);
        const unsigned eq = __ballot_sync(0xffffffffu, j < n && key == thr);
        if (lane == 0) sh.counts[tl * kWarps + warp] = pack(__popc(gt), __popc(eq));
      }
      __syncthreads();
      const int mine = tid < tiles * kWarps ? sh.counts[tid] : 0;
      int before = 0;
      int total = 0;
      ScanInt(sh.tmp.scan).ExclusiveSum(mine, before, total);
      sh.counts[tid] = before;
      __syncthreads();
      for (int tl = 0; tl < tiles; ++tl) {
        const int j = chunk + tl * kThreads + tid;
        const std::uint32_t key = j < n ? key_at(j) : 0u;
        const bool is_gt = j < n && key > thr;
        const bool is_eq = j < n && key == thr;
        const unsigned gt = __ballot_sync(0xffffffffu, is_gt);
        const unsigned eq = __ballot_sync(0xffffffffu, is_eq);
        const int pre = sh.counts[tl * kWarps + warp];
        const int gt_before = gt_run + (pre >> 16) + __popc(gt & lt_mask);
        const int eq_before = eq_run + (pre & 0xffff) + __popc(eq & lt_mask);
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
      __syncthreads();  // counts and the scan storage are reused by the next chunk
    }
  }
  __syncthreads();

  // 4. Sort by key descending; stable, so ties stay in index order.
  std::uint32_t keys[kItems];
  std::int32_t idx[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int p = tid * kItems + i;
    keys[i] = p < count ? sh.cand_key[p] : 0u;  // 0 is below every non-NaN key
    idx[i] = p < count ? sh.cand_idx[p] : -1;
  }
  SortT(sh.tmp.sort).SortDescending(keys, idx);
  std::int32_t* o = out + row * k;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int p = tid * kItems + i;
    if (p < k) o[p] = p < count ? idx[i] : -1;
  }
}

// The most shared memory a launch asks for fits every device ESS targets.
static_assert(kFixedBytes + static_cast<std::size_t>(kCacheKeys) * 4 <= kHopperSmemOptin, "top-k shared memory");

}  // namespace

int topk_cuda(const TopkArgs& a, Stream stream) {
  if (!check_args(a).empty()) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  const int cache_n = static_cast<int>(a.stride < kCacheKeys ? a.stride : kCacheKeys);
  const std::size_t smem = kFixedBytes + static_cast<std::size_t>(cache_n) * 4;
  static DynamicSmemLimit limit;
  const cudaError_t e = limit.raise(topk_kernel);
  if (e != cudaSuccess) return e;
  topk_kernel<<<static_cast<unsigned>(a.rows), kThreads, smem, static_cast<cudaStream_t>(stream)>>>(
      a.logits, a.stride, a.lengths, a.k, a.out, a.nan_row, cache_n);
  return cudaGetLastError();
}

}  // namespace ess::cuda
