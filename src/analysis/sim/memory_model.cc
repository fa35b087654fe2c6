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

void require_modelled(const ModelSpec& m, const Deployment& dep) {
  for (int l = 0; l < m.num_hidden_layers && m.is_deepseek_v4(); ++l) {
    const int r = m.compress_ratio(l);
    ESS_CHECK(r == 0 || r == 4 || r == 128,
              "{}: layer {} has compress ratio {}: the simulator models DeepSeek-V4's ratios 0 (the window only), 4 "
              "and 128; the low-ratio caches (1, 2) of later configs are not modelled",
              m.name, l, r);
  }
  const int t = dep.attention_tensor_parallel;
  if (!m.is_minimax_m3()) {
    ESS_CHECK(t == 1,
              "{}: attention_tensor_parallel = {}: its cache is modelled under data-parallel attention (every GPU its "
              "requests' whole latent cache, as SGLang's DP attention holds it); attention tensor parallel is modelled "
              "for MiniMax-M3",
              m.name, t);
    return;
  }
  ESS_CHECK(m.weight_quant.empty() || m.weight_quant == "fp8",
            "{}: weights quantized as '{}' (quantization_config.quant_method): the simulator sizes {}'s weights in "
            "torch_dtype or block FP8",
            m.name, m.weight_quant, m.name);
  for (int l = m.first_k_dense_replace; l < m.num_hidden_layers && !m.moe_layers.empty(); ++l) {
    ESS_CHECK(m.moe_layers[static_cast<std::size_t>(l)],
              "{}: layer {} is a dense MLP after MoE layer {} (moe_layer_freq): the step model runs the dense layers "
              "first",
              m.name, l, m.first_k_dense_replace);
  }
  // SGLang's HiSparse holds one KV head per rank (hisparse_coordinator.py asserts main_pool.head_num == 1;
  // a rank's heads are max(1, num_key_value_heads // attn_tp), models/minimax_m3.py).
  const int kv = m.num_key_value_heads;
  ESS_CHECK(t >= kv && t % kv == 0,
            "{}: attention_tensor_parallel = {}: SGLang's HiSparse serves MiniMax-M3 with one KV head per rank "
            "(\"Increase the tensor-parallel size\"), so attention TP must be a multiple of its {} KV heads (the "
            "shipped deployment {}: --tp 8 --ep 8)",
            m.name, t, kv, "minimax-m3-tp8");
  ESS_CHECK(m.num_attention_heads % t == 0,
            "{}: attention_tensor_parallel = {} does not divide its {} query heads", m.name, t, m.num_attention_heads);
  // models/minimax_m3.py splits the index heads over the ranks or replicates them, one of the two dividing the
  // other; more index heads a rank than its one KV head widen the selection to the group's union
  // (minimax_sparse.py topk_index_reduce), which is not modelled.
  const int idx = m.index_n_heads;
  ESS_CHECK(idx % t == 0 || t % idx == 0,
            "{}: sparse_num_index_heads = {} and attention_tensor_parallel = {}: SGLang splits or replicates the index "
            "heads, one dividing the other",
            m.name, idx, t);
  ESS_CHECK(idx <= t,
            "{}: sparse_num_index_heads = {} over attention_tensor_parallel = {} puts {} index heads on a rank of one KV "
            "head: SGLang then selects the union of their top-k, which the simulator does not model",
            m.name, idx, t, idx / t);
  ESS_CHECK(m.num_dense_layers() == 0 || m.intermediate_size > 0,
            "{}: {} dense MLP layers (moe_layer_freq) but no 'dense_intermediate_size', their width (SGLang's "
            "MiniMaxM3DecoderLayer reads it)",
            m.name, m.num_dense_layers());
}

std::int64_t context_in_entries(const ModelSpec& m, std::int64_t tokens) {
  return m.is_deepseek_v4() ? std::max<std::int64_t>(tokens / 4, 1) : tokens;
}

double V4Caches::page_entry_bytes(int ratio) const {
  // page_size / ratio entries, the page padded to a multiple of 576 B (DeepSeekV4SingleKVPool:
  // bytes_per_page_padded; pool_configurator.py _get_paged_kv_bytes_per_token).
  constexpr double kPad = 576;
  const double n = kPageTokens / ratio;
  return std::ceil(n * entry_data_bytes / kPad) * kPad / n;
}

