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

// The host pool byte offset of (pool row `row`, token) in `layer`, through the device's page
// tables: page_table[(row x max_pages + token / 64) x layers + layer] is the token's arena page.
ESS_DEVICE_INLINE std::uint64_t host_offset(const std::int32_t* page_table, std::int64_t row, int max_pages, int layers,
                                            int layer, std::int64_t token, std::uint64_t page_bytes,
                                            std::uint64_t entry_bytes) {
  const std::int32_t page = page_table[(row * max_pages + token / 64) * layers + layer];
  return static_cast<std::uint64_t>(page) * page_bytes + static_cast<std::uint64_t>(token % 64) * entry_bytes;
}

// The own rows of the whole request at pool row `row`, or nullptr when it is sparse (or padding).
ESS_DEVICE_INLINE const std::int32_t* whole_units(const StepShape& s, std::int32_t row) {
  if (s.whole_units == nullptr || row < 0) return nullptr;
  const std::int32_t* units = s.whole_units + static_cast<std::int64_t>(row) * s.max_units;
  return units[0] >= 0 ? units : nullptr;
}

template <class P>
ESS_DEVICE_INLINE void mask_cta(const StepShape& s, std::int32_t* lru_ids, P& p) {
  const int b = static_cast<int>(p.block());
  const std::int64_t Pn = static_cast<std::int64_t>(s.query_tokens) * s.topk;
  const std::int32_t row = s.rows[b];
  const std::int32_t len = s.lengths[b];
  const bool whole = whole_units(s, row) != nullptr;  // its ids go to no LRU
  const bool real = row >= 0 && s.pool.placed(row);
  for (std::int64_t i = p.tid(); i < Pn; i += p.threads()) {
    const std::int32_t id = s.topk_ids[b * Pn + i];
    const bool keep = real && in_group(s, i) && valid_id(id, len) && newest_index(s, id, len) < 0;
    lru_ids[b * Pn + i] = keep && !whole ? id : -1;
  }
}

template <class P>
ESS_DEVICE_INLINE void finalize_cta(const StepShape& s, const std::int32_t* lru_slots, std::int32_t* slot_ids,
                                     std::int32_t* physical, P& p) {
  const int b = static_cast<int>(p.block());
  const std::int64_t Pn = static_cast<std::int64_t>(s.query_tokens) * s.topk;
  const std::int32_t row = s.rows[b];
  const std::int32_t len = s.lengths[b];
  const std::int32_t* units = whole_units(s, row);
  for (std::int64_t i = p.tid(); i < Pn; i += p.threads()) {
    const std::int32_t id = s.topk_ids[b * Pn + i];
    std::int32_t slot = -1, phys = -1;
    if (row >= 0 && s.pool.placed(row) && id >= 0 && in_group(s, i) && valid_id(id, len)) {
      const int newest = newest_index(s, id, len);
      if (newest >= 0) {
        slot = s.slots + newest;
        phys = s.pool.at(row, slot);
      } else if (units != nullptr) {  // a whole request's own row; no slot (the split lists nothing for it)
        phys = s.pool.at(units[id / s.slots], id % s.slots);
      } else if (!s.whole_only) {
        slot = lru_slots[b * Pn + i];
        phys = slot >= 0 ? s.pool.at(row, slot) : -1;
      }
    }
    slot_ids[b * Pn + i] = slot;
    physical[b * Pn + i] = phys;
  }
  if (units == nullptr || s.windows <= 0) return;
  // A whole position records its query rows of the group, as the LRU would see them.
  const std::int64_t ring = static_cast<std::int64_t>(row) * s.layers + s.layer;
  std::int32_t* head = s.recorded_head + ring * 2;
  const int next = head[0], count = head[1];
  int g = 0;
  for (int t = s.query_begin; t < s.query_end; ++t, ++g) {
    std::int32_t* window = s.recorded + (ring * s.windows + (next + g) % s.windows) * s.topk;
    for (int k = p.tid(); k < s.topk; k += p.threads()) {
      const std::int32_t id = s.topk_ids[b * Pn + static_cast<std::int64_t>(t) * s.topk + k];
      window[k] = id >= 0 && valid_id(id, len) && newest_index(s, id, len) < 0 ? id : -1;
    }
  }
  p.sync();  // every thread has read the head
  if (p.tid() == 0) {
    head[0] = (next + g) % s.windows;
    head[1] = count + g < s.windows ? count + g : s.windows;
  }
}

