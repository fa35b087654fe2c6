#include "ess/sim/memory_model.h"

#include <algorithm>
#include <cmath>

#include "ess/core/error.h"

namespace ess::sim {
namespace {

// FP8 weights carry one fp32 scale per 128 x 128 block (DeepSeek-V3's checkpoint format).
constexpr double kFp8BytesPerParam = 1.0 + 4.0 / (128.0 * 128.0);
constexpr double kBf16 = 2.0;

}  // namespace

void require_dsa_layers(const ModelSpec& m) {
  ESS_CHECK(!m.is_deepseek_v4(),
            "{}: the simulator models DSA layers (every layer's sparse MLA over the whole latent cache, an entry per "
            "token); DeepSeek-V4's mix of sliding-window, C4 (an entry per 4 tokens, top-{} of them) and C128 "
            "attention is not modelled yet: `ess verify --model` checks its C4 offload, `ess sim` / `ess plan` cannot "
            "size it",
            m.name, m.index_topk);
  ESS_CHECK(!m.is_minimax_m3(),
            "{}: the simulator models DSA layers (sparse MLA over latent entries); MiniMax-M3's grouped-query "
            "attention over K / V blocks (top-{} blocks of {} tokens in its sparse layers, dense layers resident) is "
            "not modelled yet: `ess sim` / `ess plan` cannot size it",
            m.name, m.sparse_topk_blocks, m.sparse_block_size);
}

MemoryModel::MemoryModel(const ModelSpec& m, const HardwareProfile& hw, const Deployment& dep,
                         std::int64_t context, double min_slots)
    : model_(m), hw_(hw), dep_(dep), context_(context) {
  require_dsa_layers(m);
  ESS_CHECK(context > 0, "memory model: context = {} must be positive", context);
  const std::int64_t whole = std::min<std::int64_t>(std::int64_t{dep.mtp_tokens} * m.index_topk, context);
  const std::int64_t one = std::min<std::int64_t>(m.index_topk, context);
  ESS_CHECK(min_slots == 0 || (min_slots >= double(one) && min_slots <= double(whole)),
            "memory model: pool floor {} outside [{}, {}] (one query token's top-k, T x top-k)", min_slots, one, whole);
  min_slots_ = static_cast<std::int32_t>(min_slots > 0 ? std::ceil(min_slots) : double(whole));
  const double h = m.hidden_size;
  const int mtp_layers = dep.mtp_tokens > 1 ? m.num_nextn_predict_layers : 0;
  cache_layers_ = m.num_hidden_layers + mtp_layers;
  indexer_layers_ = m.indexer_layers(m.num_hidden_layers) + mtp_layers;
  const double heads = m.num_attention_heads;
  const double mla = h * m.q_lora_rank + double(m.q_lora_rank) * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) +
                     h * (m.kv_lora_rank + m.qk_rope_head_dim) +
                     double(m.kv_lora_rank) * heads * (m.qk_nope_head_dim + m.v_head_dim) +
                     heads * m.v_head_dim * h;
  const double indexer = double(m.q_lora_rank) * m.index_n_heads * m.index_head_dim + h * m.index_head_dim +
                         h * m.index_n_heads;
  const double expert = 3.0 * h * m.moe_intermediate_size;
  const int moe_layers = m.num_moe_layers() + mtp_layers;  // the MTP layer is an MoE layer
  const double experts_per_gpu = std::ceil(double(m.n_routed_experts) / dep.expert_parallel);
  weights_.attention = (mla * cache_layers_ + indexer * indexer_layers_) * kFp8BytesPerParam;
  weights_.dense_ffn = 3.0 * h * m.intermediate_size * m.num_dense_layers() * kFp8BytesPerParam;
  weights_.shared_experts = expert * m.n_shared_experts * moe_layers * kFp8BytesPerParam;
  weights_.routed_experts = expert * experts_per_gpu * moe_layers * kFp8BytesPerParam;
  weights_.embedding = 2.0 * h * m.vocab_size * kBf16 + mtp_layers * 2.0 * h * h * kBf16;
  weights_.router = h * m.n_routed_experts * moe_layers * kBf16;
  cache_budget_ = hbm_bytes() * dep.mem_fraction_static - weights_.total();
  ESS_CHECK(cache_budget_ > 0,
            "{} on {}: weights take {:.1f} GB per GPU, more than mem_fraction_static {} x {:.1f} GB of "
            "HBM; no room for any cache",
            model_.name, hw.name, weights_.total() / 1e9, dep.mem_fraction_static, hw.hbm_capacity_gb);
}