V4Caches V4Caches::of(const ModelSpec& m) {
  V4Caches c;
  const double nope = m.head_dim - m.qk_rope_head_dim;
  c.entry_data_bytes = nope + 2.0 * m.qk_rope_head_dim + std::ceil(nope / 64 / 8) * 8;
  c.entry_bytes = c.page_entry_bytes(4);
  c.c128_entry_bytes = c.page_entry_bytes(128);
  for (int l = 0; l < m.num_hidden_layers; ++l) {
    c.c4_layers += m.compress_ratio(l) == 4 ? 1 : 0;
    c.c128_layers += m.compress_ratio(l) == 128 ? 1 : 0;
  }
  c.window_layers = m.num_hidden_layers;
  c.window_tokens = m.window_size + kEvictionInterval + 2 * kPageTokens;
  c.window_bytes = c.window_tokens * c.window_layers * c.page_entry_bytes(1);
  // State rings of fp32 rows (CompressStatePool: last_dim = 2 (1 + overlap) head_dim, overlap for
  // ratio 4): the C4 compressors' (attention's and the indexer's) 8 rows per 256-token window page
  // (pool_configurator.py _get_bytes_per_swa_token), the offline C128 compressors' 128 rows.
  constexpr double kFp32 = 4;
  const double c4_rows = c.window_tokens / kPageTokens * 8;
  const double c4 = 4.0 * m.head_dim * kFp32, c4_index = 4.0 * m.index_head_dim * kFp32;
  const double c128 = 128 * 2.0 * m.head_dim * kFp32;
  c.state_bytes = c.c4_layers * c4_rows * (c4 + c4_index) + c.c128_layers * c128;
  return c;
}

double V4Caches::resident_bytes(std::int64_t context) const {
  return std::floor(double(context) / 128) * c128_layers * c128_entry_bytes + window_bytes + state_bytes;
}

MemoryModel::MemoryModel(const ModelSpec& m, const HardwareProfile& hw, const Deployment& dep,
                         std::int64_t context, double min_slots)
    : model_(m), hw_(hw), dep_(dep), context_(context) {
  require_modelled(m, dep);
  ESS_CHECK(context > 0, "memory model: context = {} must be positive", context);
  context_entries_ = context_in_entries(m, context);
  const std::int64_t whole = std::min<std::int64_t>(std::int64_t{dep.mtp_tokens} * m.selected_entries(), context_entries_);
  const std::int64_t one = std::min<std::int64_t>(m.selected_entries(), context_entries_);
  ESS_CHECK(min_slots == 0 || (min_slots >= double(one) && min_slots <= double(whole)),
            "memory model: pool floor {} outside [{}, {}] (one query token's top-k, T x top-k)", min_slots, one, whole);
  min_slots_ = static_cast<std::int32_t>(min_slots > 0 ? std::ceil(min_slots) : double(whole));
  if (m.is_deepseek_v4()) {
    size_deepseek_v4();
  } else if (m.is_minimax_m3()) {
    size_minimax_m3();
  } else {
    size_dsa();
  }
  cache_budget_ = hbm_bytes() * dep.mem_fraction_static - weights_.total();
  ESS_CHECK(cache_budget_ > 0,
            "{} on {}: weights take {:.1f} GB per GPU, more than mem_fraction_static {} x {:.1f} GB of "
            "HBM; no room for any cache",
            model_.name, hw.name, weights_.total() / 1e9, dep.mem_fraction_static, hw.hbm_capacity_gb);
}

void MemoryModel::size_dsa() {
  const ModelSpec& m = model_;
  const Deployment& dep = dep_;
  entry_bytes_ = double(m.latent_entry_bytes());
  const double h = m.hidden_size;
  const int mtp_layers = dep.mtp_tokens > 1 ? m.num_nextn_predict_layers : 0;
  cache_layers_ = m.num_hidden_layers + mtp_layers;
  indexer_layers_ = m.indexer_layers(m.num_hidden_layers) + mtp_layers;
  index_bytes_per_token_ = double(indexer_layers_) * double(m.indexer_entry_bytes());
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
}

