#include <gtest/gtest.h>

#include <cmath>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ess/core/error.h"
#include "ess/sim/deployment.h"
#include "ess/sim/hardware.h"
#include "ess/sim/inputs.h"
#include "ess/trace/generator.h"
#include "testing/testing.h"

namespace ess::sim {
namespace {

using ess::test::error_of;

TEST(sim_inputs, EveryShippedProfileLoadsWithSources) {
  for (const auto& name : HardwareProfile::shipped_names()) {
    const HardwareProfile p = HardwareProfile::shipped(name);
    EXPECT_EQ(p.name, name);
    EXPECT_GE(p.sources.size(), 21u) << name;
    // Round trip.
    const HardwareProfile q = HardwareProfile::from_json(p.to_json(), "round trip");
    EXPECT_EQ(q.hbm_capacity_gb, p.hbm_capacity_gb);
  }
  EXPECT_EQ(HardwareProfile::shipped_names().size(), 5u);
  EXPECT_NO_THROW(Deployment::shipped("paper-table1"));
}

TEST(sim_inputs, HardwareNamesIgnoreCaseAndAShortNameIsCompleted) {
  EXPECT_EQ(HardwareProfile::load("H200").name, HardwareProfile::load("h200").name);
  const std::string m = error_of([] { HardwareProfile::load("h20"); });
  EXPECT_NE(m.find("did you mean h20-141gb or h200?"), std::string::npos) << m;
  EXPECT_NE(m.find("configs/hardware/h200.json"), std::string::npos) << m;
}

TEST(sim_inputs, UnknownHardwareNamesTheChoices) {
  const std::string m = error_of([] { HardwareProfile::load("b200"); });
  EXPECT_NE(m.find("unknown hardware 'b200'"), std::string::npos) << m;
  EXPECT_NE(m.find("h100"), std::string::npos) << m;
}

// A profile written before the tile model's fields loads: each missing field takes its default
// and says so in its source; a copy grid of every SM is refused.
TEST(sim_inputs, OlderProfilesGetTheNewFieldsWithTheirSources) {
  nlohmann::json j = HardwareProfile::shipped("h200").to_json();
  for (const char* f : {"sm_count", "gemm_tile_overhead_k", "gemm_memory_efficiency", "step_overhead_us", "transfer_sms"}) {
    j.erase(f);
    j["sources"].erase(f);
  }
  const HardwareProfile p = HardwareProfile::from_json(j, "old.json");
  EXPECT_EQ(p.sm_count, 132);
  EXPECT_EQ(p.gemm_tile_overhead_k, 512);
  EXPECT_EQ(p.gemm_memory_efficiency, 0.7);
  EXPECT_EQ(p.step_overhead_us, 0);
  EXPECT_EQ(p.transfer_sms, 32);
  EXPECT_NE(p.sources.at("gemm_tile_overhead_k").find("DeepGEMM"), std::string::npos);
  EXPECT_NE(p.sources.at("step_overhead_us").find("default"), std::string::npos);
  // A source for a field the file does not set would label the default: refused.
  j = HardwareProfile::shipped("h200").to_json();
  j.erase("sm_count");
  EXPECT_NE(error_of([&] { HardwareProfile::from_json(j, "x.json"); }).find("sources.sm_count is given but the profile sets no 'sm_count'"),
            std::string::npos);
  j = HardwareProfile::shipped("h200").to_json();
  j["transfer_sms"] = 132;
  EXPECT_NE(error_of([&] { HardwareProfile::from_json(j, "x.json"); }).find("'transfer_sms' = 132 must be below sm_count"),
            std::string::npos);
}

TEST(sim_inputs, BadProfilesAreRefusedNamingTheField) {
  const nlohmann::json good = HardwareProfile::shipped("h200").to_json();
  nlohmann::json j = good;
  j["hbm_bandwidth_gbps"] = -1;
  EXPECT_NE(error_of([&] { HardwareProfile::from_json(j, "x.json"); }).find("hbm_bandwidth_gbps"), std::string::npos);
  j = good;
  j["gemm_efficiency"] = 1.5;
  EXPECT_NE(error_of([&] { HardwareProfile::from_json(j, "x.json"); }).find("gemm_efficiency"), std::string::npos);
  j = good;
  j["sources"].erase("rdma_gbps");
  EXPECT_NE(error_of([&] { HardwareProfile::from_json(j, "x.json"); }).find("has no source"), std::string::npos);
  j = good;
  j["warp_speed"] = 9;
  EXPECT_NE(error_of([&] { HardwareProfile::from_json(j, "x.json"); }).find("unknown hardware field 'warp_speed'"),
            std::string::npos);
  j = good;
  j["fp8_tflops"] = "fast";
  EXPECT_NE(error_of([&] { HardwareProfile::from_json(j, "x.json"); }).find("must be a number"), std::string::npos);
  j = good;
  j.erase("rdma_latency_us");
  EXPECT_NE(error_of([&] { HardwareProfile::from_json(j, "x.json"); }).find("rdma_latency_us"), std::string::npos);
}

TEST(sim_inputs, MalformedJsonFileNamesTheFile) {
  const std::string path = ::testing::TempDir() + "ess_sim_bad.json";
  std::ofstream(path) << "{\"name\": \"x\", ";
  const std::string m = error_of([&] { HardwareProfile::from_file(path); });
  EXPECT_NE(m.find(path), std::string::npos) << m;
  EXPECT_NE(m.find("malformed JSON"), std::string::npos) << m;
  std::remove(path.c_str());
}

TEST(sim_inputs, BadDeploymentsAreRefused) {
  nlohmann::json j = Deployment::shipped("paper-table1").to_json();
  j["accept_ratio"] = 2.5;  // > MTP 2
  EXPECT_NE(error_of([&] { Deployment::from_json(j, "d.json"); }).find("accept_ratio"), std::string::npos);
  j["accept_ratio"] = 1.7;
  j["expert_parallel"] = 64;  // > 32 GPUs
  EXPECT_NE(error_of([&] { Deployment::from_json(j, "d.json"); }).find("expert_parallel"), std::string::npos);
  j["expert_parallel"] = 32;
  j["nodes"] = -2;
  EXPECT_THROW(Deployment::from_json(j, "d.json"), Error);
  j["nodes"] = 4;
  j["tbo"] = true;
  EXPECT_NE(error_of([&] { Deployment::from_json(j, "d.json"); }).find("unknown deployment field 'tbo'"),
            std::string::npos);
  j.erase("tbo");
  j["mem_fraction_static"] = 1.2;
  EXPECT_THROW(Deployment::from_json(j, "d.json"), Error);
}

TEST(sim_inputs, MissModelShape) {
  MissModel m;
  EXPECT_DOUBLE_EQ(m.misses(0, 6554, 32768, 2), 200);
  EXPECT_DOUBLE_EQ(m.misses(0, 32768, 32768, 2), 0);
  EXPECT_DOUBLE_EQ(m.misses(0, 6554, 32768, 1), 100);  // linear in T
  EXPECT_GT(m.misses(0, 4096, 32768, 2), 200);
  EXPECT_LT(m.misses(0, 16384, 32768, 2), 200);
  m.layer_shape = {0.5, 1.5};
  EXPECT_DOUBLE_EQ(m.misses(0, 6554, 32768, 2), 100);
  EXPECT_DOUBLE_EQ(m.misses(3, 6554, 32768, 2), 300);
  m.exponent = -1;
  EXPECT_THROW(m.validate("t"), Error);
}

TEST(sim_inputs, MissProfileFile) {
  const std::string path = ::testing::TempDir() + "ess_sim_profile.json";
  std::ofstream(path) << R"({"per_layer_misses": [10, 30, 20]})";
  const auto shape = MissModel::load_layer_shape(path);
  ASSERT_EQ(shape.size(), 3u);
  EXPECT_DOUBLE_EQ(shape[0], 0.5);
  EXPECT_DOUBLE_EQ(shape[1], 1.5);
  std::ofstream(path) << R"({"per_layer_misses": [10, -1]})";
  EXPECT_THROW(MissModel::load_layer_shape(path), Error);
  std::remove(path.c_str());
}

TEST(sim_inputs, WorkloadJson) {
  const Workload w = Workload::from_json(
      nlohmann::json::parse(R"({"context": 131072, "batch": "max", "slots": 8192, "overlap": "dba",
                               "misses": {"reference_misses": 300, "exponent": 0.5}})"),
      "w.json");
  EXPECT_EQ(w.context, 131072);
  EXPECT_EQ(w.batch, 0);
  EXPECT_EQ(w.slots, 8192);
  EXPECT_EQ(w.overlap, OverlapMode::kDualBatchAttention);
  EXPECT_DOUBLE_EQ(w.misses.reference_misses, 300);
  EXPECT_DOUBLE_EQ(w.misses.exponent, 0.5);
  auto bad = [](const char* text) { return error_of([&] { Workload::from_json(nlohmann::json::parse(text), "w.json"); }); };
  EXPECT_NE(bad(R"({"contxt": 5})").find("unknown workload field 'contxt'"), std::string::npos);
  EXPECT_NE(bad(R"({"ratio": 0.2, "slots": 100})").find("not both"), std::string::npos);
  EXPECT_NE(bad(R"({"ratio": 1.2})").find("ratio"), std::string::npos);
  EXPECT_NE(bad(R"({"batch": "all"})").find("batch"), std::string::npos);
  EXPECT_NE(bad(R"({"batch": -4})").find("batch"), std::string::npos);
  EXPECT_NE(bad(R"({"overlap": "fast"})").find("overlap"), std::string::npos);
  EXPECT_NE(bad(R"({"misses": {"mean": 3}})").find("unknown field 'mean'"), std::string::npos);
  EXPECT_EQ(Workload::from_json(nlohmann::json::parse(R"({"residency": "adaptive"})"), "w.json").residency,
            Residency::kAdaptive);
  EXPECT_NE(bad(R"({"residency": "whole"})").find("residency 'whole' is not sparse or adaptive"), std::string::npos);
  EXPECT_THROW(Workload::from_file("/nonexistent/w.json"), Error);
}

TEST(sim_inputs, TraceMissProfileBecomesTheReferencePoint) {
  const std::string path = ::testing::TempDir() + "ess_sim_trace_profile.json";
  std::ofstream(path) << R"({"format": "ess-miss-profile", "version": 1, "mtp": 2, "contexts": [
      {"context": 8192, "slots": 2048, "ratio": null, "mean_misses": 50,
       "layers": [{"layer": 0, "mean": 25}, {"layer": 1, "mean": 75}]},
      {"context": 32768, "slots": 8192, "ratio": null, "mean_misses": 100,
       "layers": [{"layer": 0, "mean": 50}, {"layer": 1, "mean": 150}]}]})";
  const MissModel m = MissModel::load_profile(path, 30000, MissModel{});
  EXPECT_DOUBLE_EQ(m.reference_misses, 100);
  EXPECT_DOUBLE_EQ(m.reference_slots, 8192);
  EXPECT_DOUBLE_EQ(m.reference_context, 32768);
  EXPECT_DOUBLE_EQ(m.misses(0, 8192, 32768, 2), 50);   // the profile's own point, per layer
  EXPECT_DOUBLE_EQ(m.misses(1, 8192, 32768, 2), 150);
  EXPECT_DOUBLE_EQ(MissModel::load_profile(path, 4096, MissModel{}).reference_context, 8192);  // nearest
  std::ofstream(path) << R"({"format": "ess-miss-profile", "contexts": [{"context": 100, "slots": 200, "layers": []}]})";
  EXPECT_THROW(MissModel::load_profile(path, 100, MissModel{}), Error);
  std::remove(path.c_str());
}

