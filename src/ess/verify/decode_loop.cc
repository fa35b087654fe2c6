#include "ess/verify/decode_loop.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>

#include "ess/cache/sparse_pool.h"
#include "ess/cache/swap_engine.h"
#include "ess/cache/total_pool.h"
#include "ess/core/error.h"
#include "ess/kernels/ref/reference.h"
#include "ess/model/entry_layout.h"
#include "ess/model/numerics.h"

namespace ess {

void VerifyConfig::validate(const ModelSpec& model) const {
  ESS_CHECK(requests > 0 && requests <= 4096, "verify: --requests = {} must be in [1, 4096]", requests);
  ESS_CHECK(layers > 0 && layers <= model.num_hidden_layers,
            "verify: --layers = {} must be in [1, {}] (the model's num_hidden_layers)", layers,
            model.num_hidden_layers);
  ESS_CHECK(context > 0 && context <= (std::int64_t{1} << 24), "verify: --context = {} must be in [1, 2^24]", context);
  ESS_CHECK(steps >= 0 && steps <= 100000, "verify: --steps = {} must be in [0, 100000]", steps);
  ESS_CHECK(mtp > 0 && mtp <= 16, "verify: --mtp = {} must be in [1, 16]", mtp);
  ESS_CHECK(topk > 0, "verify: --topk = {} must be positive", topk);
  ESS_CHECK(slots >= 0, "verify: --slots = {} must be >= 0 (0 = use --ratio)", slots);
  ESS_CHECK(warmup_windows >= 0, "verify: --warmup = {} must be >= 0", warmup_windows);
  ESS_CHECK(query_drift >= 0.0 && query_drift <= 1.0, "verify: query drift = {} must be in [0, 1]", query_drift);
}

namespace {

struct LayerState {
  std::vector<std::vector<std::uint8_t>> index_pages;  // indexer key cache, 64-token pages
  std::vector<float> q;                                // indexer query [H][D], drifts per step
  std::vector<float> w;                                // head weights [H]
};

class Loop {
 public:
  Loop(const ModelSpec& model, const VerifyConfig& cfg)
      : model_(model),
        cfg_(cfg),
        latent_(LatentLayout::for_model(model)),
        index_(IndexerLayout::for_model(model)),
        rng_(cfg.seed),
        max_len_(cfg.context + static_cast<std::int64_t>(cfg.steps) * cfg.mtp) {}

  VerifyReport run();

 private:
  float normal() { return normal_(rng_); }
  void append_token(RequestId id, std::int64_t token);
  std::vector<std::int32_t> select(RequestId id, int layer, std::int64_t position);
  void compare_attention(const SwapEngine& engine, RequestId id, int layer, int t,
                         std::span<const std::int32_t> token_ids, std::span<const std::int32_t> slot_ids,
                         std::int64_t step);

