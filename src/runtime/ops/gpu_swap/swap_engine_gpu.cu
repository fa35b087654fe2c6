#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "runtime/cuda/smem_limit.h"
#include "runtime/ops/gpu_swap/swap_engine_kernels.h"

namespace ess::cuda {
namespace {

constexpr int kThreads = 1024;
using BlockScan = cub::BlockScan<int, kThreads>;
static_assert(sizeof(BlockScan::TempStorage) <= kSwapStepStaticSmemBound, "launch_args.h bounds the static shared memory");

__device__ inline int hash_home(std::int32_t tok, int mask) {
  return static_cast<int>((static_cast<std::uint32_t>(tok) * 0x9E3779B1u) >> 7) & mask;
}

// Open-addressing probe for `tok`; -1 when absent.
__device__ inline int hash_find(const std::int32_t* keys, std::int32_t tok, int mask) {
  int h = hash_home(tok, mask);
  while (true) {
    const std::int32_t k = keys[h];
    if (k == tok) return h;
    if (k == -1) return -1;
    h = (h + 1) & mask;
  }
}

struct Shared {
  std::int32_t* key;    // [H] token, -1 = empty
  std::int32_t* first;  // [H] first (canonical) position of the token
  std::int32_t* slot;   // [H] resident slot; -2 - m while miss m waits for its victim; -1 unknown
  std::int32_t* miss_tok;  // [P]
  std::int32_t* victim;    // [P]
  std::uint8_t* flag;      // [S] 1 = slot holds a working-set token this step
};

// Runs an exclusive prefix sum over n predicates in tiles of kThreads, in index order, and
// calls on_rank(i, rank) for every i whose predicate holds. Returns the total. `pred(i)` is
// evaluated (and may read memory that on_rank of the same tile writes) before any
// on_rank call of its tile.
template <typename Pred, typename OnRank>
__device__ int scan_tiles(BlockScan::TempStorage& tmp, int n, Pred pred, OnRank on_rank) {
  int running = 0;
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    int value = 0;
    const int flag = (i < n && pred(i, value)) ? 1 : 0;
    int rank = 0;
    int total = 0;
    BlockScan(tmp).ExclusiveSum(flag, rank, total);
    if (flag) on_rank(i, running + rank, value);
    running += total;
    __syncthreads();  // tmp is reused by the next tile
  }
  return running;
}

__global__ void __launch_bounds__(kThreads, 1) swap_step_kernel(GpuSwapStep p, int S, int layers, int hash_cap,
                                                                std::int32_t* order_all, std::int32_t* stamp_all,
                                                                std::int32_t* token_all, std::int32_t* clock_all) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ BlockScan::TempStorage scan_tmp;
  const int P = p.query_tokens * p.topk;
  const int mask = hash_cap - 1;
  Shared sh;
  sh.key = reinterpret_cast<std::int32_t*>(smem);
  sh.first = sh.key + hash_cap;
  sh.slot = sh.first + hash_cap;
  sh.miss_tok = sh.slot + hash_cap;
  sh.victim = sh.miss_tok + P;
  sh.flag = reinterpret_cast<std::uint8_t*>(sh.victim + P);

  const int b = blockIdx.x;
  const int row = p.rows[b];
  const int tid = static_cast<int>(threadIdx.x);
  if (row < 0) {  // a padded batch position: no state, no misses, every slot id -1
    for (int i = tid; i < P; i += kThreads) p.slot_ids[static_cast<std::int64_t>(b) * P + i] = -1;
    if (tid == 0) {
      p.counts[2 * b] = 0;
      p.counts[2 * b + 1] = 0;
    }
    return;
  }
  const std::int64_t state = static_cast<std::int64_t>(row) * layers + p.layer;
  std::int32_t* order = order_all + state * S;
  std::int32_t* stamp = stamp_all + state * S;
  std::int32_t* token_of_slot = token_all + state * S;
  const std::int32_t* ids = p.ids + static_cast<std::int64_t>(b) * P;

  for (int i = tid; i < hash_cap; i += kThreads) {
    sh.key[i] = -1;
    sh.first[i] = INT_MAX;
    sh.slot[i] = -1;
  }
  for (int s = tid; s < S; s += kThreads) sh.flag[s] = 0;
  __syncthreads();

  // 1. The working set: every selected token once, with its first canonical position.
  for (int i = tid; i < P; i += kThreads) {
    const std::int32_t tok = ids[i];
    if (tok < 0) continue;
    int h = hash_home(tok, mask);
    while (true) {
      const std::int32_t prev = atomicCAS(&sh.key[h], -1, tok);
      if (prev == -1 || prev == tok) {
        atomicMin(&sh.first[h], i);
        break;
      }
      h = (h + 1) & mask;
    }
  }
  __syncthreads();

  // 2. Hits: resident slots whose token is in the working set.
  for (int s = tid; s < S; s += kThreads) {
    const std::int32_t tok = token_of_slot[s];
    if (tok < 0) continue;
    const int h = hash_find(sh.key, tok, mask);
    if (h >= 0) {
      sh.flag[s] = 1;
      sh.slot[h] = s;
    }
  }
  __syncthreads();

  // 3. Misses, ranked by first occurrence (the canonical order).
  const int n_miss = scan_tiles(
      scan_tmp, P,
      [&](int i, int& h) {
        const std::int32_t tok = ids[i];
        if (tok < 0) return false;
        h = hash_find(sh.key, tok, mask);
        return sh.slot[h] == -1 && sh.first[h] == i;
      },
      [&](int i, int m, int h) {
        sh.miss_tok[m] = ids[i];
        sh.slot[h] = -2 - m;
      });

