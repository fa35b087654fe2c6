// The GPU swap engine's CTA programs (design: swap_engine_gpu.h), written against a policy `P`
// that supplies the GPU primitives: p.tid(), p.threads(), p.block(), p.blocks(),
// p.exclusive_sum(items[kScanItems], ranks[kScanItems], total) (a block-wide exclusive sum over
// each thread's items: cub's BlockScan; its storage is reused only after a p.cluster_sync()),
// p.atomic_cas and p.atomic_min on shared int32 (local or another block's of the cluster), and
// the cluster (cooperative_groups::this_cluster()): p.rank() and p.ranks() (block_rank,
// num_blocks; a launch without clusters: 0 and 1), p.cluster_sync() (every thread of the
// cluster, with release / acquire order; a launch without clusters: __syncthreads) and
// p.remote(ptr, rank) (map_shared_rank). swap_engine_gpu.cu instantiates them with CUDA's
// primitives; the emulated CUDA target runs the same code on the CPU (cta_emulator.h;
// cuda_swap_engine_emulated_test).
#pragma once

#include <climits>
#include <cstdint>

#include "runtime/cuda/device_inline.h"
#include "runtime/ops/gpu_swap/swap_engine_gpu.h"
#include "runtime/ops/launch_args.h"

namespace ess::cuda::swap {

// The launch shapes (swap_engine_gpu.cu; the emulated launchers use the same): the step one
// block of kStepThreads per request, or a cluster of them (swap_cluster_size), the diff one
// block of kStepThreads, the reset kResetBlocks of kResetThreads.
inline constexpr int kStepThreads = kSwapStepThreads;
inline constexpr int kResetBlocks = 64;
inline constexpr int kResetThreads = 256;

ESS_DEVICE_INLINE int hash_home(std::int32_t tok, int mask) {
  return static_cast<int>((static_cast<std::uint32_t>(tok) * 0x9E3779B1u) >> 7) & mask;
}

// n values of one type spread over the cluster's blocks in equal parts: value i lives at
// local[i % part] of block i / part (one block: local[i]).
template <typename T, class P>
struct Spread {
  T* local;
  int part;
  const P* p;
  ESS_DEVICE_INLINE T& operator[](int i) const {
    if (p->ranks() == 1) return local[i];
    return *p->remote(local + i % part, i / part);
  }
};

// Open-addressing probe for `tok`; -1 when absent.
template <class Keys>
ESS_DEVICE_INLINE int hash_find(const Keys& keys, std::int32_t tok, int mask) {
  int h = hash_home(tok, mask);
  while (true) {
    const std::int32_t k = keys[h];
    if (k == tok) return h;
    if (k == -1) return -1;
    h = (h + 1) & mask;
  }
}

// The step's shared memory (swap_step_smem_bytes), each array spread over the request's blocks:
// per hash entry a token and its state; the misses' tokens; the cluster scan's exchange (one
// int32, with more than one block); a flag per slot.
//   state[h]: >= 0            the token's slot (a hit, or its victim once filled)
//             -2 - m          miss m, waiting for its victim
//             INT_MIN + i     not ranked yet; i = its first (canonical) position
//             -1              no token
template <class P>
struct SwapShared {
  Spread<std::int32_t, P> key;       // [H] token, -1 = empty
  Spread<std::int32_t, P> state;     // [H]
  Spread<std::int32_t, P> miss_tok;  // [P]
  std::int32_t* exchange;            // this block's total of a cluster scan's tile
  Spread<std::uint8_t, P> flag;      // [S] 1 = slot holds a working-set token this step
};

template <class P>
ESS_DEVICE_INLINE SwapShared<P> swap_shared(std::uint8_t* smem, int hash_cap, int positions, int slots, const P& p) {
  const int r = p.ranks();
  const int hash_part = hash_cap / r, miss_part = (positions + r - 1) / r, flag_part = (slots + r - 1) / r;
  auto* key = reinterpret_cast<std::int32_t*>(smem);
  std::int32_t* state = key + hash_part;
  std::int32_t* miss = state + hash_part;
  std::int32_t* exchange = miss + miss_part;
  auto* flag = reinterpret_cast<std::uint8_t*>(exchange + (r > 1 ? 1 : 0));
  return SwapShared<P>{{key, hash_part, &p}, {state, hash_part, &p}, {miss, miss_part, &p}, exchange, {flag, flag_part, &p}};
}

// Items per thread of a scan tile: a block's share of a tile is p.threads() x kScanItems indices
// (8,192 at 1,024 threads), so one block covers a step's T x K <= 8,192 selections, or a pool of
// up to 8,192 slots, in one block scan: a step runs 3 dependent scans instead of one per 1,024
// indices.
inline constexpr int kScanItems = 8;

// An exclusive prefix sum over n predicates in tiles of p.ranks() shares of at most p.threads() x
// kScanItems indices (n split evenly over the blocks, in whole kScanItems; block r of the cluster
// takes the r-th share of each tile; thread t of a share holds its indices t x kScanItems .. +
// kScanItems - 1: cub's blocked arrangement), in index order: calls
// on_rank(i, rank, value) for every i whose predicate holds; returns the total. `pred(i, value)`
// is evaluated (and may read memory that on_rank of the same tile writes, in any block) before
// any on_rank call of its tile; a tile's on_rank calls finish before the next tile's preds. With
// more than one block, each block's total goes through its `exchange` and a cluster barrier.
template <class P, typename Pred, typename OnRank>
ESS_DEVICE_INLINE int scan_tiles(P& p, std::int32_t* exchange, int n, Pred pred, OnRank on_rank) {
  int running = 0;
  const int ranks = p.ranks(), me = p.rank();
  const int per_rank = ((n + ranks - 1) / ranks + kScanItems - 1) / kScanItems * kScanItems;
  const int share = per_rank < p.threads() * kScanItems ? per_rank : p.threads() * kScanItems;
  const int tile = ranks * share;
  for (int base = 0; base < n; base += tile) {
    const int own = p.tid() * kScanItems;  // this thread's first index within the block's share
    const int first = base + me * share + own;
    int flag[kScanItems], value[kScanItems], rank[kScanItems];
    ESS_UNROLL
    for (int u = 0; u < kScanItems; ++u) {
      value[u] = 0;
      flag[u] = (own + u < share && first + u < n && pred(first + u, value[u])) ? 1 : 0;
    }
    int total = 0;
    p.exclusive_sum(flag, rank, total);
    int before = 0;  // the totals of the blocks of lower rank
    if (ranks > 1) {
      if (p.tid() == 0) *exchange = total;
      p.cluster_sync();
      total = 0;
      for (int q = 0; q < ranks; ++q) {
        const int t = *p.remote(exchange, q);
        if (q < me) before += t;
        total += t;
      }
    }
    ESS_UNROLL
    for (int u = 0; u < kScanItems; ++u) {
      if (flag[u]) on_rank(first + u, running + before + rank[u], value[u]);
    }
    running += total;
    p.cluster_sync();  // the scan's storage and the exchange are reused by the next tile
  }
  return running;
}

// One request per block, or per cluster of p.ranks() consecutive blocks: request b = p.block() /
// p.ranks(). Every loop strides over the cluster's threads; a barrier is the cluster's.
template <class P>
ESS_DEVICE_INLINE void swap_step_cta(const GpuSwapStep& a, int S, int layers, int hash_cap, std::int32_t* order_all,
                                     std::int32_t* stamp_all, std::int32_t* token_all, std::int32_t* clock_all,
                                     std::uint8_t* smem, P& p) {
  const int P_ = a.query_tokens * a.topk;
  const int mask = hash_cap - 1;
  const int ranks = p.ranks();
  const int stride = ranks * p.threads();                  // the cluster's threads
  const int tid = p.rank() * p.threads() + p.tid();        // this thread among them
  const SwapShared<P> sh = swap_shared(smem, hash_cap, P_, S, p);

  const int b = static_cast<int>(p.block()) / ranks;
  const int row = a.rows[b];
  if (row < 0) {  // a padded batch position: no state, no misses, every slot id -1
    for (int i = tid; i < P_; i += stride) a.slot_ids[static_cast<std::int64_t>(b) * P_ + i] = -1;
    if (tid == 0) {
      a.counts[2 * b] = 0;
      a.counts[2 * b + 1] = 0;
    }
    return;
  }
  const std::int64_t state = static_cast<std::int64_t>(row) * layers + a.layer;
  std::int32_t* order = order_all + state * S;
  std::int32_t* stamp = stamp_all + state * S;
  std::int32_t* token_of_slot = token_all + state * S;
  const std::int32_t* ids = a.ids + static_cast<std::int64_t>(b) * P_;

  // Each block clears its own parts.
  for (int i = p.tid(); i < sh.key.part; i += p.threads()) {
    sh.key.local[i] = -1;
    sh.state.local[i] = -1;
  }
  for (int s = p.tid(); s < sh.flag.part; s += p.threads()) sh.flag.local[s] = 0;
  p.cluster_sync();

  // 1. The working set: every selected token once, with its first canonical position
  //    (the smallest INT_MIN + i).
  for (int i = tid; i < P_; i += stride) {
    const std::int32_t tok = ids[i];
    if (tok < 0) continue;
    int h = hash_home(tok, mask);
    while (true) {
      const std::int32_t prev = p.atomic_cas(&sh.key[h], -1, tok);
      if (prev == -1 || prev == tok) {
        p.atomic_min(&sh.state[h], INT_MIN + i);
        break;
      }
      h = (h + 1) & mask;
    }
  }
  p.cluster_sync();

  // 2. Hits: resident slots whose token is in the working set.
  for (int s = tid; s < S; s += stride) {
    const std::int32_t tok = token_of_slot[s];
    if (tok < 0) continue;
    const int h = hash_find(sh.key, tok, mask);
    if (h >= 0) {
      sh.flag[s] = 1;
      sh.state[h] = s;
    }
  }
  p.cluster_sync();

  // 3. Misses, ranked by first occurrence (the canonical order).
  const int n_miss = scan_tiles(
      p, sh.exchange, P_,
      [&](int i, int& h) {
        const std::int32_t tok = ids[i];
        if (tok < 0) return false;
        h = hash_find(sh.key, tok, mask);
        return sh.state[h] == INT_MIN + i;
      },
      [&](int i, int m, int h) {
        sh.miss_tok[m] = ids[i];
        sh.state[h] = -2 - m;
      });

  // 4. Victims: the first n_miss non-working-set slots of `order` (miss r takes the r-th);
  //    the rest of the non-working-set slots move to the front, keeping their order (in
  //    place: writes land at or before the index being read).
  const int non_hits = scan_tiles(
      p, sh.exchange, S,
      [&](int i, int& s) {
        s = order[i];
        return sh.flag[s] == 0;
      },
      [&](int, int r, int s) {
        if (r < n_miss) {
          sh.state[hash_find(sh.key, sh.miss_tok[r], mask)] = s;
        } else {
          order[r - n_miss] = s;
        }
      });
  const int hits = S - non_hits;
  // A working set larger than the pool (a step not split into query groups) is a caller
  // error the host cannot see: the misses past the free slots get no slot (their rows read
  // as padding, -1) rather than a slot another miss holds.
  const int n_fill = n_miss < non_hits ? n_miss : non_hits;

  // 5. Fill: miss m takes its victim.
  for (int m = tid; m < n_fill; m += stride) {
    const std::int32_t tok = sh.miss_tok[m];
    const std::int32_t v = sh.state[hash_find(sh.key, tok, mask)];
    sh.flag[v] = 1;
    token_of_slot[v] = tok;
    const std::int64_t o = static_cast<std::int64_t>(b) * P_ + m;
    a.fill_tokens[o] = tok;
    a.fill_slots[o] = v;
    if (a.page_table != nullptr && a.fill_host_offsets != nullptr) {
      const std::int32_t page = a.page_table[(static_cast<std::int64_t>(row) * a.max_pages + tok / 64) * layers + a.layer];
      a.fill_host_offsets[o] = static_cast<std::uint64_t>(page) * a.page_bytes + static_cast<std::uint64_t>(tok % 64) * a.entry_bytes;
    }
  }
  p.cluster_sync();

  // 6. Slot ids for every position (a miss without a victim reads -1).
  for (int i = tid; i < P_; i += stride) {
    const std::int32_t tok = ids[i];
    const std::int32_t slot = tok < 0 ? -1 : sh.state[hash_find(sh.key, tok, mask)];
    a.slot_ids[static_cast<std::int64_t>(b) * P_ + i] = slot < 0 ? -1 : slot;
  }

  // 7. The working set becomes the most recent, in ascending slot order. (Every block reads the
  //    clock before the scan's first barrier; it is advanced after the last, when no block
  //    reads another's shared memory any more, so each may exit.)
  const int ws = hits + n_fill;
  const std::int32_t clock = clock_all[state];
  scan_tiles(
      p, sh.exchange, S, [&](int s, int&) { return sh.flag[s] != 0; },
      [&](int s, int r, int) {
        order[S - ws + r] = s;
        stamp[s] = clock;
      });
  if (tid == 0) {
    clock_all[state] = clock + 1;
    a.counts[2 * b] = hits;
    a.counts[2 * b + 1] = n_fill;
  }
}

// A fresh LRU for every layer of `row` (a grid-stride loop over layers x slots).
template <class P>
ESS_DEVICE_INLINE void swap_reset_cta(std::int32_t* order, std::int32_t* stamp, std::int32_t* token, std::int32_t* clock,
                                    int S, int layers, int row, P& p) {
  const std::int64_t base = static_cast<std::int64_t>(row) * layers;
  const std::int64_t stride = static_cast<std::int64_t>(p.blocks()) * p.threads();
  for (std::int64_t i = static_cast<std::int64_t>(p.block()) * p.threads() + p.tid(); i < static_cast<std::int64_t>(layers) * S;
       i += stride) {
    const std::int64_t l = i / S;
    const int s = static_cast<int>(i - l * S);
    order[(base + l) * S + s] = s;
    stamp[(base + l) * S + s] = -1;
    token[(base + l) * S + s] = -1;
    if (s == 0) clock[base + l] = 0;
  }
}

// One fill per slot whose token changed, in slot order (LRU-Warmup's plan); one block.
template <class P>
ESS_DEVICE_INLINE void swap_diff_cta(const std::int32_t* before, const std::int32_t* after, int S, std::int32_t* out_tokens,
                                   std::int32_t* out_slots, std::int32_t* count, P& p) {
  const int n = scan_tiles(
      p, nullptr, S, [&](int s, int&) { return after[s] >= 0 && after[s] != before[s]; },
      [&](int s, int r, int) {
        out_tokens[r] = after[s];
        out_slots[r] = s;
      });
  if (p.tid() == 0) *count = n;
}

}  // namespace ess::cuda::swap
