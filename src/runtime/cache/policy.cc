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
      list_(slots, 1),
      stamp_(static_cast<std::size_t>(slots), -1),
      in_set_((static_cast<std::size_t>(slots) + 63) / 64, 0) {
  ESS_CHECK(slots > 0, "lru policy: slots = {} must be positive", slots);
  for (std::int32_t s = 0; s < n_; ++s) list_.push_back(0, s);
}

void LruPolicy::step(const PolicyStepView& view, std::span<std::int32_t> victims) {
  ESS_ASSERT(victims.size() == view.miss_tokens.size());
  std::uint64_t* const in_set = in_set_.data();
  const auto hits = view.hit_slots;
  // The hit slots lie anywhere in the list: their links are loaded ahead of the unlinks.
  constexpr std::size_t kAhead = 16;
  for (std::size_t j = 0; j < hits.size(); ++j) {
    if (j + kAhead < hits.size()) list_.prefetch(hits[j + kAhead]);
    const std::int32_t s = hits[j];
    list_.unlink(s);
    in_set[static_cast<std::size_t>(s) >> 6] |= 1ULL << (s & 63);
  }
  for (auto& v : victims) {
    const std::int32_t s = list_.first(0);
    ESS_ASSERT(s != list_.head(0), "lru: no victim left (working set larger than the pool)");
    list_.unlink(s);
    in_set[static_cast<std::size_t>(s) >> 6] |= 1ULL << (s & 63);
    v = s;
  }
  // The working set becomes the most recent, in ascending slot order.
  working_.resize(hits.size() + victims.size());
  std::int32_t* const ws = working_.data();
  std::int64_t* const stamp = stamp_.data();
  std::size_t k = 0;
  for (std::size_t w = 0; w < in_set_.size(); ++w) {
    std::uint64_t bits = in_set[w];
    in_set[w] = 0;
    while (bits != 0) {
      const auto s = static_cast<std::int32_t>(w * 64 + static_cast<std::size_t>(std::countr_zero(bits)));
      bits &= bits - 1;
      ws[k++] = s;
      stamp[s] = clock_;
    }
  }
  ESS_ASSERT(k == working_.size(), "lru: {} working-set slots, expected {} (a hit slot repeated?)", k, working_.size());
  list_.push_back_all(0, working_);
  ++clock_;
}

std::vector<std::int64_t> LruPolicy::recency() const { return stamp_; }

void LruPolicy::hash(Digest& d) const {
  d.value(clock_);
  d.values(std::span<const std::int64_t>(stamp_));
  d.values(std::span<const std::int32_t>(list_.links()));
}

