// Offload's residency (docs/architecture.md, "Residency"): which requests are whole, which rows
// they borrow, and the transitions between whole and sparse. The front's state changes here; the
// backend then makes the device follow (units_changed, load_whole, demote).
#include "ess/core/error.h"
#include "runtime/offload/offload_impl.h"

namespace ess {

std::string_view to_string(Residency r) {
  switch (r) {
    case Residency::kSparse: return "sparse";
    case Residency::kWhole: return "whole";
    case Residency::kAdaptive: return "adaptive";
  }
  return "?";
}

std::int32_t OffloadState::free_rows() const {
  std::int32_t n = 0;
  for (std::int32_t r = 0; r < config.max_requests; ++r) n += row_free(r) ? 1 : 0;
  return n;
}

std::int32_t Offload::Impl::demotion_victim() const {
  std::int32_t victim = -1;
  std::size_t most = 1;  // a whole request on its own row alone frees nothing
  for (std::int32_t r = 0; r < config.max_requests; ++r) {
    const std::size_t n = units_of_row[static_cast<std::size_t>(r)].size();
    if (n >= most && n > 1) {
      most = n;
      victim = r;
    }
  }
  return victim;
}

void Offload::Impl::borrow(std::int32_t row, std::int32_t n) {
  auto& units = units_of_row[static_cast<std::size_t>(row)];
  for (std::int32_t r = config.max_requests - 1; r >= 0 && n > 0; --r) {
    if (!row_free(r)) continue;
    units.push_back(r);
    borrower_of_row[static_cast<std::size_t>(r)] = row;
    --n;
  }
  ESS_ASSERT(n == 0, "offload: whole residency without the free rows it was checked for");
}

void Offload::Impl::give_back(std::int32_t row) {
  auto& units = units_of_row[static_cast<std::size_t>(row)];
  for (std::size_t i = 1; i < units.size(); ++i) borrower_of_row[static_cast<std::size_t>(units[i])] = -1;
  units.clear();
}

void Offload::Impl::demote(std::int32_t row) {
  ESS_ASSERT(whole(row), "offload: demotion of a sparse request");
  give_back(row);
  ++demotions;
  const RequestId id = request_of_row[static_cast<std::size_t>(row)];
  device("demotion", [&] { backend->demote(row, id); });
}

void Offload::Impl::make_whole(std::int32_t row, std::int32_t extra, bool load) {
  ESS_ASSERT(!whole(row), "offload: a whole request made whole again");
  units_of_row[static_cast<std::size_t>(row)].push_back(row);
  borrow(row, extra);
  const RequestId id = request_of_row[static_cast<std::size_t>(row)];
  device("whole residency", [&] {
    backend->units_changed(row, id);
    if (load) backend->load_whole(row, id, {}, 0);
  });
}

void Offload::Impl::check_growth(std::int32_t row, std::int64_t length, const char* what) const {
  if (!whole(row) || config.residency != Residency::kWhole) return;
  const std::int32_t lack = config.whole_rows(length) - static_cast<std::int32_t>(units_of_row[static_cast<std::size_t>(row)].size());
  const std::int32_t free = free_rows();
  ESS_CHECK(lack <= free, "offload: {} of request {} to {} tokens: whole residency needs {} more pool rows, {} are free",
            what, request_of_row[static_cast<std::size_t>(row)], length, lack, free);
}

void Offload::Impl::grow_whole(std::int32_t row, std::int64_t length) {
  if (!whole(row)) return;
  const std::int32_t lack =
      config.whole_rows(length) - static_cast<std::int32_t>(units_of_row[static_cast<std::size_t>(row)].size());
  if (lack <= 0) return;
  if (lack > free_rows()) {
    demote(row);
    return;
  }
  borrow(row, lack);
  const RequestId id = request_of_row[static_cast<std::size_t>(row)];
  device("whole residency", [&] { backend->units_changed(row, id); });
}

void Offload::Impl::promote_waiting() {
  if (config.residency != Residency::kAdaptive) return;
  for (;;) {
    std::int32_t best = -1, best_need = 0;
    const std::int32_t free = free_rows();
    for (std::int32_t r = 0; r < config.max_requests; ++r) {
      const RequestId id = request_of_row[static_cast<std::size_t>(r)];
      if (id < 0 || whole(r)) continue;
      const std::int32_t need = config.whole_rows(pool->length(id));
      const bool fits = need == 1 || need - 1 + config.whole_headroom <= free;
      if (fits && (best < 0 || need < best_need)) {
        best = r;
        best_need = need;
      }
    }
    if (best < 0) return;
    ++promotions;
    make_whole(best, best_need - 1, /*load=*/true);
  }
}

}  // namespace ess
