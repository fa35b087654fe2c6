// The residency of one request-layer in the Sparse Memory Pool: which token each slot holds,
// which slot each token occupies, and the replacement policy that picks victims. This is the
// whole decision logic of the swap engine for one request-layer; SwapEngine adds batching,
// validation and the miss plan, and the trace analyzers replay traces through it directly.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ess/cache/policy.h"
#include "ess/cache/types.h"

namespace ess {

class Digest;

struct Fill {
  std::int32_t token;
  std::int32_t slot;
};

class LayerCache {
 public:
  LayerCache(std::int32_t slots, std::unique_ptr<ReplacementPolicy> policy);

  // Makes the token index cover tokens [0, length). Changes no observable state.
  void reserve_tokens(std::int64_t length);

  // One step. `ids` holds T x K selected token ids (row t = query token t), -1 = padding.
  // Preconditions (checked by the caller, see SwapEngine::step): every id is -1 or in
  // [0, reserved length), and no id repeats within one query row.
  // Writes the slot id of every position to `slot_ids` (-1 for padding) and appends the
  // misses, in canonical order, to `fills`. Returns the distinct hits and misses.
  StepCounts access(std::span<const std::int32_t> ids, int T, int K, std::span<std::int32_t> slot_ids,
                    std::vector<Fill>& fills);

  std::int32_t slots() const { return static_cast<std::int32_t>(token_of_slot_.size()); }
  std::int32_t slot_of(std::int32_t token) const {
    return token >= 0 && static_cast<std::size_t>(token) < slot_of_token_.size() ? slot_of_token_[token] : -1;
  }
  std::int32_t token_in(std::int32_t slot) const { return token_of_slot_[slot]; }
  std::span<const std::int32_t> token_of_slot() const { return token_of_slot_; }
  std::int32_t resident() const { return resident_; }
  const ReplacementPolicy& policy() const { return *policy_; }

  // Throws (internal error) unless token <-> slot is a bijection between resident tokens and
  // occupied slots and the policy is consistent.
  void check_invariants() const;
  void hash(Digest& d) const;

 private:
  std::vector<std::int32_t> slot_of_token_;  // token -> slot, -1 = not resident
  std::vector<std::int32_t> token_of_slot_;  // slot -> token, -1 = empty
  std::unique_ptr<ReplacementPolicy> policy_;
  std::int32_t resident_ = 0;
  // Per-step scratch.
  std::vector<std::int32_t> hits_;        // distinct hit slots, canonical order
  std::vector<std::int32_t> hit_tokens_;  // their tokens
  std::vector<std::int32_t> miss_tokens_;
  std::vector<std::size_t> miss_at_;      // positions whose slot id is a miss mark
  std::vector<std::int32_t> victims_;
};

}  // namespace ess