// DeepSeek-V4 (models/deepseek_v4.py): per layer the query's low-rank projections, one shared KV head
// of head_dim, the grouped low-rank output; the compressors (bf16) of the C4 and C128 layers; the C4
// layers' indexer. Its speculative layer is not counted (SGLang's HiSparse refuses speculative
// decoding with it), nor the small hyper-connection weights. Routed experts in MXFP4 (SGLang's
// default for V4: SGLANG_DSV4_FP4_EXPERTS), the shared expert in FP8.
void MemoryModel::size_deepseek_v4() {
  const ModelSpec& m = model_;
  const Deployment& dep = dep_;
  const V4Caches v4 = V4Caches::of(m);
  entry_bytes_ = v4.entry_bytes;
  cache_layers_ = indexer_layers_ = v4.c4_layers;
  index_bytes_per_token_ = double(indexer_layers_) * double(m.indexer_entry_bytes());
  other_resident_ = v4.resident_bytes(context_);
  const double h = m.hidden_size, heads = m.num_attention_heads, hd = m.head_dim;
  const double attention = h * m.q_lora_rank + double(m.q_lora_rank) * heads * hd + h * hd +
                           heads * hd * m.o_lora_rank + double(m.o_groups) * m.o_lora_rank * h;
  const double index_q = double(m.q_lora_rank) * m.index_n_heads * m.index_head_dim;
  const double compressors = v4.c4_layers * (2 * h * 2 * hd + 2 * h * 2 * m.index_head_dim + h * m.index_n_heads) +
                             v4.c128_layers * 2 * h * hd;
  const double expert = 3.0 * h * m.moe_intermediate_size;
  const double experts_per_gpu = std::ceil(double(m.n_routed_experts) / dep.expert_parallel);
  const int layers = m.num_hidden_layers;
  weights_.attention = (attention * layers + index_q * v4.c4_layers) * kFp8BytesPerParam + compressors * kBf16;
  weights_.dense_ffn = 3.0 * h * m.intermediate_size * m.num_dense_layers() * kFp8BytesPerParam;
  weights_.shared_experts = expert * m.n_shared_experts * m.num_moe_layers() * kFp8BytesPerParam;
  weights_.routed_experts = expert * experts_per_gpu * m.num_moe_layers() * V4Caches::kExpertBytesPerParam;
  weights_.embedding = 2.0 * h * m.vocab_size * kBf16;
  weights_.router = h * m.n_routed_experts * m.num_moe_layers() * kBf16;
}

// MiniMax-M3 on one rank of attention TP t (models/minimax_m3.py; under HiSparse
// mem_cache/memory_pool.py MiniMaxSparseKVPool and model_executor/pool_configurator.py): its
// max(1, kv_heads / t) KV heads' K and V per token, offloaded in the sparse layers and resident whole in
// the dense ones; the index cache of the sparse layers resident (one head of sparse_index_dim, keys only
// where sparse_disable_index_value says so, in the model's dtype, FP8 with an FP8 KV cache:
// get_minimax_sparse_index_dtype on Hopper). Weights: q / o and the index queries split over the t
// ranks, K / V and the index key replicated per KV head, the experts over expert_parallel, the
// vocabulary split over t; in torch_dtype, or block FP8 (quantization_config fp8).
M3Rank M3Rank::of(const ModelSpec& m, const Deployment& d) {
  const int t = d.attention_tensor_parallel;
  M3Rank r;
  r.q_heads = double(m.num_attention_heads) / t;
  r.kv_heads = std::max(1, m.num_key_value_heads / t);
  r.index_heads = std::max(1, m.index_n_heads / t);
  r.entry_bytes = r.kv_heads * 2 * m.head_dim * m.kv_value_bytes;
  r.index_value_bytes = m.kv_cache_dtype == "fp8_e4m3" ? 1.0 : double(m.dtype_bytes);
  r.fp8_weights = m.weight_quant == "fp8";
  r.weight_bytes = r.fp8_weights ? 1.0 : double(m.dtype_bytes);
  return r;
}

void MemoryModel::size_minimax_m3() {
  const ModelSpec& m = model_;
  const Deployment& dep = dep_;
  const M3Rank r = M3Rank::of(m, dep);
  const double t = dep.attention_tensor_parallel;
  const double kv = r.kv_heads, hd = m.head_dim, h = m.hidden_size;
  entry_bytes_ = r.entry_bytes;
  const std::vector<int> sparse = m.offloaded_layers();
  cache_layers_ = indexer_layers_ = static_cast<int>(sparse.size());
  const int dense = m.num_hidden_layers - cache_layers_;
  other_resident_ = double(context_) * dense * entry_bytes_;
  const auto with_values = static_cast<int>(std::count_if(sparse.begin(), sparse.end(),
                                                          [&](int l) { return m.index_keeps_values(l); }));
  index_bytes_per_token_ = (cache_layers_ + with_values) * double(m.index_head_dim) * r.index_value_bytes;
  const double w = r.fp8_weights ? kFp8BytesPerParam : r.weight_bytes;
  const double q_heads = r.q_heads, index_heads = r.index_heads;
  const double attention = h * q_heads * hd * 2 + h * kv * hd * 2;
  const double index = h * index_heads * m.index_head_dim + h * m.index_head_dim;
  const double expert = 3.0 * h * m.moe_intermediate_size;
  const double experts_per_gpu = std::ceil(double(m.n_routed_experts) / dep.expert_parallel);
  const int moe_layers = m.num_moe_layers();
  // A layer whose index cache keeps values also projects them (index_v_proj) and its index output (index_o_proj).
  const double index_values = h * m.index_head_dim + index_heads * m.index_head_dim * h;
  weights_.attention = (attention * m.num_hidden_layers + index * cache_layers_ + index_values * with_values) * w;
  weights_.dense_ffn = 3.0 * h * m.intermediate_size * m.num_dense_layers() / t * w;  // dense_intermediate_size
  weights_.shared_experts = expert * m.n_shared_experts * moe_layers / t * w;
  weights_.routed_experts = expert * experts_per_gpu * moe_layers * w;
  weights_.embedding = 2.0 * h * m.vocab_size / t * kBf16;
  weights_.router = h * m.n_routed_experts * moe_layers * kBf16;
}