// The MTP working set a profile measured sets the pool's floor: its max (or p99) x (1 +
// margin), carried linearly in T past the first query token, within [K, T x K].
TEST(sim_inputs, MeasuredWorkingSetSetsThePoolFloor) {
  const std::string path = ::testing::TempDir() + "ess_sim_ws_profile.json";
  std::ofstream(path) << R"({"format": "ess-miss-profile", "version": 1, "mtp": 2, "topk": 2048, "contexts": [
      {"context": 32768, "slots": 6554, "layers": [{"layer": 0, "mean": 200}],
       "working_set": {"mean": 2200, "p99": 2500, "max": 2600}}]})";
  MissModel m = MissModel::load_profile(path, 32768, MissModel{});
  EXPECT_DOUBLE_EQ(m.working_set_max, 2600);
  EXPECT_DOUBLE_EQ(m.working_set_p99, 2500);
  EXPECT_DOUBLE_EQ(m.working_set(m.working_set_max, 2, 2048), 2600);
  EXPECT_DOUBLE_EQ(m.working_set(m.working_set_max, 4, 2048), 2048 + 3 * 552);  // 552 new ids per query token
  EXPECT_DOUBLE_EQ(m.working_set(m.working_set_max, 1, 2048), 2048);
  EXPECT_DOUBLE_EQ(m.min_slots(2, 2048, 32768), std::ceil(2600 * 1.1));
  EXPECT_DOUBLE_EQ(m.min_slots(4, 2048, 32768), std::ceil((2048 + 3 * 552) * 1.1));
  EXPECT_DOUBLE_EQ(m.min_slots(2, 2048, 2500), 2500);  // capped at the context
  m.floor_margin = 1.0;
  EXPECT_DOUBLE_EQ(m.min_slots(2, 2048, 32768), 4096);  // capped at T x K
  m.floor_margin = 0;
  m.pool_floor = "p99";
  EXPECT_DOUBLE_EQ(m.min_slots(2, 2048, 32768), 2500);
  m.pool_floor = "tk";
  EXPECT_DOUBLE_EQ(m.min_slots(2, 2048, 32768), 4096);
  EXPECT_NE(m.floor_rule(2, 2048, 32768).find("T x top-k"), std::string::npos);
  // One query token: its top-k, whatever was measured at another T.
  EXPECT_EQ(m.floor_rule(1, 2048, 32768), "T = 1: one query token's top-2048");
  EXPECT_EQ(m.floor_rule(1, 2048, 1000), "T = 1: one query token's top-2048, capped at the context");
  // Splits: none at or above the max, a 1% bound down to the p99, every step below it.
  EXPECT_EQ(m.split_bound(2600, 2, 2048, 32768), 0);
  EXPECT_EQ(m.split_bound(2550, 2, 2048, 32768), 0.01);
  EXPECT_EQ(m.split_bound(2400, 2, 2048, 32768), 1);
  EXPECT_EQ(m.split_bound(4096, 2, 2048, 32768), 0);
  // Nothing measured: the floor is T x K and any smaller pool may split.
  const MissModel none;
  EXPECT_DOUBLE_EQ(none.min_slots(4, 2048, 32768), 8192);
  EXPECT_EQ(none.split_bound(8000, 4, 2048, 32768), 1);
  MissModel bad = m;
  bad.pool_floor = "p50";
  EXPECT_THROW(bad.validate("test"), Error);
  bad = m;
  bad.floor_margin = -0.1;
  EXPECT_THROW(bad.validate("test"), Error);
  std::remove(path.c_str());
}

