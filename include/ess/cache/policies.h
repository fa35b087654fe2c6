// Alternative replacement policies of the Sparse Memory Pool, for the trace analyzer and for
// experiments. They follow the contract of ess::ReplacementPolicy (policy.h) exactly: victims
// are distinct, never a slot of the step's working set, and empty slots are ordinary victims.
// Every tie is broken towards the lower slot index, so each policy is deterministic.
//
//   fifo    first in, first out: evicts the slot filled longest ago; hits do not refresh.
//   clock   CLOCK (second chance): a hand sweeps the slots; a hit sets the slot's reference
//           bit, the hand clears set bits and evicts the first slot whose bit is clear. New
//           fills start with the bit clear.
//   lfu     LFU with aging: evicts the slot with the fewest uses (ties: least recently used,
//           then lower slot); every `aging_period` steps all counts are halved, so tokens that
//           were hot long ago do not squat forever.
//   s3fifo  S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10 % of the slots) that new tokens
//           enter, a main FIFO with 2-bit frequencies and lazy promotion, and a ghost FIFO of
//           recently evicted tokens; a miss on a ghost token enters the main FIFO directly.
//           When every slot of the main FIFO is in the step's working set, the small FIFO gives
//           up its victim whatever its size.
//   lru     LruPolicy (policy.h).
// Belady's MIN (BeladyPolicy, policy.h) needs the future and is built by the analyzer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ess/cache/policy.h"
#include "ess/cache/slot_lists.h"

namespace ess {

class FifoPolicy final : public ReplacementPolicy {
 public:
  explicit FifoPolicy(std::int32_t slots);
  std::string_view name() const override { return "fifo"; }
  void step(const PolicyStepView& view, std::span<std::int32_t> victims) override;
  std::vector<std::int64_t> recency() const override;  // step of the slot's fill, -1 = never
  void hash(Digest& d) const override;
  void check_invariants() const override;

 private:
  std::int32_t n_;
  std::int64_t clock_ = 0;
  SlotLists list_;  // one list in (fill step, slot) order
  std::vector<std::int64_t> filled_;
  std::vector<std::uint64_t> in_set_;  // scratch: hit and chosen slots of this step
};

class ClockPolicy final : public ReplacementPolicy {
 public:
  explicit ClockPolicy(std::int32_t slots);
  std::string_view name() const override { return "clock"; }
  void step(const PolicyStepView& view, std::span<std::int32_t> victims) override;
  std::vector<std::int64_t> recency() const override;  // reference bits (0/1)
  void hash(Digest& d) const override;
  void check_invariants() const override;

 private:
  std::int32_t n_;
  std::int32_t hand_ = 0;
  std::vector<std::uint8_t> ref_;
  std::vector<std::uint8_t> in_set_;  // scratch
};

class LfuPolicy final : public ReplacementPolicy {
 public:
  LfuPolicy(std::int32_t slots, std::int64_t aging_period);
  std::string_view name() const override { return "lfu"; }
  void step(const PolicyStepView& view, std::span<std::int32_t> victims) override;
  std::vector<std::int64_t> recency() const override;  // use counts
  void hash(Digest& d) const override;
  void check_invariants() const override;

 private:
  std::uint64_t key(std::int32_t s) const;
  void set(std::int32_t s, std::uint64_t k);
  void rebuild();

  std::int32_t n_;
  std::int32_t leaves_;  // power of two >= n_
  std::int64_t aging_period_;
  std::int64_t clock_ = 0;
  std::vector<std::uint32_t> count_;  // 0 = empty slot
  std::vector<std::int64_t> stamp_;   // last use, -1 = never
  std::vector<std::int32_t> tree_;    // tournament tree of argmin keys; leaves at [leaves_, 2 leaves_)
  std::vector<std::uint64_t> keys_;   // current key per slot (UINT64_MAX while in the working set)
};

class S3FifoPolicy final : public ReplacementPolicy {
 public:
  explicit S3FifoPolicy(std::int32_t slots);
  std::string_view name() const override { return "s3fifo"; }
  void step(const PolicyStepView& view, std::span<std::int32_t> victims) override;
  std::vector<std::int64_t> recency() const override;  // frequency (0..3), -1 = empty
  void hash(Digest& d) const override;
  void check_invariants() const override;

 private:
  enum Queue : std::uint8_t { kFree = 0, kSmall = 1, kMain = 2 };
  void unlink(std::int32_t s);
  void push_head(Queue q, std::int32_t s);
  std::int32_t tail(Queue q) const { return lists_.last(q); }
  bool in_ghost(std::int32_t token) const;
  void to_ghost(std::int32_t token);
  std::int32_t evict(std::span<const std::int32_t> token_of_slot);

  std::int32_t n_;
  std::int32_t small_target_;  // 10 % of the slots (at least 1)
  std::int32_t size_[3] = {0, 0, 0};
  std::int32_t busy_main_ = 0;  // during a step: slots of the main FIFO in its working set
  SlotLists lists_;  // one list per queue
  std::vector<Queue> queue_;
  std::vector<std::uint8_t> freq_;
  std::vector<std::uint8_t> in_set_;  // scratch
  std::vector<std::int64_t> ghost_seq_;  // token -> sequence number when it entered the ghost, -1
  std::int64_t ghost_next_ = 0;          // sequence numbers handed out so far
  std::int64_t ghost_capacity_;
};

struct PolicyOptions {
  std::int64_t lfu_aging_period = 64;  // steps between halvings of the LFU counts
};

// The online policies by name: lru, fifo, clock, lfu, s3fifo. Throws ess::Error for another
// name (belady is offline: the analyzer builds it from the trace).
PolicyFactory make_policy_factory(std::string_view name, const PolicyOptions& options = {});
std::vector<std::string> online_policy_names();

}  // namespace ess
