#include "runtime/ops/split/split.h"

#include <fmt/format.h>

#include <algorithm>
#include <unordered_set>

#include "ess/core/error.h"

namespace ess {

std::string check_args(const SplitArgs& a) {
  const auto fail = [](std::string_view what) { return fmt::format("miss split: {}", what); };
  if (a.batch < 0) return fail(fmt::format("batch = {} is negative", a.batch));
  if (a.batch == 0) return "";
  if (a.positions <= 0) return fail(fmt::format("positions = {} must be positive", a.positions));
  if (a.pool.rows_per_request <= 0) {
    return fail(fmt::format("rows_per_request = {} must be positive", a.pool.rows_per_request));
  }
  if (a.pool.region != nullptr && (a.pool.region_blocks <= 0 || a.pool.block_rows <= 0 ||
                                   a.pool.rows_per_request > a.pool.region_blocks * a.pool.block_rows)) {
    return fail(fmt::format("regions of {} blocks of {} rows cannot hold {} rows per request", a.pool.region_blocks,
                            a.pool.block_rows, a.pool.rows_per_request));
  }
  if (a.buffer.row_stride == 0 || a.buffer.row_stride % 16 != 0) {
    return fail(fmt::format("row_stride = {} must be a positive multiple of 16", a.buffer.row_stride));
  }
  if (a.buffer.block_rows < 0 || (a.buffer.block_rows > 0 && a.buffer.block_stride % 16 != 0)) {
    return fail(fmt::format("block_rows = {} / block_stride = {}: a block stride must be a multiple of 16",
                            a.buffer.block_rows, a.buffer.block_stride));
  }
  const std::pair<const void*, const char*> required[] = {
      {a.rows, "rows"},         {a.slot_ids, "slot_ids"},       {a.counts, "counts"},
      {a.fill_slots, "fill_slots"}, {a.fill_host_offsets, "fill_host_offsets"}, {a.miss_offsets, "miss_offsets"},
      {a.src_offsets, "src_offsets"}, {a.dst_offsets, "dst_offsets"}, {a.total, "total"}};
  for (const auto& [p, name] : required) {
    if (p == nullptr) return fail(fmt::format("{} is null", name));
  }
  if ((a.resident == nullptr) != (a.fetched == nullptr)) return fail("resident and fetched must be given together");
  if (a.resident == nullptr) return "";
  if (a.flags == nullptr || a.resident_count == nullptr || a.fetched_count == nullptr) {
    return fail("the resident / fetched split needs flags, resident_count and fetched_count");
  }
  if (a.query_tokens <= 0 || a.positions % a.query_tokens != 0) {
    return fail(fmt::format("positions = {} is not a whole number of rows of query_tokens = {}", a.positions,
                            a.query_tokens));
  }
  return "";
}

SplitResult split_reference(const SplitProblem& p) {
  const auto P = static_cast<std::size_t>(p.positions);
  const auto B = static_cast<std::size_t>(p.batch);
  ESS_CHECK(p.positions > 0 && p.query_tokens > 0 && p.positions % p.query_tokens == 0 && p.rows.size() == B &&
                p.slot_ids.size() == B * P && p.counts.size() == 2 * B && p.fill_slots.size() == B * P &&
                p.fill_host_offsets.size() == B * P,
            "split reference: arrays do not match batch {} x positions {} (T {})", p.batch, p.positions, p.query_tokens);
  // Row s of request b's pool row, and whether that pool row has rows at all.
  const auto has_rows = [&](std::size_t b) {
    return p.rows[b] >= 0 && (p.region.empty() || p.region[static_cast<std::size_t>(p.rows[b]) * static_cast<std::size_t>(p.region_blocks)] >= 0);
  };
  const auto physical = [&](std::size_t b, std::int32_t s) -> std::int64_t {
    if (p.region.empty()) return static_cast<std::int64_t>(p.rows[b]) * p.rows_per_request + s;
    const std::int64_t block = p.region[static_cast<std::size_t>(p.rows[b]) * static_cast<std::size_t>(p.region_blocks) +
                                        static_cast<std::size_t>(s / p.block_rows)];
    return block * p.block_rows + s % p.block_rows;
  };
  SplitResult r;
  for (std::size_t b = 0; b < B; ++b) {
    if (!has_rows(b)) continue;
    const auto misses = static_cast<std::size_t>(p.counts[2 * b + 1]);
    for (std::size_t m = 0; m < misses; ++m) {
      r.src_offsets.push_back(p.fill_host_offsets[b * P + m]);
      r.dst_offsets.push_back(p.buffer.offset(physical(b, p.fill_slots[b * P + m])));
    }
  }
  r.total = static_cast<std::int64_t>(r.src_offsets.size());
  if (!p.split) return r;
  const auto T = static_cast<std::size_t>(p.query_tokens);
  const std::size_t K = P / T;
  r.resident.assign(B * P, -1);
  r.fetched.assign(B * P, -1);
  r.resident_count.assign(B * T, 0);
  r.fetched_count.assign(B * T, 0);
  for (std::size_t b = 0; b < B; ++b) {
    if (!has_rows(b)) continue;
    const auto first = p.fill_slots.begin() + static_cast<std::ptrdiff_t>(b * P);
    const std::unordered_set<std::int32_t> fetched(first, first + p.counts[2 * b + 1]);
    for (std::size_t t = 0; t < T; ++t) {
      const std::size_t row = b * P + t * K;
      std::size_t hits = 0, misses = 0;
      for (std::size_t k = 0; k < K; ++k) {
        const std::int32_t s = p.slot_ids[row + k];
        if (s < 0) continue;
        const auto at = static_cast<std::int32_t>(physical(b, s));
        if (fetched.contains(s)) {
          r.fetched[row + misses++] = at;
        } else {
          r.resident[row + hits++] = at;
        }
      }
      r.resident_count[b * T + t] = static_cast<std::int32_t>(hits);
      r.fetched_count[b * T + t] = static_cast<std::int32_t>(misses);
    }
  }
  return r;
}

}  // namespace ess
