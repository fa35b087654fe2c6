#include "ess/cache/sparse_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "ess/cache/query_groups.h"
#include "ess/cache/total_pool.h"
#include "ess/core/digest.h"
#include "ess/core/error.h"

namespace ess {

std::int64_t SparsePoolConfig::min_slots() const {
  return max_context > 0 ? std::min<std::int64_t>(topk, max_context) : topk;
}

void SparsePoolConfig::validate() const {
  ESS_CHECK(num_layers > 0, "sparse pool: num_layers = {} must be positive", num_layers);
  layout.validate();
  ESS_CHECK(max_requests > 0, "sparse pool: max_requests = {} must be positive", max_requests);
  ESS_CHECK(query_tokens > 0 && query_tokens <= kMaxQueryTokens, "sparse pool: query_tokens (MTP T) = {} must be in [1, {}]",
            query_tokens, kMaxQueryTokens);
  ESS_CHECK(topk > 0, "sparse pool: topk = {} must be positive", topk);
  ESS_CHECK(max_context >= 0, "sparse pool: max_context = {} must be >= 0 (0 = unbounded)", max_context);
  ESS_CHECK(slots > 0, "sparse pool: slots = {} must be positive", slots);
  ESS_CHECK(slots >= min_slots(),
            "sparse pool too small: {} slots per request-layer cannot hold one query token's top-k "
            "{}{}; use at least {} slots",
            slots, topk, max_context > 0 ? fmt::format(" (capped by max_context {})", max_context) : std::string(),
            min_slots());
}

std::int32_t slots_for_ratio(double ratio, std::int64_t context_length) {
  ESS_CHECK(std::isfinite(ratio) && ratio > 0.0 && ratio <= 1.0,
            "sparse memory ratio = {} must be in (0, 1]", ratio);
  ESS_CHECK(context_length > 0, "sparse memory ratio: context length = {} must be positive",
            context_length);
  const double slots = std::ceil(ratio * static_cast<double>(context_length) - 1e-9);
  ESS_CHECK(slots <= std::numeric_limits<std::int32_t>::max(),
            "sparse memory ratio {} x context {} = {} slots is too many", ratio, context_length, slots);
  return static_cast<std::int32_t>(slots);
}

void CpuSlotStorage::allocate(const SparsePoolConfig& config) {
  entry_bytes_ = config.layout.bytes();
  layers_ = static_cast<std::size_t>(config.num_layers);
  slots_ = static_cast<std::size_t>(config.slots);
  bytes_.assign(static_cast<std::size_t>(config.max_requests) * layers_ * slots_ * entry_bytes_, 0);
}

void CpuSlotStorage::fill(const MissPlan& plan, const TotalPool& total) {
  const std::uint8_t* base = total.base();
  for (const MissEntry& m : plan.entries) {
    std::memcpy(bytes_.data() + index(m.row, plan.layer, m.slot) * entry_bytes_, base + m.host_offset,
                entry_bytes_);
  }
}

void CpuSlotStorage::read(std::int32_t row, int layer, std::int32_t slot, std::span<std::uint8_t> out) const {
  ESS_CHECK(out.size() == entry_bytes_, "slot read: buffer of {} bytes, entry is {}", out.size(), entry_bytes_);
  std::memcpy(out.data(), host_entry(row, layer, slot), entry_bytes_);
}

SparsePool::SparsePool(SparsePoolConfig config, std::unique_ptr<SlotStorage> storage)
    : config_(config), storage_(std::move(storage)) {
  config_.validate();
  ESS_CHECK(storage_ != nullptr, "sparse pool: no slot storage backend");
  storage_->allocate(config_);
  free_rows_.resize(static_cast<std::size_t>(config_.max_requests));
  for (std::int32_t i = 0; i < config_.max_requests; ++i) free_rows_[i] = config_.max_requests - 1 - i;
}

std::int32_t SparsePool::admit(RequestId id) {
  ESS_CHECK(!rows_.contains(id), "sparse pool: request {} is already admitted", id);
  ESS_CHECK(!free_rows_.empty(), "sparse pool full: all {} request rows are taken (request {})",
            config_.max_requests, id);
  const std::int32_t r = free_rows_.back();
  rows_.emplace(id, r);  // may throw: nothing taken yet
  free_rows_.pop_back();
  return r;
}

void SparsePool::release(RequestId id) {
  auto it = rows_.find(id);
  ESS_CHECK(it != rows_.end(), "sparse pool: release of unknown request {}", id);
  free_rows_.push_back(it->second);
  rows_.erase(it);
}

std::int32_t SparsePool::row(RequestId id) const {
  auto it = rows_.find(id);
  ESS_CHECK(it != rows_.end(), "sparse pool: unknown request {}", id);
  return it->second;
}

std::uint64_t SparsePool::bytes() const {
  return static_cast<std::uint64_t>(config_.max_requests) * config_.num_layers * config_.slots *
         config_.layout.bytes();
}

std::uint64_t SparsePool::digest() const {
  Digest d;
  d.values(std::span<const std::int32_t>(free_rows_));
  std::vector<std::pair<RequestId, std::int32_t>> rows(rows_.begin(), rows_.end());
  std::sort(rows.begin(), rows.end());
  for (const auto& [id, r] : rows) {
    d.value(id);
    d.value(r);
  }
  return d.get();
}

}  // namespace ess
