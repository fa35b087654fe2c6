// Memory model of one decode GPU: weights under the deployment's sharding, the indexer cache
// (always whole on the GPU), the latent cache (Sparse Memory Pool: slots per request-layer),
// activations and workspace, the CUDA context; and the host side (Total Memory Pool of all
// GPUs of a node against host DRAM). All sizes in bytes.
#pragma once

#include <cstdint>

#include "ess/model/model_spec.h"
#include "ess/sim/deployment.h"
#include "ess/sim/hardware.h"

namespace ess::sim {

struct WeightBytes {
  double attention = 0;       // MLA + indexer projections, every layer (+ the MTP layer)
  double dense_ffn = 0;       // the first_k_dense_replace layers' FFN
  double shared_experts = 0;
  double routed_experts = 0;  // this GPU's share under expert parallelism
  double embedding = 0;       // embedding + LM head (+ the MTP layer's eh_proj), BF16
  double router = 0;
  double total() const { return attention + dense_ffn + shared_experts + routed_experts + embedding + router; }
};

// Throws ess::Error naming the model unless its layers and their deployment are what the step
// model models: DSA's (DeepSeek-V3.2, GLM-5.x) and DeepSeek-V4's under data-parallel attention;
// MiniMax-M3's under attention tensor parallel with one KV head per rank (SGLang's HiSparse), its
// weights in torch_dtype or FP8, its dense MLP layers first.
void require_modelled(const ModelSpec& m, const Deployment& dep);

// `tokens` of context in the offloaded cache's entries: tokens, or DeepSeek-V4's C4 entries (at
// least 1), one per 4 tokens as SGLang's compressed_seq_lens (seq_len // 4).
std::int64_t context_in_entries(const ModelSpec& m, std::int64_t tokens);

// DeepSeek-V4's caches as SGLang 0.5.23's pools hold them (mem_cache/deepseek_v4_memory_pool.py,
// deepseek_v4_compress_state.py, model_executor/pool_configurator.py), bytes per request unless
// said, without speculative decoding: pages of 256 tokens, so page_size / ratio entries a page,
// each page padded to a multiple of 576 B (585 B an entry for the window and C4, 864 B for C128);
// the C4 indexer's keys (FP8: 132 B per C4 entry); the sliding window as the scheduler holds it at
// worst (compute_swa_request_cap: window + SGLANG_SWA_EVICTION_INTERVAL 128 + a page + a page of
// decode allocation: 768 tokens), the C4 compressors' fp32 state priced per window token (ring 8
// per 256-token page, attention's and indexer's), the offline C128 compressors' 128-row state per
// request (SGLANG_DSV4_COMPRESS_STATE_DTYPE float32 and online C128 off: SGLang's defaults).
struct V4Caches {
  static constexpr double kPageTokens = 256;
  static constexpr double kEvictionInterval = 128;
  // Routed experts in MXFP4 (SGLang's default for V4, SGLANG_DSV4_FP4_EXPERTS): 4-bit values and a
  // one-byte scale per 32.
  static constexpr double kExpertBytesPerParam = 0.5 + 1.0 / 32;
  // An entry as SGLang's V4 layout stores it (DeepSeekV4SingleKVPool.get_bytes_per_token): NoPE in
  // FP8, RoPE in bf16, a ue8m0 scale per 64 NoPE values (padded to 8): 448 + 128 + 8 = 584 B.
  double entry_data_bytes = 0;
  double entry_bytes = 0;       // a C4 / window entry on the device, page padding included
  double c128_entry_bytes = 0;  // a C128 entry (2 a page)
  int c4_layers = 0;            // compress ratio 4: the cache HiSparse offloads
  int c128_layers = 0;
  int window_layers = 0;        // every layer keeps its sliding window
  double window_tokens = 0;     // held per request (compute_swa_request_cap)
  double window_bytes = 0;      // window_tokens x window_layers x entry
  double state_bytes = 0;       // the compressors' state rings
  // An entry's bytes on the device in a cache of compress ratio `ratio` (1: the window).
  double page_entry_bytes(int ratio) const;
  static V4Caches of(const ModelSpec& m);
  // Per request at `context` tokens: the C128 cache, windows and states (the indexer keys apart).
  double resident_bytes(std::int64_t context) const;
};

// MiniMax-M3 on one rank of attention TP t, as SGLang 0.5.23 shards it (models/minimax_m3.py): its
// query heads (heads / t), KV heads (max(1, kv_heads / t)) and index heads (split or replicated: one a
// rank at most, require_modelled), a token's K / V entry on the rank, an index cache value's bytes (the
// model's dtype; FP8 with an fp8_e4m3 KV cache, get_minimax_sparse_index_dtype on Hopper) and the
// weights' (torch_dtype's, or 1 with block FP8: quantization_config fp8, its scales apart).
struct M3Rank {
  double q_heads = 0, kv_heads = 0, index_heads = 0;
  double entry_bytes = 0;        // K and V of the rank's KV heads, a token
  double index_value_bytes = 0;  // a value of the index cache
  bool fp8_weights = false;
  double weight_bytes = 0;       // a weight, block scales not counted
  static M3Rank of(const ModelSpec& m, const Deployment& d);
};

class MemoryModel {
 public:
  // `min_slots`: the pool's floor (MissModel::min_slots: from the measured MTP working set);
  // 0 = min(T x top-k, context), a pool no step can overflow.
  MemoryModel(const ModelSpec& model, const HardwareProfile& hw, const Deployment& dep,
              std::int64_t context, double min_slots = 0);

