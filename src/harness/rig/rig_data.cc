#include "harness/rig/rig_data.h"

#include <cmath>
#include <random>

#include "ess/core/error.h"
#include "ess/model/numerics.h"

namespace ess::rig {
namespace {

std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 29;
  return x;
}

}  // namespace

std::uint64_t RigData::entry_index(int b, int l, std::int64_t p) {
  const std::uint64_t x = (static_cast<std::uint64_t>(b) << 40) ^ (static_cast<std::uint64_t>(l) << 32) ^
                          static_cast<std::uint64_t>(p) ^ 0x9E3779B97F4A7C15ULL;
  return mix(x) % kEntryTable;
}

RigData::RigData(const ModelSpec& m, int batch, int query_tokens, std::uint64_t seed)
    : layout_(LatentLayout::for_model(m)),
      heads_(m.num_attention_heads),
      query_tokens_(query_tokens),
      softmax_scale_(1.0f / std::sqrt(static_cast<float>(m.qk_nope_head_dim + m.qk_rope_head_dim))) {
  ESS_CHECK(batch >= 1 && query_tokens >= 1, "rig data: batch {} and query tokens {} must be >= 1", batch, query_tokens);
  // Entries of different ranges per 128-value tile, as real latents after block scaling.
  table_.resize(static_cast<std::size_t>(kEntryTable) * layout_.bytes());
  std::mt19937_64 rng(seed + 5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> nope(static_cast<std::size_t>(layout_.nope_dim)), rope(static_cast<std::size_t>(layout_.rope_dim));
  for (int i = 0; i < kEntryTable; ++i) {
    const float tile_scale = std::ldexp(1.0f, static_cast<int>(rng() % 7) - 3);
    for (float& v : nope) v = nd(rng) * tile_scale;
    for (float& v : rope) v = nd(rng);
    quantize_latent(layout_, nope, rope, {table_.data() + static_cast<std::size_t>(i) * layout_.bytes(), layout_.bytes()});
  }
  // Queries uniform in [-1, 1], rounded to bf16.
  const std::size_t dim = static_cast<std::size_t>(layout_.nope_dim + layout_.rope_dim);
  queries_.resize(static_cast<std::size_t>(batch) * static_cast<std::size_t>(query_tokens) * static_cast<std::size_t>(heads_) * dim);
  const std::uint64_t salt = mix(seed + 1) | 1;
  for (std::size_t i = 0; i < queries_.size(); ++i) {
    const double u = static_cast<double>(mix(mix(i * 0x9E3779B97F4A7C15ULL + salt)) >> 11) * 0x1p-53;  // [0, 1)
    queries_[i] = bf16_from_float(static_cast<float>(2.0 * u - 1.0));
  }
}

std::span<const std::uint8_t> RigData::entry(int b, int l, std::int64_t p) const {
  return {table_.data() + entry_index(b, l, p) * layout_.bytes(), layout_.bytes()};
}

std::span<const std::uint16_t> RigData::query(int b, int t) const {
  const std::size_t n = static_cast<std::size_t>(heads_) * static_cast<std::size_t>(layout_.nope_dim + layout_.rope_dim);
  const std::size_t token = static_cast<std::size_t>(b) * static_cast<std::size_t>(query_tokens_) + static_cast<std::size_t>(t);
  ESS_CHECK((token + 1) * n <= queries_.size() && t < query_tokens_, "rig data: no query for request {} token {}", b, t);
  return {queries_.data() + token * n, n};
}

TokenProblem token_problem(const RigData& rig, const StepInputs& in, int step, int layer, int b, int t) {
  ESS_CHECK(step >= 0 && step < in.steps && layer >= 0 && layer < in.layers && b >= 0 && b < in.batch && t >= 0 &&
                t < in.mtp,
            "rig data: step {} layer {} request {} token {} outside the inputs ({} x {} x {} x {})", step, layer, b, t,
            in.steps, in.layers, in.batch, in.mtp);
  TokenProblem p;
  p.params = ref::SparseMlaParams{rig.layout(), rig.heads(), rig.softmax_scale()};
  p.q = rig.query(b, t);
  const std::int32_t* ids =
      in.step_ids(step, layer) + (static_cast<std::size_t>(b) * in.mtp + static_cast<std::size_t>(t)) * in.topk;
  for (int k = 0; k < in.topk; ++k) {
    const std::int32_t id = ids[k];
    p.entries.push_back(id < 0 ? nullptr : rig.entry(b, layer, id).data());
    p.valid += id < 0 ? 0 : 1;
  }
  return p;
}

}  // namespace ess::rig