double MemoryModel::hbm_bytes() const { return hw_.hbm_capacity_gb * 1e9; }

double MemoryModel::activation_budget() const {
  return hbm_bytes() * (1.0 - dep_.mem_fraction_static) - hw_.cuda_context_gb * 1e9;
}

double MemoryModel::indexer_bytes_per_request() const {
  return double(context_) * indexer_layers_ * double(model_.indexer_entry_bytes());
}

double MemoryModel::latent_bytes_per_request(double slots) const {
  return slots * cache_layers_ * double(model_.latent_entry_bytes());
}

double MemoryModel::activation_bytes(int batch) const {
  // Per token in flight: ~a dozen hidden-size BF16 buffers (residual, norms, attention output,
  // MoE dispatch/combine staging); workspace: the indexer's fp32 logits over the context.
  const double tokens = double(batch) * dep_.mtp_tokens;
  const double per_token = 12.0 * model_.hidden_size * kBf16 + double(context_) * 4.0;
  return tokens * per_token;
}

int MemoryModel::max_batch(double slots) const {
  const double per_request = indexer_bytes_per_request() + latent_bytes_per_request(slots);
  int b = static_cast<int>(std::floor(cache_budget_ / per_request));
  while (b > 0 && activation_bytes(b) > activation_budget()) --b;
  return std::max(b, 0);
}

void MemoryModel::check_fits(int batch, double slots) const {
  ESS_CHECK(batch >= 1, "batch = {} must be at least 1", batch);
  ESS_CHECK(slots >= min_slots(),
            "{} slots per request-layer is below the pool's floor ({} slots: {})", slots, min_slots(),
            min_slots() < std::min<std::int64_t>(std::int64_t{dep_.mtp_tokens} * model_.index_topk, context_)
                ? "the MTP working set, measured by --miss-profile or else the built-in locality model's, "
                  "with its margin"
                : "T x top-k, capped at the context");
  const double need = batch * (indexer_bytes_per_request() + latent_bytes_per_request(slots));
  ESS_CHECK(need <= cache_budget_ * (1 + 1e-12),
            "batch {} cannot fit: its caches need {:.2f} GB per GPU (indexer {:.2f} + latent {:.2f}) but "
            "{} leaves {:.2f} GB after {:.2f} GB of weights (mem_fraction_static {}); largest batch at "
            "{} slots is {}",
            batch, need / 1e9, batch * indexer_bytes_per_request() / 1e9,
            batch * latent_bytes_per_request(slots) / 1e9, hw_.name, cache_budget_ / 1e9,
            weights_.total() / 1e9, dep_.mem_fraction_static, slots, max_batch(slots));
  ESS_CHECK(activation_bytes(batch) <= activation_budget(),
            "batch {} cannot fit: activations and workspace need {:.2f} GB but only {:.2f} GB is left "
            "outside the static pools",
            batch, activation_bytes(batch) / 1e9, activation_budget() / 1e9);
}

std::int32_t MemoryModel::slots_for_batch(int batch) const {
  ESS_CHECK(batch >= 1, "batch = {} must be at least 1", batch);
  const double per_request = cache_budget_ / batch - indexer_bytes_per_request();
  const double slots = std::floor(per_request / (cache_layers_ * double(model_.latent_entry_bytes())));
  const double capped = std::min(slots, double(context_));
  if (capped < min_slots()) {
    check_fits(batch, min_slots());  // throws with the full account
  }
  check_fits(batch, capped);
  return static_cast<std::int32_t>(capped);
}

double MemoryModel::host_pool_bytes_per_node(int batch, double prefix_share) const {
  ESS_CHECK(std::isfinite(prefix_share) && prefix_share >= 0 && prefix_share <= 1,
            "prefix share = {} must be in [0, 1]", prefix_share);
  // Shared: the prefix's whole 64-token pages; every request keeps the rest (its partial page too).
  const double shared = std::floor(prefix_share * double(context_) / 64) * 64;
  const double tokens = batch > 0 ? shared + double(batch) * (double(context_) - shared) : 0.0;
  return double(dep_.gpus_per_node) * tokens * cache_layers_ * double(model_.latent_entry_bytes());
}

}  // namespace ess::sim