  const ModelSpec& model_;
  VerifyConfig cfg_;
  LatentLayout latent_;
  IndexerLayout index_;
  std::mt19937_64 rng_;
  std::normal_distribution<float> normal_{0.0f, 1.0f};
  std::int64_t max_len_;
  std::unique_ptr<TotalPool> total_;
  std::unique_ptr<SparsePool> sparse_;
  std::vector<std::vector<LayerState>> state_;  // [request][layer]
  std::vector<std::uint8_t> slot_copy_;          // slot bytes read back from a device backend
  VerifyReport report_;
};

void Loop::append_token(RequestId id, std::int64_t token) {
  std::vector<float> nope(static_cast<std::size_t>(latent_.nope_dim));
  std::vector<float> rope(static_cast<std::size_t>(latent_.rope_dim));
  std::vector<std::uint8_t> entry(latent_.bytes());
  std::vector<float> key(static_cast<std::size_t>(index_.head_dim));
  for (int l = 0; l < cfg_.layers; ++l) {
    // Latent values of varying magnitude per tile, so the four scales differ.
    for (std::size_t d = 0; d < nope.size(); ++d) {
      nope[d] = normal() * std::ldexp(1.0f, static_cast<int>(d / kQuantTile) - 1);
    }
    for (float& v : rope) v = normal();
    quantize_latent(latent_, nope, rope, entry);
    total_->write(id, l, token, entry);

    for (float& v : key) v = normal();
    auto& pages = state_[static_cast<std::size_t>(id)][static_cast<std::size_t>(l)].index_pages;
    if (token % kPageTokens == 0) pages.emplace_back(index_.page_bytes(), 0);
    quantize_indexer_key(index_, key, pages[static_cast<std::size_t>(token / kPageTokens)],
                         static_cast<int>(token % kPageTokens));
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
  ref::topk(logits, cfg_.topk, ids);
  return ids;
}

void Loop::compare_attention(const SwapEngine& engine, RequestId id, int layer, int t,
                             std::span<const std::int32_t> token_ids, std::span<const std::int32_t> slot_ids,
                             std::int64_t step) {
  const int heads = model_.num_attention_heads;
  const std::size_t qdim = static_cast<std::size_t>(latent_.nope_dim + latent_.rope_dim);
  std::vector<std::uint16_t> q(static_cast<std::size_t>(heads) * qdim);
  for (auto& v : q) v = bf16_from_float(normal());
  const std::int32_t row = engine.sparse().row(id);
  std::vector<const std::uint8_t*> from_slots(token_ids.size(), nullptr);
  std::vector<const std::uint8_t*> from_full(token_ids.size(), nullptr);
  const SlotStorage& storage = engine.sparse().storage();
  slot_copy_.resize(token_ids.size() * latent_.bytes());
  for (std::size_t k = 0; k < token_ids.size(); ++k) {
    if (token_ids[k] < 0) continue;
    from_slots[k] = storage.host_entry(row, layer, slot_ids[k]);
    if (from_slots[k] == nullptr) {  // device-resident slots: read them back
      const std::span<std::uint8_t> dst(slot_copy_.data() + k * latent_.bytes(), latent_.bytes());
      storage.read(row, layer, slot_ids[k], dst);
      from_slots[k] = dst.data();
    }
    from_full[k] = total_->entry(id, layer, token_ids[k]).data();
  }
  const ref::SparseMlaParams p{latent_, heads, static_cast<float>(model_.softmax_scale())};
  const std::size_t out_n = static_cast<std::size_t>(heads) * latent_.nope_dim;
  std::vector<std::uint16_t> out_a(out_n), out_b(out_n);
  std::vector<float> lse_a(static_cast<std::size_t>(heads)), lse_b(static_cast<std::size_t>(heads));
  ref::sparse_mla_decode(p, q, from_slots, out_a, lse_a);
  ref::sparse_mla_decode(p, q, from_full, out_b, lse_b);
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
  const std::int32_t slots = cfg_.slots > 0 ? cfg_.slots : slots_for_ratio(cfg_.ratio, cfg_.context);

  const std::uint64_t pages_per_request = static_cast<std::uint64_t>((max_len_ + kPageTokens - 1) / kPageTokens) * L;
  const std::uint64_t capacity = B * pages_per_request * kPageTokens * latent_.bytes();
  total_ = std::make_unique<TotalPool>(L, latent_, capacity);
  report_.host_memory = std::string(to_string(total_->memory_kind()));
  SparsePoolConfig sp;
  sp.num_layers = L;
  sp.layout = latent_;
  sp.max_requests = B;
  sp.slots = slots;
  sp.query_tokens = T;
  sp.topk = K;
  sp.max_context = max_len_;
  sparse_ = cfg_.storage ? std::make_unique<SparsePool>(sp, cfg_.storage()) : std::make_unique<SparsePool>(sp);
  report_.backend = std::string(sparse_->storage().backend());
  SwapEngine::Config ec;
  ec.warmup_windows = std::max(cfg_.warmup_windows, 1);
  SwapEngine engine(*total_, *sparse_, ec);
  report_.slots = slots;
  report_.per_layer.resize(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l) report_.per_layer[static_cast<std::size_t>(l)].layer = l;

  // Prefill: every request's prompt is in the Total Memory Pool and the indexer cache.
  state_.assign(static_cast<std::size_t>(B), std::vector<LayerState>(static_cast<std::size_t>(L)));
  const std::size_t qn = static_cast<std::size_t>(model_.index_n_heads) * index_.head_dim;
  for (RequestId id = 0; id < B; ++id) {
    for (auto& ls : state_[static_cast<std::size_t>(id)]) {
      ls.q.resize(qn);
      for (float& v : ls.q) v = normal();
      ls.w.resize(static_cast<std::size_t>(model_.index_n_heads));
      for (float& v : ls.w) v = normal() / std::sqrt(static_cast<float>(model_.index_n_heads));
    }
    total_->admit(id, cfg_.context);
    for (std::int64_t tok = 0; tok < cfg_.context; ++tok) append_token(id, tok);
    engine.admit(id);
  }

  // LRU-Warmup from the top-k of the last prefill query positions.
  if (cfg_.warmup_windows > 0) {
    const std::int64_t W = std::min<std::int64_t>(cfg_.warmup_windows, cfg_.context);
    for (RequestId id = 0; id < B; ++id) {
      for (int l = 0; l < L; ++l) {
        std::vector<std::int32_t> windows;
        for (std::int64_t pos = cfg_.context - W; pos < cfg_.context; ++pos) {
          const auto ids = select(id, l, pos);
          windows.insert(windows.end(), ids.begin(), ids.end());
        }
        const WarmupResult wr = engine.warmup(id, l, windows, cfg_.context);
        sparse_->storage().fill(wr.plan, *total_);
        report_.per_layer[static_cast<std::size_t>(l)].warmup_fills += static_cast<std::int64_t>(wr.plan.entries.size());
        report_.warmup_fills += static_cast<std::int64_t>(wr.plan.entries.size());
      }
    }
  }

  std::vector<RequestId> batch(static_cast<std::size_t>(B));
  for (int b = 0; b < B; ++b) batch[static_cast<std::size_t>(b)] = b;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(B));
  std::vector<std::int32_t> topk_ids(static_cast<std::size_t>(B) * T * K);
  SwapResult res;
  for (int s = 0; s < cfg_.steps; ++s) {
    // The step's T new tokens are written back to the Total Memory Pool (the D2H write-back).
    for (RequestId id = 0; id < B; ++id) {
      const std::int64_t len = total_->length(id);
      total_->extend(id, T);
      for (int t = 0; t < T; ++t) append_token(id, len + t);
      lengths[static_cast<std::size_t>(id)] = len + T;
    }
    std::int64_t step_misses = 0;
    for (int l = 0; l < L; ++l) {
      for (int b = 0; b < B; ++b) {
        for (int t = 0; t < T; ++t) {
          const std::int64_t pos = lengths[static_cast<std::size_t>(b)] - T + t;
          const auto ids = select(b, l, pos);
          std::copy(ids.begin(), ids.end(), topk_ids.begin() + (static_cast<std::ptrdiff_t>(b) * T + t) * K);
        }
      }
      engine.step(SwapStep{l, batch, topk_ids, lengths}, res);
      sparse_->storage().fill(res.plan, *total_);
      if (cfg_.inject_fault && s == cfg_.steps - 1 && l == L - 1) {
        // Flip one bit of the first selected slot of request 0: the check below must notice.
        const std::int32_t slot = res.slot_ids[0];
        ESS_ASSERT(slot >= 0, "fault injection needs a selected first position");
        ESS_CHECK(sparse_->storage().host_entry(sparse_->row(0), l, slot) != nullptr,
                  "verify: fault injection needs host-resident slots (the cpu backend)");
        auto* p = const_cast<std::uint8_t*>(sparse_->storage().host_entry(sparse_->row(0), l, slot));
        p[3] ^= 0x01;
      }
      auto& pl = report_.per_layer[static_cast<std::size_t>(l)];
      pl.hits += res.total.hits;
      pl.misses += res.total.misses;
      step_misses += res.total.misses;
      for (int b = 0; b < B; ++b) {
        for (int t = 0; t < T; ++t) {
          const std::size_t off = (static_cast<std::size_t>(b) * T + t) * K;
          compare_attention(engine, b, l, t, std::span<const std::int32_t>(topk_ids).subspan(off, K),
                            std::span<const std::int32_t>(res.slot_ids).subspan(off, K), s);
        }
      }
    }
    report_.misses_per_step.push_back(step_misses);
  }
  engine.check_invariants();
  report_.steps = cfg_.steps;
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
