#include "ess/model/model_spec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "ess/core/error.h"
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
