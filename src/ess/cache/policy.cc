#include "ess/cache/policy.h"

#include <algorithm>
#include <bit>
#include <limits>
#include <unordered_map>

#include "ess/core/digest.h"
#include "ess/core/error.h"

namespace ess {

// ---- LRU ---------------------------------------------------------------------------------

LruPolicy::LruPolicy(std::int32_t slots)
    : n_(slots),
      prev_(static_cast<std::size_t>(slots) + 1),
      next_(static_cast<std::size_t>(slots) + 1),
      stamp_(static_cast<std::size_t>(slots), -1),
      in_set_((static_cast<std::size_t>(slots) + 63) / 64, 0) {
  ESS_CHECK(slots > 0, "lru policy: slots = {} must be positive", slots);
  prev_[n_] = n_;
  next_[n_] = n_;
  for (std::int32_t s = 0; s < n_; ++s) push_back(s);
}

void LruPolicy::step(const PolicyStepView& view, std::span<std::int32_t> victims) {
  ESS_ASSERT(victims.size() == view.miss_tokens.size());
  for (std::int32_t s : view.hit_slots) {
    unlink(s);
    in_set_[static_cast<std::size_t>(s) >> 6] |= 1ULL << (s & 63);
  }
  for (auto& v : victims) {
    const std::int32_t s = next_[n_];
    ESS_ASSERT(s != n_, "lru: no victim left (working set larger than the pool)");
    unlink(s);
    in_set_[static_cast<std::size_t>(s) >> 6] |= 1ULL << (s & 63);
    v = s;
  }
  // The working set becomes the most recent, in ascending slot order.
  for (std::size_t w = 0; w < in_set_.size(); ++w) {
    std::uint64_t bits = in_set_[w];
    in_set_[w] = 0;
    while (bits != 0) {
      const auto s = static_cast<std::int32_t>(w * 64 + static_cast<std::size_t>(std::countr_zero(bits)));
      bits &= bits - 1;
      push_back(s);
      stamp_[s] = clock_;
    }
  }
  ++clock_;
}

std::vector<std::int64_t> LruPolicy::recency() const { return stamp_; }

void LruPolicy::hash(Digest& d) const {
  d.value(clock_);
  d.values(std::span<const std::int64_t>(stamp_));
  d.values(std::span<const std::int32_t>(next_));
}

void LruPolicy::check_invariants() const {
  std::int32_t count = 0;
  std::int32_t prev = n_;
  for (std::int32_t s = next_[n_]; s != n_; s = next_[s]) {
    ESS_ASSERT(s >= 0 && s < n_, "lru list holds slot {}", s);
    ESS_ASSERT(prev_[s] == prev, "lru list: prev of slot {} broken", s);
    if (prev != n_) {
      const bool ordered = stamp_[prev] < stamp_[s] || (stamp_[prev] == stamp_[s] && prev < s);
      ESS_ASSERT(ordered, "lru list out of (recency, slot) order at slots {} -> {}", prev, s);
    }
    ESS_ASSERT(stamp_[s] < clock_, "slot {} stamped {} in the future (clock {})", s, stamp_[s], clock_);
    prev = s;
    ESS_ASSERT(++count <= n_, "lru list has a cycle");
  }
  ESS_ASSERT(count == n_, "lru list holds {} of {} slots", count, n_);
  ESS_ASSERT(std::all_of(in_set_.begin(), in_set_.end(), [](std::uint64_t w) { return w == 0; }));
}

PolicyFactory lru_factory() {
  return [](RequestId, int, std::int32_t slots) { return std::make_unique<LruPolicy>(slots); };
}

// ---- Belady ------------------------------------------------------------------------------

namespace {
constexpr std::int64_t kEmpty = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kNever = kEmpty - 1;
}  // namespace

BeladyPolicy::BeladyPolicy(std::int32_t slots, std::vector<std::vector<std::int32_t>> future)
    : n_(slots), next_(future.size()), key_(static_cast<std::size_t>(slots), kEmpty) {
  ESS_CHECK(slots > 0, "belady policy: slots = {} must be positive", slots);
  std::unordered_map<std::int32_t, std::int64_t> seen;  // token -> the next step it is used
  for (std::size_t i = future.size(); i-- > 0;) {
    auto& out = next_[i];
    out.reserve(future[i].size());
    for (std::int32_t tok : future[i]) {
      auto it = seen.find(tok);
      out.emplace_back(tok, it == seen.end() ? kNever : it->second);
    }
    for (std::int32_t tok : future[i]) seen[tok] = static_cast<std::int64_t>(i);
    std::sort(out.begin(), out.end());
    ESS_CHECK(std::adjacent_find(out.begin(), out.end(),
                                 [](const auto& a, const auto& b) { return a.first == b.first; }) ==
                  out.end(),
              "belady policy: step {} of the future lists a token twice", i);
    ESS_CHECK(out.size() <= static_cast<std::size_t>(slots),
              "belady policy: step {} needs {} tokens but the pool has {} slots", i, out.size(), slots);
  }
  for (std::int32_t s = 0; s < n_; ++s) order_.emplace(kEmpty, s);
}

std::int64_t BeladyPolicy::next_use(std::int64_t step, std::int32_t token) const {
  ESS_ASSERT(step < static_cast<std::int64_t>(next_.size()),
             "belady policy asked for step {} but was given a future of {} steps", step, next_.size());
  const auto& v = next_[static_cast<std::size_t>(step)];
  auto it = std::lower_bound(v.begin(), v.end(), std::make_pair(token, std::int64_t{-1}));
  ESS_ASSERT(it != v.end() && it->first == token,
             "belady policy: token {} at step {} is not in the future it was given", token, step);
  return it->second;
}

void BeladyPolicy::step(const PolicyStepView& view, std::span<std::int32_t> victims) {
  ESS_ASSERT(victims.size() == view.miss_tokens.size());
  const auto step = clock_;
  ESS_ASSERT(static_cast<std::size_t>(step) < next_.size() &&
                 view.hit_slots.size() + view.miss_tokens.size() == next_[static_cast<std::size_t>(step)].size(),
             "belady policy: step {} does not match the future it was given", step);
  for (std::int32_t s : view.hit_slots) order_.erase({key_[s], s});
  for (auto& v : victims) {
    ESS_ASSERT(!order_.empty());
    const auto it = order_.begin();
    v = it->second;
    order_.erase(it);
  }
  for (std::int32_t s : view.hit_slots) {
    key_[s] = next_use(step, view.token_of_slot[s]);
    order_.emplace(key_[s], s);
  }
  for (std::size_t i = 0; i < victims.size(); ++i) {
    const std::int32_t s = victims[i];
    key_[s] = next_use(step, view.miss_tokens[i]);
    order_.emplace(key_[s], s);
  }
  ++clock_;
}

std::vector<std::int64_t> BeladyPolicy::recency() const { return key_; }

void BeladyPolicy::hash(Digest& d) const {
  d.value(clock_);
  d.values(std::span<const std::int64_t>(key_));
}

void BeladyPolicy::check_invariants() const {
  ESS_ASSERT(order_.size() == static_cast<std::size_t>(n_), "belady order holds {} of {} slots",
             order_.size(), n_);
  for (const auto& [key, s] : order_) ESS_ASSERT(key_[s] == key, "belady key of slot {} stale", s);
}

}  // namespace ess
