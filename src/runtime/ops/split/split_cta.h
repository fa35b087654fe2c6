// The split's block programs (design: split.cu, contract: split.h), written against a policy
// `P` that supplies the GPU primitives: p.tid(), p.threads(), p.block(), p.sync(), and block
// exclusive sums p.exclusive_sum(value, rank, total) and, over kItems thread-contiguous items,
// p.exclusive_sum(items, ranks, total) (cub's BlockScan; its storage is reused only after a
// p.sync()). split.cu instantiates them with CUDA's; split_emulation_test.cc runs the same
// code on the CPU (cta_emulator.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/cuda/device_inline.h"
#include "runtime/ops/split/split.h"

namespace ess::cuda::split {

inline constexpr int kThreads = 512;       // split_cta's block
inline constexpr int kItems = 4;           // positions per thread per tile of the compaction scan
inline constexpr int kScanThreads = 1024;  // miss_offsets_cta's block

// Exclusive scan of the miss counts in tiles of the block: miss_offsets[b] = the misses of
// the requests before b, *total = all of them. O(batch) for any batch; one block.
template <class P>
ESS_DEVICE_INLINE void miss_offsets_cta(const std::int32_t* counts, int batch, std::int64_t* miss_offsets,
                                       std::int64_t* total, P& p) {
  std::int64_t running = 0;
  for (int base = 0; base < batch; base += p.threads()) {
    const int b = base + p.tid();
    const std::int64_t m = b < batch ? counts[2 * b + 1] : 0;
    std::int64_t before = 0, tile = 0;
    p.exclusive_sum(m, before, tile);
    if (b < batch) miss_offsets[b] = running + before;
    running += tile;
    p.sync();  // the scan's storage is reused by the next tile
  }
  if (p.tid() == 0) *total = running;
}

// One block per position b = p.block(): its FlashTrans list entries and, for DA / DBA, each
// query row's resident and fetched rows.
template <class P>
ESS_DEVICE_INLINE void split_cta(const ess::SplitArgs& a, P& p) {
  const int b = static_cast<int>(p.block());
  const int tid = p.tid();
  const int threads = p.threads();
  const std::size_t Pn = static_cast<std::size_t>(a.positions);
  const std::int32_t pool_row = a.rows[b];
  const int K = a.positions / a.query_tokens;
  if (pool_row < 0 || !a.pool.placed(pool_row)) {  // a padded position (or one without rows): nothing to list, empty halves
    if (a.resident == nullptr) return;
    for (std::size_t i = static_cast<std::size_t>(tid); i < Pn; i += static_cast<std::size_t>(threads)) {
      a.resident[static_cast<std::size_t>(b) * Pn + i] = -1;
      a.fetched[static_cast<std::size_t>(b) * Pn + i] = -1;
    }
    for (int t = tid; t < a.query_tokens; t += threads) {
      a.resident_count[b * a.query_tokens + t] = 0;
      a.fetched_count[b * a.query_tokens + t] = 0;
    }
    return;
  }
  const int misses = a.counts[2 * b + 1];
  const std::int64_t base = a.miss_offsets[b];
  const std::int32_t* fs = a.fill_slots + static_cast<std::size_t>(b) * Pn;
  const std::uint64_t* fh = a.fill_host_offsets + static_cast<std::size_t>(b) * Pn;
  for (int m = tid; m < misses; m += threads) {
    a.src_offsets[base + m] = fh[m];
    a.dst_offsets[base + m] = a.buffer.offset(a.pool.at(pool_row, fs[m]));
  }
  if (a.resident == nullptr) return;
  // The slots filled this step; every other selected slot was resident before it.
  std::uint8_t* flag = a.flags + static_cast<std::size_t>(b) * static_cast<std::size_t>(a.pool.rows_per_request);
  for (int s = tid; s < a.pool.rows_per_request; s += threads) flag[s] = 0;
  p.sync();
  for (int m = tid; m < misses; m += threads) flag[fs[m]] = 1;
  p.sync();
  // Per query row: stable compaction of the resident and the fetched rows.
  for (int t = 0; t < a.query_tokens; ++t) {
    const std::size_t row = static_cast<std::size_t>(b) * Pn + static_cast<std::size_t>(t) * static_cast<std::size_t>(K);
    const std::int32_t* ids = a.slot_ids + row;
    std::int32_t* hit = a.resident + row;
    std::int32_t* miss = a.fetched + row;
    int n_hit = 0, n_miss = 0;  // running totals (identical in every thread)
    for (int tile0 = 0; tile0 < K; tile0 += threads * kItems) {
      int is_hit[kItems], is_miss[kItems];
      std::int32_t sl[kItems];
      for (int u = 0; u < kItems; ++u) {
        const int i = tile0 + tid * kItems + u;  // blocked: thread-contiguous
        sl[u] = i < K ? ids[i] : -1;
        const bool fetched = sl[u] >= 0 && flag[sl[u]] != 0;
        is_hit[u] = sl[u] >= 0 && !fetched ? 1 : 0;
        is_miss[u] = fetched ? 1 : 0;
      }
      int rank_hit[kItems], rank_miss[kItems], tile_hit = 0, tile_miss = 0;
      p.exclusive_sum(is_hit, rank_hit, tile_hit);
      p.sync();
      p.exclusive_sum(is_miss, rank_miss, tile_miss);
      p.sync();
      for (int u = 0; u < kItems; ++u) {
        if (is_hit[u]) hit[n_hit + rank_hit[u]] = a.pool.at(pool_row, sl[u]);
        if (is_miss[u]) miss[n_miss + rank_miss[u]] = a.pool.at(pool_row, sl[u]);
      }
      n_hit += tile_hit;
      n_miss += tile_miss;
    }
    for (int i = n_hit + tid; i < K; i += threads) hit[i] = -1;
    for (int i = n_miss + tid; i < K; i += threads) miss[i] = -1;
    if (tid == 0) {
      a.resident_count[b * a.query_tokens + t] = n_hit;
      a.fetched_count[b * a.query_tokens + t] = n_miss;
    }
  }
}

}  // namespace ess::cuda::split
