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
};

}  // namespace ess