// Without a miss profile the floor comes from the MTP working set stored with the shipped
// generator profile (measured once from its locality model), carried to T as a profile's is;
// --pool-floor tk keeps T x K.
TEST(sim_inputs, BuiltInWorkingSetSetsTheDefaultPoolFloor) {
  const trace::GeneratorProfile shipped = trace::GeneratorProfile::shipped_default();
  ASSERT_FALSE(shipped.mtp_working_set.empty());
  Inputs in;
  for (const std::int64_t context : {32768LL, 131072LL}) {
    const MissModel m = in.load_misses(context);
    const trace::GeneratorProfile::WorkingSet* w = nullptr;
    for (const auto& x : shipped.mtp_working_set) {
      if (x.context == context) w = &x;
    }
    ASSERT_NE(w, nullptr) << context;
    EXPECT_EQ(m.working_set_max, w->max);
    EXPECT_EQ(m.working_set_p99, w->p99);
    EXPECT_DOUBLE_EQ(m.min_slots(4, 2048, double(context)),
                     std::ceil((2048 + 3 * (w->max - 2048)) * 1.1));  // carried to T = 4
    EXPECT_LT(m.min_slots(4, 2048, double(context)), 8192);
    EXPECT_NE(m.floor_rule(4, 2048, double(context)).find("built-in locality model"), std::string::npos);
    EXPECT_NE(m.floor_rule(4, 2048, double(context)).find("carried to T = 4"), std::string::npos);
  }
  in.pool_floor = "tk";
  EXPECT_DOUBLE_EQ(in.load_misses(32768).min_slots(4, 2048, 32768), 8192);
  // The measured entries are refused when they cannot be a working set of `mtp` x top-k.
  nlohmann::json j = nlohmann::json::parse(R"({"drift": [0.1], "mtp_working_set": {"how": "x", "measured": [
      {"context": 32768, "mtp": 2, "p99": 2500, "max": 5000}]}})");
  EXPECT_THROW(trace::GeneratorProfile::from_json(j, "test"), Error);
  j["mtp_working_set"]["measured"][0]["max"] = 2600;
  j["mtp_working_set"]["measured"][0]["extra"] = 1;
  EXPECT_THROW(trace::GeneratorProfile::from_json(j, "test"), Error);
  j["mtp_working_set"]["measured"][0].erase("extra");
  EXPECT_EQ(trace::GeneratorProfile::from_json(j, "test").mtp_working_set.size(), 1u);
}

}  // namespace
}  // namespace ess::sim