double MemoryModel::hbm_bytes() const { return hw_.hbm_capacity_gb * 1e9; }

double MemoryModel::activation_budget() const {
  return hbm_bytes() * (1.0 - dep_.mem_fraction_static) - hw_.cuda_context_gb * 1e9;
}

double MemoryModel::indexer_bytes_per_request() const {
  return double(context_entries_) * index_bytes_per_token_;
}

double MemoryModel::resident_bytes_per_request() const { return indexer_bytes_per_request() + other_resident_; }

double MemoryModel::latent_bytes_per_request(double slots) const { return slots * cache_layers_ * entry_bytes_; }

double MemoryModel::activation_bytes(int batch) const {
  // Per token in flight: ~a dozen hidden-size BF16 buffers (residual, norms, attention output,
  // MoE dispatch/combine staging); workspace: the indexer's fp32 logits over the context.
  const double tokens = double(batch) * dep_.mtp_tokens;
  const double per_token = 12.0 * model_.hidden_size * kBf16 + double(context_) * 4.0;
  return tokens * per_token;
}

int MemoryModel::max_batch(double slots) const {
  const double per_request = resident_bytes_per_request() + latent_bytes_per_request(slots);
  int b = static_cast<int>(std::floor(cache_budget_ / per_request));
  while (b > 0 && activation_bytes(b) > activation_budget()) --b;
  return std::max(b, 0);
}

void MemoryModel::check_fits(int batch, double slots) const {
  ESS_CHECK(batch >= 1, "batch = {} must be at least 1", batch);
  ESS_CHECK(slots >= min_slots(),
            "{} slots per request-layer is below the pool's floor ({} slots: {})", slots, min_slots(),
            min_slots() < std::min<std::int64_t>(std::int64_t{dep_.mtp_tokens} * model_.selected_entries(), context_entries_)
                ? "the MTP working set, measured by --miss-profile or else the built-in locality model's, "
                  "with its margin"
                : "T x top-k, capped at the context");
  const double need = batch * (resident_bytes_per_request() + latent_bytes_per_request(slots));
  ESS_CHECK(need <= cache_budget_ * (1 + 1e-12),
            "batch {} cannot fit: its caches need {:.2f} GB per GPU ({} {:.2f} + latent {:.2f}) but "
            "{} leaves {:.2f} GB after {:.2f} GB of weights (mem_fraction_static {}); largest batch at "
            "{} slots is {}",
            batch, need / 1e9, other_resident_ > 0 ? "indexer and other resident caches" : "indexer",
            batch * resident_bytes_per_request() / 1e9,
            batch * latent_bytes_per_request(slots) / 1e9, hw_.name, cache_budget_ / 1e9,
            weights_.total() / 1e9, dep_.mem_fraction_static, slots, max_batch(slots));
  ESS_CHECK(activation_bytes(batch) <= activation_budget(),
            "batch {} cannot fit: activations and workspace need {:.2f} GB but only {:.2f} GB is left "
            "outside the static pools",
            batch, activation_bytes(batch) / 1e9, activation_budget() / 1e9);
}

std::int32_t MemoryModel::slots_for_batch(int batch) const {
  ESS_CHECK(batch >= 1, "batch = {} must be at least 1", batch);
  const double per_request = cache_budget_ / batch - resident_bytes_per_request();
  const double slots = std::floor(per_request / (cache_layers_ * entry_bytes_));
  const double capped = std::min(slots, double(context_entries_));
  if (capped < min_slots()) {
    check_fits(batch, min_slots());  // throws with the full account
  }
  check_fits(batch, capped);
  return static_cast<std::int32_t>(capped);
}

double MemoryModel::host_pool_bytes_per_node(int batch, double prefix_share) const {
  ESS_CHECK(std::isfinite(prefix_share) && prefix_share >= 0 && prefix_share <= 1,
            "prefix share = {} must be in [0, 1]", prefix_share);
  // Shared: the prefix's whole pages of 64 entries; every request keeps the rest (its partial page
  // too). A host entry is the latent's bytes rounded up to 16 (DeepSeek-V4's 584 B: 592).
  const double ctx = double(context_entries_);
  const double shared = std::floor(prefix_share * ctx / 64) * 64;
  const double entries = batch > 0 ? shared + double(batch) * (ctx - shared) : 0.0;
  const double host_entry = std::ceil(double(model_.latent_entry_bytes()) / 16) * 16;
  return double(dep_.gpus_per_node) * entries * cache_layers_ * host_entry;
}

}  // namespace ess::sim
