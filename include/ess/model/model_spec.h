// The model facts ESS needs, read from JSON with the field names of the model's own
// Hugging Face config.json, so a user can point at the real file (unknown fields are
// ignored; missing required fields and out-of-range values are errors naming the field).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace ess {

struct ModelSpec {
  std::string name;  // "_name_or_path" / "model_type" when present, else the file name
  std::string model_type;  // the config's "model_type" ("" when absent)

  // Transformer shape.
  int num_hidden_layers = 0;
  int hidden_size = 0;
  int vocab_size = 0;
  int num_attention_heads = 0;
  // MLA.
  int q_lora_rank = 0;
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  // DSA lightning indexer.
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  // FFN / MoE.
  int intermediate_size = 0;
  int moe_intermediate_size = 0;
  int n_routed_experts = 0;
  int n_shared_experts = 0;
  int num_experts_per_tok = 0;
  int first_k_dense_replace = 0;
  // Multi-token prediction (next-n) layers.
  int num_nextn_predict_layers = 0;
  int max_position_embeddings = 0;
  // YaRN softmax correction (rope_scaling.factor / mscale_all_dim); 1 / 0 when absent.
  double rope_scaling_factor = 1.0;
  double rope_mscale_all_dim = 0.0;
  // Index sharing (GLM-5.2's): shared_index[l] says layer l runs no indexer and attends over the
  // top-k of the last layer before it that runs one (its leader). Empty when every layer runs its
  // own. Derived as SGLang derives each layer's `skip_topk` (configs/model_config.py,
  // dsa_layer_skips_topk), the first field present deciding: `indexer_types` ("full" / "shared"
  // per layer; layers past its end are full), `cli_factor` > 1 (a fresh top-k every cli_factor
  // layers; not for `glm_moe_dsa`, whose transformers config ignores it and floors the frequency
  // at 1), `index_topk_pattern` ("F" / "S" per layer), else `index_topk_freq` with
  // `index_skip_topk_offset` (layer l shared unless max(l - offset + 1, 0) is a multiple of the
  // frequency; offset 2 when absent).
  std::vector<bool> shared_index;
  // DeepSeek-V4 (model_type "deepseek_v4", read as SGLang's DeepSeekV4Config and
  // models/deepseek_v4.py read it): head_dim (the latent's width: qk_rope_head_dim RoPE values
  // after head_dim - qk_rope_head_dim NoPE ones), the per-layer compress_ratios (0: the sliding
  // window only; 4: the C4 cache of every 4 tokens, which the sparse attention reads through the
  // indexer's top-k and HiSparse offloads; 128: the C128 cache, read whole; 1, 2: SGLang accepts
  // them; a list may run past num_hidden_layers: V4-Flash's 44th entry is its MTP layer's) and
  // the sliding window (config.sliding_window). 0 / empty for other models.
  int head_dim = 0;
  std::vector<int> compress_ratios;
  int window_size = 0;
  // The grouped low-rank output projection (config o_lora_rank, o_groups; SGLang's defaults 1024, 8):
  // each of o_groups groups of heads projected to o_lora_rank, then all groups to hidden_size.
  int o_lora_rank = 0;
  int o_groups = 0;
  // DeepSeek-V4: layer l's compress ratio (0 past the list, or for another model).
  int compress_ratio(int layer) const {
    return layer >= 0 && static_cast<std::size_t>(layer) < compress_ratios.size() ? compress_ratios[static_cast<std::size_t>(layer)] : 0;
  }
  bool is_deepseek_v4() const { return model_type == "deepseek_v4"; }
  // MiniMax-M3 (architectures[0] MiniMaxM3SparseForCausalLM or ...ForConditionalGeneration, its
  // fields from text_config when the config has one: SGLang's configs/model_config.py
  // is_minimax_sparse, get_minimax_sparse_attention_config, models/minimax_m3.py): head_dim (default
  // hidden_size / num_attention_heads), num_key_value_heads, and from sparse_attention_config the
  // sparse layers (sparse_attention_freq != 0: K / V offloaded, a top-k of sparse_topk_blocks blocks
  // of sparse_block_size tokens; the others dense, resident), the index heads (sparse_num_index_heads,
  // sparse_index_dim: the indexer fields above). index_topk is the tokens a block top-k selects.
  // kv_value_bytes: a cached K / V value's bytes, from kv_cache_dtype when the config carries
  // SGLang's server flag (fp8_e4m3 / fp8_e5m2: 1; auto, bfloat16: the model's), else torch_dtype's
  // (bfloat16 / float16 2, float32 4; 2 when absent).
  std::string architecture;
  // The KV cache's dtype when the config carries SGLang's server flag kv_cache_dtype: "bfloat16"
  // (a DSA model's latent in bf16, 1,152-byte entries: SGLang's default on Hopper) or "fp8_e4m3";
  // "" (absent, or "auto"): ESS's default, FP8 (656 bytes) for DSA models.
  std::string kv_cache_dtype;
  int num_key_value_heads = 0;
  std::vector<bool> sparse_layers;
  int sparse_block_size = 0;
  int sparse_topk_blocks = 0;
  // Blocks every query reads, forced into its top-k: the first sparse_init_blocks and the
  // sparse_local_blocks ending at the query's own (SGLang's CUDA index kernel scores them 1e30 / 1e29,
  // flash_with_topk_idx.py; only its NPU path appends them past the top-k, _merge_sparse_blocks).
  int sparse_init_blocks = 0;
  int sparse_local_blocks = 0;
  int kv_value_bytes = 0;
  // MiniMax-M3: the model's dtype (torch_dtype's bytes: its weights, its index cache but with an FP8
  // e4m3 KV cache). Its dense MLP layers' width is intermediate_size (config dense_intermediate_size),
  // its experts' moe_intermediate_size (config intermediate_size).
  int dtype_bytes = 0;
  // MiniMax-M3: the layers whose index cache holds keys only (sparse_disable_index_value != 0; the
  // others keep index values too; empty: none), the MoE layers (moe_layer_freq != 0; empty: every
  // layer; its leading dense layers also set first_k_dense_replace) and the weights' quantization
  // (quantization_config.quant_method, e.g. "fp8"; "": torch_dtype's).
  std::vector<bool> index_k_only;
  std::vector<bool> moe_layers;
  std::string weight_quant;
  bool is_minimax_m3() const {
    return architecture == "MiniMaxM3SparseForCausalLM" || architecture == "MiniMaxM3SparseForConditionalGeneration";
  }
  // Tokens per selected unit: MiniMax-M3's blocks of sparse_block_size, else 1 (a token).
  int selection_block() const { return is_minimax_m3() ? sparse_block_size : 1; }
  // The layers whose latent cache ESS holds: DeepSeek-V4's C4 layers (their compressed entries,
  // one per 4 tokens); MiniMax-M3's sparse layers (their K / V); every layer for the others.
  std::vector<int> offloaded_layers() const;
  bool offloads(int layer) const;  // whether `layer` is one of offloaded_layers()
  // MiniMax-M3: whether a sparse layer's index cache keeps values beside its keys
  // (sparse_disable_index_value 0 or absent); false for every other layer and model.
  bool index_keeps_values(int layer) const;
  // Tokens per entry of the offloaded cache: 4 for DeepSeek-V4's C4 cache, else 1.
  int tokens_per_entry() const { return is_deepseek_v4() ? 4 : 1; }
  // Ids a query's selection holds (an id: selection_block() entries of tokens_per_entry() tokens):
  // MiniMax-M3's top blocks (its forced ones among them), else index_topk.
  int selected_ids() const { return is_minimax_m3() ? sparse_topk_blocks : index_topk; }
  // Entries of the offloaded cache a query token reads: MiniMax-M3's top blocks' tokens, else
  // index_topk (DeepSeek-V4's C4 entries, DSA's tokens).
  int selected_entries() const { return is_minimax_m3() ? selected_ids() * sparse_block_size : index_topk; }
  // Whether the config's sharing fields declare sharing (index_topk_freq > 1, an S in
  // index_topk_pattern, a "shared" in indexer_types), whatever pattern they give: the condition on
  // which SGLang refuses two-batch overlap.
  bool declares_index_sharing = false;

