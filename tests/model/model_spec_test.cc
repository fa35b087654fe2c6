#include "ess/model/model_spec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ess/core/error.h"
#include "ess/model/entry_layout.h"
#include "testing/testing.h"

namespace ess {
namespace {

using nlohmann::json;

using test::error_of;

TEST(ModelSpec, ShippedDeepSeekV32Exp) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  EXPECT_EQ(m.name, "deepseek-ai/DeepSeek-V3.2-Exp");
  EXPECT_EQ(m.num_hidden_layers, 61);
  EXPECT_EQ(m.first_k_dense_replace, 3);
  EXPECT_EQ(m.num_moe_layers(), 58);
  EXPECT_EQ(m.hidden_size, 7168);
  EXPECT_EQ(m.num_attention_heads, 128);
  EXPECT_EQ(m.q_lora_rank, 1536);
  EXPECT_EQ(m.kv_lora_rank, 512);
  EXPECT_EQ(m.qk_rope_head_dim, 64);
  EXPECT_EQ(m.index_n_heads, 64);
  EXPECT_EQ(m.index_head_dim, 128);
  EXPECT_EQ(m.index_topk, 2048);
  EXPECT_EQ(m.n_routed_experts, 256);
  EXPECT_EQ(m.num_experts_per_tok, 8);
  EXPECT_EQ(m.moe_intermediate_size, 2048);
  EXPECT_EQ(m.intermediate_size, 18432);
  EXPECT_EQ(m.num_nextn_predict_layers, 1);
  EXPECT_EQ(m.vocab_size, 129280);
  EXPECT_EQ(m.mla_head_dim(), 576);
  EXPECT_EQ(m.latent_entry_bytes(), 656u);
  EXPECT_EQ(m.indexer_entry_bytes(), 132u);
  // 132 / (656 + 132) = 16.8 % (the brief).
  EXPECT_NEAR(132.0 / 788.0, 0.168, 0.001);
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(m.softmax_scale(), mscale * mscale / std::sqrt(192.0));
}

TEST(ModelSpec, ReadsTheShippedFileAndIgnoresUnknownFields) {
  const ModelSpec a = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/deepseek-v3.2-exp.json");
  const ModelSpec b = ModelSpec::deepseek_v32_exp();
  EXPECT_EQ(a.to_json(), b.to_json());
  json j = b.to_json();
  j["quantization_config"] = {{"fmt", "e4m3"}};
  j["some_future_field"] = 3;
  EXPECT_EQ(ModelSpec::from_json(j).to_json(), b.to_json());
}

TEST(ModelSpec, RejectsMissingWrongAndOutOfRangeFields) {
  json base = ModelSpec::deepseek_v32_exp().to_json();
  {
    json j = base;
    j.erase("kv_lora_rank");
    const auto msg = error_of([&] { ModelSpec::from_json(j, "cfg.json"); });
    EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find("kv_lora_rank"), std::string::npos) << msg;
  }
  {
    json j = base;
    j["num_hidden_layers"] = "61";
    const auto msg = error_of([&] { ModelSpec::from_json(j, "cfg.json"); });
    EXPECT_NE(msg.find("num_hidden_layers"), std::string::npos) << msg;
  }
  {
    json j = base;
    j["index_topk"] = -5;
    const auto msg = error_of([&] { ModelSpec::from_json(j, "cfg.json"); });
    EXPECT_NE(msg.find("index_topk"), std::string::npos) << msg;
    EXPECT_NE(msg.find("-5"), std::string::npos) << msg;
  }
  {
    json j = base;
    j["first_k_dense_replace"] = 62;
    EXPECT_NE(error_of([&] { ModelSpec::from_json(j); }).find("first_k_dense_replace"), std::string::npos);
  }
  {
    json j = base;
    j["kv_lora_rank"] = 500;
    EXPECT_NE(error_of([&] { ModelSpec::from_json(j); }).find("kv_lora_rank"), std::string::npos);
  }
  {
    json j = base;
    j["hidden_size"] = 1ll << 40;
    EXPECT_NE(error_of([&] { ModelSpec::from_json(j); }).find("out of range"), std::string::npos);
  }
  EXPECT_THROW(ModelSpec::from_json(json::array()), Error);
}

