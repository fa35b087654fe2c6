// FlashTrans's CPU reference (ess/ops/reference.h): the entry copies it performs.
#include "ess/ops/reference.h"

#include <cstring>

#include "ess/core/error.h"
#include "ess/model/numerics.h"

namespace ess::ref {

void copy_entries(const std::uint8_t* src_base, std::uint8_t* dst_base, std::span<const std::uint64_t> src_offsets,
                  std::span<const std::uint64_t> dst_offsets, std::int64_t count, int entry_bytes) {
  ESS_CHECK(count >= 0 && entry_bytes > 0 && src_offsets.size() >= static_cast<std::size_t>(count) &&
                dst_offsets.size() >= static_cast<std::size_t>(count),
            "copy_entries: {} entries of {} bytes with {} / {} offsets", count, entry_bytes, src_offsets.size(),
            dst_offsets.size());
  for (std::size_t i = 0; i < static_cast<std::size_t>(count); ++i) {
    std::memcpy(dst_base + dst_offsets[i], src_base + src_offsets[i], static_cast<std::size_t>(entry_bytes));
  }
}

}  // namespace ess::ref
