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

// The shipped config (60 layers: 3 dense attention and MLP layers, then 57 sparse attention and MoE layers; 64
// query heads, 4 KV heads of 128; index heads 4 of 128, keys only in the sparse layers; 128 experts of 3 x 6144 x
// 3072, top 4, and a shared one; dense MLPs of 12288; bf16) on one rank of --tp 8 --ep 8: its KV head's K and V, 2 x
// 128 x 2 = 512 B a token; the index key 128 x 2 = 256 B a token in each sparse layer; the dense layers' K / V whole.
TEST(sim_minimax_m3, ARankHoldsOneKvHeadAndTheIndexKeysOfEverySparseLayer) {
  const MemoryModel mem(m3(), paper_hw(), tp8(), 32768);
  EXPECT_EQ(mem.cache_layers(), 57);
  EXPECT_DOUBLE_EQ(mem.latent_bytes_per_request(1000), 1000.0 * 57 * 512);
  EXPECT_DOUBLE_EQ(mem.resident_bytes_per_request(), 32768.0 * (57 * 256 + 3 * 512));
  // Weights: q / o of 8 of the 64 heads and k / v of one KV head in every layer; the sparse layers' index query (4
  // heads over 8 ranks: one a rank) and key; 16 of the 128 experts, 1/8 of the shared expert and of the dense MLPs,
  // the router whole, in the 57 MoE layers and 3 dense ones; 1/8 of the vocabulary (embedding and head). All bf16.
  const double h = 6144;
  const double attention = 60 * (h * 8 * 128 * 2 + h * 1 * 128 * 2) + 57 * (h * 1 * 128 + h * 128);
  const double experts = 16.0 * 3 * h * 3072 * 57;
  const double shared = 3.0 * h * 3072 * 57 / 8;
  const double dense = 3.0 * h * 12288 * 3 / 8;
  const double embedding = 2.0 * h * 200064 / 8;
  const double router = h * 128 * 57;
  EXPECT_NEAR(mem.weights().total(), 2 * (attention + experts + shared + dense + embedding + router), 1.0);
  // Host: each of the node's 8 ranks holds its KV head's K / V of every sparse layer.
  EXPECT_DOUBLE_EQ(mem.host_pool_bytes_per_node(10), 8.0 * 10 * 32768 * 57 * 512);
}

// The config's own fields decide: index values kept where sparse_disable_index_value does not drop
// them (double the index cache, their projections too), block FP8 weights (quantization_config), the
// leading dense MLP layers at dense_intermediate_size; an FP8 e4m3 KV cache stores the index keys in FP8.
TEST(sim_minimax_m3, TheConfigsIndexValuesWeightFormatAndDenseLayersAreRead) {
  const ModelSpec kv_index = m3_with([](nlohmann::json& j) { j["sparse_attention_config"].erase("sparse_disable_index_value"); });
  const MemoryModel kv_mem(kv_index, paper_hw(), tp8(), 32768), mem(m3(), paper_hw(), tp8(), 32768);
  EXPECT_DOUBLE_EQ(kv_mem.resident_bytes_per_request(), 32768.0 * (57 * 512 + 3 * 512));
  // index_v_proj (6144 x 128) and index_o_proj (one index head of 128 x 6144) in each of the 57 layers, bf16.
  EXPECT_NEAR(kv_mem.weights().attention - mem.weights().attention, 57 * 2 * (6144.0 * 128 * 2), 1.0);
  const ModelSpec fp8_kv = m3_with([](nlohmann::json& j) { j["kv_cache_dtype"] = "fp8_e4m3"; });
  EXPECT_DOUBLE_EQ(MemoryModel(fp8_kv, paper_hw(), tp8(), 32768).resident_bytes_per_request(),
                   32768.0 * (57 * 128 + 3 * 256));
  const ModelSpec fp8 = m3_with([](nlohmann::json& j) { j["quantization_config"] = {{"quant_method", "fp8"}}; });
  const MemoryModel fp8_mem(fp8, paper_hw(), tp8(), 32768);
  EXPECT_NEAR(fp8_mem.weights().routed_experts, mem.weights().routed_experts / 2 * (1 + 4.0 / (128 * 128)), 1e3);
  EXPECT_NEAR(fp8_mem.weights().dense_ffn, mem.weights().dense_ffn / 2 * (1 + 4.0 / (128 * 128)), 1e3);
  EXPECT_EQ(fp8_mem.weights().embedding, mem.weights().embedding);  // embedding and head stay bf16
  EXPECT_EQ(m3().first_k_dense_replace, 3);
  EXPECT_EQ(m3().intermediate_size, 12288);
  EXPECT_EQ(m3().moe_intermediate_size, 3072);
  EXPECT_EQ(ModelSpec::from_json(m3().to_json(), "round trip").to_json(), m3().to_json());
  // The step reads the weights it counts: FP8 shared expert and dense MLPs take less time than bf16 ones.
  const auto op_us = [](const ModelSpec& model, std::string_view name) {
    Workload w;
    w.batch = 8;
    w.offload = false;
    w.overlap = OverlapMode::kNone;
    Timeline tl;
    StepModel(model, paper_hw(), tp8()).run(w, &tl);
    double us = 0;
    for (const TimelineEvent& e : tl.events) us += e.name.find(name) != std::string::npos ? e.dur_us : 0.0;
    return us;
  };
  EXPECT_LT(op_us(fp8, op::kSharedExpert), 0.75 * op_us(m3(), op::kSharedExpert));
  EXPECT_LT(op_us(fp8, "dense.norm+ffn"), 0.75 * op_us(m3(), "dense.norm+ffn"));
}

