#include "ess/cache/policies.h"

#include <algorithm>
#include <bit>
#include <limits>

#include "ess/core/digest.h"
#include "ess/core/error.h"

namespace ess {

namespace {
void check_victims(const PolicyStepView& view, std::span<std::int32_t> victims) {
  ESS_ASSERT(victims.size() == view.miss_tokens.size());
}
}  // namespace

// ---- FIFO --------------------------------------------------------------------------------

FifoPolicy::FifoPolicy(std::int32_t slots)
    : n_(slots),
      list_(slots, 1),
      filled_(static_cast<std::size_t>(std::max(slots, 0)), -1),
      in_set_((static_cast<std::size_t>(std::max(slots, 0)) + 63) / 64, 0) {
  ESS_CHECK(slots > 0, "fifo policy: slots = {} must be positive", slots);
  for (std::int32_t s = 0; s < n_; ++s) list_.push_back(0, s);
}

void FifoPolicy::step(const PolicyStepView& view, std::span<std::int32_t> victims) {
  check_victims(view, victims);
  for (std::int32_t s : view.hit_slots) in_set_[static_cast<std::size_t>(s) >> 6] |= 1ULL << (s & 63);
  std::int32_t cur = list_.first(0);
  std::size_t chosen = 0;
  while (chosen < victims.size()) {
    ESS_ASSERT(cur != list_.head(0), "fifo: no victim left (working set larger than the pool)");
    const std::int32_t nx = list_.next(cur);
    if ((in_set_[static_cast<std::size_t>(cur) >> 6] >> (cur & 63) & 1ULL) == 0) {
      victims[chosen++] = cur;
      list_.unlink(cur);
    }
    cur = nx;
  }
  for (std::int32_t s : view.hit_slots) in_set_[static_cast<std::size_t>(s) >> 6] &= ~(1ULL << (s & 63));
  // This step's fills join the tail in ascending slot order.
  std::vector<std::int32_t> sorted(victims.begin(), victims.end());
  std::sort(sorted.begin(), sorted.end());
  for (std::int32_t s : sorted) {
    list_.push_back(0, s);
    filled_[s] = clock_;
  }
  ++clock_;
}

std::vector<std::int64_t> FifoPolicy::recency() const { return filled_; }

void FifoPolicy::hash(Digest& d) const {
  d.value(clock_);
  d.values(std::span<const std::int64_t>(filled_));
  d.values(std::span<const std::int32_t>(list_.links()));
}

void FifoPolicy::check_invariants() const {
  std::int32_t count = 0;
  const std::int32_t head = list_.head(0);
  std::int32_t prev = head;
  for (std::int32_t s = list_.first(0); s != head; s = list_.next(s)) {
    ESS_ASSERT(s >= 0 && s < n_ && list_.prev(s) == prev, "fifo list broken at slot {}", s);
    if (prev != head) {
      ESS_ASSERT(filled_[prev] < filled_[s] || (filled_[prev] == filled_[s] && prev < s),
                 "fifo list out of (fill, slot) order at {} -> {}", prev, s);
    }
    prev = s;
    ESS_ASSERT(++count <= n_, "fifo list has a cycle");
  }
  ESS_ASSERT(count == n_, "fifo list holds {} of {} slots", count, n_);
}

// ---- CLOCK -------------------------------------------------------------------------------

ClockPolicy::ClockPolicy(std::int32_t slots)
    : n_(slots), ref_(static_cast<std::size_t>(std::max(slots, 0)), 0), in_set_(static_cast<std::size_t>(std::max(slots, 0)), 0) {
  ESS_CHECK(slots > 0, "clock policy: slots = {} must be positive", slots);
}

void ClockPolicy::step(const PolicyStepView& view, std::span<std::int32_t> victims) {
  check_victims(view, victims);
  for (std::int32_t s : view.hit_slots) {
    ref_[s] = 1;
    in_set_[s] = 1;
  }
  std::int64_t budget = 3LL * n_ + 3;  // two sweeps clear every bit; a third finds a victim
  for (auto& v : victims) {
    for (;;) {
      ESS_ASSERT(--budget >= 0, "clock: no victim left (working set larger than the pool)");
      const std::int32_t s = hand_;
      hand_ = hand_ + 1 == n_ ? 0 : hand_ + 1;
      if (in_set_[s] != 0) continue;
      if (ref_[s] != 0) {
        ref_[s] = 0;
        continue;
      }
      v = s;
      in_set_[s] = 1;
      ref_[s] = 0;
      break;
    }
  }
  for (std::int32_t s : view.hit_slots) in_set_[s] = 0;
  for (std::int32_t s : victims) in_set_[s] = 0;
}

std::vector<std::int64_t> ClockPolicy::recency() const { return {ref_.begin(), ref_.end()}; }

void ClockPolicy::hash(Digest& d) const {
  d.value(hand_);
  d.values(std::span<const std::uint8_t>(ref_));
}

void ClockPolicy::check_invariants() const {
  ESS_ASSERT(hand_ >= 0 && hand_ < n_, "clock hand {} outside [0, {})", hand_, n_);
  ESS_ASSERT(std::all_of(in_set_.begin(), in_set_.end(), [](std::uint8_t b) { return b == 0; }));
}

// ---- LFU with aging -------------------------------------------------------------------------

LfuPolicy::LfuPolicy(std::int32_t slots, std::int64_t aging_period)
    : n_(slots),
      leaves_(static_cast<std::int32_t>(std::bit_ceil(static_cast<std::uint32_t>(std::max(slots, 1))))),
      aging_period_(aging_period),
      count_(static_cast<std::size_t>(std::max(slots, 0)), 0),
      stamp_(static_cast<std::size_t>(std::max(slots, 0)), -1),
      tree_(2 * static_cast<std::size_t>(leaves_), -1),
      keys_(static_cast<std::size_t>(std::max(slots, 0)), 0) {
  ESS_CHECK(slots > 0, "lfu policy: slots = {} must be positive", slots);
  ESS_CHECK(aging_period > 0, "lfu policy: aging period {} must be positive", aging_period);
  rebuild();
}

// Smaller key = better victim: (count, last use + 1); empty slots have key 0.
std::uint64_t LfuPolicy::key(std::int32_t s) const {
  if (count_[s] == 0) return 0;
  return (static_cast<std::uint64_t>(count_[s]) << 32) | static_cast<std::uint64_t>(stamp_[s] + 1);
}

void LfuPolicy::rebuild() {
  for (std::int32_t s = 0; s < n_; ++s) keys_[s] = key(s);
  for (std::int32_t i = 0; i < leaves_; ++i) tree_[static_cast<std::size_t>(leaves_ + i)] = i < n_ ? i : -1;
  for (std::int32_t i = leaves_ - 1; i >= 1; --i) {
    const std::int32_t a = tree_[2 * static_cast<std::size_t>(i)];
    const std::int32_t b = tree_[2 * static_cast<std::size_t>(i) + 1];
    tree_[static_cast<std::size_t>(i)] = b < 0 || (a >= 0 && keys_[a] <= keys_[b]) ? a : b;
  }
}

void LfuPolicy::set(std::int32_t s, std::uint64_t k) {
  keys_[s] = k;
  for (std::size_t i = (static_cast<std::size_t>(leaves_) + static_cast<std::size_t>(s)) >> 1; i >= 1; i >>= 1) {
    const std::int32_t a = tree_[2 * i];
    const std::int32_t b = tree_[2 * i + 1];
    // Ties go to the left child, i.e. the lower slot index.
    tree_[i] = b < 0 || (a >= 0 && keys_[a] <= keys_[b]) ? a : b;
  }
}

void LfuPolicy::step(const PolicyStepView& view, std::span<std::int32_t> victims) {
  check_victims(view, victims);
  constexpr std::uint64_t kBusy = std::numeric_limits<std::uint64_t>::max();
  // Re-keys many slots with one sweep of the tree, a few with path updates.
  const auto log = static_cast<std::size_t>(std::bit_width(static_cast<std::uint32_t>(leaves_)));
  auto settle = [&](std::span<const std::int32_t> a, std::span<const std::int32_t> b) {
    if ((a.size() + b.size()) * log > static_cast<std::size_t>(leaves_)) {
      for (std::size_t i = static_cast<std::size_t>(leaves_) - 1; i >= 1; --i) {
        const std::int32_t x = tree_[2 * i];
        const std::int32_t y = tree_[2 * i + 1];
        tree_[i] = y < 0 || (x >= 0 && keys_[x] <= keys_[y]) ? x : y;
      }
    } else {
      for (std::int32_t s : a) set(s, keys_[s]);
      for (std::int32_t s : b) set(s, keys_[s]);
    }
  };
  for (std::int32_t s : view.hit_slots) keys_[s] = kBusy;
  settle(view.hit_slots, {});
  for (auto& v : victims) {
    const std::int32_t s = tree_[1];
    ESS_ASSERT(s >= 0 && keys_[s] != kBusy, "lfu: no victim left (working set larger than the pool)");
    v = s;
    set(s, kBusy);
  }
  for (std::int32_t s : view.hit_slots) {
    if (count_[s] < std::numeric_limits<std::uint32_t>::max()) ++count_[s];
    stamp_[s] = clock_;
  }
  for (std::int32_t s : victims) {
    count_[s] = 1;
    stamp_[s] = clock_;
  }
  ++clock_;
  if (clock_ % aging_period_ == 0) {
    for (auto& c : count_) c = c == 0 ? 0 : std::max<std::uint32_t>(1, c >> 1);
    rebuild();
  } else {
    for (std::int32_t s : view.hit_slots) keys_[s] = key(s);
    for (std::int32_t s : victims) keys_[s] = key(s);
    settle(view.hit_slots, victims);
  }
}

std::vector<std::int64_t> LfuPolicy::recency() const { return {count_.begin(), count_.end()}; }

void LfuPolicy::hash(Digest& d) const {
  d.value(clock_);
  d.values(std::span<const std::uint32_t>(count_));
  d.values(std::span<const std::int64_t>(stamp_));
}

void LfuPolicy::check_invariants() const {
  for (std::int32_t s = 0; s < n_; ++s) ESS_ASSERT(keys_[s] == key(s), "lfu key of slot {} stale", s);
  std::int32_t best = 0;
  for (std::int32_t s = 1; s < n_; ++s) {
    if (keys_[s] < keys_[best]) best = s;
  }
  ESS_ASSERT(tree_[1] == best, "lfu tree root {} is not the minimum {}", tree_[1], best);
}

// ---- S3-FIFO -------------------------------------------------------------------------------

S3FifoPolicy::S3FifoPolicy(std::int32_t slots)
    : n_(slots),
      small_target_(std::max<std::int32_t>(1, slots / 10)),
      lists_(slots, 3),
      queue_(static_cast<std::size_t>(std::max(slots, 0)), kFree),
      freq_(static_cast<std::size_t>(std::max(slots, 0)), 0),
      in_set_(static_cast<std::size_t>(std::max(slots, 0)), 0),
      ghost_capacity_(std::max<std::int64_t>(1, slots - std::max<std::int32_t>(1, slots / 10))) {
  ESS_CHECK(slots > 0, "s3fifo policy: slots = {} must be positive", slots);
  // The free list pops from its tail: pushing 0, 1, ... at the head leaves slot 0 at the tail.
  for (std::int32_t s = 0; s < n_; ++s) push_head(kFree, s);
}

void S3FifoPolicy::unlink(std::int32_t s) {
  lists_.unlink(s);
  --size_[queue_[s]];
}

void S3FifoPolicy::push_head(Queue q, std::int32_t s) {
  lists_.push_front(q, s);
  queue_[s] = q;
  ++size_[q];
}

bool S3FifoPolicy::in_ghost(std::int32_t token) const {
  if (token < 0 || static_cast<std::size_t>(token) >= ghost_seq_.size()) return false;
  const std::int64_t seq = ghost_seq_[static_cast<std::size_t>(token)];
  return seq >= 0 && ghost_next_ - seq <= ghost_capacity_;
}

void S3FifoPolicy::to_ghost(std::int32_t token) {
  if (token < 0) return;
  if (static_cast<std::size_t>(token) >= ghost_seq_.size()) {
    ghost_seq_.resize(std::max<std::size_t>(static_cast<std::size_t>(token) + 1, ghost_seq_.size() * 2), -1);
  }
  ghost_seq_[static_cast<std::size_t>(token)] = ghost_next_++;
}

// Frees one slot that is not in this step's working set and returns it (unlinked).
std::int32_t S3FifoPolicy::evict(std::span<const std::int32_t> token_of_slot) {
  if (size_[kFree] > 0) {
    const std::int32_t s = tail(kFree);
    unlink(s);
    return s;
  }
  std::int64_t budget = 8LL * n_ + 8;
  for (;;) {
    ESS_ASSERT(--budget >= 0, "s3fifo: no victim left (working set larger than the pool)");
    // The main FIFO yields a victim only when it holds a slot outside the working set; when
    // every slot it holds is in use, the small FIFO must give one up however small it is.
    if (size_[kSmall] >= small_target_ || size_[kMain] == busy_main_) {
      const std::int32_t s = tail(kSmall);
      ESS_ASSERT(s < n_, "s3fifo: both queues empty or in use");
      unlink(s);
      if (freq_[s] > 0 || in_set_[s] != 0) {
        freq_[s] = 0;
        push_head(kMain, s);  // accessed while in the small FIFO: promote
        if (in_set_[s] != 0) ++busy_main_;
        continue;
      }
      to_ghost(token_of_slot[s]);
      return s;
    }
    const std::int32_t s = tail(kMain);
    unlink(s);
    if (in_set_[s] != 0 || freq_[s] > 0) {
      if (freq_[s] > 0) --freq_[s];
      push_head(kMain, s);  // lazy promotion: reinsert with one use less
      continue;
    }
    return s;
  }
}

void S3FifoPolicy::step(const PolicyStepView& view, std::span<std::int32_t> victims) {
  check_victims(view, victims);
  busy_main_ = 0;
  for (std::int32_t s : view.hit_slots) {
    in_set_[s] = 1;
    if (freq_[s] < 3) ++freq_[s];
    if (queue_[s] == kMain) ++busy_main_;
  }
  for (std::size_t i = 0; i < victims.size(); ++i) {
    victims[i] = evict(view.token_of_slot);
    in_set_[victims[i]] = 1;
  }
  for (std::size_t i = 0; i < victims.size(); ++i) {
    const std::int32_t s = victims[i];
    const std::int32_t tok = view.miss_tokens[i];
    freq_[s] = 0;
    if (in_ghost(tok)) {
      ghost_seq_[static_cast<std::size_t>(tok)] = -1;
      push_head(kMain, s);
    } else {
      push_head(kSmall, s);
    }
  }
  for (std::int32_t s : view.hit_slots) in_set_[s] = 0;
  for (std::int32_t s : victims) in_set_[s] = 0;
}

std::vector<std::int64_t> S3FifoPolicy::recency() const {
  std::vector<std::int64_t> out(static_cast<std::size_t>(n_));
  for (std::int32_t s = 0; s < n_; ++s) out[s] = queue_[s] == kFree ? -1 : freq_[s];
  return out;
}

void S3FifoPolicy::hash(Digest& d) const {
  d.values(std::span<const std::int32_t>(lists_.links()));
  d.values(std::span<const std::uint8_t>(freq_));
  d.value(ghost_next_);
}

void S3FifoPolicy::check_invariants() const {
  std::int32_t total = 0;
  for (int q = 0; q < 3; ++q) {
    const std::int32_t h = lists_.head(q);
    std::int32_t count = 0;
    std::int32_t prev = h;
    for (std::int32_t s = lists_.first(q); s != h; s = lists_.next(s)) {
      ESS_ASSERT(s >= 0 && s < n_ && lists_.prev(s) == prev && queue_[s] == q, "s3fifo queue {} broken at slot {}", q, s);
      prev = s;
      ESS_ASSERT(++count <= n_, "s3fifo queue {} has a cycle", q);
    }
    ESS_ASSERT(count == size_[q], "s3fifo queue {} holds {} slots, size says {}", q, count, size_[q]);
    total += count;
  }
  ESS_ASSERT(total == n_, "s3fifo queues hold {} of {} slots", total, n_);
}

// ---- factory -----------------------------------------------------------------------------

std::vector<std::string> online_policy_names() { return {"lru", "fifo", "clock", "lfu", "s3fifo"}; }

PolicyFactory make_policy_factory(std::string_view name, const PolicyOptions& options) {
  if (name == "lru") return lru_factory();
  if (name == "fifo") return [](RequestId, int, std::int32_t slots) { return std::make_unique<FifoPolicy>(slots); };
  if (name == "clock") return [](RequestId, int, std::int32_t slots) { return std::make_unique<ClockPolicy>(slots); };
  if (name == "lfu") {
    const auto period = options.lfu_aging_period;
    ESS_CHECK(period > 0, "lfu aging period {} must be positive", period);
    return [period](RequestId, int, std::int32_t slots) { return std::make_unique<LfuPolicy>(slots, period); };
  }
  if (name == "s3fifo") return [](RequestId, int, std::int32_t slots) { return std::make_unique<S3FifoPolicy>(slots); };
  if (name == "belady") {
    ESS_THROW("policy 'belady' is offline (it needs the future top-k): use the trace analyzer");
  }
  ESS_THROW("unknown replacement policy '{}' (known: lru, fifo, clock, lfu, s3fifo; belady in the analyzer)", name);
}

}  // namespace ess
