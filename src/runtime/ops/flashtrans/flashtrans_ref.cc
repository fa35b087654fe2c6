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

void copy_entries(const std::uint8_t* src_base, std::uint8_t* dst_base, std::span<const std::uint64_t> src_offsets,
                  std::span<const std::uint64_t> dst_offsets, std::int64_t count, int entry_bytes, const RowTail& src_tail,
                  const RowTail& dst_tail) {
  if (!src_tail.split() && !dst_tail.split()) {
    copy_entries(src_base, dst_base, src_offsets, dst_offsets, count, entry_bytes);
    return;
  }
  const RowTail& cut = src_tail.split() ? src_tail : dst_tail;
  ESS_CHECK(count >= 0 && cut.head_bytes + cut.bytes <= entry_bytes && src_offsets.size() >= static_cast<std::size_t>(count) &&
                dst_offsets.size() >= static_cast<std::size_t>(count),
            "copy_entries: {} entries of {} bytes cut at {} + {} with {} / {} offsets", count, entry_bytes, cut.head_bytes,
            cut.bytes, src_offsets.size(), dst_offsets.size());
  const auto tail = [&](const RowTail& side, std::uint64_t at) {
    return side.split() ? side.offset_of(at) : static_cast<std::int64_t>(at) + cut.head_bytes;
  };
  for (std::size_t i = 0; i < static_cast<std::size_t>(count); ++i) {
    std::memcpy(dst_base + dst_offsets[i], src_base + src_offsets[i], static_cast<std::size_t>(cut.head_bytes));
    std::memcpy(dst_base + tail(dst_tail, dst_offsets[i]), src_base + tail(src_tail, src_offsets[i]),
                static_cast<std::size_t>(cut.bytes));
  }
}

}  // namespace ess::ref
