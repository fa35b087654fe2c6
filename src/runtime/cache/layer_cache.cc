#include "ess/cache/layer_cache.h"

#include <algorithm>
#include <limits>

#include "ess/core/digest.h"
#include "ess/core/error.h"

namespace ess {

LayerCache::LayerCache(std::int32_t slots, std::unique_ptr<ReplacementPolicy> policy)
    : token_of_slot_(static_cast<std::size_t>(slots), -1),
      policy_(std::move(policy)) {
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

// Slot values >= 0 are resident slots. During a step a token already looked up is
// temporarily marked in slot_of_token_, so that a later query token selecting it resolves to
// the same entry without counting it twice: a miss as -2 - (its miss index), a hit as
// -2 - n - (its hit index) (n = the step's ids, more than there can be misses). The marks
// are replaced by the slots (victims for the misses) before returning.
StepCounts LayerCache::access(std::span<const std::int32_t> ids, int T, int K,
                              std::span<std::int32_t> slot_ids, std::vector<Fill>& fills) {
  ESS_ASSERT(ids.size() == static_cast<std::size_t>(T) * K && slot_ids.size() == ids.size());
  const std::size_t n = ids.size();
  ESS_ASSERT(n <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max() / 2 - 2),
             "layer cache: a step of {} ids is too large to mark", n);
  // Sized once for the largest step (nothing below allocates once tokens are marked); a
  // step uses the first n_hits / n_misses entries.
  if (hits_.size() < n) {
    hits_.resize(n);
    hit_tokens_.resize(n);
    miss_tokens_.resize(n);
    miss_at_.resize(n);
    victims_.resize(n);
  }
  fills.reserve(fills.size() + n);
  std::int32_t* const s_of_t = slot_of_token_.data();
  std::int32_t* const hit_slot = hits_.data();
  std::int32_t* const hit_token = hit_tokens_.data();
  std::int32_t* const miss_token = miss_tokens_.data();
  std::size_t* const miss_at = miss_at_.data();
  const std::int32_t* const id = ids.data();
  std::int32_t* const out = slot_ids.data();
  const auto hit_base = static_cast<std::int32_t>(n);
  std::int32_t n_hits = 0, n_misses = 0;
  std::size_t n_miss_at = 0;
  // The lookups are independent loads spread over the token index: fetch them ahead.
  constexpr std::size_t kAhead = 24;
  for (std::size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(s_of_t + std::max(id[i + kAhead], 0), 1);
    const std::int32_t tok = id[i];
    if (tok < 0) {
      out[i] = -1;
      continue;
    }
    const std::int32_t s = s_of_t[tok];
    if (s >= 0) {  // a hit, first seen
      hit_slot[n_hits] = s;
      hit_token[n_hits] = tok;
      s_of_t[tok] = -2 - hit_base - n_hits;
      ++n_hits;
      out[i] = s;
    } else if (s == -1) {  // a miss, first seen
      miss_token[n_misses] = tok;
      s_of_t[tok] = -2 - n_misses;
      out[i] = -2 - n_misses;
      miss_at[n_miss_at++] = i;
      ++n_misses;
    } else if (-2 - s >= hit_base) {  // a hit seen already in this step
      out[i] = hit_slot[-2 - s - hit_base];
    } else {  // a miss seen already in this step
      out[i] = s;
      miss_at[n_miss_at++] = i;
    }
  }
  for (std::int32_t j = 0; j < n_hits; ++j) s_of_t[hit_token[j]] = hit_slot[j];  // unmark the hits

  const std::span<const std::int32_t> misses(miss_token, static_cast<std::size_t>(n_misses));
  const std::span<std::int32_t> victims(victims_.data(), misses.size());
  try {
    policy_->step(PolicyStepView{std::span<const std::int32_t>(hit_slot, static_cast<std::size_t>(n_hits)), misses,
                                 token_of_slot_},
                  victims);
  } catch (...) {
    for (std::int32_t tok : misses) s_of_t[tok] = -1;  // undo the miss marks
    throw;
  }

  for (std::size_t m = 0; m < misses.size(); ++m) {
    const std::int32_t v = victims[m];
    const std::int32_t tok = misses[m];
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
  for (std::size_t j = 0; j < n_miss_at; ++j) {
    std::int32_t& o = out[miss_at[j]];
    o = victims[static_cast<std::size_t>(-2 - o)];
  }
  return StepCounts{n_hits, n_misses};
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