TEST(ModelSpec, ShippedGlm5HasOneIndexerPerLayer) {
  const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/glm-5.json");
  EXPECT_EQ(m.name, "zai-org/GLM-5");
  EXPECT_EQ(m.num_hidden_layers, 78);
  EXPECT_EQ(m.latent_entry_bytes(), 656u);  // kv_lora_rank 512 + rope 64: DeepSeek-V3.2's entry
  EXPECT_EQ(m.indexer_entry_bytes(), 132u);
  EXPECT_TRUE(m.shared_index.empty());
  EXPECT_EQ(m.indexer_layers(78), 78);
  EXPECT_EQ(m.index_leader(40), 40);
  EXPECT_DOUBLE_EQ(m.softmax_scale(), 1.0 / std::sqrt(256.0));  // no YaRN: 1 / sqrt(192 + 64)
}

std::vector<int> full_layers(const ModelSpec& m) {
  std::vector<int> out;
  for (int l = 0; l < m.num_hidden_layers; ++l) {
    if (!m.index_shared(l)) out.push_back(l);
  }
  return out;
}

TEST(ModelSpec, Glm52SharesItsIndexersAsItsConfigSays) {
  const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/glm-5.2.json");
  // The published indexer_types: full at 0, 1, 2, then every fourth layer from 6.
  std::vector<int> expected = {0, 1, 2};
  for (int l = 6; l < 78; l += 4) expected.push_back(l);
  EXPECT_EQ(full_layers(m), expected);
  EXPECT_EQ(m.indexer_layers(78), 21);
  EXPECT_EQ(m.indexer_layers(6), 3);
  EXPECT_EQ(m.index_leader(3), 2);
  EXPECT_EQ(m.index_leader(5), 2);
  EXPECT_EQ(m.index_leader(6), 6);
  EXPECT_EQ(m.index_leader(77), 74);
  // The same pattern from index_topk_freq 4 and index_skip_topk_offset 3 alone (SGLang's rule when
  // the config has no indexer_types), and through to_json.
  json j = m.to_json();
  j.erase("indexer_types");
  j["index_topk_freq"] = 4;
  j["index_skip_topk_offset"] = 3;
  EXPECT_EQ(full_layers(ModelSpec::from_json(j)), expected);
  EXPECT_EQ(ModelSpec::from_json(m.to_json()).shared_index, m.shared_index);
}

// An eight-layer DeepSeek-V3.2 with `extra` fields set.
ModelSpec eight_layers(const json& extra) {
  json j = ModelSpec::deepseek_v32_exp().to_json();
  j["num_hidden_layers"] = 8;
  j["first_k_dense_replace"] = 1;
  j.update(extra);
  return ModelSpec::from_json(j);
}

TEST(ModelSpec, IndexSharingFollowsSglangsOrderOfFields) {
  const auto pattern = [](const json& extra) {
    std::string out;
    for (const bool s : eight_layers(extra).shared_index) out += s ? 'S' : 'F';
    return out;
  };
  EXPECT_EQ(pattern(json::object()), "");                              // no field: every layer its own
  EXPECT_EQ(pattern({{"index_topk_freq", 1}}), "");
  EXPECT_EQ(pattern({{"index_topk_freq", 2}}), "FFSFSFSF");           // offset 2 when absent
  EXPECT_EQ(pattern({{"index_topk_freq", 3}, {"index_skip_topk_offset", 1}}), "FSSFSSFS");
  EXPECT_EQ(pattern({{"index_topk_pattern", "FSFFSS"}}), "FSFFSSFF");  // past its end: full
  EXPECT_EQ(pattern({{"cli_factor", 4}}), "FSSSFSSS");
  EXPECT_EQ(pattern({{"indexer_types", {"full", "shared", "shared"}}}), "FSSFFFFF");
  // The first field present decides: indexer_types, cli_factor, index_topk_pattern, the frequency.
  EXPECT_EQ(pattern({{"indexer_types", {"full", "shared"}}, {"cli_factor", 4}, {"index_topk_freq", 2}}), "FSFFFFFF");
  EXPECT_EQ(pattern({{"cli_factor", 4}, {"index_topk_pattern", "FS"}}), "FSSSFSSS");
  EXPECT_EQ(pattern({{"cli_factor", 1}, {"index_topk_pattern", "FS"}}), "FSFFFFFF");
  EXPECT_EQ(pattern({{"index_topk_pattern", nullptr}, {"index_topk_freq", 2}}), "FFSFSFSF");  // null: absent
  // GLM-5.x: transformers' GlmMoeDsaConfig ignores cli_factor and floors the frequency at 1.
  EXPECT_EQ(pattern({{"model_type", "glm_moe_dsa"}, {"cli_factor", 4}, {"index_topk_freq", 2}}), "FFSFSFSF");
  EXPECT_EQ(pattern({{"model_type", "glm_moe_dsa"}, {"index_topk_freq", 0}}), "");
}

