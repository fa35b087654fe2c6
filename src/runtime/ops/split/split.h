// The split of one layer's swap decision into copy work and attention halves, as the split
// kernels run it (split.cu): the swap engine's per-request miss lists become one FlashTrans
// list for the batch, and, for DA / DBA, each query row's selected rows are separated into
// those resident before the step and those fetched by it.
//
// Request b's slot s is physical row pool.at(rows[b], s) of the layer's buffer (PoolRows: rows[b] x
// rows_per_request + s, or in the row's region), stored buffer.offset(row) bytes from the layer's
// base (RowLayout, offload.h); rows[b] = -1 is a padded position, and so is a row without a
// region: nothing listed, halves empty.
//
// Plain C++: the arguments, their check (run by the launcher before any CUDA call) and an
// independent CPU reference that the GPU output must equal bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ess/ops/flashtrans.h"
#include "ess/ops/row_layout.h"

namespace ess {

struct SplitArgs {
  int batch = 0;                                 // positions of this launch
  int positions = 0;                             // T x K ids per position
  PoolRows pool;     // rows_per_request: slots per request-layer (reserved rows included)
  RowLayout buffer;  // row_stride set
  const std::int32_t* rows = nullptr;            // [batch] pool row, -1 = padded
  const std::int32_t* slot_ids = nullptr;        // [batch][positions] slot of each id, -1 = padding
  const std::int32_t* counts = nullptr;          // [batch][2]: hits, misses
  const std::int32_t* fill_slots = nullptr;      // [batch][positions]: slot of miss m
  const std::uint64_t* fill_host_offsets = nullptr;  // [batch][positions]: host pool byte offset
  std::int64_t* miss_offsets = nullptr;          // [batch] scratch: each position's first place in the list
  std::uint64_t* src_offsets = nullptr;          // [batch x positions] out: FlashTrans list,
  std::uint64_t* dst_offsets = nullptr;          //   positions in batch order, misses in order
  std::int64_t* total = nullptr;                 // [1] out: entries in the list
  // Optional split for DA / DBA, per query row (b, t) of K = positions / query_tokens ids:
  // the row's resident physical rows and its fetched ones, each compacted to the front of
  // the row in their original order, -1 after; *_count[b * T + t] = how many. The two lists
  // together hold the row's valid ids exactly once (attention is order-independent up to
  // rounding, so Attn0 + Attn1 + merge see the same entries as one attention over the row).
  int query_tokens = 1;
  std::uint8_t* flags = nullptr;                 // [batch][pool.rows_per_request] scratch (with the split)
  std::int32_t* resident = nullptr;               // [batch][positions] out or nullptr
  std::int32_t* fetched = nullptr;              // [batch][positions] out
  std::int32_t* resident_count = nullptr;             // [batch][T] out
  std::int32_t* fetched_count = nullptr;            // [batch][T] out
};

// "" when the split kernels accept the arguments, else what is wrong (field and value).
std::string check_args(const SplitArgs& args);

// The split on the device: two launches, no host synchronization (an exclusive scan of the
// positions' miss counts in one block, each position's place in the list and the total; then
// one block per position). Returns a cudaError_t value: cudaErrorInvalidValue when check_args
// fails, kNoCudaDevice without the CUDA backend.
int split_misses(const SplitArgs& args, cuda::Stream stream);

// The same computation on host arrays, written straightforwardly.
struct SplitProblem {
  int batch = 0, positions = 0, query_tokens = 1;
  std::int32_t rows_per_request = 0;
  // Regions: [pool rows][region_blocks] block ids of block_rows rows each (a row's first -1: no
  // region, a padded position); empty: row r's slots at r x rows_per_request.
  std::vector<std::int32_t> region;
  std::int32_t region_blocks = 0;
  std::int64_t block_rows = 0;
  RowLayout buffer;
  bool split = true;                     // also the resident / fetched halves
  std::vector<std::int32_t> rows;        // [batch]
  std::vector<std::int32_t> slot_ids;    // [batch][positions]
  std::vector<std::int32_t> counts;      // [batch][2]
  std::vector<std::int32_t> fill_slots;  // [batch][positions], the first counts[b][1] used
  std::vector<std::uint64_t> fill_host_offsets;  // [batch][positions]
};
struct SplitResult {
  std::int64_t total = 0;
  std::vector<std::uint64_t> src_offsets, dst_offsets;  // [total]
  std::vector<std::int32_t> resident, fetched;          // [batch][positions] physical rows (with the split)
  std::vector<std::int32_t> resident_count, fetched_count;      // [batch][T]
};
SplitResult split_reference(const SplitProblem& problem);

}  // namespace ess
