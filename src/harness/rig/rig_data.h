// The data the decode-step executor runs on, generated on the host: the latent entry of
// every (request, layer, token) and the attention queries. Both are functions of the seed,
// so the host pool, the device slots, the resident cache and the CPU reference agree on
// every byte, and the reference output of any query token can be computed without a device
// (the executor tests check the GPU's attention against it).
//
// Entries: (request, layer, token) picks one of kEntryTable quantized random latent entries
// by a hash, so nothing is stored per token and a misplaced entry shows up as other bytes.
// Plain C++.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ess/model/entry_layout.h"
#include "ess/model/model_spec.h"
#include "ess/ops/reference.h"
#include "harness/rig/config.h"

namespace ess::rig {

class RigData {
 public:
  static constexpr int kEntryTable = 4096;

  // Queries for `batch` requests of `query_tokens` tokens each.
  RigData(const ModelSpec& model, int batch, int query_tokens, std::uint64_t seed);

  const LatentLayout& layout() const { return layout_; }
  int heads() const { return heads_; }
  float softmax_scale() const { return softmax_scale_; }
  // kEntryTable entries of layout().bytes(), back to back.
  const std::vector<std::uint8_t>& table() const { return table_; }
  // The table index of token p of request b in layer l.
  static std::uint64_t entry_index(int b, int l, std::int64_t p);
  std::span<const std::uint8_t> entry(int b, int l, std::int64_t p) const;
  // [batch][query_tokens][heads][576] bf16 bits; the same queries in every layer and step.
  const std::vector<std::uint16_t>& queries() const { return queries_; }
  std::span<const std::uint16_t> query(int b, int t) const;

 private:
  LatentLayout layout_;
  int heads_ = 0, query_tokens_ = 0;
  float softmax_scale_ = 0;
  std::vector<std::uint8_t> table_;
  std::vector<std::uint16_t> queries_;
};

// The CPU reference input of query token (b, t) at step s, layer l: its query and the
// entries its K selected ids name (nullptr where padded).
struct TokenProblem {
  ref::SparseMlaParams params;
  std::span<const std::uint16_t> q;
  std::vector<const std::uint8_t*> entries;
  int valid = 0;  // selected ids that are not padding
};
TokenProblem token_problem(const RigData& rig, const StepInputs& inputs, int step, int layer, int b, int t);

}  // namespace ess::rig