// SGLang refuses two-batch overlap on the sharing fields themselves, not on the pattern they give.
TEST(ModelSpec, DeclaredIndexSharingIsSglangsTest) {
  const auto declares = [](const json& extra) { return eight_layers(extra).declares_index_sharing; };
  EXPECT_FALSE(declares(json::object()));
  EXPECT_FALSE(declares({{"index_topk_freq", 1}, {"index_topk_pattern", "FFF"}}));
  EXPECT_TRUE(declares({{"index_topk_freq", 2}}));
  EXPECT_TRUE(declares({{"index_topk_pattern", "FS"}}));
  EXPECT_TRUE(declares({{"indexer_types", {"full", "shared"}}}));
  // A frequency above 1 with every layer full by indexer_types: no pattern, still refused by SGLang.
  const ModelSpec m = eight_layers({{"index_topk_freq", 4}, {"indexer_types", {"full", "full"}}});
  EXPECT_TRUE(m.shared_index.empty());
  EXPECT_TRUE(m.declares_index_sharing);
  EXPECT_FALSE(declares({{"cli_factor", 4}}));  // LongCat's rule: not among SGLang's TBO test's fields
}

TEST(ModelSpec, IndexSharingFieldsOutOfRangeAreRefusedByName) {
  json base = ModelSpec::deepseek_v32_exp().to_json();
  const auto error = [&](const json& extra) {
    json j = base;
    j.update(extra);
    return error_of([&] { ModelSpec::from_json(j, "cfg.json"); });
  };
  EXPECT_NE(error({{"indexer_types", {"full", "Shared"}}}).find("'indexer_types'[1] = \"Shared\""), std::string::npos);
  EXPECT_NE(error({{"indexer_types", "FS"}}).find("'indexer_types' must be a list"), std::string::npos);
  EXPECT_NE(error({{"index_topk_pattern", "FSX"}}).find("character 2 is 'X'"), std::string::npos);
  EXPECT_NE(error({{"index_topk_freq", 0}}).find("'index_topk_freq' = 0"), std::string::npos);
  EXPECT_NE(error({{"index_topk_freq", 2}, {"index_skip_topk_offset", 0}}).find("'index_skip_topk_offset' = 0"),
            std::string::npos);
  EXPECT_NE(error({{"cli_factor", -2}}).find("'cli_factor' = -2"), std::string::npos);
  for (const json& first_shared : {json{{"index_topk_pattern", "SF"}}, json{{"indexer_types", {"shared"}}}}) {
    const std::string msg = error(first_shared);
    EXPECT_NE(msg.find("cfg.json: layer 0 reuses a top-k"), std::string::npos) << msg;
  }
}

// DeepSeek-V4-Flash as SGLang reads it: head_dim (no kv_lora_rank in its config), the C4 layers
// (compress ratio 4: the even layers from 2, 21 of 43; the 44th entry is the MTP layer's), the
// sliding window, DeepSeekV4Config's defaults for what the file leaves out, head_dim^-0.5.
TEST(ModelSpec, ShippedDeepSeekV4FlashOffloadsItsC4Layers) {
  const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/deepseek-v4-flash.json");
  EXPECT_TRUE(m.is_deepseek_v4());
  EXPECT_EQ(m.num_hidden_layers, 43);
  EXPECT_EQ(m.head_dim, 512);
  EXPECT_EQ(m.kv_lora_rank, 512);
  EXPECT_EQ(m.qk_nope_head_dim, 448);
  EXPECT_EQ(m.index_topk, 512);
  EXPECT_EQ(m.window_size, 128);
  EXPECT_EQ(m.tokens_per_entry(), 4);
  std::vector<int> c4;
  for (int l = 2; l < 43; l += 2) c4.push_back(l);
  EXPECT_EQ(m.offloaded_layers(), c4);
  EXPECT_EQ(m.latent_entry_bytes(), 592u);
  EXPECT_DOUBLE_EQ(m.softmax_scale(), 1.0 / std::sqrt(512.0));
  const ModelSpec again = ModelSpec::from_json(m.to_json(), "round trip");
  EXPECT_EQ(again.offloaded_layers(), c4);
  EXPECT_EQ(again.head_dim, 512);
  EXPECT_EQ(again.window_size, 128);
  EXPECT_EQ(ModelSpec::deepseek_v32_exp().offloaded_layers().size(), 61u);  // every layer
  EXPECT_EQ(ModelSpec::deepseek_v32_exp().tokens_per_entry(), 1);
}

