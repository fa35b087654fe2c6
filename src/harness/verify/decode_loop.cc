#include "harness/verify/decode_loop.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include "ess/cache/query_groups.h"
#include "ess/cache/sparse_pool.h"
#include "ess/core/error.h"
#include "ess/io/host_budget.h"
#include "ess/model/entry_layout.h"
#include "ess/model/numerics.h"
#include "ess/ops/reference.h"
#include "ess/runtime/backend.h"
#include "testing/offload_io.h"

namespace ess {

void VerifyConfig::validate(const ModelSpec& model) const {
  if (model.selection_block() > 1) {
    ESS_CHECK(topk > 0 && topk % model.selection_block() == 0,
              "verify: --topk = {} with {}'s block top-k: a multiple of its {}-token blocks (the model selects {})", topk,
              model.name, model.selection_block(), model.index_topk);
  }
  ESS_CHECK(requests > 0 && requests <= 4096, "verify: --requests = {} must be in [1, 4096]", requests);
  const auto offloaded = static_cast<int>(model.offloaded_layers().size());
  ESS_CHECK(layers > 0 && layers <= offloaded,
            "verify: --layers = {} must be in [1, {}] (the model's {})", layers, offloaded,
            model.is_deepseek_v4() ? "layers with a C4 cache" : "num_hidden_layers");
  const int R = model.tokens_per_entry();
  if (R > 1) {
    ESS_CHECK(mtp == 1,
              "verify: --mtp = {} with {}'s compressed cache: a step's reserved rows hold its new entries, and a "
              "cache of one entry per {} tokens gains at most one per step; use --mtp 1",
              mtp, model.name, R);
    ESS_CHECK(prefix_share == 0.0, "verify: --prefix-share with {}'s compressed cache is not served (entries of {} tokens "
              "do not end where a shared prompt does)", model.name, R);
    ESS_CHECK(context >= R, "verify: --context = {} holds no entry of {}'s compressed cache ({} tokens each)", context,
              model.name, R);
  }
  ESS_CHECK(context > 0 && context <= (std::int64_t{1} << 24), "verify: --context = {} must be in [1, 2^24]", context);
  ESS_CHECK(steps >= 1 && steps <= 4096, "verify: --steps = {} must be in [1, 4096] (at least one step is checked)",
            steps);
  ESS_CHECK(model.max_position_embeddings <= 0 || context + static_cast<std::int64_t>(steps) * mtp <= model.max_position_embeddings,
            "verify: --context {} + {} steps x {} tokens exceeds the model's max_position_embeddings ({})", context,
            steps, mtp, model.max_position_embeddings);
  ESS_CHECK(mtp > 0 && mtp <= 16, "verify: --mtp = {} must be in [1, 16]", mtp);
  ESS_CHECK(topk > 0, "verify: --topk = {} must be positive", topk);
  // Entries: tokens, or for a compressed cache one per R tokens.
  const std::int64_t entries = (context + static_cast<std::int64_t>(steps) * mtp) / R;
  ESS_CHECK(slots >= 0 && slots <= entries,
            "verify: --slots = {} must be in [0, {}] (0 = use --ratio; at most the {} entries there will be)", slots,
            entries, R > 1 ? "compressed" : "context + steps x T");
  if (slots == 0) {
    const std::int32_t derived = slots_for_ratio(ratio, context / R);
    const std::int64_t need = std::min<std::int64_t>(topk, entries);
    ESS_CHECK(derived >= need,
              "verify: --ratio {} of the prompt's {} entries{} gives {} slots, fewer than one query token's top-{}: "
              "raise --ratio or --context, or give --slots",
              ratio, context / R, R > 1 ? fmt::format(" (--context {} tokens / {})", context, R) : std::string(), derived,
              need);
  }
  ESS_CHECK(warmup_windows >= 0, "verify: --warmup = {} must be >= 0", warmup_windows);
  ESS_CHECK(query_drift >= 0.0 && query_drift <= 1.0, "verify: query drift = {} must be in [0, 1]", query_drift);
  ESS_CHECK(prefix_share >= 0.0 && prefix_share <= 1.0, "verify: --prefix-share = {} must be in [0, 1]", prefix_share);
  ESS_CHECK(warmup_windows <= context / R, "verify: --warmup = {} exceeds the prefill's {} query positions", warmup_windows,
            context / R);
  ESS_CHECK(residency == Residency::kSparse || reserve_newest,
            "verify: --residency {} needs --reserve-newest (a whole request's newest entries reach its rows by the "
            "write-back)",
            to_string(residency));
  ESS_CHECK(residency != Residency::kAdaptive || requests >= 2,
            "verify: --residency adaptive needs --requests >= 2 (one request finishes halfway to free rows)");
  ESS_CHECK(pool_rows >= 0 && pool_rows <= (1 << 20), "verify: --pool-rows = {} must be in [0, 2^20] (0 = by residency)",
            pool_rows);
  ESS_CHECK(pool_rows == 0 || pool_rows >= requests, "verify: --pool-rows = {} cannot hold the {} requests", pool_rows,
            requests);
  // Per request-layer: the full latent cache and the host pool (an entry each), the indexer's keys,
  // and the device rows.
  const double tokens = static_cast<double>(entries);
  const double entry = static_cast<double>(LatentLayout::for_model(model).bytes());
  const double per_layer = tokens * (2 * entry + model.index_head_dim + 4) +
                           (slots > 0 ? slots : ratio * tokens + mtp) * entry;
  check_host_memory(per_layer * requests * layers,
                    fmt::format("verify ({} requests x {} layers x {:.0f} entries)", requests, layers, tokens));
}

namespace {

struct LayerState {
  std::vector<std::vector<std::uint8_t>> index_pages;  // indexer key cache, 64-token pages
  std::vector<float> q;                                // indexer query [H][D], drifts per step
  std::vector<float> w;                                // head weights [H]
  std::vector<std::uint8_t> full;                      // the full latent cache [tokens][entry]
};

class Loop {
 public:
  Loop(const ModelSpec& model, const VerifyConfig& cfg)
      : model_(model),
        cfg_(cfg),
        latent_(LatentLayout::for_model(model)),
        index_(IndexerLayout::for_model(model)),
        rng_(cfg.seed),
        per_entry_(model.tokens_per_entry()),
        layer_ids_(model.offloaded_layers()),
        context_(cfg.context / per_entry_),
        max_len_((cfg.context + static_cast<std::int64_t>(cfg.steps) * cfg.mtp) / per_entry_) {}

