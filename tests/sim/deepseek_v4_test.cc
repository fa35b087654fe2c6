// DeepSeek-V4 in the simulator: its C4 cache offloaded in entries of 4 tokens, one query token per
// step, the rest of its caches resident; what it cannot run is refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>

#include "ess/core/error.h"
#include "ess/model/model_spec.h"
#include "ess/sim/inputs.h"
#include "ess/sim/report.h"
#include "ess/sim/memory_model.h"
#include "ess/sim/step_model.h"
#include "sim/sim_test_util.h"
#include "testing/testing.h"

namespace ess::sim {
namespace {

using ess::test::error_of;
using testing::paper_dep;
using testing::paper_hw;

const ModelSpec& v4() {
  static const ModelSpec m = testing::shipped_model("deepseek-v4-flash.json");
  return m;
}

Deployment t1() {
  Deployment d = paper_dep();
  d.mtp_tokens = 1;
  d.accept_ratio = 1;
  return d;
}

// The built-in locality model, calibrated in tokens at top-2048, carried to C4 entries at top-512:
// the same share of the selection missed at the same share of the context held (at ratio 0.2 and
// T 1, a quarter of DSA's 200 / 2). The misses travel in 584-byte entries, in the C4 layers only.
TEST(sim_deepseek_v4, TheC4LayersMissAShareOfTheirTopkAndCopyTheirEntries) {
  const StepModel sm(v4(), paper_hw(), t1());
  Workload w;
  w.batch = 64;
  w.ratio = 0.2;
  w.overlap = OverlapMode::kNone;
  const StepResult r = sm.run(w);
  EXPECT_EQ(r.slots, static_cast<std::int32_t>(std::ceil(0.2 * 8192)));
  EXPECT_NEAR(r.misses_per_request_layer, 200.0 / 4 / 2, 0.2);
  EXPECT_NEAR(r.h2d_bytes, 64 * 21 * r.misses_per_request_layer * 584, 1.0);
  // All on the GPU: no copies; the same batch is slower with offload by no more than its copies.
  w.offload = false;
  w.ratio = 0;
  const StepResult resident = sm.run(w);
  EXPECT_EQ(resident.h2d_bytes, 0);
  EXPECT_GE(r.step_us, resident.step_us);
}

TEST(sim_deepseek_v4, WhatItDoesNotRunIsRefusedByName) {
  Deployment t2 = t1();
  t2.mtp_tokens = 2;
  EXPECT_NE(error_of([&] { StepModel(v4(), paper_hw(), t2); }).find("refuses speculative decoding with DeepSeek-V4"),
            std::string::npos);
  Deployment rig = t1();
  rig.rig_layers = 4;
  EXPECT_NE(error_of([&] { StepModel(v4(), paper_hw(), rig); }).find("rig"), std::string::npos);
  const StepModel sm(v4(), paper_hw(), t1());
  Workload w;
  w.batch = 8;
  w.overlap = OverlapMode::kDualAttention;
  EXPECT_NE(error_of([&] { sm.run(w); }).find("overlap da"), std::string::npos);
  // A reference point in tokens (a DSA trace's profile, --misses) does not describe C4 entries.
  w.overlap = OverlapMode::kNone;
  w.misses.builtin = false;
  w.misses.profile_topk = 2048;
  EXPECT_NE(error_of([&] { sm.run(w); }).find("reference point given in tokens"), std::string::npos);
  w.misses.profile_topk = 512;
  w.misses.unit_tokens = 128;
  EXPECT_NE(error_of([&] { sm.run(w); }).find("units of 128 tokens"), std::string::npos);
  w.misses.unit_tokens = 4;  // a profile of its own C4 entries
  EXPECT_NO_THROW(sm.run(w));
}

// A miss profile of V4's own C4 entries (`ess trace gen --model`, `ess trace analyze --miss-profile`):
// its slots and misses count entries and its context is the entries of its tokens, so a step at the
// profile's own pool misses the profile's mean.
TEST(sim_deepseek_v4, AProfileOfItsOwnEntriesIsReadInEntries) {
  std::string path;
  double mean = 0;
  const nlohmann::json profile = testing::own_miss_profile(v4(), "v4_profile", path, mean);
  ASSERT_EQ(profile["unit_tokens"], 4);
  Workload w;
  w.batch = 16;
  w.slots = 1639;  // ceil(0.2 x 8192 entries)
  w.overlap = OverlapMode::kNone;
  w.misses = MissModel::load_profile(path, 32768, MissModel{});
  EXPECT_NEAR(StepModel(v4(), paper_hw(), t1()).run(w).misses_per_request_layer, mean, 1e-6 * mean);
  // A reference point in tokens given by hand (--misses) is refused rather than misread.
  w.misses = MissModel{};
  w.misses.reference_misses = 100;
  w.misses.builtin = false;
  EXPECT_NE(error_of([&] { StepModel(v4(), paper_hw(), t1()).run(w); }).find("reference point given in tokens"),
            std::string::npos);
  // A measured op table times DSA's ops: refused for V4.
  MeasuredTables tables = MeasuredTables::from_csv_text("op,context,tokens,time_us\nattn.sparse_mla,32768,64,5\n", "t.csv");
  EXPECT_NE(error_of([&] { StepModel(v4(), paper_hw(), t1(), &tables); }).find("--op-table"), std::string::npos);
}

// `ess plan` for DeepSeek-V4: T 1 without --mtp, overlap none only (said in its notes), no vLLM.
TEST(sim_deepseek_v4, ThePlanRunsOneTokenPerStepWithoutOverlap) {
  Inputs in;
  in.model = ESS_SOURCE_DIR "/configs/models/deepseek-v4-flash.json";
  in.hardware = "h200";
  EXPECT_EQ(in.load_deployment().mtp_tokens, 1);
  in.deployment = "paper-table1";  // the shipped deployment named: the same
  EXPECT_EQ(in.load_deployment().mtp_tokens, 1);
  in.deployment.clear();
  PlanOptions opt;
  opt.contexts = {32768};
  opt.engine = "sglang";
  const Plans plans = plan_contexts(in, opt);
  ASSERT_EQ(plans.results.size(), 1u);
  EXPECT_TRUE(plans.results[0].found);
  EXPECT_TRUE(plans.results[0].chosen.best.offload);
  EXPECT_EQ(plans.results[0].chosen.best.overlap, OverlapMode::kNone);
  EXPECT_TRUE(plans.launches[0].is_null());
  bool said = false;
  for (const std::string& note : plans.engine_notes) said = said || note.find("overlap none only") != std::string::npos;
  EXPECT_TRUE(said);
  opt.engine = "vllm";
  EXPECT_NE(error_of([&] { plan_contexts(in, opt); }).find("plan --engine vllm"), std::string::npos);
}

}  // namespace
}  // namespace ess::sim
