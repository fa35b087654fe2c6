// `ess plan --engine sglang`: the search limited to what ESS serves inside SGLang 0.5.23 and the
// launch line of what it chose (ess/sim/launch.h). That SGLang's own parser reads the line as
// meant is python/tests/engines/sglang/test_sglang_launch_line.py's.
#include "ess/sim/launch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "ess/sim/inputs.h"
#include "ess/sim/memory_model.h"
#include "testing/testing.h"

namespace ess::sim {
namespace {

// The paper's deployment on the h200 profile, and a plan for an engine at one context.
Inputs h200() {
  Inputs in;
  in.hardware = "h200";
  return in;
}

// One node of 8 H200 (DP attention 8, EP 8).
Inputs h200_node() {
  Inputs in = h200();
  in.nodes = 1;
  in.gpus_per_node = 8;
  in.ep = 8;
  return in;
}

PlanOptions engine_options(const char* engine, std::int64_t context, double min_otps) {
  PlanOptions o;
  o.contexts = {context};
  o.min_otps = min_otps;
  o.engine = engine;
  return o;
}

PlanOptions sglang_options(std::int64_t context, double min_otps) {
  return engine_options("sglang", context, min_otps);
}

PlanOptions vllm_options(std::int64_t context, double min_otps) { return engine_options("vllm", context, min_otps); }

// Every overlap mode runs inside the engine: a plan asked for one mode alone chooses it.
void expect_every_mode_planned(const Inputs& in, PlanOptions o) {
  for (const char* mode : {"da", "dba", "layerwise"}) {
    o.modes = {mode};
    const Plans p = plan_contexts(in, o);
    ASSERT_TRUE(p.results[0].found) << mode;
    EXPECT_EQ(to_string(p.results[0].chosen.best.overlap), std::string(mode)) << o.engine;
  }
}

TEST(sim_launch, SglangLimitsTheModesAndThePoolFloor) {
  EngineLimits l = engine_limits("sglang", "", false, 2);
  expect_every_mode_planned(h200(), sglang_options(131072, 10));  // DA / DBA inside its decode, ESS_OVERLAP_LAYERS
  EXPECT_FALSE(l.preattn_in_copy_window);  // its model computes q before the indexer
  EXPECT_TRUE(engine_limits("", "", false, 2).preattn_in_copy_window);
  EXPECT_EQ(l.pool_floor, "tk");  // MTP: the verify step swaps T x top-k at once
  EXPECT_EQ(engine_limits("sglang", "", false, 1).pool_floor, "");
  EXPECT_EQ(engine_limits("", "max", true, 2).pool_floor, "max");  // no engine: as asked
  EXPECT_NE(test::error_of([&] { engine_limits("sglang", "p99", true, 2); }).find("use --pool-floor tk"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { engine_limits("tgi", "", false, 2); }).find("sglang (0.5.23) and vllm"),
            std::string::npos);
}

TEST(sim_launch, VllmRunsEveryModeWithoutTboAndEveryRequestSparse) {
  const EngineLimits l = engine_limits("vllm", "", false, 2);
  expect_every_mode_planned(h200_node(), vllm_options(131072, 10));
  EXPECT_FALSE(l.two_batch_overlap);
  EXPECT_FALSE(l.whole_residency);
  EXPECT_FALSE(l.preattn_in_copy_window);
  EXPECT_EQ(l.pool_floor, "tk");
  EXPECT_TRUE(engine_limits("sglang", "", false, 2).two_batch_overlap);
}

TEST(sim_launch, TheVllmLaunchLineCarriesThePlansChoiceAndLeavesRoomForEsssRows) {
  const Plans p = plan_contexts(h200_node(), vllm_options(32768, 15));
  EXPECT_FALSE(p.deployment.two_batch_overlap);
  ASSERT_TRUE(p.results[0].found);
  EXPECT_FALSE(p.results[0].chosen.two_batch_overlap);
  EXPECT_FALSE(p.results[0].low_load.found);
  const StepResult& c = p.results[0].chosen.best;
  ASSERT_TRUE(c.offload);
  const std::vector<std::string> env = p.launches[0]["env"];
  if (c.overlap == OverlapMode::kNone) {
    EXPECT_TRUE(env.empty());
  } else {
    ASSERT_FALSE(env.empty());
    EXPECT_EQ(env[0], "ESS_OVERLAP=" + std::string(to_string(c.overlap)));
    EXPECT_EQ(env.size(), c.overlap == OverlapMode::kLayerWise ? 2u : 1u);
  }
  const std::vector<std::string> argv = p.launches[0]["argv"];
  ASSERT_GE(argv.size(), 3u);
  EXPECT_EQ(argv[0] + " " + argv[1], "vllm serve");
  auto value = [&](const std::string& flag) {
    const auto it = std::find(argv.begin(), argv.end(), flag);
    return it == argv.end() || it + 1 == argv.end() ? std::string("(absent)") : *(it + 1);
  };
  EXPECT_EQ(value("--max-num-seqs"), std::to_string(c.batch));
  EXPECT_EQ(value("--max-model-len"), "32768");
  EXPECT_EQ(value("--data-parallel-size"), "8");
  EXPECT_EQ(value("--tensor-parallel-size"), "1");
  // ESS's rows are a hot region: its slots and the T = 2 reserved rows.
  EXPECT_NE(value("--attention-config").find(fmt::format("\"device_buffer_size\": {}", c.slots + 2)), std::string::npos);
  EXPECT_NE(value("--kv-transfer-config").find("\"kv_connector_module_path\": \"ess.integrations.vllm_connector\""),
            std::string::npos);
  // ESS's rows inside vLLM's budget, its engine's state (about 1 GiB) outside: the utilization drops by that alone.
  const double utilization = std::stod(value("--gpu-memory-utilization"));
  const double gib = double(1ull << 30) / (p.hardware.hbm_capacity_gb * 1e9);
  EXPECT_LE(utilization, p.deployment.mem_fraction_static - gib);
  EXPECT_GT(utilization, p.deployment.mem_fraction_static - gib - 0.002);
  EXPECT_NE(to_table(p).find("launch (vllm 0.33.0):"), std::string::npos);
}

TEST(sim_launch, TheLaunchLineCarriesThePlansChoice) {
  const Inputs in = h200();
  PlanOptions o = sglang_options(131072, 10);
  const Plans p = plan_contexts(in, o);
  ASSERT_TRUE(p.results[0].found);
  const StepResult& c = p.results[0].chosen.best;
  ASSERT_TRUE(c.offload);
  EXPECT_GE(c.slots, 2 * 2048);  // MTP 2: the T x top-k floor
  const nlohmann::json& l = p.launches[0];
  const std::vector<std::string> argv = l["argv"];
  auto value = [&](const std::string& flag) {
    const auto it = std::find(argv.begin(), argv.end(), flag);
    return it == argv.end() || it + 1 == argv.end() ? std::string("(absent)") : *(it + 1);
  };
  EXPECT_EQ(value("--max-running-requests"), std::to_string(c.batch * p.deployment.attention_data_parallel));
  EXPECT_EQ(value("--context-length"), "131072");
  EXPECT_EQ(value("--speculative-num-draft-tokens"), "2");
  EXPECT_NE(value("--hisparse-config").find(fmt::format("\"device_buffer_size\": {}", c.slots)), std::string::npos);
  EXPECT_EQ(std::count(argv.begin(), argv.end(), "--enable-two-batch-overlap"), p.results[0].chosen.two_batch_overlap ? 1 : 0);
  const bool overlap = c.overlap != OverlapMode::kNone;
  const std::vector<std::string> env = l["env"];
  EXPECT_EQ(env.size(), overlap ? 2u : 1u);
  EXPECT_EQ(std::count(env.begin(), env.end(), fmt::format("ESS_OVERLAP={}", to_string(c.overlap))), overlap ? 1 : 0);
  EXPECT_EQ(std::count(env.begin(), env.end(), "ESS_RESIDENCY=adaptive"), 1);
  EXPECT_EQ(value("--dsa-decode-backend"), overlap ? "flashmla_kv" : "(absent)");
  EXPECT_NE(to_table(p).find("launch (sglang 0.5.23):"), std::string::npos);
  // The host pool holds every request's context whatever else SGLang's device pool keeps.
  const std::string config = value("--hisparse-config");
  const auto at = config.find("\"host_to_device_ratio\": ") + 24;
  const long long ratio = std::stoll(config.substr(at));
  EXPECT_GE(double(ratio) * c.batch * (c.slots + 2), double(c.batch) * 131072);
}

TEST(sim_launch, SglangLayerWiseLineCarriesEachLayersSchedule) {
  const Inputs in = h200();
  PlanOptions o = sglang_options(131072, 10);
  o.modes = {"layerwise"};
  const Plans p = plan_contexts(in, o);
  ASSERT_TRUE(p.results[0].found);
  const StepResult& c = p.results[0].chosen.best;
  ASSERT_TRUE(c.offload);
  ASSERT_EQ(c.overlap, OverlapMode::kLayerWise);
  const std::vector<std::string> env = p.launches[0]["env"];
  const std::string layers = "ESS_OVERLAP_LAYERS=" + c.layer_modes;
  EXPECT_EQ(std::count(env.begin(), env.end(), layers), 1);
  EXPECT_EQ(std::count(env.begin(), env.end(), "ESS_OVERLAP=layerwise"), 1);
  // One group per layer (and the MTP draft layer), codes the adapter reads: a (DA), b (DBA), - (no misses).
  EXPECT_EQ(c.layer_modes.find_first_not_of("ab- "), std::string::npos) << c.layer_modes;
  // The shell line quotes the value, not the name: a quoted NAME=value would not be an assignment.
  const std::string line = p.launches[0]["command_line"];
  EXPECT_NE(line.find("ESS_OVERLAP_LAYERS='" + c.layer_modes + "'"), std::string::npos) << line;
}

// vLLM runs no micro-batches: each layer's group is one code (DA, DBA or none), which the connector reads by the
// model's layer index (vllm_connector.py overlap_schedules).
TEST(sim_launch, VllmLayerWiseLineCarriesOneCodePerLayer) {
  PlanOptions o = vllm_options(131072, 10);
  o.modes = {"layerwise"};
  const Plans p = plan_contexts(h200_node(), o);
  ASSERT_TRUE(p.results[0].found);
  const StepResult& c = p.results[0].chosen.best;
  ASSERT_TRUE(c.offload);
  ASSERT_EQ(c.overlap, OverlapMode::kLayerWise);
  const std::vector<std::string> env = p.launches[0]["env"];
  EXPECT_EQ(env, (std::vector<std::string>{"ESS_OVERLAP=layerwise", "ESS_OVERLAP_LAYERS=" + c.layer_modes}));
  std::istringstream groups(c.layer_modes);
  std::string group;
  int layers = 0;
  while (groups >> group) {
    EXPECT_EQ(group.size(), 1u) << c.layer_modes;
    EXPECT_EQ(group.find_first_not_of("ab-"), std::string::npos) << c.layer_modes;
    ++layers;
  }
  EXPECT_GE(layers, 61) << c.layer_modes;
}

// Stock HiSparse beside the plan, sized by SGLang 0.5.23's rules at its defaults: a device token
// costs every cache layer's latent entry and host_to_device_ratio (2) indexer entries, the logical
// pool is twice the device pool, a request takes device_buffer_size + one page (+ the speculative
// scratch with MTP).
TEST(sim_launch, StockHiSparseIsSizedAsSglangSizesIt) {
  const Inputs in = h200();
  PlanOptions o = sglang_options(32768, 0);
  const Plans p = plan_contexts(in, o);
  ASSERT_TRUE(p.results[0].found);
  const nlohmann::json& s = p.stock.at(0);
  ASSERT_FALSE(s.is_null());
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const MemoryModel mem(m, p.hardware, p.deployment, 32768);
  const double per_token = mem.cache_layers() * (656.0 + 2 * 132.0);
  const double device = std::floor(mem.cache_budget() / per_token / 64) * 64;
  EXPECT_DOUBLE_EQ(s["device_tokens"].get<double>(), device);
  EXPECT_DOUBLE_EQ(s["logical_tokens"].get<double>(), 2 * device);
  EXPECT_DOUBLE_EQ(s["slots_per_request"].get<double>(), 4096 + 64 + 1024);  // MTP 2: min(4096, max(1024, 0))
  const int admitted = std::min(static_cast<int>(2 * device / 32768), static_cast<int>(device / 5184));
  EXPECT_EQ(s["admitted"].get<int>(), admitted);
  EXPECT_EQ(s["batch"].get<int>(), admitted);  // no OTPS target
  EXPECT_GT(s["throughput_tokens_per_s_per_node"].get<double>(), 0);
  EXPECT_NE(to_table(p).find("stock HiSparse (SGLang 0.5.23's defaults"), std::string::npos);
  // An OTPS target above what its admitted batch runs at lowers its batch, and says so.
  o.min_otps = s["otps"].get<double>() + 1;
  const Plans q = plan_contexts(in, o);
  if (q.results[0].found && !q.stock.at(0).is_null()) {
    EXPECT_LT(q.stock[0]["batch"].get<int>(), admitted);
    EXPECT_NE(q.stock[0]["limit"].get<std::string>().find("OTPS"), std::string::npos);
  }
  // Not modelled for vLLM (its own budget and hot regions), nor without an engine.
  o.min_otps = 0;
  o.engine = "vllm";
  EXPECT_TRUE(plan_contexts(in, o).stock.at(0).is_null());
  o.engine = "";
  EXPECT_TRUE(plan_contexts(in, o).stock.at(0).is_null());
}

// MiniMax-M3 under SGLang: attention TP over the node, SGLang's default MoE (its all-reduce, no DeepEP), the model's
// own KV dtype, a device buffer holding a step's blocks. DeepSeek-V4 still has no launch line.
TEST(sim_launch, MiniMaxM3sLaunchLineRunsAttentionTensorParallel) {
  Inputs in;
  in.model = ESS_SOURCE_DIR "/configs/models/minimax-m3.json";
  in.hardware = "h200";
  PlanOptions o;
  o.contexts = {32768};
  o.engine = "sglang";
  const Plans p = plan_contexts(in, o);
  ASSERT_TRUE(p.results[0].found);
  const StepResult& c = p.results[0].chosen.best;
  ASSERT_TRUE(c.offload);
  const std::vector<std::string> argv = p.launches[0]["argv"];
  auto value = [&](const std::string& flag) {
    const auto it = std::find(argv.begin(), argv.end(), flag);
    return it == argv.end() ? std::string("(absent)") : it + 1 == argv.end() ? std::string() : *(it + 1);
  };
  EXPECT_EQ(value("--tp-size"), "8");
  EXPECT_EQ(value("--ep-size"), "8");
  EXPECT_EQ(value("--moe-a2a-backend"), "(absent)");
  EXPECT_EQ(value("--enable-dp-attention"), "(absent)");
  EXPECT_EQ(value("--kv-cache-dtype"), "(absent)");
  EXPECT_EQ(value("--max-running-requests"), std::to_string(c.batch));
  EXPECT_GE(c.slots, 16 * 128);
  EXPECT_NE(value("--hisparse-config").find(fmt::format("\"device_buffer_size\": {}", c.slots)), std::string::npos);
  EXPECT_TRUE(p.stock[0].is_null());
  // A config that carries SGLang's kv_cache_dtype flag: the line passes it as given.
  nlohmann::json j;
  std::ifstream(ESS_SOURCE_DIR "/configs/models/minimax-m3.json") >> j;
  j["kv_cache_dtype"] = "fp8_e5m2";
  const std::string e5m2 = ::testing::TempDir() + "/minimax-m3-e5m2.json";
  std::ofstream(e5m2) << j.dump();
  in.model = e5m2;
  const std::vector<std::string> fp8 = plan_contexts(in, o).launches[0]["argv"];
  const auto it = std::find(fp8.begin(), fp8.end(), "--kv-cache-dtype");
  ASSERT_NE(it, fp8.end());
  EXPECT_EQ(*(it + 1), "fp8_e5m2");
  in.model = ESS_SOURCE_DIR "/configs/models/deepseek-v4-flash.json";
  EXPECT_TRUE(plan_contexts(in, o).launches[0].is_null());
}

}  // namespace
}  // namespace ess::sim