  VerifyReport run();

 private:
  // Progress units: one per warmed request, then one per decode step.
  std::size_t warmed() const { return cfg_.warmup_windows > 0 ? static_cast<std::size_t>(cfg_.requests) : 0; }
  void report_progress(std::size_t done) const {
    if (cfg_.progress) cfg_.progress(done, warmed() + static_cast<std::size_t>(cfg_.steps));
  }
  float normal() { return normal_(rng_); }
  // Generates the entries of `token` for every layer into the full cache (and the indexer's);
  // returns them, [layer][entry].
  std::vector<std::uint8_t> append_token(RequestId id, std::int64_t token);
  // Request `id`'s `token` is request 0's (a shared prompt prefix): its latent entries and its
  // indexer keys are request 0's.
  void share_token(RequestId id, std::int64_t token);
  std::vector<std::int32_t> select(RequestId id, int layer, std::int64_t position);
  // Row p of the layer's buffer as the attention reads it (its two parts put together when the
  // buffer keeps them apart), in `at`.
  const std::uint8_t* row_bytes(int layer, std::int32_t p, std::uint8_t* at);
  // A buffer in two parts, as the engine that serves the model keeps it: DeepSeek-V4's C4 pages
  // (each entry's value and scale apart), MiniMax-M3's K and V (two regions of one allocation).
  LatentBuffer split_buffer(const OffloadConfig& oc);
  void compare_attention(RequestId id, int layer, int t, std::span<const std::int32_t> token_ids,
                         std::span<const std::int32_t> rows, std::int64_t step);
  // Counts the positions whose own working set (reserved newest tokens left out) exceeds the slots.
  void count_split_steps(const test::OffloadStepIn& in, std::int32_t slots);