// One block per position: the DA halves of a whole or padded position (offload_launch.h).
template <class P>
ESS_DEVICE_INLINE void whole_halves_cta(const StepShape& s, const WholeHalves& h, P& p) {
  const int b = static_cast<int>(p.block());
  const std::int32_t row = s.rows[b];
  const bool whole = whole_units(s, row) != nullptr;
  if (row >= 0 && !whole && !s.whole_only) return;  // the split's (without a split: none, as padding)
  const int K = s.topk;
  for (int t = 0; t < s.query_tokens; ++t) {
    const std::int64_t at = (static_cast<std::int64_t>(b) * s.query_tokens + t) * K;
    std::int64_t running = 0;
    for (int tile0 = 0; tile0 < K && whole; tile0 += p.threads()) {
      const int i = tile0 + p.tid();
      const std::int32_t phys = i < K ? h.physical[at + i] : -1;
      std::int64_t rank = 0, tile = 0;
      p.exclusive_sum(static_cast<std::int64_t>(phys >= 0 ? 1 : 0), rank, tile);
      if (phys >= 0) h.resident[at + running + rank] = phys;
      running += tile;
      p.sync();  // the scan's storage is reused by the next tile
    }
    for (std::int64_t i = running + p.tid(); i < K; i += p.threads()) h.resident[at + i] = -1;
    for (int i = p.tid(); i < K; i += p.threads()) h.fetched[at + i] = -1;
    if (p.tid() == 0) {
      h.resident_count[static_cast<std::int64_t>(b) * s.query_tokens + t] = static_cast<std::int32_t>(running);
      h.fetched_count[static_cast<std::int64_t>(b) * s.query_tokens + t] = 0;
    }
  }
}

// One block: each real position's T newest tokens, in position order, listed from their rows
// to their host pool entries.
template <class P>
ESS_DEVICE_INLINE void write_back_list_cta(const WriteBackList& w, P& p) {
  std::int64_t running = 0, whole_running = 0;
  const int T = w.query_tokens;
  for (int base = 0; base < w.batch; base += p.threads()) {
    const int b = base + p.tid();
    const std::int32_t row = b < w.batch ? w.rows[b] : -1;
    const int first = row >= 0 && (w.source_rows != nullptr || w.pool.placed(row)) ? first_newest(w.lengths[b], T) : T;
    const std::int64_t n = T - first;
    std::int64_t before = 0, tile = 0;
    p.exclusive_sum(n, before, tile);
    p.sync();
    const std::int32_t* units = nullptr;
    if (w.whole_units != nullptr && row >= 0) {
      units = w.whole_units + static_cast<std::int64_t>(row) * w.max_units;
      units = units[0] >= 0 ? units : nullptr;
    }
    std::int64_t whole_before = 0, whole_tile = 0;
    p.exclusive_sum(units != nullptr ? n : std::int64_t{0}, whole_before, whole_tile);
    for (int t = first; t < T; ++t) {
      const std::int64_t token = static_cast<std::int64_t>(w.lengths[b]) - T + t;
      const std::int32_t src = w.source_rows != nullptr ? w.source_rows[b * T + t] : w.pool.at(row, w.slots + t);
      const std::int64_t at = running + before + (t - first);
      w.src_offsets[at] = w.buffer.offset(src);
      w.dst_offsets[at] = host_offset(w.page_table, row, w.max_pages, w.layers, w.layer, token, w.page_bytes, w.entry_bytes);
      if (units != nullptr) {  // and into its own row, read there once it is not among the newest
        const std::int64_t own = w.pool.at(units[token / w.slots], static_cast<std::int32_t>(token % w.slots));
        w.whole_src[whole_running + whole_before + (t - first)] = w.buffer.offset(src);
        w.whole_dst[whole_running + whole_before + (t - first)] = w.buffer.offset(own);
      }
    }
    running += tile;
    whole_running += whole_tile;
    p.sync();  // the scan's storage is reused by the next tile
  }
  if (p.tid() == 0) {
    *w.total = running;
    if (w.whole_total != nullptr) *w.whole_total = whole_running;
  }
}

// One block: a lifecycle load's list (offload_launch.h, HostFillList). With regions the row has one:
// the front loads only into placed rows (warmup refuses an unplaced one; place loads after placing).
template <class P>
ESS_DEVICE_INLINE void host_fill_list_cta(const HostFillList& f, P& p) {
  const bool range = f.units != nullptr || f.reserved;
  const std::int64_t n = range ? f.length - f.first : *f.count;
  for (std::int64_t i = p.tid(); i < n; i += p.threads()) {
    const auto token = range ? static_cast<std::int32_t>(f.first + i) : f.tokens[i];
    std::int32_t dest = 0;
    if (f.reserved) {
      dest = f.pool.at(f.row, f.slots + static_cast<std::int32_t>(token - (f.length - f.query_tokens)));
    } else if (f.units != nullptr) {
      dest = f.pool.at(f.units[token / f.slots], token % f.slots);
    } else {
      dest = f.pool.at(f.row, f.token_slots[i]);
    }
    f.src_offsets[i] = host_offset(f.page_table, f.row, f.max_pages, f.layers, f.layer, token, f.page_bytes, f.entry_bytes);
    f.dst_offsets[i] = f.buffer.offset(dest);
  }
  if (p.tid() == 0) {
    *f.total = n;
    if (f.tally != nullptr) *f.tally += n;
  }
}

}  // namespace ess::cuda::offload
