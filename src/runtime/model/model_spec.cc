#include "ess/model/model_spec.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "ess/core/error.h"
#include "ess/core/json.h"
#include "ess/model/entry_layout.h"
#include "runtime/model/shipped_models.h"

namespace ess {

using nlohmann::json;

namespace {

// A field that is absent or JSON null (a config object's None) is not set.
const json* present(const json& j, const char* field) {
  const auto it = j.find(field);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

// Per layer, whether it reuses its leader's top-k (ModelSpec::shared_index): SGLang's rule over
// the config object it reads. For GLM-5.x (`glm_moe_dsa`) that object is transformers'
// GlmMoeDsaConfig, which always sets indexer_types itself, from index_topk_pattern or else from
// max(index_topk_freq, 1) and the offset, and never from cli_factor.
std::vector<bool> shared_index_layers(const json& j, int layers, const std::string& source) {
  const json* type = present(j, "model_type");
  const bool glm = type != nullptr && type->is_string() && *type == "glm_moe_dsa";
  std::vector<bool> shared(static_cast<std::size_t>(std::max(layers, 0)), false);
  if (const json* types = present(j, "indexer_types")) {
    ESS_CHECK(types->is_array(), "{}: field 'indexer_types' must be a list of \"full\" / \"shared\", got {}", source,
              types->dump());
    for (std::size_t l = 0; l < types->size(); ++l) {
      const json& t = (*types)[l];
      ESS_CHECK(t.is_string() && (t == "full" || t == "shared"),
                "{}: field 'indexer_types'[{}] = {} must be \"full\" or \"shared\"", source, l, t.dump());
      if (l < shared.size()) shared[l] = t == "shared";
    }
  } else if (const int f = !glm && present(j, "cli_factor") != nullptr ? json_int(j, "cli_factor", source, true) : 1;
             f != 1) {
    ESS_CHECK(f > 0, "{}: field 'cli_factor' = {} must be positive", source, f);
    for (int l = 0; l < layers; ++l) shared[static_cast<std::size_t>(l)] = l % f != 0;
  } else if (const json* pattern = present(j, "index_topk_pattern")) {
    ESS_CHECK(pattern->is_string(), "{}: field 'index_topk_pattern' must be a string of F and S, got {}", source,
              pattern->dump());
    const std::string p = pattern->get<std::string>();
    for (std::size_t l = 0; l < p.size(); ++l) {
      ESS_CHECK(p[l] == 'F' || p[l] == 'S', "{}: field 'index_topk_pattern' = \"{}\": character {} is '{}', not F or S",
                source, p, l, std::string(1, p[l]));
      if (l < shared.size()) shared[l] = p[l] == 'S';
    }
  } else {
    int freq = present(j, "index_topk_freq") != nullptr ? json_int(j, "index_topk_freq", source, true) : 1;
    if (glm) freq = std::max(freq, 1);
    ESS_CHECK(freq > 0, "{}: field 'index_topk_freq' = {} must be positive", source, freq);
    int offset = 2;
    if (present(j, "index_skip_topk_offset") != nullptr) {
      offset = json_int(j, "index_skip_topk_offset", source, true);
      ESS_CHECK(offset > 0, "{}: field 'index_skip_topk_offset' = {} must be positive (layer 0 has no top-k before it "
                "to reuse)", source, offset);
    }
    for (int l = 0; l < layers; ++l) shared[static_cast<std::size_t>(l)] = std::max(l - offset + 1, 0) % freq != 0;
  }
  if (std::find(shared.begin(), shared.end(), true) == shared.end()) return {};
  ESS_CHECK(!shared[0], "{}: layer 0 reuses a top-k (the index sharing fields), but no layer before it runs an indexer",
            source);
  return shared;
}

// SGLang's test for refusing two-batch overlap (arg_groups/model_hook.py,
// _validate_dsa_tbo_index_sharing): on the fields, not on the pattern they give.
bool sharing_fields_declare_it(const json& j) {
  const json* freq = present(j, "index_topk_freq");
  const json* pattern = present(j, "index_topk_pattern");
  const json* types = present(j, "indexer_types");
  return (freq != nullptr && freq->is_number() && freq->get<double>() > 1) ||
         (pattern != nullptr && pattern->is_string() && pattern->get<std::string>().find('S') != std::string::npos) ||
         (types != nullptr && types->is_array() && std::find(types->begin(), types->end(), "shared") != types->end());
}

// SGLang's kv_cache_dtype flag when the config carries it, normalized as SGLang does ("bf16" is
// "bfloat16"; "auto" is left to the default: "").
std::string kv_cache_dtype_of(const json& j, const std::string& source) {
  const json* k = present(j, "kv_cache_dtype");
  if (k == nullptr) return {};
  ESS_CHECK(k->is_string(), "{}: field 'kv_cache_dtype' must be a string, got {}", source, k->dump());
  std::string d = k->get<std::string>();
  if (d == "bf16") d = "bfloat16";
  return d == "auto" ? std::string() : d;
}

// The first architecture a config names ("" when none).
std::string first_architecture(const json& j) {
  const json* a = present(j, "architectures");
  if (a == nullptr || !a->is_array() || a->empty() || !(*a)[0].is_string()) return {};
  return (*a)[0].get<std::string>();
}

// A cached K / V value's bytes for MiniMax-M3: SGLang's kv_cache_dtype when the config carries it
// (server flag; "auto" is the model's dtype), else the config's torch_dtype.
int kv_value_bytes(const json& j, const std::string& source, const std::string& flag) {
  std::string dtype = "bfloat16";
  if (const json* t = present(j, "torch_dtype")) {
    ESS_CHECK(t->is_string(), "{}: field 'torch_dtype' must be a string, got {}", source, t->dump());
    dtype = t->get<std::string>();
  }
  if (!flag.empty()) dtype = flag;
  if (dtype == "bfloat16" || dtype == "bf16" || dtype == "float16" || dtype == "fp16") return 2;
  if (dtype == "float32") return 4;
  if (dtype == "fp8_e4m3" || dtype == "fp8_e5m2" || dtype == "fp8_e4m3fnuz") return 1;
  ESS_THROW("{}: the K / V cache's dtype '{}' (kv_cache_dtype, else torch_dtype) is not one of bfloat16, float16, "
            "float32, fp8_e4m3, fp8_e5m2",
            source, dtype);
}

// MiniMax-M3's fields as SGLang reads them (configs/model_config.py, models/minimax_m3.py,
// layers/attention/minimax_sparse_backend.py): `t` the text config, `top` the whole file (the
// sparse attention config is the text config's, else the top level's).
void read_minimax_m3(const json& t, const json& top, const std::string& source, ModelSpec& m) {
  m.num_hidden_layers = json_int(t, "num_hidden_layers", source, true);
  m.hidden_size = json_int(t, "hidden_size", source, true);
  m.vocab_size = json_int(t, "vocab_size", source, true);
  m.num_attention_heads = json_int(t, "num_attention_heads", source, true);
  m.num_key_value_heads = json_int(t, "num_key_value_heads", source, true);
  ESS_CHECK(m.num_attention_heads > 0, "{}: field 'num_attention_heads' = {} must be positive", source,
            m.num_attention_heads);
  m.head_dim = json_int(t, "head_dim", source, false, m.hidden_size / m.num_attention_heads);
  m.qk_rope_head_dim = json_int(t, "rotary_dim", source, false, m.head_dim);
  m.max_position_embeddings = json_int(t, "max_position_embeddings", source, false, 8192);
  m.n_routed_experts = json_int(t, "num_local_experts", source, false, 0);
  m.num_experts_per_tok = json_int(t, "num_experts_per_tok", source, false, 0);
  // The experts' width is intermediate_size, a shared expert's intermediate_size x n_shared_experts
  // (MiniMaxM3MoE), a dense MLP layer's dense_intermediate_size (MiniMaxM3DecoderLayer; 0 when absent).
  m.moe_intermediate_size = json_int(t, "intermediate_size", source, false, 0);
  m.intermediate_size = json_int(t, "dense_intermediate_size", source, false, 0);
  m.n_shared_experts = json_int(t, "n_shared_experts", source, false, 0);
  m.kv_value_bytes = kv_value_bytes(t, source, m.kv_cache_dtype);
  m.dtype_bytes = kv_value_bytes(t, source, "");
  // MoE or dense MLP per layer (models/minimax_m3.py _is_layer_sparse: moe_layer_freq[l] != 0; every
  // layer MoE when absent); the weights' quantization (quantization_config.quant_method).
  if (const json* moe = present(t, "moe_layer_freq")) {
    ESS_CHECK(moe->is_array(), "{}: field 'moe_layer_freq' (per layer, 0 for a dense MLP) must be a list", source);
    for (std::size_t l = 0; l < moe->size(); ++l) {
      const json& f = (*moe)[l];
      ESS_CHECK(f.is_number_integer(), "{}: field 'moe_layer_freq'[{}] = {} is not an integer", source, l, f.dump());
      m.moe_layers.push_back(f.get<std::int64_t>() != 0);
    }
  }
  while (m.first_k_dense_replace < std::ssize(m.moe_layers) && !m.moe_layers[static_cast<std::size_t>(m.first_k_dense_replace)]) {
    ++m.first_k_dense_replace;
  }
  const json* quant = present(t, "quantization_config");
  if (quant == nullptr) quant = present(top, "quantization_config");
  if (quant != nullptr) {
    ESS_CHECK(quant->is_object(), "{}: field 'quantization_config' must be an object, got {}", source, quant->dump());
    const json* method = present(*quant, "quant_method");
    ESS_CHECK(method != nullptr && method->is_string(),
              "{}: field 'quantization_config' has no string 'quant_method' (how its weights are stored): {}", source,
              quant->dump());
    m.weight_quant = method->get<std::string>();
  }
  const json* sparse = present(t, "sparse_attention_config");
  if (sparse == nullptr) sparse = present(top, "sparse_attention_config");
  ESS_CHECK(sparse != nullptr && sparse->is_object(),
            "{}: a MiniMax-M3 config needs 'sparse_attention_config' (in text_config or at the top level)", source);
  const std::string where = source + " sparse_attention_config";
  const json* freq = present(*sparse, "sparse_attention_freq");
  ESS_CHECK(freq != nullptr && freq->is_array(),
            "{}: field 'sparse_attention_freq' (per layer, 0 for a dense layer) must be a list of integers", where);
  for (std::size_t l = 0; l < freq->size(); ++l) {
    const json& f = (*freq)[l];
    ESS_CHECK(f.is_number_integer(), "{}: field 'sparse_attention_freq'[{}] = {} is not an integer", where, l, f.dump());
    m.sparse_layers.push_back(f.get<std::int64_t>() != 0);
  }
  m.sparse_block_size = json_int(*sparse, "sparse_block_size", where, true);
  m.sparse_topk_blocks = json_int(*sparse, "sparse_topk_blocks", where, true);
  m.index_head_dim = json_int(*sparse, "sparse_index_dim", where, true);
  m.index_n_heads = json_int(*sparse, "sparse_num_index_heads", where, true);
  // An index cache of keys only in the layers flagged (configs/model_config.py
  // get_minimax_sparse_disable_value_layer_ids: none when absent).
  if (const json* k_only = present(*sparse, "sparse_disable_index_value")) {
    ESS_CHECK(k_only->is_array(), "{}: field 'sparse_disable_index_value' (per layer) must be a list of integers", where);
    for (std::size_t l = 0; l < k_only->size(); ++l) {
      const json& f = (*k_only)[l];
      ESS_CHECK(f.is_number_integer(), "{}: field 'sparse_disable_index_value'[{}] = {} is not an integer", where, l,
                f.dump());
      m.index_k_only.push_back(f.get<std::int64_t>() != 0);
    }
  }
  if (const json* score = present(*sparse, "sparse_score_type")) {
    ESS_CHECK(score->is_string() && (*score == "max" || *score == "lse"),
              "{}: field 'sparse_score_type' = {} must be \"max\" or \"lse\"", where, score->dump());
  }
  ESS_CHECK(m.sparse_block_size > 0 && m.sparse_topk_blocks > 0,
            "{}: sparse_block_size = {} and sparse_topk_blocks = {} must be positive", where, m.sparse_block_size,
            m.sparse_topk_blocks);
  m.index_topk = m.sparse_topk_blocks * m.sparse_block_size;
  // The forced blocks (minimax_sparse_backend.py, MiniMaxSparseAttnBackend.__init__): sparse_init_block, else
  // ceil(sparse_init_tokens / block); sparse_local_block, else ceil(sparse_local_tokens / block) + 1.
  const auto blocks_of = [&](const char* blocks, const char* tokens, int extra) {
    if (present(*sparse, blocks) != nullptr) return json_int(*sparse, blocks, where, true);
    ESS_CHECK(present(*sparse, tokens) != nullptr, "{}: field '{}' (or '{}', as SGLang reads it) is missing", where,
              blocks, tokens);
    const int n = json_int(*sparse, tokens, where, true);
    return n < 0 ? n : (n + m.sparse_block_size - 1) / m.sparse_block_size + extra;
  };
  m.sparse_init_blocks = blocks_of("sparse_init_block", "sparse_init_tokens", 0);
  m.sparse_local_blocks = blocks_of("sparse_local_block", "sparse_local_tokens", 1);
  ESS_CHECK(m.sparse_init_blocks >= 0 && m.sparse_local_blocks >= 0,
            "{}: sparse_init_block = {} and sparse_local_block = {} must be >= 0", where, m.sparse_init_blocks,
            m.sparse_local_blocks);
}

// DeepSeek-V4's fields as SGLang reads them: its DeepSeekV4Config dataclass's defaults
// (configs/deepseek_v4.py) for what the file leaves out, head_dim from the file (models/deepseek_v4.py
// reads config.head_dim), the latent's NoPE width head_dim - qk_rope_head_dim.
void read_deepseek_v4(const json& j, const std::string& source, ModelSpec& m) {
  m.head_dim = json_int(j, "head_dim", source, true);
  m.qk_rope_head_dim = json_int(j, "qk_rope_head_dim", source, false, 64);
  ESS_CHECK(m.head_dim > m.qk_rope_head_dim, "{}: field 'head_dim' = {} must exceed qk_rope_head_dim = {}", source,
            m.head_dim, m.qk_rope_head_dim);
  m.kv_lora_rank = json_int(j, "kv_lora_rank", source, false, m.head_dim);
  m.qk_nope_head_dim = m.head_dim - m.qk_rope_head_dim;
  m.q_lora_rank = json_int(j, "q_lora_rank", source, false, 1024);
  m.v_head_dim = json_int(j, "v_head_dim", source, false, 512);
  m.index_n_heads = json_int(j, "index_n_heads", source, false, 64);
  m.index_head_dim = json_int(j, "index_head_dim", source, false, 128);
  m.index_topk = json_int(j, "index_topk", source, false, 512);
  m.intermediate_size = json_int(j, "intermediate_size", source, false, 2048);
  m.moe_intermediate_size = json_int(j, "moe_intermediate_size", source, false, 2048);
  m.n_routed_experts = json_int(j, "n_routed_experts", source, false, 256);
  m.n_shared_experts = json_int(j, "n_shared_experts", source, false, 1);
  m.num_experts_per_tok = json_int(j, "num_experts_per_tok", source, false, 6);
  // models read config.sliding_window (configs/model_config.py: window_size = sliding_window).
  m.window_size = json_int(j, "sliding_window", source, false, json_int(j, "window_size", source, false, 128));
  m.o_lora_rank = json_int(j, "o_lora_rank", source, false, 1024);
  m.o_groups = json_int(j, "o_groups", source, false, 8);
  const json* ratios = present(j, "compress_ratios");
  ESS_CHECK(ratios != nullptr && ratios->is_array(),
            "{}: field 'compress_ratios' (a DeepSeek-V4 config's per-layer compression) must be a list of integers, got {}",
            source, ratios == nullptr ? "nothing" : ratios->dump());
  for (std::size_t l = 0; l < ratios->size(); ++l) {
    const json& r = (*ratios)[l];
    ESS_CHECK(r.is_number_integer() && (r == 0 || r == 1 || r == 2 || r == 4 || r == 128),
              "{}: field 'compress_ratios'[{}] = {} must be 0, 1, 2, 4 or 128 (SGLang's "
              "deepseek_v4_memory_pool.py collect_sources_by_ratio)",
              source, l, r.dump());
    m.compress_ratios.push_back(r.get<int>());
  }
}

}  // namespace

ModelSpec ModelSpec::from_json(const json& j, const std::string& source) {
  ESS_CHECK(j.is_object(), "{}: a model config must be a JSON object, got {}", source,
            std::string(j.type_name()));
  ModelSpec m;
  if (auto mt = j.find("model_type"); mt != j.end() && mt->is_string()) m.model_type = mt->get<std::string>();
  if (auto it = j.find("_name_or_path"); it != j.end() && it->is_string()) {
    m.name = it->get<std::string>();
  } else if (!m.model_type.empty()) {
    m.name = m.model_type;
  } else {
    m.name = source;
  }
  m.architecture = first_architecture(j);
  m.kv_cache_dtype = kv_cache_dtype_of(j, source);
  if (m.is_minimax_m3()) {
    // A VL checkpoint wraps the text model's config (SGLang's hf_text_config).
    const json* text = present(j, "text_config");
    const json& t = text != nullptr && text->is_object() ? *text : j;
    if (m.model_type.empty()) {
      if (auto mt = t.find("model_type"); mt != t.end() && mt->is_string()) m.model_type = mt->get<std::string>();
      if (m.name.empty() || m.name == source) m.name = m.model_type.empty() ? source : m.model_type;
    }
    if (m.kv_cache_dtype.empty()) m.kv_cache_dtype = kv_cache_dtype_of(t, source);
    read_minimax_m3(t, j, source, m);
    m.validate(source);
    return m;
  }
  if (m.is_deepseek_v4()) {
    read_deepseek_v4(j, source, m);
    m.num_hidden_layers = json_int(j, "num_hidden_layers", source, false, 43);
    m.hidden_size = json_int(j, "hidden_size", source, false, 4096);
    m.vocab_size = json_int(j, "vocab_size", source, false, 129280);
    m.num_attention_heads = json_int(j, "num_attention_heads", source, false, 64);
    m.first_k_dense_replace = json_int(j, "first_k_dense_replace", source, false, 0);
    m.num_nextn_predict_layers = json_int(j, "num_nextn_predict_layers", source, false, 0);
    m.max_position_embeddings = json_int(j, "max_position_embeddings", source, false, 65536);
    m.validate(source);
    return m;
  }
  m.num_hidden_layers = json_int(j, "num_hidden_layers", source, true);
  m.hidden_size = json_int(j, "hidden_size", source, true);
  m.vocab_size = json_int(j, "vocab_size", source, true);
  m.num_attention_heads = json_int(j, "num_attention_heads", source, true);
  m.q_lora_rank = json_int(j, "q_lora_rank", source, true);
  m.kv_lora_rank = json_int(j, "kv_lora_rank", source, true);
  m.qk_nope_head_dim = json_int(j, "qk_nope_head_dim", source, true);
  m.qk_rope_head_dim = json_int(j, "qk_rope_head_dim", source, true);
  m.v_head_dim = json_int(j, "v_head_dim", source, true);
  m.index_n_heads = json_int(j, "index_n_heads", source, true);
  m.index_head_dim = json_int(j, "index_head_dim", source, true);
  m.index_topk = json_int(j, "index_topk", source, true);
  m.intermediate_size = json_int(j, "intermediate_size", source, true);
  m.moe_intermediate_size = json_int(j, "moe_intermediate_size", source, true);
  m.n_routed_experts = json_int(j, "n_routed_experts", source, true);
  m.n_shared_experts = json_int(j, "n_shared_experts", source, false, 0);
  m.num_experts_per_tok = json_int(j, "num_experts_per_tok", source, true);
  m.first_k_dense_replace = json_int(j, "first_k_dense_replace", source, false, 0);
  m.num_nextn_predict_layers = json_int(j, "num_nextn_predict_layers", source, false, 0);
  m.max_position_embeddings = json_int(j, "max_position_embeddings", source, true);
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    ESS_CHECK(rs->is_object(), "{}: field 'rope_scaling' must be an object, got {}", source,
              rs->dump());
    const std::string where = source + " rope_scaling";
    m.rope_scaling_factor = json_number_or(*rs, "factor", where, 1.0);
    m.rope_mscale_all_dim = json_number_or(*rs, "mscale_all_dim", where, 0.0);
  }
  m.shared_index = shared_index_layers(j, m.num_hidden_layers, source);
  m.declares_index_sharing = sharing_fields_declare_it(j);
  m.validate(source);
  return m;
}

ModelSpec ModelSpec::from_file(const std::string& path) {
  return from_json(read_json_file(path, "model config"), path);
}

ModelSpec ModelSpec::deepseek_v32_exp() {
  return from_json(json::parse(shipped::kDeepseekV32ExpJson), "configs/models/deepseek-v3.2-exp.json");
}

json ModelSpec::to_json() const {
  json j = {{"_name_or_path", name},
            {"num_hidden_layers", num_hidden_layers},
            {"hidden_size", hidden_size},
            {"vocab_size", vocab_size},
            {"num_attention_heads", num_attention_heads},
            {"q_lora_rank", q_lora_rank},
            {"kv_lora_rank", kv_lora_rank},
            {"qk_nope_head_dim", qk_nope_head_dim},
            {"qk_rope_head_dim", qk_rope_head_dim},
            {"v_head_dim", v_head_dim},
            {"index_n_heads", index_n_heads},
            {"index_head_dim", index_head_dim},
            {"index_topk", index_topk},
            {"intermediate_size", intermediate_size},
            {"moe_intermediate_size", moe_intermediate_size},
            {"n_routed_experts", n_routed_experts},
            {"n_shared_experts", n_shared_experts},
            {"num_experts_per_tok", num_experts_per_tok},
            {"first_k_dense_replace", first_k_dense_replace},
            {"num_nextn_predict_layers", num_nextn_predict_layers},
            {"max_position_embeddings", max_position_embeddings}};
  if (is_minimax_m3()) {
    json freq = json::array();
    for (const bool sparse : sparse_layers) freq.push_back(sparse ? 1 : 0);
    json m3 = {{"_name_or_path", name},
            {"architectures", {architecture}},
            {"model_type", model_type},
            {"num_hidden_layers", num_hidden_layers},
            {"hidden_size", hidden_size},
            {"vocab_size", vocab_size},
            {"num_attention_heads", num_attention_heads},
            {"num_key_value_heads", num_key_value_heads},
            {"head_dim", head_dim},
            {"rotary_dim", qk_rope_head_dim},
            {"max_position_embeddings", max_position_embeddings},
            {"num_local_experts", n_routed_experts},
            {"num_experts_per_tok", num_experts_per_tok},
            {"intermediate_size", moe_intermediate_size},
            {"torch_dtype", dtype_bytes == 4 ? "float32" : "bfloat16"},
            {"kv_cache_dtype", kv_cache_dtype.empty() ? std::string("auto") : kv_cache_dtype},
            {"sparse_attention_config",
             {{"sparse_attention_freq", freq},
              {"sparse_block_size", sparse_block_size},
              {"sparse_topk_blocks", sparse_topk_blocks},
              {"sparse_init_block", sparse_init_blocks},
              {"sparse_local_block", sparse_local_blocks},
              {"sparse_index_dim", index_head_dim},
              {"sparse_num_index_heads", index_n_heads}}}};
    const auto flags = [](const std::vector<bool>& v) {
      json a = json::array();
      for (const bool b : v) a.push_back(b ? 1 : 0);
      return a;
    };
    if (!index_k_only.empty()) m3["sparse_attention_config"]["sparse_disable_index_value"] = flags(index_k_only);
    if (!moe_layers.empty()) m3["moe_layer_freq"] = flags(moe_layers);
    if (n_shared_experts > 0) m3["n_shared_experts"] = n_shared_experts;
    if (intermediate_size > 0) m3["dense_intermediate_size"] = intermediate_size;
    if (!weight_quant.empty()) m3["quantization_config"] = {{"quant_method", weight_quant}};
    return m3;
  }
  if (!kv_cache_dtype.empty()) j["kv_cache_dtype"] = kv_cache_dtype;
  if (is_deepseek_v4()) {
    j["model_type"] = model_type;
    j["head_dim"] = head_dim;
    j["compress_ratios"] = compress_ratios;
    j["sliding_window"] = window_size;
    j["o_lora_rank"] = o_lora_rank;
    j["o_groups"] = o_groups;
  }
  if (!shared_index.empty()) {
    json types = json::array();
    for (const bool shared : shared_index) types.push_back(shared ? "shared" : "full");
    j["indexer_types"] = std::move(types);
  }
  if (rope_scaling_factor != 1.0 || rope_mscale_all_dim != 0.0) {
    j["rope_scaling"] = {{"factor", rope_scaling_factor}, {"mscale_all_dim", rope_mscale_all_dim}};
  }
  return j;
}

std::size_t ModelSpec::latent_entry_bytes() const { return LatentLayout::for_model(*this).bytes(); }

std::size_t ModelSpec::indexer_entry_bytes() const {
  return IndexerLayout::for_model(*this).entry_bytes();
}

bool ModelSpec::offloads(int layer) const {
  if (layer < 0 || layer >= num_hidden_layers) return false;
  const auto at = static_cast<std::size_t>(layer);
  if (is_minimax_m3()) return at < sparse_layers.size() && sparse_layers[at];
  return !is_deepseek_v4() || compress_ratio(layer) == 4;
}

bool ModelSpec::index_keeps_values(int layer) const {
  const auto at = static_cast<std::size_t>(layer);
  return is_minimax_m3() && offloads(layer) && !(at < index_k_only.size() && index_k_only[at]);
}

std::vector<int> ModelSpec::offloaded_layers() const {
  std::vector<int> layers;
  for (int l = 0; l < num_hidden_layers; ++l) {
    if (offloads(l)) layers.push_back(l);
  }
  return layers;
}

int ModelSpec::index_leader(int layer) const {
  while (index_shared(layer)) --layer;
  return layer;
}

int ModelSpec::indexer_layers(int layers) const {
  int n = 0;
  for (int l = 0; l < layers; ++l) n += index_shared(l) ? 0 : 1;
  return n;
}

double ModelSpec::softmax_scale() const {
  // models/deepseek_v4.py, minimax_m3.py: head_dim**-0.5
  if (is_deepseek_v4() || is_minimax_m3()) return 1.0 / std::sqrt(static_cast<double>(head_dim));
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_nope_head_dim + qk_rope_head_dim));
  if (rope_mscale_all_dim != 0.0 && rope_scaling_factor > 1.0) {
    const double mscale = 0.1 * rope_mscale_all_dim * std::log(rope_scaling_factor) + 1.0;
    scale *= mscale * mscale;
  }
  return scale;
}