  static ModelSpec from_json(const nlohmann::json& j, const std::string& source = "<json>");
  static ModelSpec from_file(const std::string& path);
  // The shipped configs/models/deepseek-v3.2-exp.json, compiled in.
  static ModelSpec deepseek_v32_exp();

  nlohmann::json to_json() const;

  // Derived facts.
  int num_dense_layers() const { return first_k_dense_replace; }
  int num_moe_layers() const { return num_hidden_layers - first_k_dense_replace; }
  int mla_head_dim() const { return kv_lora_rank + qk_rope_head_dim; }  // absorbed q/k width (576)
  std::size_t latent_entry_bytes() const;   // 656 for DeepSeek-V3.2
  std::size_t indexer_entry_bytes() const;  // 132 for DeepSeek-V3.2
  bool index_shared(int layer) const {
    return layer >= 0 && static_cast<std::size_t>(layer) < shared_index.size() && shared_index[static_cast<std::size_t>(layer)];
  }
  // The layer whose indexer's top-k `layer` attends over: itself, or its leader when shared.
  int index_leader(int layer) const;
  // Of the first `layers` layers, those that run an indexer.
  int indexer_layers(int layers) const;
  // Softmax scale of the absorbed MLA: mscale^2 / sqrt(qk_nope_head_dim + qk_rope_head_dim),
  // mscale = 0.1 * mscale_all_dim * ln(factor) + 1 under YaRN (as DeepSeek's reference code);
  // DeepSeek-V4 and MiniMax-M3: head_dim^-0.5 (SGLang's models/deepseek_v4.py, minimax_m3.py).
  double softmax_scale() const;

  void validate(const std::string& source) const;
};

}  // namespace ess
