// FlashTrans's program for one block (design: flashtrans.cu), written against a policy `P`
// that supplies the GPU primitives: p.tid(), p.threads(), p.block(), p.blocks(), and
// p.load(ptr) / p.store(ptr, value) of one 16-byte chunk (streamed: __ldcs / __stcs on the
// GPU). flashtrans.cu instantiates it with CUDA's; flashtrans_emulation_test.cc runs the
// same code on the CPU (cta_emulator.h).
#pragma once

#include <cstdint>

#include "ess/ops/flashtrans.h"
#include "runtime/cuda/device_inline.h"

namespace ess::cuda::flashtrans {

struct alignas(16) Chunk {
  std::uint32_t x, y, z, w;
};

// Thread i of the grid copies chunks i, i + stride, ... of the flattened (entry, chunk) space;
// consecutive threads copy consecutive 16-byte chunks of one entry, so each warp's reads and
// writes are contiguous runs. Loads are issued before stores to keep kChunks reads in flight
// per thread. A chunk index fits 32 bits (check_args), so the entry / chunk split is a 32-bit
// division.
template <class P>
ESS_DEVICE_INLINE void copy_entries_cta(const Chunk* src_base, Chunk* dst_base, const std::uint64_t* src_off,
                                    const std::uint64_t* dst_off, std::int64_t total_chunks, int chunks_per_entry,
                                    const std::int64_t* device_count, P& p) {
  constexpr int kChunks = kFlashTransChunksPerThread;
  if (device_count != nullptr) {
    const std::int64_t n = *device_count * chunks_per_entry;
    total_chunks = n < total_chunks ? (n > 0 ? n : 0) : total_chunks;
  }
  const std::int64_t stride = static_cast<std::int64_t>(p.blocks()) * p.threads();
  const auto per_entry = static_cast<std::uint32_t>(chunks_per_entry);
  std::int64_t i = static_cast<std::int64_t>(p.block()) * p.threads() + p.tid();
  for (; i < total_chunks; i += stride * kChunks) {
    Chunk v[kChunks];
    std::int64_t dst[kChunks];
    ESS_UNROLL
    for (int u = 0; u < kChunks; ++u) {
      const std::int64_t c = i + u * stride;
      dst[u] = -1;
      if (c < total_chunks) {
        const auto c32 = static_cast<std::uint32_t>(c);
        const std::uint32_t e = c32 / per_entry;
        const std::uint32_t k = c32 - e * per_entry;
        v[u] = p.load(src_base + src_off[e] / 16 + k);
        dst[u] = static_cast<std::int64_t>(dst_off[e] / 16) + k;
      }
    }
    ESS_UNROLL
    for (int u = 0; u < kChunks; ++u) {
      if (dst[u] >= 0) p.store(dst_base + dst[u], v[u]);
    }
  }
}

}  // namespace ess::cuda::flashtrans
