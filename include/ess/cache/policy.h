// Replacement policies of the Sparse Memory Pool (one instance per request-layer).
//
// Contract, shared by every policy and by the GPU swap engine that must match them:
//   * A step's working set is the set of distinct tokens its T query tokens select.
//   * The engine finds the hits (resident tokens) and the misses, in canonical order:
//     query token 0..T-1, then top-k position 0..K-1, first occurrence only.
//   * The policy is told the hit slots (distinct, canonical order) and how many misses there
//     are; it returns as many distinct victim slots, none of them a hit slot; the i-th miss
//     goes to the i-th victim. Empty slots are ordinary victims (they hold no token).
//   * Afterwards the whole working set (hits and newly filled victims) counts as used by
//     this step.
// The pool has at least as many slots as a working set can hold, so victims always exist.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string_view>
#include <vector>

#include "ess/cache/slot_lists.h"
#include "ess/cache/types.h"

namespace ess {

class Digest;

struct PolicyStepView {
  std::span<const std::int32_t> hit_slots;      // distinct resident slots, canonical order
  std::span<const std::int32_t> miss_tokens;    // tokens needing a slot, canonical order
  std::span<const std::int32_t> token_of_slot;  // residency before this step (-1 = empty)
};

class ReplacementPolicy {
 public:
  virtual ~ReplacementPolicy() = default;
  virtual std::string_view name() const = 0;
  // Chooses victims.size() == miss_tokens.size() victims and records the step's use.
  virtual void step(const PolicyStepView& view, std::span<std::int32_t> victims) = 0;
  // Per-slot recency as the policy sees it, for inspection and for bit-exact comparison
  // with the GPU engine (LRU: the step index of the slot's last use, -1 if never used).
  virtual std::vector<std::int64_t> recency() const = 0;
  virtual void hash(Digest& d) const = 0;
  // Throws ess::Error (internal) if the policy's own structures are inconsistent.
  virtual void check_invariants() const = 0;
};

// Creates the policy of one request-layer with `slots` slots.
using PolicyFactory =
    std::function<std::unique_ptr<ReplacementPolicy>(RequestId request, int layer, std::int32_t slots)>;

// LRU exactly as the ESS paper: recency is the index of the step that last used the slot
// (steps counted per request-layer from 0, LRU-Warmup windows included; -1 = never used).
// Victims are the non-working-set slots in ascending (recency, slot index) order: the least
// recently used first, ties (slots used in the same step, or never used) to the lower slot
// index. All T MTP query tokens of one step refresh to the same step index.
class LruPolicy final : public ReplacementPolicy {
 public:
  explicit LruPolicy(std::int32_t slots);
  std::string_view name() const override { return "lru"; }
  void step(const PolicyStepView& view, std::span<std::int32_t> victims) override;
  std::vector<std::int64_t> recency() const override;
  void hash(Digest& d) const override;
  void check_invariants() const override;

 private:
  std::int32_t n_;
  std::int64_t clock_ = 0;             // index of the next step
  SlotLists list_;                     // one list in (recency, slot) order: first() is the LRU slot
  std::vector<std::int64_t> stamp_;    // last step that used the slot, -1 = never
  std::vector<std::uint64_t> in_set_;  // scratch bitmap of this step's working-set slots
  std::vector<std::int32_t> working_;  // scratch: those slots in ascending order
};

// Belady's MIN, offline: given the exact sequence of working sets the policy will see, it
// evicts the resident token whose next use lies furthest in the future (empty slots first,
// then tokens never used again, then the furthest next use; ties to the lower slot index).
// For demand fetching with whole working sets that must be resident together this is the
// minimum number of misses any policy can achieve; the analyzers use it as the lower bound.
// O(|working set| + min(slots, |working set| log slots)) per step: a tournament tree over the
// slots' keys (largest key wins, ties to the lower slot), rebuilt in one sweep when a step
// changes more keys than a sweep costs. A hit slot's key is always the current step (that is
// its next use), smaller than every other slot's, so hits never win before they are re-keyed.
class BeladyPolicy final : public ReplacementPolicy {
 public:
  // future[i] holds the distinct tokens of the i-th step this policy will see.
  BeladyPolicy(std::int32_t slots, std::vector<std::vector<std::int32_t>> future);
  std::string_view name() const override { return "belady"; }
  void step(const PolicyStepView& view, std::span<std::int32_t> victims) override;
  std::vector<std::int64_t> recency() const override;  // next-use step per slot
  void hash(Digest& d) const override;
  void check_invariants() const override;

 private:
  std::int64_t next_use(std::int64_t step, std::int32_t token) const;
  bool wins(std::int32_t a, std::int32_t b) const {  // a beats b as a victim (b may be -1)
    return b < 0 || (a >= 0 && key_[a] >= key_[b]);
  }
  void update(std::int32_t s);  // re-evaluates the path from slot s to the root
  void rebuild();

  std::int32_t n_;
  std::int32_t leaves_;  // power of two >= n_
  std::int64_t clock_ = 0;
  std::vector<std::size_t> begin_;          // per step: first index in tokens_ / uses_ (+ end)
  std::vector<std::int32_t> tokens_;        // the future, flat
  std::vector<std::int64_t> uses_;          // next use of tokens_[j] after its step
  std::vector<std::int64_t> use_of_token_;  // scratch: token -> next use, valid where stamped
  std::vector<std::int64_t> stamp_of_token_;  // token -> step whose uses fill use_of_token_
  std::vector<std::int64_t> key_;   // per slot: next use (kEmpty for empty slots)
  std::vector<std::int32_t> tree_;  // tournament tree: winner slot per node, leaves at [leaves_, 2 leaves_)
};

PolicyFactory lru_factory();

}  // namespace ess