  const WeightBytes& weights() const { return weights_; }
  // Layers holding the offloaded cache (+ MTP layer): every layer of a DSA model, DeepSeek-V4's C4
  // layers, MiniMax-M3's sparse layers.
  int cache_layers() const { return cache_layers_; }
  // Layers holding indexer keys and weights (+ MTP layer): a layer that reuses its leader's top-k
  // (ModelSpec::shared_index) has neither.
  int indexer_layers() const { return indexer_layers_; }
  double hbm_bytes() const;
  // HBM x mem_fraction_static - weights: what the indexer and latent caches may use.
  double cache_budget() const { return cache_budget_; }
  // (1 - mem_fraction_static) x HBM - CUDA context: what activations and workspace may use.
  double activation_budget() const;
  double indexer_bytes_per_request() const;                  // whole context, every indexer layer
  // What a request keeps on the GPU whatever its pool: its indexer keys; DeepSeek-V4's C128
  // cache, sliding windows and compressor states as well; MiniMax-M3's dense layers' K / V.
  double resident_bytes_per_request() const;
  double latent_bytes_per_request(double slots) const;       // slots x cache layers x entry (656 B for V3.2)
  // The context in the offloaded cache's entries: tokens, DeepSeek-V4's C4 entries (one per 4
  // tokens). Slots, top-k and misses count these.
  std::int64_t context_entries() const { return context_entries_; }
  double activation_bytes(int batch) const;                  // B x T tokens in flight + workspace
  // Smallest pool a plan may use: as constructed (at least one query token's top-k; a step
  // whose working set exceeds the pool runs in query groups).
  std::int32_t min_slots() const { return min_slots_; }

  // Largest batch whose caches fit with `slots` per request-layer (0 when none fits).
  int max_batch(double slots) const;
  // Most slots per request-layer that fit `batch` requests (capped at the context). Throws
  // ess::Error naming the batch when even min_slots() does not fit or activations overflow.
  std::int32_t slots_for_batch(int batch) const;
  // Throws unless `batch` requests with `slots` each fit (message names what overflows).
  void check_fits(int batch, double slots) const;

  // Host: the Total Memory Pool of all GPUs of a node (every token of every layer). With a
  // shared prompt prefix (prefix_share of the context common to every request of a GPU), its
  // full pages are held once per GPU's pool.
  double host_pool_bytes_per_node(int batch, double prefix_share = 0) const;

 private:
  void size_dsa();           // weights and layers of a DSA model
  void size_deepseek_v4();   // of DeepSeek-V4 (V4Caches)
  void size_minimax_m3();    // of MiniMax-M3, on one rank of attention TP

  ModelSpec model_;
  HardwareProfile hw_;
  Deployment dep_;
  std::int64_t context_;
  std::int64_t context_entries_ = 0;
  double entry_bytes_ = 0;     // an offloaded entry on the device
  double other_resident_ = 0;  // resident_bytes_per_request() beside the indexer keys
  double index_bytes_per_token_ = 0;  // the indexer cache's bytes per context entry, every layer
  int cache_layers_ = 0;
  int indexer_layers_ = 0;
  WeightBytes weights_;
  double cache_budget_ = 0;
  std::int32_t min_slots_ = 0;
};

}  // namespace ess::sim
