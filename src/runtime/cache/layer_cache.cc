#include "ess/cache/layer_cache.h"

#include <algorithm>

#include "ess/core/digest.h"
#include "ess/core/error.h"

namespace ess {

LayerCache::LayerCache(std::int32_t slots, std::unique_ptr<ReplacementPolicy> policy)
    : token_of_slot_(static_cast<std::size_t>(slots), -1),
      policy_(std::move(policy)),
      mark_(static_cast<std::size_t>(slots), 0) {
  ESS_CHECK(slots > 0, "layer cache: slots = {} must be positive", slots);
  ESS_CHECK(policy_ != nullptr, "layer cache: no replacement policy");
}

void LayerCache::reserve_tokens(std::int64_t length) {
  if (static_cast<std::size_t>(length) > slot_of_token_.size()) {
    // Grow geometrically in whole pages so decode's one-token appends stay amortized O(1).
    const std::size_t want = std::max<std::size_t>(static_cast<std::size_t>(length), slot_of_token_.size() * 5 / 4);
    slot_of_token_.resize((want + 63) / 64 * 64, -1);
  }
}

// Slot values >= 0 are resident slots. During a step a token that missed is temporarily
// marked in slot_of_token_ as -2 - (its miss index), so that a second query token selecting
// it resolves to the same miss; the marks are replaced by the victims before returning.
StepCounts LayerCache::access(std::span<const std::int32_t> ids, int T, int K,
                              std::span<std::int32_t> slot_ids, std::vector<Fill>& fills) {
  ESS_ASSERT(ids.size() == static_cast<std::size_t>(T) * K && slot_ids.size() == ids.size());
  if (++epoch_ == 0) {  // wrapped: clear the marks so that no stale epoch matches
    std::fill(mark_.begin(), mark_.end(), 0);
    epoch_ = 1;
  }
  hits_.clear();
  miss_tokens_.clear();
  // Reserve up front so that nothing below allocates once tokens are marked.
  hits_.reserve(ids.size());
  miss_tokens_.reserve(ids.size());
  victims_.reserve(ids.size());
  fills.reserve(fills.size() + ids.size());
  std::int32_t* const s_of_t = slot_of_token_.data();
  std::uint32_t* const mark = mark_.data();
  const std::size_t n = ids.size();
  for (std::size_t i = 0; i < n; ++i) {
    const std::int32_t tok = ids[i];
    if (tok < 0) {
      slot_ids[i] = -1;
      continue;
    }
    const std::int32_t s = s_of_t[tok];
    if (s >= 0) {
      if (mark[s] != epoch_) {
        mark[s] = epoch_;
        hits_.push_back(s);
      }
      slot_ids[i] = s;
    } else if (s == -1) {
      const auto m = static_cast<std::int32_t>(miss_tokens_.size());
      miss_tokens_.push_back(tok);
      s_of_t[tok] = -2 - m;
      slot_ids[i] = -2 - m;
    } else {
      slot_ids[i] = s;  // a miss already seen in this step
    }
  }

  victims_.resize(miss_tokens_.size());
  try {
    policy_->step(PolicyStepView{hits_, miss_tokens_, token_of_slot_}, victims_);
  } catch (...) {
    for (std::int32_t tok : miss_tokens_) s_of_t[tok] = -1;  // undo the miss marks
    throw;
  }

  for (std::size_t m = 0; m < miss_tokens_.size(); ++m) {
    const std::int32_t v = victims_[m];
    const std::int32_t tok = miss_tokens_[m];
    const std::int32_t old = token_of_slot_[v];
    if (old >= 0) {
      s_of_t[old] = -1;
    } else {
      ++resident_;
    }
    token_of_slot_[v] = tok;
    s_of_t[tok] = v;
    fills.push_back({tok, v});
  }
  if (!miss_tokens_.empty()) {
    for (std::size_t i = 0; i < n; ++i) {
      if (slot_ids[i] <= -2) slot_ids[i] = victims_[static_cast<std::size_t>(-2 - slot_ids[i])];
    }
  }
  return StepCounts{static_cast<std::int64_t>(hits_.size()), static_cast<std::int64_t>(miss_tokens_.size())};
}

void LayerCache::check_invariants() const {
  std::int32_t occupied = 0;
  for (std::size_t s = 0; s < token_of_slot_.size(); ++s) {
    const std::int32_t tok = token_of_slot_[s];
    if (tok < 0) {
      ESS_ASSERT(tok == -1, "slot {} holds token {}", s, tok);
      continue;
    }
    ++occupied;
    ESS_ASSERT(static_cast<std::size_t>(tok) < slot_of_token_.size() &&
                   slot_of_token_[static_cast<std::size_t>(tok)] == static_cast<std::int32_t>(s),
               "slot {} holds token {} but the token maps elsewhere", s, tok);
  }
  std::int32_t mapped = 0;
  for (std::size_t t = 0; t < slot_of_token_.size(); ++t) {
    const std::int32_t s = slot_of_token_[t];
    if (s == -1) continue;
    ESS_ASSERT(s >= 0 && s < slots() && token_of_slot_[static_cast<std::size_t>(s)] == static_cast<std::int32_t>(t),
               "token {} maps to slot {} which does not hold it", t, s);
    ++mapped;
  }
  ESS_ASSERT(occupied == mapped && occupied == resident_, "occupied {} / mapped {} / resident {}",
             occupied, mapped, resident_);
  policy_->check_invariants();
}

void LayerCache::hash(Digest& d) const {
  d.values(std::span<const std::int32_t>(token_of_slot_));
  d.value(resident_);
  policy_->hash(d);
}

}  // namespace ess
