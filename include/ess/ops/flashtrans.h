// FlashTrans: zero-copy gather / scatter of latent entries between the pinned Total Memory
// Pool (read or written through Unified Virtual Addressing) and Sparse Memory Pool slots in
// device memory. One launch per layer moves every miss of the batch; the work is spread
// over 16-byte chunks, not over requests, so one request with many misses does not
// serialize on one thread block.
//
// Plain C++ declarations: the kernels are in flashtrans.cu (CUDA target only).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ess/ops/row_layout.h"
#include "ess/runtime/backend.h"  // cuda::device_view: the device pointer of mapped pinned host memory

namespace ess::cuda {

using Stream = void*;  // cudaStream_t, without the CUDA headers

// What every op returns when this build has no CUDA backend (ess/runtime/backend.h): CUDA's
// own cudaErrorNoDevice.
inline constexpr int kNoCudaDevice = 100;

// Copy `count` entries of `entry_bytes` (a multiple of 16) each:
//   dst_base + dst_offsets[i]  <-  src_base + src_offsets[i]
// The offset arrays live in device memory (or mapped host memory). Every base pointer and
// offset must be 16-byte aligned.
//
// A side whose buffer keeps entries in two parts (`src_tail` / `dst_tail` split: RowTail) has an
// entry's first head_bytes at the listed offset and its next tail bytes at the tail's place;
// the other side holds the entry whole (head, then tail, then padding up to entry_bytes, which
// is not copied). Heads move in 16-byte chunks, tails in 8-byte ones.
struct EntryCopy {
  const std::uint8_t* src_base = nullptr;
  std::uint8_t* dst_base = nullptr;
  const std::uint64_t* src_offsets = nullptr;
  const std::uint64_t* dst_offsets = nullptr;
  std::int64_t count = 0;
  int entry_bytes = 656;
  // Optional: the entry count lives in device memory (written by an earlier kernel of the
  // same stream, so no host synchronization is needed). `count` is then the largest value it
  // can hold; the launch is sized for it and copies min(*device_count, count) entries.
  const std::int64_t* device_count = nullptr;
  // Grid: at most `blocks` blocks of `threads` threads (0 = the defaults below); fewer when
  // the copy is small. Every thread keeps kFlashTransChunksPerThread 16-byte loads in flight.
  int blocks = 0;
  int threads = 0;  // 32 .. 256, a multiple of 32
  RowTail src_tail{};
  RowTail dst_tail{};
  bool split() const { return src_tail.split() || dst_tail.split(); }
  const RowTail& tail() const { return src_tail.split() ? src_tail : dst_tail; }
  // The copy's units per entry: 16-byte chunks of the head (the whole entry when not split),
  // then 8-byte ones of the tail.
  int head_chunks() const { return split() ? tail().head_bytes / 16 : entry_bytes / 16; }
  int units_per_entry() const { return head_chunks() + (split() ? tail().bytes / 8 : 0); }
};

// The default grid. PCIe, not the SMs, bounds the copy: sustaining W bytes/s over a host
// read latency of L seconds needs W x L bytes in flight (Little's law), about 110 KB for
// 55 GB/s at 2 us. A 256-thread block with 8 loads of 16 bytes per thread keeps 32 KB in
// flight, so a few blocks could fill the link if an SM could track that many misses; 32
// blocks (1 MB in flight) leave ample margin for the per-SM limits while taking a quarter of
// an H100's 132 SMs, so that a concurrent sparse MLA (one CTA per SM, the whole register
// file) keeps the other 100 (the DA schedule's Attn0 and the DBA half-indexer run beside the
// copy). `ess bench transfer --blocks` measures bandwidth against block count, alone and
// beside a sparse MLA, and reports the smallest block count within 5 % of the best.
inline constexpr int kFlashTransDefaultBlocks = 32;
inline constexpr int kFlashTransDefaultThreads = 256;
inline constexpr int kFlashTransChunksPerThread = 8;

// Host -> device gather (misses into slots) and device -> host scatter (new entries back to
// the Total Memory Pool); the same kernel, named for the direction. Returns a cudaError_t
// value (0 = success) and never synchronizes.
int flashtrans_gather(const EntryCopy& copy, Stream stream);
int flashtrans_scatter(const EntryCopy& copy, Stream stream);

}  // namespace ess::cuda