// The built-in locality model carried to a selection of 16 blocks of 128 tokens (2,048 tokens, as its
// own): at ratio 0.2 and T 1, 200 / 2 misses per sparse request-layer, copied in 512-byte entries; the dense layers miss nothing. Two all-reduces per layer (after attention, after the MoE)
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
  EXPECT_NEAR(r.misses_per_request_layer, 100.0, 1e-6);
  EXPECT_NEAR(r.h2d_bytes, 8 * 57 * r.misses_per_request_layer * 512, 1.0);
  int all_reduces = 0, a2a = 0;
  for (const TimelineEvent& e : tl.events) {
    all_reduces += e.name.find(op::kAllReduce) != std::string::npos ? 1 : 0;
    a2a += e.name.find(op::kDispatch) != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(all_reduces, 2 * 60);  // after attention, and after the MoE or the dense MLP
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
    w.slots = 2048;
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
  std::string path;
  double mean = 0;
  const nlohmann::json profile = testing::own_miss_profile(m3(), "m3_profile", path, mean);
  ASSERT_EQ(profile["unit_tokens"], 128);
  ASSERT_GT(mean, 0);
  Workload w;
  w.batch = 8;
  w.slots = 52 * 128;  // ceil(0.2 x 256 blocks) blocks
  w.overlap = OverlapMode::kNone;
  w.misses = MissModel::load_profile(path, 32768, MissModel{});
  const StepModel sm(m3(), paper_hw(), tp8());
  EXPECT_NEAR(sm.run(w).misses_per_request_layer, 128 * mean, 1e-6 * mean);
  EXPECT_EQ(sm.misses_in_entries(w.misses).profile_topk, 16 * 128);
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
  EXPECT_NE(error_of([&] { StepModel(m3(), paper_hw(), t2); }).find("no speculative decoding"), std::string::npos);
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
  // Index heads SGLang cannot split over the ranks, or more than a rank's KV head; dense MLPs of no width.
  const ModelSpec idx3 = m3_with([](nlohmann::json& j) { j["sparse_attention_config"]["sparse_num_index_heads"] = 3; });
  EXPECT_NE(error_of([&] { StepModel(idx3, paper_hw(), tp8()); }).find("sparse_num_index_heads = 3"), std::string::npos);
  const ModelSpec idx16 = m3_with([](nlohmann::json& j) { j["sparse_attention_config"]["sparse_num_index_heads"] = 16; });
  EXPECT_NE(error_of([&] { StepModel(idx16, paper_hw(), tp8()); }).find("union of their top-k"), std::string::npos);
  const ModelSpec no_dense_width = m3_with([](nlohmann::json& j) { j.erase("dense_intermediate_size"); });
  EXPECT_NE(error_of([&] { StepModel(no_dense_width, paper_hw(), tp8()); }).find("'dense_intermediate_size'"),
            std::string::npos);
  // A quantization the config does not name is refused where it is read.
  EXPECT_NE(error_of([] { m3_with([](nlohmann::json& j) { j["quantization_config"] = {{"fmt", "e4m3"}}; }); })
                .find("no string 'quant_method'"),
            std::string::npos);
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
  // A deployment the user names is taken as named (and refused for M3 when it is data-parallel attention).
  in.deployment = "paper-table1";
  EXPECT_EQ(in.load_deployment().name, "paper-table1");
  in.deployment.clear();
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
