// An Offload driven from host arrays, whatever its backend: the CPU backend gets the arrays
// themselves; the CUDA backend device copies of them (uploaded, the call run on a stream of
// its own and synchronized, the outputs downloaded). For the tools and tests that keep their
// inputs on the host (`ess verify`, the offload tests); an engine passes device pointers.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ess/runtime/offload.h"

namespace ess::test {

struct OffloadStepIn {
  int layer = 0;
  int batch = 0;
  std::vector<std::int32_t> rows, topk, lengths;
  bool split = false;                             // ask for the DA split
  // CUDA: the fetch on a stream of its own (LayerStep::copy_stream, copy_done), which the step's
  // stream waits for before the outputs are read, as DA's attention over the fetched rows does;
  // wait_for_copy = false leaves the wait out (a consumer with the bug, for the stream-order tests).
  bool copy_stream = false;
  bool wait_for_copy = true;
  int query_begin = 0, query_end = 0;             // LayerStep's query group (0, 0 = all T)
};

struct OffloadStepOut {
  std::vector<std::int32_t> physical, resident, fetched, resident_count, fetched_count, counts;
  // CUDA with copy_stream: the layer's buffer as work on the step's stream reads it right after
  // the step (and its wait for the copy), before anything else synchronizes; else empty.
  std::vector<std::uint8_t> seen;
};

struct OffloadIo {
  OffloadStepOut (*step)(Offload& o, const OffloadStepIn& in);
  // The write-back of a layer; empty source_rows: the reserved rows.
  void (*write_back)(Offload& o, int layer, const std::vector<std::int32_t>& rows,
                     const std::vector<std::int32_t>& lengths, const std::vector<std::int32_t>& source_rows);
  // Writes an entry into physical row p of a layer's buffer (the model's KV write).
  void (*write_row)(Offload& o, int layer, std::int32_t p, std::span<const std::uint8_t> bytes);
  // A layer's buffer up to its last row's end, as host bytes (row p at buffer().rows.offset(p);
  // tails that lie after the heads in the same allocation included).
  std::vector<std::uint8_t> (*dump)(const Offload& o, int layer);
  // `bytes` of the backend's memory, zeroed and 256-byte aligned, freed with the last owner: an
  // engine's own layer buffers.
  std::shared_ptr<std::uint8_t> (*allocate)(std::size_t bytes);
};

// The calls for `backend`; throws ess::Error for kCuda when this build has no CUDA target.
const OffloadIo& offload_io(Backend backend);
// The bytes from a layer buffer's base to its last row's end.
std::uint64_t buffer_extent(const Offload& o);

// Called once by the CUDA part (offload_io_cuda.cc), before main.
void register_cuda_offload_io(const OffloadIo* io);

}  // namespace ess::test