void LruPolicy::check_invariants() const {
  std::int32_t count = 0;
  const std::int32_t head = list_.head(0);
  std::int32_t prev = head;
  for (std::int32_t s = list_.first(0); s != head; s = list_.next(s)) {
    ESS_ASSERT(s >= 0 && s < n_, "lru list holds slot {}", s);
    ESS_ASSERT(list_.prev(s) == prev, "lru list: prev of slot {} broken", s);
    if (prev != head) {
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
    : n_(slots),
      leaves_(static_cast<std::int32_t>(std::bit_ceil(static_cast<std::uint32_t>(std::max(slots, 1))))),
      key_(static_cast<std::size_t>(std::max(slots, 0)), kEmpty) {
  ESS_CHECK(slots > 0, "belady policy: slots = {} must be positive", slots);
  std::int32_t max_token = -1;
  std::size_t total = 0;
  for (std::size_t i = 0; i < future.size(); ++i) {
    for (std::int32_t tok : future[i]) {
      ESS_CHECK(tok >= 0, "belady policy: step {} of the future lists token {}", i, tok);
      max_token = std::max(max_token, tok);
    }
    ESS_CHECK(future[i].size() <= static_cast<std::size_t>(slots),
              "belady policy: step {} needs {} tokens but the pool has {} slots", i, future[i].size(), slots);
    total += future[i].size();
  }
  const auto universe = static_cast<std::size_t>(max_token + 1);
  begin_.resize(future.size() + 1);
  tokens_.reserve(total);
  for (std::size_t i = 0; i < future.size(); ++i) {
    begin_[i] = tokens_.size();
    tokens_.insert(tokens_.end(), future[i].begin(), future[i].end());
  }
  begin_[future.size()] = tokens_.size();
  uses_.resize(total);
  use_of_token_.assign(universe, kNever);  // during the backward pass: the next step using the token
  stamp_of_token_.assign(universe, -1);
  for (std::size_t i = future.size(); i-- > 0;) {
    for (std::size_t j = begin_[i]; j < begin_[i + 1]; ++j) {
      const auto tok = static_cast<std::size_t>(tokens_[j]);
      ESS_CHECK(stamp_of_token_[tok] != static_cast<std::int64_t>(i),
                "belady policy: step {} of the future lists token {} twice", i, tokens_[j]);
      stamp_of_token_[tok] = static_cast<std::int64_t>(i);
      uses_[j] = use_of_token_[tok];
    }
    for (std::size_t j = begin_[i]; j < begin_[i + 1]; ++j) {
      use_of_token_[static_cast<std::size_t>(tokens_[j])] = static_cast<std::int64_t>(i);
    }
  }
  std::fill(stamp_of_token_.begin(), stamp_of_token_.end(), -1);
  tree_.assign(2 * static_cast<std::size_t>(leaves_), -1);
  rebuild();
}

void BeladyPolicy::rebuild() {
  for (std::int32_t i = 0; i < leaves_; ++i) tree_[static_cast<std::size_t>(leaves_ + i)] = i < n_ ? i : -1;
  for (std::size_t i = static_cast<std::size_t>(leaves_) - 1; i >= 1; --i) {
    const std::int32_t a = tree_[2 * i];
    const std::int32_t b = tree_[2 * i + 1];
    tree_[i] = wins(a, b) ? a : b;  // ties to the left child: the lower slot
  }
}

void BeladyPolicy::update(std::int32_t s) {
  for (std::size_t i = (static_cast<std::size_t>(leaves_) + static_cast<std::size_t>(s)) >> 1; i >= 1; i >>= 1) {
    const std::int32_t a = tree_[2 * i];
    const std::int32_t b = tree_[2 * i + 1];
    tree_[i] = wins(a, b) ? a : b;
  }
}

std::int64_t BeladyPolicy::next_use(std::int64_t step, std::int32_t token) const {
  ESS_ASSERT(token >= 0 && static_cast<std::size_t>(token) < stamp_of_token_.size() &&
                 stamp_of_token_[static_cast<std::size_t>(token)] == step,
             "belady policy: token {} at step {} is not in the future it was given", token, step);
  return use_of_token_[static_cast<std::size_t>(token)];
}

void BeladyPolicy::step(const PolicyStepView& view, std::span<std::int32_t> victims) {
  ESS_ASSERT(victims.size() == view.miss_tokens.size());
  const auto step = clock_;
  const auto i = static_cast<std::size_t>(step);
  ESS_ASSERT(i + 1 < begin_.size() && view.hit_slots.size() + view.miss_tokens.size() == begin_[i + 1] - begin_[i],
             "belady policy: step {} does not match the future it was given", step);
  for (std::size_t j = begin_[i]; j < begin_[i + 1]; ++j) {
    const auto tok = static_cast<std::size_t>(tokens_[j]);
    use_of_token_[tok] = uses_[j];
    stamp_of_token_[tok] = step;
  }
  // Check everything before changing anything (an exception leaves the policy as it was).
  for (std::int32_t s : view.hit_slots) {
    ESS_ASSERT(key_[s] == step, "belady policy: hit slot {} was not expected at step {} (its next use is {})", s, step,
               key_[s]);
    next_use(step, view.token_of_slot[s]);
  }
  for (std::int32_t tok : view.miss_tokens) next_use(step, tok);
  // Hits hold key == step, below every other slot's key, so the winners are non-hits. A chosen
  // victim takes key == step as well until the step ends.
  for (auto& v : victims) {
    const std::int32_t s = tree_[1];
    ESS_ASSERT(s >= 0 && key_[s] > step, "belady policy: no victim left (working set larger than the pool)");
    v = s;
    key_[s] = step;
    update(s);
  }
  for (std::int32_t s : view.hit_slots) key_[s] = next_use(step, view.token_of_slot[s]);
  for (std::size_t m = 0; m < victims.size(); ++m) key_[victims[m]] = next_use(step, view.miss_tokens[m]);
  const std::size_t changed = view.hit_slots.size() + victims.size();
  if (changed * static_cast<std::size_t>(std::bit_width(static_cast<std::uint32_t>(leaves_))) >
      static_cast<std::size_t>(leaves_)) {
    rebuild();
  } else {
    for (std::int32_t s : view.hit_slots) update(s);
    for (std::int32_t s : victims) update(s);
  }
  ++clock_;
}

std::vector<std::int64_t> BeladyPolicy::recency() const { return key_; }

void BeladyPolicy::hash(Digest& d) const {
  d.value(clock_);
  d.values(std::span<const std::int64_t>(key_));
}

void BeladyPolicy::check_invariants() const {
  for (std::size_t i = static_cast<std::size_t>(leaves_) - 1; i >= 1; --i) {
    const std::int32_t a = tree_[2 * i];
    const std::int32_t b = tree_[2 * i + 1];
    ESS_ASSERT(tree_[i] == (wins(a, b) ? a : b), "belady tree node {} stale", i);
  }
  for (std::int32_t s = 0; s < n_; ++s) {
    ESS_ASSERT(key_[s] == kEmpty || key_[s] >= clock_, "belady key of slot {} ({}) lies in the past (step {})", s,
               key_[s], clock_);
  }
}

}  // namespace ess
