// The simulator's model of an executor run: with an op table covering the executor's ops,
// every op of the rig's step is priced from the table (same names on both sides), and the
// step is their sum where nothing overlaps.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "ess/sim/op_names.h"
#include "harness/rig/predict.h"

namespace ess::rig {
namespace {

// Every profiled op at 10 us flat over tokens [1, 100000] (indexer and attention rows at
// the run's context, as `ess bench profile` writes them).
sim::MeasuredTables flat_table(std::int64_t context) {
  std::string csv = "op,context,tokens,time_us\n";
  auto add = [&](std::string_view op, std::int64_t ctx) {
    csv += fmt::format("{},{},1,10\n{},{},100000,10\n", op, ctx, op, ctx);
  };
  for (const GemmOp g : kAllGemmOps) add(op_name(g), 0);
  add(op::kIndexerLogits, context);
  add(op::kIndexerTopk, context);
  add(op::kSparseMla, context);
  add(op::kSwap, 0);
  add(op::kMerge, 0);
  return sim::MeasuredTables::from_csv_text(csv, "flat");
}

ExecutorReport report(bool offload, int layers, std::vector<double> misses) {
  ExecutorReport r;
  r.batch = 32;
  r.layers = layers;
  r.mtp = 2;
  r.topk = 2048;
  r.context = 32768;
  r.offload = offload;
  r.slots = offload ? 6554 : 32768;
  r.misses = std::move(misses);
  return r;
}

TEST(pipeline_predict, ResidentStepIsItsTwelveTabledOpsPerLayer) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const sim::HardwareProfile hw = sim::HardwareProfile::shipped("h100");
  ExecutorConfig c;
  c.offload = false;
  const sim::StepResult s = predict_step(m, hw, flat_table(32768), c, report(false, 4, {}));
  // proj0, q_b, absorb, wq_b, logits, top-k, sparse MLA, out bmm, o_proj, gate, shared, experts
  // = 12 ops of the table per layer, nothing else.
  EXPECT_EQ(s.ops_measured, 4 * 12);
  EXPECT_EQ(s.ops_analytical + s.ops_outside_grid, 0);
  EXPECT_NEAR(s.step_us, 4 * 12 * 10.0, 1e-9);
}

TEST(pipeline_predict, OffloadedStepAddsTheSwapAndTheExposedCopy) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const sim::HardwareProfile hw = sim::HardwareProfile::shipped("h100");
  ExecutorConfig c;
  c.overlap = OverlapMode::kNone;
  const ExecutorReport r = report(true, 2, {400, 100});
  const sim::StepResult s = predict_step(m, hw, flat_table(32768), c, r);
  // The table prices 13 ops per layer (the 12 above + the swap); the copies are analytical.
  EXPECT_EQ(s.ops_measured, 2 * 13);
  // None waits for the whole copy: batch x misses x 656 B at the profile's H2D rate.
  double copy = 0;
  for (const double m_l : r.misses) copy += 32 * m_l * 656 / (hw.h2d_scattered_gbps * 1e3) + hw.transfer_launch_us;
  // The new tokens' write-back (analytical) holds FlashTrans's SMs beside the next ops: what
  // that slows is reported, and it is small.
  EXPECT_GT(s.transfer_sm_us, 0);
  EXPECT_LT(s.transfer_sm_us, 0.05 * s.step_us);
  EXPECT_NEAR(s.step_us, 2 * 13 * 10.0 + copy + s.transfer_sm_us, 1e-6);
  // The measured per-layer misses reach the model layer by layer.
  EXPECT_NEAR(s.misses_per_request_layer, 250, 1e-9);
  // DA: Attn0 / Attn1 are not in the table (they read fewer entries): priced analytically.
  c.overlap = OverlapMode::kDualAttention;
  const sim::StepResult da = predict_step(m, hw, flat_table(32768), c, r);
  EXPECT_GT(da.ops_analytical, 0);
  EXPECT_LT(da.exposed_transfer_us, s.exposed_transfer_us);
}

TEST(pipeline_predict, LayerWiseThresholdIsPerRequest) {
  ExecutorConfig c;
  c.overlap = OverlapMode::kLayerWise;
  c.layerwise_threshold = 150;
  const sim::Workload w = rig_workload(c, report(true, 2, {400, 100}));
  EXPECT_DOUBLE_EQ(w.layerwise_threshold, 150.0 * 32);  // the sim compares misses of the whole micro-batch
  const sim::Deployment d = rig_deployment(c, report(true, 2, {400, 100}));
  EXPECT_EQ(d.rig_layers, 2);
  EXPECT_FALSE(d.two_batch_overlap);
  EXPECT_TRUE(d.preattn_in_copy_window);
}

TEST(pipeline_predict, PreAttnPlacementIsTheRigs) {
  ExecutorConfig c;
  c.preattn_in_copy_window = false;  // ess bench step --preattn-before-indexer: as SGLang runs it
  EXPECT_FALSE(rig_deployment(c, report(true, 2, {400, 100})).preattn_in_copy_window);
}

}  // namespace
}  // namespace ess::rig
