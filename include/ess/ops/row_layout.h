// Where the rows of a layer's device latent buffer lie: the buffer the ops write and read by
// physical row (FlashTrans's destination, the split's lists, the attention's indices).
#pragma once

#include <cstdint>

namespace ess {

// Where physical row p of a layer's buffer lives, in bytes from its base:
//   (p / block_rows) * block_stride + (p % block_rows) * row_stride
// (a paged cache of blocks of block_rows rows; block_rows = 0: one contiguous block).
struct RowLayout {
  std::uint64_t row_stride = 0;    // 0 = the entry size
  std::int64_t block_rows = 0;
  std::uint64_t block_stride = 0;
  constexpr std::uint64_t offset(std::int64_t p) const {
    if (block_rows <= 0) return static_cast<std::uint64_t>(p) * row_stride;
    return static_cast<std::uint64_t>(p / block_rows) * block_stride +
           static_cast<std::uint64_t>(p % block_rows) * row_stride;
  }
  // The row that starts `at` bytes from the base: offset()'s inverse (row_stride > 0; `at` one
  // of offset()'s values).
  constexpr std::int64_t row_at(std::uint64_t at) const {
    if (block_rows <= 0) return static_cast<std::int64_t>(at / row_stride);
    const std::uint64_t block = at / block_stride;
    return static_cast<std::int64_t>(block) * block_rows + static_cast<std::int64_t>((at - block * block_stride) / row_stride);
  }
};

// Where a pool row's rows (its slots, then its reserved rows) lie among a layer's buffer rows:
// row s of pool row r is buffer row r x rows_per_request + s; or, with regions (another engine's
// blocks handed to each request, e.g. vLLM's hot regions), row s lies in block
// region[r x region_blocks + s / block_rows] of block_rows rows, at s % block_rows. A pool row
// whose region is not set (its first block -1) has no rows: at() gives -1.
struct PoolRows {
  std::int32_t rows_per_request = 0;
  const std::int32_t* region = nullptr;  // [pool rows][region_blocks] block ids; nullptr: no regions
  std::int32_t region_blocks = 0;
  std::int64_t block_rows = 0;
  constexpr bool placed(std::int32_t r) const {
    return region == nullptr || region[static_cast<std::int64_t>(r) * region_blocks] >= 0;
  }
  constexpr std::int32_t at(std::int32_t r, std::int32_t s) const {
    if (region == nullptr) return r * rows_per_request + s;
    const std::int32_t block = region[static_cast<std::int64_t>(r) * region_blocks + s / block_rows];
    return block < 0 ? -1 : static_cast<std::int32_t>(block * block_rows + s % block_rows);
  }
};

// A buffer that keeps each entry in two parts (DeepSeek-V4's C4 pages: a token's 576 value bytes
// in one run of the page, its 8 scale bytes in another; separate K and V tensors): row p's first
// `head_bytes` lie at the buffer's own RowLayout offset(p) (`head`), its next `bytes` at
// `delta + rows.offset(p)` from the same base (`delta`: where the tails start, another tensor's
// base less this one's). head_bytes = 0: entries whole, at offset(p).
struct RowTail {
  int head_bytes = 0;        // a multiple of 16
  int bytes = 0;             // a multiple of 8
  std::int64_t delta = 0;    // a multiple of 8
  RowLayout head;            // the buffer's rows (where the heads are)
  RowLayout rows;            // the tails' (row_stride, block_stride multiples of 8)
  constexpr bool split() const { return head_bytes > 0; }
  // The tail of the row whose head is `head_offset` bytes from the base.
  constexpr std::int64_t offset_of(std::uint64_t head_offset) const {
    return delta + static_cast<std::int64_t>(rows.offset(head.row_at(head_offset)));
  }
};

}  // namespace ess
