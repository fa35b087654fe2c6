// The CUDA backend's own kernels of the per-layer step (contract: offload_launch.h) as block
// programs, written against a policy `P` that supplies the GPU primitives: p.tid(),
// p.threads(), p.block(), p.sync(), and a block exclusive sum p.exclusive_sum(value, rank,
// total) (cub's BlockScan; its storage is reused only after a p.sync()). offload.cu
// instantiates them with CUDA's; offload_cta_emulation_test.cc runs the same code on
// the CPU (cta_emulator.h).
#pragma once

#include <cstdint>

#include "runtime/cuda/device_inline.h"
#include "runtime/offload/offload_launch.h"
#include "runtime/offload/reserved_rows.h"

namespace ess::cuda::offload {

inline constexpr int kThreads = 256;       // mask and finalize: one block per position
inline constexpr int kListThreads = 1024;  // the write-back list: one block

// Whether id is one of position b's T newest tokens (reserve_newest), and which.
ESS_DEVICE_INLINE int newest_index(const StepShape& s, std::int32_t id, std::int32_t len) {
  return s.reserve_newest && id >= 0 && id >= len - s.query_tokens && id < len ? id - (len - s.query_tokens) : -1;
}

ESS_DEVICE_INLINE bool valid_id(std::int32_t id, std::int32_t len) { return id >= -1 && id < len; }

// Whether position i of a [T][K] row block belongs to the query group.
ESS_DEVICE_INLINE bool in_group(const StepShape& s, std::int64_t i) {
  const auto t = static_cast<int>(i / s.topk);
  return t >= s.query_begin && t < s.query_end;
}

template <class P>
ESS_DEVICE_INLINE void mask_cta(const StepShape& s, std::int32_t* lru_ids, P& p) {
  const int b = static_cast<int>(p.block());
  const std::int64_t Pn = static_cast<std::int64_t>(s.query_tokens) * s.topk;
  const std::int32_t row = s.rows[b];
  const std::int32_t len = s.lengths[b];
  for (std::int64_t i = p.tid(); i < Pn; i += p.threads()) {
    const std::int32_t id = s.topk_ids[b * Pn + i];
    const bool keep = row >= 0 && in_group(s, i) && valid_id(id, len) && newest_index(s, id, len) < 0;
    lru_ids[b * Pn + i] = keep ? id : -1;
  }
}

template <class P>
ESS_DEVICE_INLINE void finalize_cta(const StepShape& s, const std::int32_t* lru_slots, std::int32_t* slot_ids,
                                     std::int32_t* physical, P& p) {
  const int b = static_cast<int>(p.block());
  const std::int64_t Pn = static_cast<std::int64_t>(s.query_tokens) * s.topk;
  const std::int32_t row = s.rows[b];
  const std::int32_t len = s.lengths[b];
  for (std::int64_t i = p.tid(); i < Pn; i += p.threads()) {
    const std::int32_t id = s.topk_ids[b * Pn + i];
    std::int32_t slot = -1;
    if (row >= 0 && id >= 0 && in_group(s, i) && valid_id(id, len)) {
      const int newest = newest_index(s, id, len);
      slot = newest >= 0 ? s.slots + newest : lru_slots[b * Pn + i];
    }
    slot_ids[b * Pn + i] = slot;
    physical[b * Pn + i] = slot >= 0 ? row * s.rows_per_request + slot : -1;
  }
}

// One block: each real position's T newest tokens, in position order, listed from their rows
// to their host pool entries.
template <class P>
ESS_DEVICE_INLINE void write_back_list_cta(const WriteBackList& w, P& p) {
  std::int64_t running = 0;
  const int T = w.query_tokens;
  for (int base = 0; base < w.batch; base += p.threads()) {
    const int b = base + p.tid();
    const std::int32_t row = b < w.batch ? w.rows[b] : -1;
    const int first = row >= 0 ? first_newest(w.lengths[b], T) : T;
    const std::int64_t n = T - first;
    std::int64_t before = 0, tile = 0;
    p.exclusive_sum(n, before, tile);
    for (int t = first; t < T; ++t) {
      const std::int64_t token = static_cast<std::int64_t>(w.lengths[b]) - T + t;
      const std::int32_t src = w.source_rows != nullptr ? w.source_rows[b * T + t] : row * w.rows_per_request + w.slots + t;
      const std::int32_t page = w.page_table[(static_cast<std::int64_t>(row) * w.max_pages + token / 64) * w.layers + w.layer];
      const std::int64_t at = running + before + (t - first);
      w.src_offsets[at] = w.buffer.offset(src);
      w.dst_offsets[at] = static_cast<std::uint64_t>(page) * w.page_bytes + static_cast<std::uint64_t>(token % 64) * w.entry_bytes;
    }
    running += tile;
    p.sync();  // the scan's storage is reused by the next tile
  }
  if (p.tid() == 0) *w.total = running;
}

}  // namespace ess::cuda::offload