TEST(ModelSpec, DeepSeekV4FieldsAreCheckedByName) {
  const json base = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/deepseek-v4-flash.json").to_json();
  const auto error = [&](const json& extra, const char* drop = nullptr) {
    json j = base;
    if (!extra.is_null()) j.update(extra);
    if (drop != nullptr) j.erase(drop);
    return error_of([&] { ModelSpec::from_json(j, "v4.json"); });
  };
  EXPECT_NE(error(json::object(), "head_dim").find("head_dim"), std::string::npos);
  EXPECT_NE(error({{"compress_ratios", {0, 4, 3}}}).find("'compress_ratios'[2] = 3"), std::string::npos);
  EXPECT_NE(error({{"compress_ratios", "4"}}).find("'compress_ratios'"), std::string::npos);
  EXPECT_NE(error({{"compress_ratios", {0, 4}}}).find("has 2 layers"), std::string::npos);
  EXPECT_NE(error({{"compress_ratios", std::vector<int>(43, 128)}}).find("no layer has compress ratio 4"), std::string::npos);
  EXPECT_NE(error({{"head_dim", 64}}).find("'head_dim' = 64"), std::string::npos);
  EXPECT_NE(error({{"head_dim", 520}}).find("multiple of 64"), std::string::npos);  // 456 NoPE values
}

TEST(ModelSpec, ShippedMiniMaxM3OffloadsItsSparseLayersKAndV) {
  const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/minimax-m3.json");
  EXPECT_TRUE(m.is_minimax_m3());
  EXPECT_FALSE(m.is_deepseek_v4());
  EXPECT_EQ(m.num_hidden_layers, 60);
  EXPECT_EQ(m.head_dim, 128);
  EXPECT_EQ(m.num_key_value_heads, 4);
  EXPECT_EQ(m.selection_block(), 128);
  EXPECT_EQ(m.index_topk, 16 * 128);  // the tokens of the top-16 blocks
  EXPECT_EQ(m.sparse_init_blocks, 0);
  EXPECT_EQ(m.sparse_local_blocks, 1);
  EXPECT_EQ(m.selected_ids(), 16);  // the top 16, the query's own block forced among them
  EXPECT_EQ(m.tokens_per_entry(), 1);
  std::vector<int> sparse;
  for (int l = 3; l < 60; ++l) sparse.push_back(l);
  EXPECT_EQ(m.offloaded_layers(), sparse);
  const LatentLayout kv = LatentLayout::for_model(m);
  EXPECT_TRUE(kv.key_value());
  EXPECT_EQ(kv.value_bytes(), 256u);  // the key: 128 bf16 values; the value the same, after it
  EXPECT_EQ(kv.bytes(), 512u);
  EXPECT_DOUBLE_EQ(m.softmax_scale(), 1.0 / std::sqrt(128.0));
  const ModelSpec again = ModelSpec::from_json(m.to_json(), "round trip");
  EXPECT_EQ(again.offloaded_layers(), sparse);
  EXPECT_EQ(again.index_topk, 2048);
  EXPECT_EQ(again.selected_ids(), 16);
  EXPECT_EQ(again.latent_entry_bytes(), 512u);
  // An fp8 KV cache (SGLang's --kv-cache-dtype, carried in the config) halves the entry.
  json fp8 = m.to_json();
  fp8["kv_cache_dtype"] = "fp8_e4m3";
  EXPECT_EQ(ModelSpec::from_json(fp8, "fp8").latent_entry_bytes(), 256u);
  // The VL checkpoint wraps the text model's config; its sparse attention config may be the top level's.
  json vl = {{"architectures", {"MiniMaxM3SparseForConditionalGeneration"}}, {"model_type", "minimax_m3_vl"}};
  json text = m.to_json();
  vl["sparse_attention_config"] = text["sparse_attention_config"];
  text.erase("sparse_attention_config");
  text.erase("architectures");
  vl["text_config"] = text;
  const ModelSpec wrapped = ModelSpec::from_json(vl, "vl.json");
  EXPECT_TRUE(wrapped.is_minimax_m3());
  EXPECT_EQ(wrapped.offloaded_layers(), sparse);
  EXPECT_EQ(wrapped.num_attention_heads, 64);
  // A K / V entry holds no latent: the latent quantizer refuses it by name.
  std::vector<float> nope(512), rope(64);
  std::vector<std::uint8_t> out(kv.bytes());
  EXPECT_NE(error_of([&] { quantize_latent(kv, nope, rope, out); }).find("K / V entry"), std::string::npos);
}

