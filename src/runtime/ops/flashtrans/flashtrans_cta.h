// FlashTrans's program for one block (design: flashtrans.cu), written against a policy `P`
// that supplies the GPU primitives: p.tid(), p.threads(), p.block(), p.blocks(), p.load(ptr) /
// p.store(ptr, value) of one 16-byte chunk and p.load8(ptr) / p.store8(ptr, value) of 8 bytes
// (streamed: __ldcs / __stcs on the GPU). flashtrans.cu instantiates it with CUDA's;
// flashtrans_emulation_test.cc runs the same code on the CPU (cta_emulator.h).
#pragma once

#include <cstdint>

#include "ess/ops/flashtrans.h"
#include "runtime/cuda/device_inline.h"

namespace ess::cuda::flashtrans {

struct alignas(16) Chunk {
  std::uint32_t x, y, z, w;
};

// One launch's copy, as the block program reads it (by value: a kernel argument). An entry is
// units_per_entry units: head_chunks 16-byte chunks at the listed offsets, then (a split
// entry) 8-byte units of its tail, at the tail's place on a split side (RowTail) and right
// after the head_bytes on a whole one.
struct CopyPlan {
  const Chunk* src_base = nullptr;
  Chunk* dst_base = nullptr;
  const std::uint64_t* src_off = nullptr;
  const std::uint64_t* dst_off = nullptr;
  std::int64_t total_units = 0;
  int units_per_entry = 0, head_chunks = 0, head_bytes = 0;
  const std::int64_t* device_count = nullptr;
  RowTail src_tail, dst_tail;
};

inline CopyPlan copy_plan(const EntryCopy& c) {
  CopyPlan k;
  k.src_base = reinterpret_cast<const Chunk*>(c.src_base);
  k.dst_base = reinterpret_cast<Chunk*>(c.dst_base);
  k.src_off = c.src_offsets;
  k.dst_off = c.dst_offsets;
  k.units_per_entry = c.units_per_entry();
  k.head_chunks = c.head_chunks();
  k.head_bytes = k.head_chunks * 16;
  k.total_units = c.count * k.units_per_entry;
  k.device_count = c.device_count;
  k.src_tail = c.src_tail;
  k.dst_tail = c.dst_tail;
  return k;
}

// Byte offset of tail unit t of the entry listed at `at` on one side.
ESS_DEVICE_INLINE std::int64_t tail_at(const RowTail& side, std::uint64_t at, int head_bytes, int t) {
  return (side.head_bytes > 0 ? side.offset_of(at) : static_cast<std::int64_t>(at) + head_bytes) + 8 * t;
}

// Thread i of the grid copies units i, i + stride, ... of the flattened (entry, unit) space;
// consecutive threads copy consecutive chunks of one entry, so each warp's reads and writes
// are contiguous runs. Loads are issued before stores to keep kChunks reads in flight per
// thread. A unit index fits 32 bits (check_args), so the entry / unit split is a 32-bit
// division.
template <class P>
ESS_DEVICE_INLINE void copy_entries_cta(const CopyPlan& k, P& p) {
  constexpr int kChunks = kFlashTransChunksPerThread;
  std::int64_t total = k.total_units;
  if (k.device_count != nullptr) {
    const std::int64_t n = *k.device_count * k.units_per_entry;
    total = n < total ? (n > 0 ? n : 0) : total;
  }
  const std::int64_t stride = static_cast<std::int64_t>(p.blocks()) * p.threads();
  const auto per_entry = static_cast<std::uint32_t>(k.units_per_entry);
  const auto head = static_cast<std::uint32_t>(k.head_chunks);
  const auto* src_bytes = reinterpret_cast<const std::uint8_t*>(k.src_base);
  auto* dst_bytes = reinterpret_cast<std::uint8_t*>(k.dst_base);
  std::int64_t i = static_cast<std::int64_t>(p.block()) * p.threads() + p.tid();
  for (; i < total; i += stride * kChunks) {
    Chunk v[kChunks];
    std::int64_t dst[kChunks];   // byte offset from dst_base (a tail's may be negative: another tensor)
    std::uint8_t kind[kChunks];  // 0: nothing to store, 1: a 16-byte chunk, 2: an 8-byte tail unit
    ESS_UNROLL
    for (int u = 0; u < kChunks; ++u) {
      const std::int64_t c = i + u * stride;
      kind[u] = 0;
      if (c < total) {
        const auto c32 = static_cast<std::uint32_t>(c);
        const std::uint32_t e = c32 / per_entry;
        const std::uint32_t j = c32 - e * per_entry;
        if (j < head) {
          v[u] = p.load(k.src_base + k.src_off[e] / 16 + j);
          dst[u] = static_cast<std::int64_t>(k.dst_off[e]) + 16 * static_cast<std::int64_t>(j);
          kind[u] = 1;
        } else {
          const int t = static_cast<int>(j - head);
          const std::uint64_t x = p.load8(reinterpret_cast<const std::uint64_t*>(src_bytes + tail_at(k.src_tail, k.src_off[e], k.head_bytes, t)));
          v[u].x = static_cast<std::uint32_t>(x);
          v[u].y = static_cast<std::uint32_t>(x >> 32);
          dst[u] = tail_at(k.dst_tail, k.dst_off[e], k.head_bytes, t);
          kind[u] = 2;
        }
      }
    }
    ESS_UNROLL
    for (int u = 0; u < kChunks; ++u) {
      if (kind[u] == 0) continue;
      if (kind[u] == 2) {
        p.store8(reinterpret_cast<std::uint64_t*>(dst_bytes + dst[u]), static_cast<std::uint64_t>(v[u].x) | (static_cast<std::uint64_t>(v[u].y) << 32));
      } else {
        p.store(reinterpret_cast<Chunk*>(dst_bytes + dst[u]), v[u]);
      }
    }
  }
}

}  // namespace ess::cuda::flashtrans