  // 4. Victims: the first n_miss non-working-set slots of `order`; the rest of the non-
  //    working-set slots move to the front, keeping their order (in place: writes land at
  //    or before the index being read).
  const int non_hits = scan_tiles(
      scan_tmp, S,
      [&](int i, int& s) {
        s = order[i];
        return sh.flag[s] == 0;
      },
      [&](int, int r, int s) {
        if (r < n_miss) {
          sh.victim[r] = s;
        } else {
          order[r - n_miss] = s;
        }
      });
  const int hits = S - non_hits;
  // A working set larger than the pool (a step not split into query groups) is a caller
  // error the host cannot see: the misses past the free slots get no slot (their rows read
  // as padding, -1) rather than a slot another miss holds.
  const int n_fill = min(n_miss, non_hits);
  for (int m = tid; m < n_fill; m += kThreads) sh.flag[sh.victim[m]] = 1;
  __syncthreads();

  // 5. Fill: miss m takes victim m.
  for (int m = tid; m < n_fill; m += kThreads) {
    const std::int32_t v = sh.victim[m];
    const std::int32_t tok = sh.miss_tok[m];
    token_of_slot[v] = tok;
    sh.slot[hash_find(sh.key, tok, mask)] = v;
    const std::int64_t o = static_cast<std::int64_t>(b) * P + m;
    p.fill_tokens[o] = tok;
    p.fill_slots[o] = v;
    if (p.page_table != nullptr && p.fill_host_offsets != nullptr) {
      const std::int32_t page = p.page_table[(static_cast<std::int64_t>(row) * p.max_pages + tok / 64) * layers + p.layer];
      p.fill_host_offsets[o] = static_cast<std::uint64_t>(page) * p.page_bytes + static_cast<std::uint64_t>(tok % 64) * p.entry_bytes;
    }
  }
  __syncthreads();

  // 6. Slot ids for every position.
  for (int i = tid; i < P; i += kThreads) {
    const std::int32_t tok = ids[i];
    const std::int32_t slot = tok < 0 ? -1 : sh.slot[hash_find(sh.key, tok, mask)];
    p.slot_ids[static_cast<std::int64_t>(b) * P + i] = slot < 0 ? -1 : slot;
  }

  // 7. The working set becomes the most recent, in ascending slot order.
  const int ws = hits + n_fill;
  const std::int32_t clock = clock_all[state];
  scan_tiles(
      scan_tmp, S, [&](int s, int&) { return sh.flag[s] != 0; },
      [&](int s, int r, int) {
        order[S - ws + r] = s;
        stamp[s] = clock;
      });
  if (tid == 0) {
    clock_all[state] = clock + 1;
    p.counts[2 * b] = hits;
    p.counts[2 * b + 1] = n_fill;
  }
}

__global__ void reset_kernel(std::int32_t* order, std::int32_t* stamp, std::int32_t* token, std::int32_t* clock, int S,
                             int layers, int row) {
  const std::int64_t base = static_cast<std::int64_t>(row) * layers;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < static_cast<std::int64_t>(layers) * S; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t l = i / S;
    const int s = static_cast<int>(i - l * S);
    order[(base + l) * S + s] = s;
    stamp[(base + l) * S + s] = -1;
    token[(base + l) * S + s] = -1;
    if (s == 0) clock[base + l] = 0;
  }
}

// One fill per slot whose token changed, in slot order (LRU-Warmup's plan).
__global__ void __launch_bounds__(kThreads, 1) diff_kernel(const std::int32_t* before, const std::int32_t* after, int S,
                                                           std::int32_t* out_tokens, std::int32_t* out_slots,
                                                           std::int32_t* count) {
  __shared__ BlockScan::TempStorage tmp;
  const int n = scan_tiles(
      tmp, S,
      [&](int s, int&) { return after[s] >= 0 && after[s] != before[s]; },
      [&](int s, int r, int) {
        out_tokens[r] = after[s];
        out_slots[r] = s;
      });
  if (threadIdx.x == 0) *count = n;
}

}  // namespace

int swap_step_raise_smem_limit() {
  static DynamicSmemLimit limit;
  return limit.raise(swap_step_kernel);
}

int launch_swap_step(const GpuSwapStep& step, const SwapState& state, Stream stream) {
  const int positions = step.query_tokens * step.topk;
  swap_step_kernel<<<step.batch, kThreads, swap_step_smem_bytes(positions, state.slots), static_cast<cudaStream_t>(stream)>>>(
      step, state.slots, state.layers, swap_hash_capacity(positions), state.order, state.stamp, state.token, state.clock);
  return cudaGetLastError();
}

int launch_swap_reset(const SwapState& state, int row, Stream stream) {
  reset_kernel<<<64, 256, 0, static_cast<cudaStream_t>(stream)>>>(state.order, state.stamp, state.token, state.clock,
                                                                   state.slots, state.layers, row);
  return cudaGetLastError();
}

int launch_swap_diff(const std::int32_t* before, const std::int32_t* after, std::int32_t slots, std::int32_t* out_tokens,
                     std::int32_t* out_slots, std::int32_t* count, Stream stream) {
  diff_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(before, after, slots, out_tokens, out_slots, count);
  return cudaGetLastError();
}

}  // namespace ess::cuda
