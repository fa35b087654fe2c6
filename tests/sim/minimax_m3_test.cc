// MiniMax-M3 in the simulator: attention tensor parallel over the node (one KV head per rank, as
// SGLang's HiSparse holds it), its sparse layers' K / V offloaded in tokens selected as blocks, its
// dense layers' K / V and index cache resident, all-reduces instead of all-to-alls; what it cannot
// run is refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "ess/core/error.h"
#include "ess/model/model_spec.h"
#include "ess/sim/inputs.h"
#include "ess/sim/memory_model.h"
#include "ess/sim/op_names.h"
#include "ess/sim/step_model.h"
#include "ess/sim/timeline.h"
#include "ess/trace/analyzer.h"
#include "ess/trace/generator.h"
#include "sim/sim_test_util.h"
#include "testing/testing.h"

namespace ess::sim {
namespace {

using ess::test::error_of;
using testing::paper_dep;
using testing::paper_hw;

const ModelSpec& m3() {
  static const ModelSpec m = testing::shipped_model("minimax-m3.json");
  return m;
}
ModelSpec m3_with(const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j;
  std::ifstream(ESS_SOURCE_DIR "/configs/models/minimax-m3.json") >> j;
  edit(j);
  return ModelSpec::from_json(j, "minimax-m3 (edited)");
}
Deployment tp8() { return Deployment::shipped("minimax-m3-tp8"); }

// The shipped config (60 layers, 3 dense then 57 sparse; 64 query heads, 4 KV heads of 128; index
// heads 4 of 128, keys only in the sparse layers; 128 experts of 3 x 6144 x 3072, top 4; bf16) on one
// rank of --tp 8 --ep 8: its KV head's K and V, 2 x 128 x 2 = 512 B a token; the index key 128 x 2 =
// 256 B a token in each sparse layer; the dense layers' K / V whole.
TEST(sim_minimax_m3, ARankHoldsOneKvHeadAndTheIndexKeysOfEverySparseLayer) {
  const MemoryModel mem(m3(), paper_hw(), tp8(), 32768);
  EXPECT_EQ(mem.cache_layers(), 57);
  EXPECT_DOUBLE_EQ(mem.latent_bytes_per_request(1000), 1000.0 * 57 * 512);
  EXPECT_DOUBLE_EQ(mem.resident_bytes_per_request(), 32768.0 * (57 * 256 + 3 * 512));
  // Weights: q / o of 8 of the 64 heads, k / v of one KV head, per layer; the sparse layers' index
  // query (4 heads over 8 ranks: one a rank) and key; 16 of the 128 experts; 1/8 of the vocabulary
  // (embedding and head); the router whole. All bf16.
  const double h = 6144;
  const double attention = 60 * (h * 8 * 128 * 2 + h * 1 * 128 * 2) + 57 * (h * 1 * 128 + h * 128);
  const double experts = 16.0 * 3 * h * 3072 * 60;
  const double embedding = 2.0 * h * 200064 / 8;
  const double router = h * 128 * 60;
  EXPECT_NEAR(mem.weights().total(), 2 * (attention + experts + embedding + router), 1.0);
  // Host: each of the node's 8 ranks holds its KV head's K / V of every sparse layer.
  EXPECT_DOUBLE_EQ(mem.host_pool_bytes_per_node(10), 8.0 * 10 * 32768 * 57 * 512);
}

// The config's own fields decide: index values kept where sparse_disable_index_value does not drop
// them (double the index cache), block FP8 weights (quantization_config), leading dense MLP layers.
TEST(sim_minimax_m3, TheConfigsIndexValuesWeightFormatAndDenseLayersAreRead) {
  const ModelSpec kv_index = m3_with([](nlohmann::json& j) { j["sparse_attention_config"].erase("sparse_disable_index_value"); });
  EXPECT_DOUBLE_EQ(MemoryModel(kv_index, paper_hw(), tp8(), 32768).resident_bytes_per_request(),
                   32768.0 * (57 * 512 + 3 * 512));
  const ModelSpec fp8 = m3_with([](nlohmann::json& j) { j["quantization_config"] = {{"quant_method", "fp8"}}; });
  const MemoryModel bf16_mem(m3(), paper_hw(), tp8(), 32768), fp8_mem(fp8, paper_hw(), tp8(), 32768);
  EXPECT_NEAR(fp8_mem.weights().routed_experts, bf16_mem.weights().routed_experts / 2 * (1 + 4.0 / (128 * 128) / 1), 1e3);
  EXPECT_EQ(fp8_mem.weights().embedding, bf16_mem.weights().embedding);  // embedding and head stay bf16
  const ModelSpec dense2 = m3_with([](nlohmann::json& j) {
    std::vector<int> moe(60, 1);
    moe[0] = moe[1] = 0;
    j["moe_layer_freq"] = moe;
  });
  EXPECT_EQ(dense2.first_k_dense_replace, 2);
  EXPECT_GT(MemoryModel(dense2, paper_hw(), tp8(), 32768).weights().dense_ffn, 0);
  EXPECT_EQ(ModelSpec::from_json(dense2.to_json(), "round trip").to_json(), dense2.to_json());
}

// The built-in locality model carried to a selection of 17 blocks of 128 tokens (2,176 tokens): at
// ratio 0.2 and T 1, 200 / 2 x 2176 / 2048 misses per sparse request-layer, copied in 512-byte
// entries; the dense layers miss nothing. Two all-reduces per layer (after attention, after the MoE)
// and no all-to-all; throughput per node is the batch's (one batch over the node's 8 GPUs).
TEST(sim_minimax_m3, TheSparseLayersMissAndEveryLayerAllReduces) {
  const StepModel sm(m3(), paper_hw(), tp8());
  Workload w;
  w.batch = 8;
  w.ratio = 0.2;
  w.overlap = OverlapMode::kNone;
  Timeline tl;
  const StepResult r = sm.run(w, &tl);
  EXPECT_EQ(r.slots, static_cast<std::int32_t>(std::ceil(0.2 * 32768)));
  EXPECT_NEAR(r.misses_per_request_layer, 100.0 * 2176 / 2048, 1e-6);
  EXPECT_NEAR(r.h2d_bytes, 8 * 57 * r.misses_per_request_layer * 512, 1.0);
  int all_reduces = 0, a2a = 0;
  for (const TimelineEvent& e : tl.events) {
    all_reduces += e.name.find(op::kAllReduce) != std::string::npos ? 1 : 0;
    a2a += e.name.find(op::kDispatch) != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(all_reduces, 2 * 60);
  EXPECT_EQ(a2a, 0);
  EXPECT_NEAR(r.throughput_tokens_per_s, r.otps * 8, 1e-9 * r.throughput_tokens_per_s);
  // All on the GPU: no copies; offload costs at most its copies and swap work here.
  w.offload = false;
  w.ratio = 0;
  const StepResult resident = sm.run(w);
  EXPECT_EQ(resident.h2d_bytes, 0);
  EXPECT_GE(r.step_us, resident.step_us);
  // A faster NVLink shortens the step: the all-reduces are on its critical path.
  HardwareProfile fast = paper_hw();
  fast.nvlink_gbps *= 4;
  EXPECT_LT(StepModel(m3(), fast, tp8()).run(w).step_us, resident.step_us);
}

// Under attention TP every rank holds the batch's n tokens, so a rank's 16 experts take n x 4 / 8 rows
// in all (not n x 4, as under DP attention): at batch 8 four rows touch about 16 (1 - e^-1/4) = 3.5 of
// them, at batch 64 about 16 (1 - e^-2) = 13.8; the experts' weights read (what bounds them at these
// rows) grow about 3.9x, where n x 4 rows would touch 13.8 and 16 (1.16x).
TEST(sim_minimax_m3, ARanksExpertsTakeTheirShareOfTheBatchsTokens) {
  // FP8 weights and a pool at the floor leave room for batch 64.
  const ModelSpec fp8 = m3_with([](nlohmann::json& j) { j["quantization_config"] = {{"quant_method", "fp8"}}; });
  const StepModel sm(fp8, paper_hw(), tp8());
  const auto experts_us = [&](int batch) {
    Workload w;
    w.batch = batch;
    w.slots = 2176;
    w.overlap = OverlapMode::kNone;
    Timeline tl;
    sm.run(w, &tl);
    double us = 0;
    for (const TimelineEvent& e : tl.events) us += e.name.find(op::kRoutedExperts) != std::string::npos ? e.dur_us : 0.0;
    return us;
  };
  const double ratio = experts_us(64) / experts_us(8);
  EXPECT_GT(ratio, 3.0);
  EXPECT_LT(ratio, 4.5);
}

// A miss profile of M3's own blocks (`ess trace gen --model`, `ess trace analyze --miss-profile`): its
// slots, misses and context count blocks of 128 tokens, read as tokens, so a step at the profile's own
// pool misses 128 x the profile's mean.
TEST(sim_minimax_m3, AProfileOfItsBlocksIsReadInTokens) {
  trace::GeneratorProfile p = trace::GeneratorProfile::shipped_default();
  trace::apply_model(p, m3());
  p.validate("m3");
  trace::GenerateConfig g;
  g.contexts = {32768};
  g.requests = 2;
  g.steps = 48;
  const std::string dir = ::testing::TempDir();
  trace::generate_trace(p, g, dir + "/m3_profile.safetensors");
  trace::AnalyzeConfig c;
  c.policies = {"lru_warmup"};
  c.ratios = {0.2};
  c.recommend = false;
  c.similarity = false;
  c.prefetch = false;
  const trace::AnalysisResult a = trace::analyze(trace::TraceReader(dir + "/m3_profile.safetensors"), c);
  const nlohmann::json profile = trace::miss_profile_json(a, "lru_warmup");
  ASSERT_EQ(profile["unit_tokens"], 128);
  std::ofstream(dir + "/m3_profile.json") << profile.dump();
  double sum = 0;
  for (const auto& l : profile["contexts"][0]["layers"]) sum += l["mean"].get<double>();
  const double mean = sum / static_cast<double>(profile["contexts"][0]["layers"].size());
  ASSERT_GT(mean, 0);
  Workload w;
  w.batch = 8;
  w.slots = 52 * 128;  // ceil(0.2 x 256 blocks) blocks
  w.overlap = OverlapMode::kNone;
  w.misses = MissModel::load_profile(dir + "/m3_profile.json", 32768, MissModel{});
  const StepModel sm(m3(), paper_hw(), tp8());
  EXPECT_NEAR(sm.run(w).misses_per_request_layer, 128 * mean, 1e-6 * mean);
  EXPECT_EQ(sm.misses_in_entries(w.misses).profile_topk, 17 * 128);
  // DeepSeek-V4's units (C4 entries of 4 tokens) are not M3's.
  w.misses.unit_tokens = 4;
  EXPECT_NE(error_of([&] { sm.run(w); }).find("units of 4 tokens"), std::string::npos);
}

TEST(sim_minimax_m3, WhatItDoesNotRunIsRefusedByName) {
  // Data-parallel attention (4 KV heads a rank): HiSparse holds one.
  EXPECT_NE(error_of([&] { StepModel(m3(), paper_hw(), paper_dep()); }).find("one KV head per rank"), std::string::npos);
  Deployment t2 = tp8();
  t2.mtp_tokens = 2;
  t2.accept_ratio = 1.5;
  EXPECT_NE(error_of([&] { StepModel(m3(), paper_hw(), t2); }).find("no next-n (MTP) layers"), std::string::npos);
  const StepModel sm(m3(), paper_hw(), tp8());
  Workload w;
  w.batch = 4;
  w.overlap = OverlapMode::kDualBatchAttention;
  EXPECT_NE(error_of([&] { sm.run(w); }).find("overlap dba"), std::string::npos);
  MeasuredTables tables = MeasuredTables::from_csv_text("op,context,tokens,time_us\nattn.sparse_mla,32768,64,5\n", "t.csv");
  EXPECT_NE(error_of([&] { StepModel(m3(), paper_hw(), tp8(), &tables); }).find("--op-table"), std::string::npos);
  const ModelSpec nvfp4 = m3_with([](nlohmann::json& j) { j["quantization_config"] = {{"quant_method", "minimax_m3_nvfp4"}}; });
  EXPECT_NE(error_of([&] { StepModel(nvfp4, paper_hw(), tp8()); }).find("'minimax_m3_nvfp4'"), std::string::npos);
  const ModelSpec dense_late = m3_with([](nlohmann::json& j) {
    std::vector<int> moe(60, 1);
    moe[30] = 0;
    j["moe_layer_freq"] = moe;
  });
  EXPECT_NE(error_of([&] { StepModel(dense_late, paper_hw(), tp8()); }).find("layer 30 is a dense MLP"), std::string::npos);
  // Attention TP is modelled for M3 only; and with experts over the same GPUs, without TBO.
  EXPECT_NE(error_of([&] { StepModel(testing::dsv32(), paper_hw(), tp8()); }).find("attention tensor parallel is modelled for MiniMax-M3"),
            std::string::npos);
  Deployment ep4 = tp8();
  ep4.expert_parallel = 4;
  EXPECT_NE(error_of([&] { ep4.validate("ep4"); }).find("tensor-parallel experts are not modelled"), std::string::npos);
  Deployment tbo = tp8();
  tbo.two_batch_overlap = true;
  EXPECT_NE(error_of([&] { tbo.validate("tbo"); }).find("two_batch_overlap under attention_tensor_parallel"),
            std::string::npos);
  Deployment half = tp8();
  half.attention_tensor_parallel = 4;
  half.attention_data_parallel = 2;
  EXPECT_NE(error_of([&] { half.validate("half"); }).find("attention tensor parallel over every GPU (8) or none"),
            std::string::npos);
}

// `ess sim` / `ess plan` for MiniMax-M3 without a deployment: the shipped --tp 8 --ep 8 one; --nodes
// keeps attention TP over every GPU. The plan runs overlap none, no vLLM.
TEST(sim_minimax_m3, ThePlanRunsOnItsOwnDeployment) {
  Inputs in;
  in.model = ESS_SOURCE_DIR "/configs/models/minimax-m3.json";
  in.hardware = "h200";
  const Deployment d = in.load_deployment();
  EXPECT_EQ(d.name, "minimax-m3-tp8");
  EXPECT_EQ(d.attention_tensor_parallel, 8);
  in.nodes = 2;
  const Deployment two = in.load_deployment();
  EXPECT_EQ(two.attention_tensor_parallel, 16);
  EXPECT_EQ(two.expert_parallel, 16);
  EXPECT_EQ(two.attention_data_parallel, 1);
  in.nodes.reset();
  PlanOptions opt;
  opt.contexts = {32768};
  opt.engine = "sglang";
  const Plans plans = plan_contexts(in, opt);
  ASSERT_EQ(plans.results.size(), 1u);
  EXPECT_TRUE(plans.results[0].found);
  EXPECT_EQ(plans.results[0].chosen.best.overlap, OverlapMode::kNone);
  opt.engine = "vllm";
  EXPECT_NE(error_of([&] { plan_contexts(in, opt); }).find("MiniMax-M3 is planned for SGLang"), std::string::npos);
}

}  // namespace
}  // namespace ess::sim