TEST(ModelSpec, MiniMaxM3FieldsAreCheckedByName) {
  const json base = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/minimax-m3.json").to_json();
  const auto error = [&](const json& extra, const char* drop = nullptr) {
    json j = base;
    if (!extra.is_null()) j.update(extra);
    if (drop != nullptr) j.erase(drop);
    return error_of([&] { ModelSpec::from_json(j, "m3.json"); });
  };
  EXPECT_NE(error(json::object(), "sparse_attention_config").find("needs 'sparse_attention_config'"), std::string::npos);
  EXPECT_NE(error(json::object(), "num_key_value_heads").find("num_key_value_heads"), std::string::npos);
  EXPECT_NE(error({{"num_key_value_heads", 5}}).find("not a multiple of num_key_value_heads = 5"), std::string::npos);
  json short_freq = base["sparse_attention_config"];
  short_freq["sparse_attention_freq"] = {0, 1};
  EXPECT_NE(error({{"sparse_attention_config", short_freq}}).find("has 2 layers"), std::string::npos);
  json dense = base["sparse_attention_config"];
  dense["sparse_attention_freq"] = std::vector<int>(60, 0);
  EXPECT_NE(error({{"sparse_attention_config", dense}}).find("no sparse layer"), std::string::npos);
  json no_block = base["sparse_attention_config"];
  no_block.erase("sparse_block_size");
  EXPECT_NE(error({{"sparse_attention_config", no_block}}).find("sparse_block_size"), std::string::npos);
  json lse = base["sparse_attention_config"];
  lse["sparse_score_type"] = "mean";
  EXPECT_NE(error({{"sparse_attention_config", lse}}).find("'sparse_score_type'"), std::string::npos);
  // The forced blocks from tokens, as SGLang derives them when the block counts are absent.
  json by_tokens = base["sparse_attention_config"];
  by_tokens.erase("sparse_init_block");
  by_tokens.erase("sparse_local_block");
  by_tokens["sparse_init_tokens"] = 200;   // ceil(200 / 128) = 2
  by_tokens["sparse_local_tokens"] = 100;  // ceil(100 / 128) + 1 = 2
  json j = base;
  j["sparse_attention_config"] = by_tokens;
  const ModelSpec from_tokens = ModelSpec::from_json(j, "m3.json");
  EXPECT_EQ(from_tokens.sparse_init_blocks, 2);
  EXPECT_EQ(from_tokens.sparse_local_blocks, 2);
  EXPECT_EQ(from_tokens.selected_ids(), 16);  // the forced blocks are among the top 16
  by_tokens.erase("sparse_local_tokens");
  EXPECT_NE(error({{"sparse_attention_config", by_tokens}}).find("'sparse_local_block' (or 'sparse_local_tokens'"),
            std::string::npos);
  EXPECT_NE(error({{"kv_cache_dtype", "int4"}}).find("dtype 'int4'"), std::string::npos);
  EXPECT_NE(error({{"head_dim", 4}}).find("not a multiple of 16 bytes"), std::string::npos);  // 4 bf16 values
}

TEST(ModelSpec, FileErrorsNameThePath) {
  EXPECT_NE(error_of([] { ModelSpec::from_file("/nonexistent/config.json"); }).find("/nonexistent/config.json"),
            std::string::npos);
  const std::string path = testing::TempDir() + "malformed_config.json";
  std::ofstream(path) << "{\"num_hidden_layers\": 61,";
  const auto msg = error_of([&] { ModelSpec::from_file(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("malformed"), std::string::npos) << msg;
}

}  // namespace
}  // namespace ess
