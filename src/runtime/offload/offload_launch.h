// The CUDA backend's own kernels of the per-layer step (offload.cu): ids lru_ids for the LRU,
// the physical rows, and the write-back's copy list. Launchers return a cudaError_t value.
// CUDA target only; plain declarations.
#pragma once

#include <cstdint>

#include "ess/ops/flashtrans.h"
#include "ess/runtime/offload.h"

namespace ess::cuda {

struct StepShape {
  int batch = 0, query_tokens = 1, topk = 0;
  std::int32_t slots = 0;
  PoolRows pool;  // where each pool row's rows lie (a row without a region: its positions are padding)
  bool reserve_newest = false;
  int query_begin = 0, query_end = 1;     // the query group served; other query tokens are padding
  const std::int32_t* rows = nullptr;     // [B], -1 = padded
  const std::int32_t* topk_ids = nullptr; // [B][T][K]
  const std::int32_t* lengths = nullptr;  // [B]
  // Residency: whole_units[r x max_units ..] the pool rows of the whole request whose own row is r,
  // r first, -1 after them (all -1: a sparse request); nullptr: every request sparse. A whole
  // position's ids go to no LRU: each maps to its own row (row id % slots of pool row
  // units[id / slots]; a newest one to its reserved row).
  const std::int32_t* whole_units = nullptr;
  int max_units = 0;
  // A step without a swap decision (every admitted request whole): a position that is not whole
  // names no request, and finalize gives it no rows (the LRU's slots were not computed).
  bool whole_only = false;
  // The query rows whole positions record for a demotion (their ids as the LRU would see them):
  // recorded[((r x layers + layer) x windows + w) x K ..], a ring of `windows` per pool row r and
  // layer, whose next place and fill are recorded_head[(r x layers + layer) x 2 ..].
  std::int32_t* recorded = nullptr;
  std::int32_t* recorded_head = nullptr;
  int windows = 0, layers = 0, layer = 0;
};

// The ids the LRU sees: padding, invalid ids (outside [-1, length)), query tokens outside the
// group and, with reserve_newest, a position's T newest tokens become -1.
int launch_mask_ids(const StepShape& s, std::int32_t* lru_ids, Stream stream);
// Each id's slot among its request's rows (the LRU's slot, or slots + t for the t-th newest
// token) and its physical row (pool.at(row, slot)); -1 where there is none.
int launch_finalize_rows(const StepShape& s, const std::int32_t* lru_slots, std::int32_t* slot_ids, std::int32_t* physical,
                         Stream stream);
// The DA halves of whole and padded positions (the split's halves of sparse ones stay): a whole
// position's query row reads every row in place (its physical rows, compacted in order) and
// fetches none; a padded one has none.
struct WholeHalves {
  const std::int32_t* physical = nullptr;  // [B][T][K]
  std::int32_t* resident = nullptr;        // [B][T][K] out
  std::int32_t* fetched = nullptr;
  std::int32_t* resident_count = nullptr;  // [B][T] out
  std::int32_t* fetched_count = nullptr;
};
int launch_whole_halves(const StepShape& s, const WholeHalves& h, Stream stream);

// The write-back's FlashTrans list: for each real position, its T newest tokens from
// source_rows (or the reserved rows) of the layer's buffer to their host pool entries
// (page_table[(row x max_pages + token / 64) x layers + layer] x page_bytes + token % 64 x entry).
struct WriteBackList {
  int batch = 0, query_tokens = 1, layers = 0, layer = 0, max_pages = 0;
  std::int32_t slots = 0;
  PoolRows pool;  // a position whose row has no region lists nothing
  const std::int32_t* rows = nullptr;
  const std::int32_t* lengths = nullptr;
  const std::int32_t* source_rows = nullptr;  // nullptr: the reserved rows
  const std::int32_t* page_table = nullptr;
  std::uint64_t page_bytes = 0, entry_bytes = 0;
  RowLayout buffer;
  std::uint64_t* src_offsets = nullptr;       // [B x T] out
  std::uint64_t* dst_offsets = nullptr;
  std::int64_t* total = nullptr;              // [1] out
  // Whole requests (StepShape::whole_units, nullptr: none): their newest tokens also from the
  // same rows to their own rows of the buffer, a second list.
  const std::int32_t* whole_units = nullptr;
  int max_units = 0;
  std::uint64_t* whole_src = nullptr;          // [B x T] out
  std::uint64_t* whole_dst = nullptr;
  std::int64_t* whole_total = nullptr;         // [1] out
};
int launch_write_back_list(const WriteBackList& w, Stream stream);

// The FlashTrans list of a lifecycle load, from the host pool into one request's buffer rows of
// a layer: the first *count of `tokens` into slots `token_slots` of pool row `row` (an
// LRU-Warmup's changed slots; *count <= max_count); or, with `units`, the tokens [first, length)
// of the whole request at `row` into its own rows (row t % slots of pool row units[t / slots]);
// or, with `reserved`, the tokens [first, length) into the reserved rows (token
// length - query_tokens + t into slot slots + t). Rows through `pool`. Sources as the write-back's destinations
// (page_table, page_bytes, entry_bytes); *total = the entries listed. One block.
struct HostFillList {
  int layers = 0, layer = 0, max_pages = 0;
  std::int32_t row = 0, slots = 0;
  PoolRows pool;
  const std::int32_t* page_table = nullptr;
  std::uint64_t page_bytes = 0, entry_bytes = 0;
  RowLayout buffer;
  const std::int32_t* tokens = nullptr;       // [max_count]
  const std::int32_t* token_slots = nullptr;  // [max_count]
  const std::int32_t* count = nullptr;        // [1]
  std::int64_t max_count = 0;
  const std::int32_t* units = nullptr;        // [max_units] of the row, or nullptr
  bool reserved = false;
  int query_tokens = 1;
  std::int64_t first = 0, length = 0;
  std::uint64_t* src_offsets = nullptr;       // out: [max_count], or [length - first]
  std::uint64_t* dst_offsets = nullptr;
  std::int64_t* total = nullptr;              // [1] out
  std::int64_t* tally = nullptr;              // [1], optional: += the entries listed
};
int launch_host_fill_list(const HostFillList& f, Stream stream);

}  // namespace ess::cuda