  const ModelSpec& model_;
  VerifyConfig cfg_;
  LatentLayout latent_;
  IndexerLayout index_;
  std::mt19937_64 rng_;
  std::normal_distribution<float> normal_{0.0f, 1.0f};
  int per_entry_;                 // tokens per cache entry: 4 for a C4 cache, else 1
  std::vector<int> layer_ids_;    // the model layer of each offloaded layer
  std::int64_t context_;          // the prompt's entries
  std::int64_t max_len_;          // entries, at most
  std::vector<std::shared_ptr<std::uint8_t>> buffers_;  // split_buffer's memory
  std::unique_ptr<Offload> offload_;
  const test::OffloadIo* io_ = nullptr;
  std::vector<std::uint8_t> device_rows_;        // kCuda: the layer's buffer read back once per step
  int device_rows_layer_ = -1;
  std::vector<std::vector<LayerState>> state_;  // [request][layer]
  QueryGrouper grouper_;
  std::vector<std::int32_t> lru_ids_;           // scratch: one position's ids as the LRU sees them
  VerifyReport report_;
};

void Loop::count_split_steps(const test::OffloadStepIn& in, std::int32_t slots) {
  const int T = cfg_.mtp, K = cfg_.topk;
  const std::size_t P = static_cast<std::size_t>(T) * K;
  for (int b = 0; b < in.batch; ++b) {
    // Padded positions and whole requests run no query groups.
    if (in.rows[static_cast<std::size_t>(b)] < 0 || offload_->whole(b)) continue;
    const std::int32_t newest = in.lengths[static_cast<std::size_t>(b)] - T;
    lru_ids_.assign(in.topk.begin() + static_cast<std::ptrdiff_t>(b * P), in.topk.begin() + static_cast<std::ptrdiff_t>((b + 1) * P));
    if (cfg_.reserve_newest) {
      for (std::int32_t& id : lru_ids_) id = id >= newest ? -1 : id;
    }
    if (grouper_.union_size(lru_ids_, K, 0, T) > slots) ++report_.split_steps;
  }
}

std::vector<std::uint8_t> Loop::append_token(RequestId id, std::int64_t token) {
  std::vector<float> nope(static_cast<std::size_t>(latent_.key_value() ? latent_.kv_dim : latent_.nope_dim));
  std::vector<float> rope(static_cast<std::size_t>(latent_.key_value() ? latent_.kv_dim : latent_.rope_dim));
  const std::size_t E = latent_.bytes();
  std::vector<std::uint8_t> entries(static_cast<std::size_t>(cfg_.layers) * E);
  std::vector<float> key(static_cast<std::size_t>(index_.head_dim));
  for (int l = 0; l < cfg_.layers; ++l) {
    const std::span<std::uint8_t> entry(entries.data() + static_cast<std::size_t>(l) * E, E);
    if (latent_.key_value()) {  // a token's key and value (MiniMax-M3)
      for (float& v : nope) v = normal();
      for (float& v : rope) v = normal();
      encode_key_value(latent_, nope, rope, entry);
    } else {
      // Latent values of varying magnitude per tile, so the four scales differ.
      for (std::size_t d = 0; d < nope.size(); ++d) {
        nope[d] = normal() * std::ldexp(1.0f, static_cast<int>(d / static_cast<std::size_t>(latent_.tile)) - 1);
      }
      for (float& v : rope) v = normal();
      quantize_latent(latent_, nope, rope, entry);
    }
    LayerState& ls = state_[static_cast<std::size_t>(id)][static_cast<std::size_t>(l)];
    ESS_ASSERT(ls.full.size() == static_cast<std::size_t>(token) * E, "verify: tokens are appended in order");
    ls.full.insert(ls.full.end(), entry.begin(), entry.end());

    for (float& v : key) v = normal();
    if (token % kPageTokens == 0) ls.index_pages.emplace_back(index_.page_bytes(), 0);
    quantize_indexer_key(index_, key, ls.index_pages[static_cast<std::size_t>(token / kPageTokens)],
                         static_cast<int>(token % kPageTokens));
  }
  return entries;
}

void Loop::share_token(RequestId id, std::int64_t token) {
  const std::size_t E = latent_.bytes();
  for (int l = 0; l < cfg_.layers; ++l) {
    const LayerState& from = state_[0][static_cast<std::size_t>(l)];
    LayerState& ls = state_[static_cast<std::size_t>(id)][static_cast<std::size_t>(l)];
    ESS_ASSERT(ls.full.size() == static_cast<std::size_t>(token) * E, "verify: tokens are shared in order");
    ls.full.insert(ls.full.end(), from.full.begin() + static_cast<std::ptrdiff_t>(token * E),
                   from.full.begin() + static_cast<std::ptrdiff_t>((token + 1) * E));
    // Whole indexer pages; the tokens past the prefix overwrite theirs as they are appended.
    if (token % kPageTokens == 0) ls.index_pages.push_back(from.index_pages[static_cast<std::size_t>(token / kPageTokens)]);
  }
}

// Top-k of the query at `position` over its causal prefix [0, position].
std::vector<std::int32_t> Loop::select(RequestId id, int layer, std::int64_t position) {
  LayerState& ls = state_[static_cast<std::size_t>(id)][static_cast<std::size_t>(layer)];
  const float keep = static_cast<float>(std::sqrt(1.0 - cfg_.query_drift * cfg_.query_drift));
  const float mix = static_cast<float>(cfg_.query_drift);
  for (float& v : ls.q) v = keep * v + mix * normal();
  std::vector<const std::uint8_t*> pages;
  for (const auto& p : ls.index_pages) pages.push_back(p.data());
  std::vector<float> logits(static_cast<std::size_t>(position + 1));
  ref::indexer_logits(index_, ls.q, ls.w, model_.index_n_heads, pages, position + 1, logits);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(cfg_.topk));
  const int block = model_.selection_block();
  if (block == 1) {
    ref::topk(logits, cfg_.topk, ids);
    return ids;
  }
  // A block top-k (MiniMax-M3): each block scored by its tokens' best logit (sparse_score_type
  // "max"), the newest block always chosen (its local block, as the index kernel boosts it), the
  // chosen blocks' tokens in ascending order, -1 after them and past the position.
  const std::int64_t blocks = (position + 1 + block - 1) / block;
  std::vector<float> score(static_cast<std::size_t>(blocks), -INFINITY);
  for (std::int64_t t = 0; t <= position; ++t) {
    float& s = score[static_cast<std::size_t>(t / block)];
    s = std::max(s, logits[static_cast<std::size_t>(t)]);
  }
  score.back() = INFINITY;
  const int want = cfg_.topk / block;
  std::vector<std::int32_t> chosen(static_cast<std::size_t>(want));
  ref::topk(score, want, chosen);
  std::sort(chosen.begin(), chosen.end(), [](std::int32_t a, std::int32_t b) {
    return (a < 0 ? INT32_MAX : a) < (b < 0 ? INT32_MAX : b);
  });
  std::fill(ids.begin(), ids.end(), -1);
  std::size_t k = 0;
  for (const std::int32_t b : chosen) {
    if (b < 0) continue;
    for (int t = 0; t < block; ++t) {
      const std::int64_t token = static_cast<std::int64_t>(b) * block + t;
      ids[k++] = token <= position ? static_cast<std::int32_t>(token) : -1;
    }
  }
  return ids;
}

const std::uint8_t* Loop::row_bytes(int layer, std::int32_t p, std::uint8_t* at) {
  const LatentBuffer& b = offload_->buffer();
  const std::uint8_t* base = b.layer_base[static_cast<std::size_t>(layer)];
  if (cfg_.backend != Backend::kCpu) {
    if (device_rows_layer_ != layer) {
      device_rows_ = io_->dump(*offload_, layer);
      device_rows_layer_ = layer;
    }
    base = device_rows_.data();
  }
  const std::size_t E = latent_.bytes();
  if (!b.split()) {
    std::memcpy(at, base + b.rows.offset(p), E);
    return at;
  }
  // The tails lie after the heads in the same allocation (split_buffer).
  const auto delta = static_cast<std::size_t>(b.tail_base[static_cast<std::size_t>(layer)] - b.layer_base[static_cast<std::size_t>(layer)]);
  const auto head = static_cast<std::size_t>(b.tail.head_bytes), tail = static_cast<std::size_t>(b.tail.bytes);
  std::memcpy(at, base + b.rows.offset(p), head);
  std::memcpy(at + head, base + delta + b.tail.rows.offset(p), tail);
  std::memset(at + head + tail, 0, E - head - tail);
  return at;
}

LatentBuffer Loop::split_buffer(const OffloadConfig& oc) {
  // The device first, as the Offload would check it: a machine without one is told so, not given an
  // allocation failure.
  if (oc.backend == Backend::kCuda && oc.device >= cuda_device_count()) {
    throw_device_error(fmt::format("verify: no CUDA device {} (found {})", oc.device, cuda_device_count()));
  }
  const std::int64_t rows = static_cast<std::int64_t>(oc.max_requests) * oc.rows_per_request();
  LatentBuffer b;
  if (latent_.key_value()) {  // K and V in two regions of one allocation, as SGLang's two tensors
    const std::uint64_t kv = latent_.value_bytes();
    b.rows = RowLayout{kv, 0, 0};
    b.tail.head_bytes = static_cast<int>(kv);
    b.tail.bytes = static_cast<int>(kv);
    b.tail.rows = RowLayout{kv, 0, 0};
    for (int l = 0; l < oc.layers; ++l) {
      buffers_.push_back(io_->allocate(2 * static_cast<std::uint64_t>(rows) * kv));
      b.layer_base.push_back(buffers_.back().get());
      b.tail_base.push_back(buffers_.back().get() + static_cast<std::uint64_t>(rows) * kv);
    }
    return b;
  }
  const C4Page page = C4Page::of(latent_);
  const std::uint64_t pages = static_cast<std::uint64_t>((rows + C4Page::kRows - 1) / C4Page::kRows);
  b.rows = RowLayout{page.value_bytes, C4Page::kRows, page.bytes()};
  b.tail.head_bytes = static_cast<int>(page.value_bytes);
  b.tail.bytes = static_cast<int>(page.scale_bytes);
  b.tail.rows = RowLayout{page.scale_bytes, C4Page::kRows, page.bytes()};
  for (int l = 0; l < oc.layers; ++l) {
    buffers_.push_back(io_->allocate(pages * page.bytes()));
    b.layer_base.push_back(buffers_.back().get());
    b.tail_base.push_back(buffers_.back().get() + page.scale_offset());
  }
  return b;
}

namespace {

// Grouped-query decode attention over K / V entries (MiniMax-M3's sparse layers, one KV head):
// `heads` query heads of kv_dim bf16 values share the selected tokens' keys and values;
// out[h] = softmax(q[h] . k * scale) . v (bf16), lse[h] the natural-log sum of exponentials; a
// row with no entry gives 0 and -inf. fp32 throughout, the keys and values read exactly.
void gqa_decode(const LatentLayout& layout, int heads, float scale, std::span<const std::uint16_t> q,
                std::span<const std::uint8_t* const> entries, std::span<std::uint16_t> out, std::span<float> lse) {
  const auto D = static_cast<std::size_t>(layout.kv_dim);
  std::vector<float> k(D), v(D), logits, acc(D);
  std::vector<std::vector<float>> values;
  std::vector<std::vector<float>> keys;
  for (const std::uint8_t* e : entries) {
    if (e == nullptr) continue;
    decode_key_value(layout, std::span<const std::uint8_t>(e, layout.bytes()), k, v);
    keys.push_back(k);
    values.push_back(v);
  }
  for (int h = 0; h < heads; ++h) {
    const auto hq = static_cast<std::size_t>(h) * D;
    logits.assign(keys.size(), 0.0f);
    float top = -INFINITY;
    for (std::size_t j = 0; j < keys.size(); ++j) {
      float dot = 0.0f;
      for (std::size_t d = 0; d < D; ++d) dot += bf16_to_float(q[hq + d]) * keys[j][d];
      logits[j] = dot * scale;
      top = std::max(top, logits[j]);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    float sum = 0.0f;
    for (std::size_t j = 0; j < keys.size(); ++j) {
      const float p = std::exp(logits[j] - top);
      sum += p;
      for (std::size_t d = 0; d < D; ++d) acc[d] += p * values[j][d];
    }
    for (std::size_t d = 0; d < D; ++d) out[hq + d] = bf16_from_float(sum > 0.0f ? acc[d] / sum : 0.0f);
    lse[static_cast<std::size_t>(h)] = sum > 0.0f ? top + std::log(sum) : -INFINITY;
  }
}

}  // namespace

void Loop::compare_attention(RequestId id, int layer, int t, std::span<const std::int32_t> token_ids,
                             std::span<const std::int32_t> rows, std::int64_t step) {
  // MLA: every head attends over the latent; MiniMax-M3: the query heads of one KV head (a TP
  // rank's, as HiSparse serves it) over its keys and values.
  const int heads = latent_.key_value() ? model_.num_attention_heads / model_.num_key_value_heads
                                        : model_.num_attention_heads;
  const std::size_t qdim = latent_.key_value() ? static_cast<std::size_t>(latent_.kv_dim)
                                               : static_cast<std::size_t>(latent_.nope_dim + latent_.rope_dim);
  std::vector<std::uint16_t> q(static_cast<std::size_t>(heads) * qdim);
  for (auto& v : q) v = bf16_from_float(normal());
  const LayerState& ls = state_[static_cast<std::size_t>(id)][static_cast<std::size_t>(layer)];
  std::vector<const std::uint8_t*> from_rows(token_ids.size(), nullptr);
  std::vector<const std::uint8_t*> from_full(token_ids.size(), nullptr);
  std::vector<std::uint8_t> seen(token_ids.size() * latent_.bytes());
  for (std::size_t k = 0; k < token_ids.size(); ++k) {
    if (token_ids[k] < 0) continue;
    ESS_CHECK(rows[k] >= 0, "verify: step {} layer {} request {}: token {} was given no row", step, layer, id, token_ids[k]);
    from_rows[k] = row_bytes(layer, rows[k], seen.data() + k * latent_.bytes());
    from_full[k] = ls.full.data() + static_cast<std::size_t>(token_ids[k]) * latent_.bytes();
  }
  std::vector<std::uint16_t> out_a, out_b;
  std::vector<float> lse_a(static_cast<std::size_t>(heads)), lse_b(static_cast<std::size_t>(heads));
  if (latent_.key_value()) {
    out_a.resize(static_cast<std::size_t>(heads) * latent_.kv_dim);
    out_b.resize(out_a.size());
    gqa_decode(latent_, heads, static_cast<float>(model_.softmax_scale()), q, from_rows, out_a, lse_a);
    gqa_decode(latent_, heads, static_cast<float>(model_.softmax_scale()), q, from_full, out_b, lse_b);
  } else {
    const ref::SparseMlaParams p{latent_, heads, static_cast<float>(model_.softmax_scale())};
    out_a.resize(static_cast<std::size_t>(heads) * latent_.nope_dim);
    out_b.resize(out_a.size());
    ref::sparse_mla_decode(p, q, from_rows, out_a, lse_a);
    ref::sparse_mla_decode(p, q, from_full, out_b, lse_b);
  }
  const std::size_t out_n = out_a.size();
  ++report_.compared_outputs;
  const bool same = std::memcmp(out_a.data(), out_b.data(), out_n * 2) == 0 &&
                    std::memcmp(lse_a.data(), lse_b.data(), lse_a.size() * 4) == 0;
  if (!same) {
    ++report_.mismatched_outputs;
    if (report_.bitwise_equal) {
      report_.first_mismatch = fmt::format("step {} layer {} request {} query token {}", step, layer, id, t);
    }
    report_.bitwise_equal = false;
  }
}

VerifyReport Loop::run() {
  const auto t0 = std::chrono::steady_clock::now();
  const int B = cfg_.requests;
  const int L = cfg_.layers;
  const int T = cfg_.mtp;
  const int K = cfg_.topk;
  const std::size_t E = latent_.bytes();
  const std::int32_t slots = cfg_.slots > 0 ? cfg_.slots : slots_for_ratio(cfg_.ratio, context_);

  OffloadConfig oc = OffloadConfig::for_model(model_, B, slots, max_len_, T);
  oc.layers = L;
  oc.topk = K;
  oc.reserve_newest = cfg_.reserve_newest;
  oc.residency = cfg_.residency;
  oc.max_requests = cfg_.pool_rows;
  if (oc.max_requests == 0) {
    switch (cfg_.residency) {
      case Residency::kSparse: oc.max_requests = B; break;
      case Residency::kWhole: oc.max_requests = B * oc.whole_rows(max_len_); break;
      // Request 0 whole on its rows, one row for each other request (sparse), none to spare and no
      // headroom: request 0's growth demotes it, the last request's finish lets it be promoted back.
      case Residency::kAdaptive:
        oc.max_requests = oc.whole_rows(context_) + B - 1;
        oc.whole_headroom = 0;
        break;
    }
  }
  report_.pool_rows = oc.max_requests;
  // kAdaptive: the last request finishes after this many steps.
  const int finish_at = cfg_.residency == Residency::kAdaptive ? cfg_.steps / 2 : cfg_.steps;
  oc.warmup_windows = std::max(cfg_.warmup_windows, 1);
  oc.backend = cfg_.backend;
  oc.device = cfg_.device;
  io_ = &test::offload_io(cfg_.backend);
  offload_ = per_entry_ > 1 || latent_.key_value() ? std::make_unique<Offload>(oc, split_buffer(oc))
                                                   : std::make_unique<Offload>(oc);
  Offload& o = *offload_;
  report_.host_memory = std::string(to_string(o.host_pool().memory_kind()));
  report_.backend = cfg_.backend == Backend::kCuda ? "cuda" : "cpu";
  report_.slots = slots;
  report_.per_layer.resize(static_cast<std::size_t>(L));
  report_.tokens_per_entry = per_entry_;
  for (int l = 0; l < L; ++l) {
    report_.per_layer[static_cast<std::size_t>(l)].layer = l;
    report_.per_layer[static_cast<std::size_t>(l)].model_layer = layer_ids_[static_cast<std::size_t>(l)];
    if (model_.index_shared(l)) report_.shared_layers.push_back(l);
  }

  // Prefill: every request's prompt is in the Total Memory Pool and the indexer cache; with
  // a shared prefix, requests 1.. hold request 0's first `prefix` tokens.
  const auto prefix = static_cast<std::int64_t>(std::floor(cfg_.prefix_share * static_cast<double>(cfg_.context)));
  state_.assign(static_cast<std::size_t>(B), std::vector<LayerState>(static_cast<std::size_t>(L)));
  const std::size_t qn = static_cast<std::size_t>(model_.index_n_heads) * index_.head_dim;
  std::vector<std::int32_t> rows(static_cast<std::size_t>(B));
  for (RequestId id = 0; id < B; ++id) {
    for (auto& ls : state_[static_cast<std::size_t>(id)]) {
      ls.q.resize(qn);
      for (float& v : ls.q) v = normal();
      ls.w.resize(static_cast<std::size_t>(model_.index_n_heads));
      for (float& v : ls.w) v = normal() / std::sqrt(static_cast<float>(model_.index_n_heads));
    }
    const bool shares = id > 0 && prefix > 0;
    rows[static_cast<std::size_t>(id)] = shares ? o.admit_shared(id, context_, 0, prefix) : o.admit(id, context_);
    for (std::int64_t tok = 0; tok < context_; ++tok) {
      if (shares && tok < prefix) {  // in the host pool already: shared pages, or the copied partial page
        share_token(id, tok);
        continue;
      }
      const std::vector<std::uint8_t> entries = append_token(id, tok);
      for (int l = 0; l < L; ++l) {
        std::memcpy(o.host_entry(id, l, tok).data(), entries.data() + static_cast<std::size_t>(l) * E, E);
      }
    }
  }

  // LRU-Warmup from the top-k of the last prefill query positions.
  if (cfg_.warmup_windows > 0) {
    const auto W = static_cast<int>(std::min<std::int64_t>(cfg_.warmup_windows, context_));
    for (RequestId id = 0; id < B; ++id) {
      std::vector<std::int32_t> windows;  // [L][W][K]
      const std::size_t per_layer = static_cast<std::size_t>(W) * static_cast<std::size_t>(K);
      for (int l = 0; l < L; ++l) {
        if (model_.index_shared(l)) {  // the prefill's top-k of a shared layer is its leader's
          const std::size_t from = static_cast<std::size_t>(model_.index_leader(l)) * per_layer;
          windows.resize(windows.size() + per_layer);
          std::copy_n(windows.begin() + static_cast<std::ptrdiff_t>(from), per_layer,
                      windows.end() - static_cast<std::ptrdiff_t>(per_layer));
          continue;
        }
        for (std::int64_t pos = context_ - W; pos < context_; ++pos) {
          const auto ids = select(id, l, pos);
          windows.insert(windows.end(), ids.begin(), ids.end());
        }
      }
      const std::int64_t before = o.stats().warmup_fills;
      o.warmup(id, windows, W);
      report_.warmup_fills += o.stats().warmup_fills - before;
      report_progress(static_cast<std::size_t>(id) + 1);
    }
  }

  test::OffloadStepIn in;
  in.batch = B;
  in.rows = rows;
  in.lengths.resize(static_cast<std::size_t>(B));
  in.topk.resize(static_cast<std::size_t>(B) * T * K);
  for (int s = 0; s < cfg_.steps; ++s) {
    if (s == finish_at && in.rows[static_cast<std::size_t>(B - 1)] >= 0) {  // the last request finishes: a padded position
      o.release(B - 1);
      in.rows[static_cast<std::size_t>(B - 1)] = -1;
      in.lengths[static_cast<std::size_t>(B - 1)] = 0;
    }
    // The step's T new tokens: into the host pool directly, or (reserve_newest) into the
    // reserved rows, from which the write-back below copies them to the host pool.
    for (RequestId id = 0; id < B; ++id) {
      if (in.rows[static_cast<std::size_t>(id)] < 0) continue;
      const std::int64_t len = o.length(id);
      // A compressed cache gains its entry on the step whose token completes it (T is 1).
      const std::int64_t tokens = cfg_.context + static_cast<std::int64_t>(s + 1) * T;
      if (per_entry_ > 1 && tokens / per_entry_ == len) {
        in.lengths[static_cast<std::size_t>(id)] = static_cast<std::int32_t>(len);
        continue;
      }
      o.extend(id, T);
      for (int t = 0; t < T; ++t) {
        const std::vector<std::uint8_t> entries = append_token(id, len + t);
        for (int l = 0; l < L; ++l) {
          const std::span<const std::uint8_t> e(entries.data() + static_cast<std::size_t>(l) * E, E);
          if (cfg_.reserve_newest) {
            io_->write_row(o, l, in.rows[static_cast<std::size_t>(id)] * o.rows_per_request() + slots + t, e);
          } else {
            std::memcpy(o.host_entry(id, l, len + t).data(), e.data(), E);
          }
        }
      }
      in.lengths[static_cast<std::size_t>(id)] = static_cast<std::int32_t>(len + T);
    }
    std::int64_t step_misses = 0;
    std::map<int, test::OffloadStepOut> prefetched;  // follower layer -> its step, issued at its leader's
    for (int l = 0; l < L; ++l) {
      // A shared-index layer runs no indexer: in.topk still holds its leader's top-k (the layers
      // between them are its leader's other followers).
      for (int b = 0; b < B && !model_.index_shared(l); ++b) {
        for (int t = 0; t < T && in.rows[static_cast<std::size_t>(b)] >= 0; ++t) {
          const std::int64_t pos = in.lengths[static_cast<std::size_t>(b)] - T + t;
          const auto ids = select(b, l, pos);
          std::copy(ids.begin(), ids.end(), in.topk.begin() + (static_cast<std::ptrdiff_t>(b) * T + t) * K);
        }
      }
      in.layer = l;
      count_split_steps(in, slots);
      // One call per query group (one for a step whose working set fits the pool), each
      // group's attention before the next group's fetch may evict what it read; a follower whose
      // step its leader's issued: that one.
      const auto ready = prefetched.find(l);
      const std::vector<int> groups = ready != prefetched.end()
                                          ? std::vector<int>{0, T}
                                          : o.query_groups(B, in.rows.data(), in.topk.data(), in.lengths.data());
      report_.group_calls += static_cast<std::int64_t>(groups.size()) - 2;
      auto& pl = report_.per_layer[static_cast<std::size_t>(l)];
      for (std::size_t g = 0; g + 1 < groups.size(); ++g) {
        in.query_begin = groups[g];
        in.query_end = groups[g + 1];
        const test::OffloadStepOut out = ready != prefetched.end() ? ready->second : io_->step(o, in);
        device_rows_layer_ = -1;
        if (cfg_.shared_index_prefetch && groups.size() == 2 && !model_.index_shared(l)) {
          // The leader's top-k is known: its followers' steps now, before the layers between.
          for (int f = l + 1; f < L && model_.index_shared(f); ++f) {
            in.layer = f;
            prefetched[f] = io_->step(o, in);
            ++report_.prefetched_steps;
          }
          in.layer = l;
        }
        if (cfg_.inject_fault && s == cfg_.steps - 1 && l == L - 1 && g == 0) {
          // Flip one bit of the first selected row of request 0 (of its tail, a C4 entry's first
          // scale, when the buffer keeps it apart): the check below must notice.
          const std::int32_t p = out.physical[0];
          ESS_ASSERT(p >= 0, "fault injection needs a selected first position");
          std::vector<std::uint8_t> bytes = o.read_row(l, p);
          bytes[o.buffer().split() ? static_cast<std::size_t>(o.buffer().tail.head_bytes) : 3] ^= 0x01;
          io_->write_row(o, l, p, bytes);
        }
        for (int b = 0; b < B; ++b) {
          if (in.rows[static_cast<std::size_t>(b)] < 0) continue;
          pl.hits += out.counts[2 * static_cast<std::size_t>(b)];
          pl.misses += out.counts[2 * static_cast<std::size_t>(b) + 1];
          step_misses += out.counts[2 * static_cast<std::size_t>(b) + 1];
          for (int t = groups[g]; t < groups[g + 1]; ++t) {
            const std::size_t off = (static_cast<std::size_t>(b) * T + t) * K;
            compare_attention(b, l, t, std::span<const std::int32_t>(in.topk).subspan(off, K),
                              std::span<const std::int32_t>(out.physical).subspan(off, K), s);
          }
        }
      }
      if (cfg_.reserve_newest) io_->write_back(o, l, in.rows, in.lengths, {});
      prefetched.erase(l);
    }
    report_.misses_per_step.push_back(step_misses);
    report_progress(warmed() + static_cast<std::size_t>(s) + 1);
  }
  // Every entry the loop generated is in the host pool, bit for bit (the write-back included).
  for (RequestId id = 0; id < B; ++id) {
    if (in.rows[static_cast<std::size_t>(id)] < 0) continue;  // finished
    for (int l = 0; l < L; ++l) {
      const LayerState& ls = state_[static_cast<std::size_t>(id)][static_cast<std::size_t>(l)];
      for (std::int64_t tok = 0; tok < o.length(id); ++tok) {
        const auto e = o.host_pool().entry(id, l, tok);
        if (std::memcmp(e.data(), ls.full.data() + static_cast<std::size_t>(tok) * E, E) != 0) {
          ++report_.mismatched_host_entries;
          if (report_.bitwise_equal) {
            report_.first_mismatch = fmt::format("host pool: request {} layer {} token {}", id, l, tok);
          }
          report_.bitwise_equal = false;
        }
      }
    }
  }
  report_.steps = cfg_.steps;
  const OffloadStats st = o.stats();
  report_.host_bytes = st.host_bytes_used;
  report_.host_bytes_unshared = st.host_bytes_unshared;
  report_.whole_steps = st.whole_steps;
  report_.sparse_steps = st.sparse_steps;
  report_.swap_launches = st.swap_launches;
  report_.demotions = st.demotions;
  report_.promotions = st.promotions;
  for (const auto& pl : report_.per_layer) {
    report_.hits += pl.hits;
    report_.misses += pl.misses;
  }
  report_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return report_;
}

}  // namespace

VerifyReport run_verify(const ModelSpec& model, const VerifyConfig& config) {
  config.validate(model);
  return Loop(model, config).run();
}

}  // namespace ess