void ModelSpec::validate(const std::string& source) const {
  const auto positive = [&](int v, const char* field) {
    ESS_CHECK(v > 0, "{}: field '{}' = {} must be positive", source, field, v);
  };
  if (is_minimax_m3()) {
    positive(num_hidden_layers, "num_hidden_layers");
    positive(hidden_size, "hidden_size");
    positive(vocab_size, "vocab_size");
    positive(head_dim, "head_dim");
    positive(num_key_value_heads, "num_key_value_heads");
    positive(index_n_heads, "sparse_num_index_heads");
    positive(index_head_dim, "sparse_index_dim");
    positive(max_position_embeddings, "max_position_embeddings");
    ESS_CHECK(num_attention_heads % num_key_value_heads == 0,
              "{}: num_attention_heads = {} is not a multiple of num_key_value_heads = {} (grouped-query attention)",
              source, num_attention_heads, num_key_value_heads);
    ESS_CHECK(std::ssize(sparse_layers) >= num_hidden_layers,
              "{}: field 'sparse_attention_freq' has {} layers; the model has num_hidden_layers = {}", source,
              sparse_layers.size(), num_hidden_layers);
    ESS_CHECK(moe_layers.empty() || std::ssize(moe_layers) >= num_hidden_layers,
              "{}: field 'moe_layer_freq' has {} layers; the model has num_hidden_layers = {}", source, moe_layers.size(),
              num_hidden_layers);
    ESS_CHECK(!offloaded_layers().empty(),
              "{}: no sparse layer (sparse_attention_freq != 0): those are what HiSparse offloads, and there is none",
              source);
    try {
      LatentLayout::for_model(*this);
    } catch (const Error& e) {
      ESS_THROW("{}: {}", source, e.what());
    }
    return;
  }
  positive(num_hidden_layers, "num_hidden_layers");
  positive(hidden_size, "hidden_size");
  positive(vocab_size, "vocab_size");
  positive(num_attention_heads, "num_attention_heads");
  positive(q_lora_rank, "q_lora_rank");
  positive(kv_lora_rank, "kv_lora_rank");
  positive(qk_nope_head_dim, "qk_nope_head_dim");
  positive(qk_rope_head_dim, "qk_rope_head_dim");
  positive(v_head_dim, "v_head_dim");
  positive(index_n_heads, "index_n_heads");
  positive(index_head_dim, "index_head_dim");
  positive(index_topk, "index_topk");
  positive(intermediate_size, "intermediate_size");
  positive(moe_intermediate_size, "moe_intermediate_size");
  positive(n_routed_experts, "n_routed_experts");
  positive(num_experts_per_tok, "num_experts_per_tok");
  positive(max_position_embeddings, "max_position_embeddings");
  ESS_CHECK(n_shared_experts >= 0, "{}: field 'n_shared_experts' = {} must be >= 0", source,
            n_shared_experts);
  ESS_CHECK(num_nextn_predict_layers >= 0, "{}: field 'num_nextn_predict_layers' = {} must be >= 0",
            source, num_nextn_predict_layers);
  ESS_CHECK(first_k_dense_replace >= 0 && first_k_dense_replace <= num_hidden_layers,
            "{}: field 'first_k_dense_replace' = {} must be in [0, num_hidden_layers = {}]", source,
            first_k_dense_replace, num_hidden_layers);
  ESS_CHECK(num_experts_per_tok <= n_routed_experts,
            "{}: field 'num_experts_per_tok' = {} exceeds n_routed_experts = {}", source,
            num_experts_per_tok, n_routed_experts);
  ESS_CHECK(rope_scaling_factor > 0.0, "{}: field 'rope_scaling.factor' = {} must be positive",
            source, rope_scaling_factor);
  ESS_CHECK(shared_index.empty() || std::ssize(shared_index) == num_hidden_layers,
            "{}: the index sharing pattern has {} layers; the model has num_hidden_layers = {}", source,
            shared_index.size(), num_hidden_layers);
  ESS_CHECK(!index_shared(0), "{}: layer 0 reuses a top-k, but no layer before it runs an indexer", source);
  ESS_CHECK(kv_cache_dtype.empty() || kv_cache_dtype == "fp8_e4m3" || kv_cache_dtype == "bfloat16",
            "{}: field 'kv_cache_dtype' = '{}': a DSA model's KV cache under HiSparse is fp8_e4m3 or bfloat16 (SGLang's "
            "HISPARSE_KV_CACHE_DTYPES)",
            source, kv_cache_dtype);
  if (is_deepseek_v4()) {
    ESS_CHECK(o_lora_rank > 0 && o_groups > 0 && num_attention_heads % o_groups == 0,
              "{}: o_lora_rank = {} and o_groups = {} must be positive, o_groups dividing num_attention_heads = {}",
              source, o_lora_rank, o_groups, num_attention_heads);
    ESS_CHECK(kv_cache_dtype != "bfloat16",
              "{}: kv_cache_dtype bfloat16 with DeepSeek-V4: SGLang's HiSparse C4 pool is FP8 (HiSparseC4DevicePool "
              "stores uint8)", source);
    ESS_CHECK(std::ssize(compress_ratios) >= num_hidden_layers,
              "{}: field 'compress_ratios' has {} layers; the model has num_hidden_layers = {}", source,
              compress_ratios.size(), num_hidden_layers);
    ESS_CHECK(moe_layers.empty() || std::ssize(moe_layers) >= num_hidden_layers,
              "{}: field 'moe_layer_freq' has {} layers; the model has num_hidden_layers = {}", source, moe_layers.size(),
              num_hidden_layers);
    ESS_CHECK(!offloaded_layers().empty(),
              "{}: no layer has compress ratio 4: the C4 cache is what HiSparse offloads, and there is none", source);
  }
  try {
    LatentLayout::for_model(*this);
    IndexerLayout::for_model(*this);
  } catch (const Error& e) {
    ESS_THROW("{}: {}", source, e.what());
  }
}

}  // namespace ess
