#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>

#include "ess/core/error.h"
#include "ess/sim/op_names.h"
#include "ess/sim/step_model.h"
#include "ess/sim/timeline.h"
#include "sim/sim_test_util.h"
#include "testing/testing.h"

namespace ess::sim {
namespace {

using testing::dsv32;
using testing::paper_dep;
using testing::paper_hw;

Workload at(int batch, OverlapMode mode, double misses = 200) {
  Workload w;
  w.batch = batch;
  w.overlap = mode;
  w.misses.reference_misses = misses;
  return w;
}

// DA splits the attention in two (Attn0 + Attn1 + merge: three more kernels). Once the copy
// is longer than that split costs, DA is never slower than None; with no misses they coincide.
// (With Two-Batch Overlap the other micro-batch's stages already run under None's copy.)
Deployment without_tbo() {
  Deployment d = paper_dep();
  d.two_batch_overlap = false;
  return d;
}

TEST(sim_step, DualAttentionIsNeverSlowerThanNone) {
  const StepModel sm(dsv32(), paper_hw(), without_tbo());
  for (int b : {32, 64, 128, 160}) {
    for (double m : {0.0, 200.0, 800.0, 3000.0}) {
      Workload none_w = at(b, OverlapMode::kNone, m), da_w = at(b, OverlapMode::kDualAttention, m);
      none_w.slots = da_w.slots = 6554;  // the miss model's reference pool: m misses per request-layer
      const StepResult none = sm.run(none_w);
      const StepResult da = sm.run(da_w);
      EXPECT_LE(da.step_us, none.step_us * (1 + 1e-12)) << "batch " << b << " misses " << m;
      EXPECT_LE(da.exposed_transfer_us, none.exposed_transfer_us + 1e-9);
    }
  }
}

// With almost no misses the split still costs three launches, the merge's pass over the partial
// outputs and Attn1's query / output traffic (about 16 + 12 us at 160 tokens): bounded per block.
TEST(sim_step, DualAttentionSplitHasABoundedCostWhenMissesAreFew) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  const StepResult none = sm.run(at(160, OverlapMode::kNone, 1));
  const StepResult da = sm.run(at(160, OverlapMode::kDualAttention, 1));
  EXPECT_DOUBLE_EQ(da.exposed_transfer_us, 0.0);
  EXPECT_GT(da.step_us, none.step_us);  // the split is not free
  // 120 attention blocks: 3 dense layers (whole batch), 58 MoE layers x 2 micro-batches, the draft.
  EXPECT_LT(da.step_us, none.step_us + 120 * (3 * paper_hw().kernel_launch_us + 40));
}

TEST(sim_step, TransferThatFitsUnderAttn0IsFullyHidden) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  // ~20 misses per request-layer: a few us of H2D per layer, far under PreAttn + Attn0.
  const StepResult da = sm.run(at(128, OverlapMode::kDualAttention, 20));
  EXPECT_GT(da.h2d_bytes, 0);
  EXPECT_DOUBLE_EQ(da.exposed_transfer_us, 0.0);
  const StepResult none = StepModel(dsv32(), paper_hw(), without_tbo()).run(at(128, OverlapMode::kNone, 20));
  EXPECT_GT(none.exposed_transfer_us, 0.0);  // serial: every copy is exposed
  EXPECT_NEAR(none.exposed_transfer_us, none.h2d_us, 1e-6 * none.h2d_us);
}

// SGLang computes q (PreAttn) before the indexer: under DA / DBA it no longer hides the copy, so
// more of it is exposed, never less; None, which runs PreAttn first anyway, is unchanged.
TEST(sim_step, PreAttnBeforeTheIndexerExposesMoreOfTheCopy) {
  Deployment sglang = without_tbo();
  sglang.preattn_in_copy_window = false;
  const StepModel paper(dsv32(), paper_hw(), without_tbo()), engine(dsv32(), paper_hw(), sglang);
  for (OverlapMode mode : {OverlapMode::kDualAttention, OverlapMode::kDualBatchAttention}) {
    for (double m : {200.0, 800.0, 3000.0}) {
      const StepResult in_window = paper.run(at(128, mode, m)), before = engine.run(at(128, mode, m));
      EXPECT_GE(before.exposed_transfer_us, in_window.exposed_transfer_us) << to_string(mode) << " " << m;
      EXPECT_GE(before.step_us, in_window.step_us * (1 - 1e-12)) << to_string(mode) << " " << m;
    }
    const StepResult in_window = paper.run(at(128, mode, 3000)), before = engine.run(at(128, mode, 3000));
    EXPECT_GT(before.exposed_transfer_us, in_window.exposed_transfer_us) << to_string(mode);  // the window shrank
  }
  EXPECT_DOUBLE_EQ(engine.run(at(128, OverlapMode::kNone, 800)).step_us,
                   paper.run(at(128, OverlapMode::kNone, 800)).step_us);
}

// The one description of the attention block the simulator and the rig follow (and the SGLang
// adapter's order): None serial; DA splits attention around the copy; DBA also splits the indexer,
// but only a batch of two or more (one request runs as DA, as the rig and the adapter run it);
// PreAttn first unless it sits in the copy window.
TEST(sim_step, AttentionScheduleIsWhatEveryRunnerFollows) {
  const AttentionSchedule none = attention_schedule(OverlapMode::kNone, true, 8, true);
  EXPECT_TRUE(none.preattn_first);
  EXPECT_EQ(none.indexer_parts, 1);
  EXPECT_FALSE(none.split_attention);
  const AttentionSchedule da = attention_schedule(OverlapMode::kDualAttention, true, 8, true);
  EXPECT_FALSE(da.preattn_first);
  EXPECT_EQ(da.indexer_parts, 1);
  EXPECT_TRUE(da.split_attention);
  EXPECT_EQ(attention_schedule(OverlapMode::kDualBatchAttention, true, 8, true).indexer_parts, 2);
  EXPECT_EQ(attention_schedule(OverlapMode::kDualBatchAttention, true, 1, true).indexer_parts, 1);
  EXPECT_TRUE(attention_schedule(OverlapMode::kDualBatchAttention, true, 8, false).preattn_first);
  EXPECT_FALSE(attention_schedule(OverlapMode::kDualBatchAttention, false, 8, true).split_attention);  // no copy
  EXPECT_THROW(attention_schedule(OverlapMode::kLayerWise, true, 8, true), Error);
  // In the step model: DBA over one request per micro-batch is DA.
  const StepModel sm(dsv32(), paper_hw(), without_tbo());
  EXPECT_DOUBLE_EQ(sm.run(at(1, OverlapMode::kDualBatchAttention, 800)).step_us,
                   sm.run(at(1, OverlapMode::kDualAttention, 800)).step_us);
}

TEST(sim_step, LayerWiseIsAtLeastAsGoodAsEitherMode) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  for (double m : {20.0, 200.0, 1500.0}) {
    const StepResult da = sm.run(at(160, OverlapMode::kDualAttention, m));
    const StepResult dba = sm.run(at(160, OverlapMode::kDualBatchAttention, m));
    const StepResult lw = sm.run(at(160, OverlapMode::kLayerWise, m));
    EXPECT_LE(lw.step_us, std::min(da.step_us, dba.step_us) * 1.005) << m;
    // 3 dense layers (the whole batch), 58 MoE layers x 2 micro-batches, the draft-extend pass.
    EXPECT_EQ(lw.layers_da + lw.layers_dba, 3 + 2 * 58 + 1);
  }
  // An explicit threshold: 0 sends every layer to DBA, a huge one to DA.
  Workload w = at(160, OverlapMode::kLayerWise);
  w.layerwise_threshold = 0;
  EXPECT_EQ(sm.run(w).layers_da, 0);
  w.layerwise_threshold = 1e12;
  EXPECT_EQ(sm.run(w).layers_dba, 0);
}

TEST(sim_step, ThroughputAndOtpsFollowFromTheStep) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  const StepResult r = sm.run(at(96, OverlapMode::kLayerWise));
  EXPECT_DOUBLE_EQ(r.otps, 1.7 / (r.step_us * 1e-6));
  EXPECT_DOUBLE_EQ(r.throughput_tokens_per_s, 96 * 8 * 1.7 / (r.step_us * 1e-6));
  EXPECT_NEAR(r.step_us, r.compute_us + r.exposed_comm_us + r.exposed_transfer_us + r.step_overhead_us,
              1e-6 * r.step_us);
  // The host's time: its fixed part and its part per request of the batch.
  EXPECT_DOUBLE_EQ(r.step_overhead_us, paper_hw().step_overhead_us + 96 * paper_hw().step_overhead_per_request_us);
  EXPECT_GT(paper_hw().step_overhead_per_request_us, 0);
  EXPECT_NEAR(r.launch_us, r.kernels * paper_hw().kernel_launch_us, 1e-9 * r.launch_us);
  EXPECT_NEAR(r.compute_us, r.attention_us + r.moe_us + r.other_us + r.mtp_draft_us, 1e-6 * r.compute_us);
}

TEST(sim_step, BaselineMovesNoBytes) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  Workload w = at(0, OverlapMode::kLayerWise);
  w.offload = false;
  const StepResult r = sm.run(w);
  EXPECT_EQ(r.slots, 32768);
  EXPECT_EQ(r.h2d_bytes, 0);
  EXPECT_EQ(r.d2h_bytes, 0);
  EXPECT_EQ(r.exposed_transfer_us, 0);
  EXPECT_GE(r.batch, 1);
  w.batch = r.batch + 1;
  EXPECT_THROW(sm.run(w), Error);  // one more request hits the memory wall
}

// Residency adaptive at a fixed pool (ratio 0.2): while the cache memory holds every request whole
// the step is the all-on-GPU one up to the write-back's own stream (no misses, no swap, no H2D);
// past that the whole requests are fewer as the batch grows, and the misses the sparse ones' share.
TEST(sim_step, AdaptiveResidencyCostsNothingWhileEverythingFits) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  for (const int batch : {1, 2, 8}) {
    Workload w = at(batch, OverlapMode::kLayerWise);
    w.ratio = 0.2;
    w.residency = Residency::kAdaptive;
    const StepResult whole = sm.run(w);
    EXPECT_EQ(whole.whole_requests, batch);
    EXPECT_EQ(whole.misses_per_request_layer, 0);
    EXPECT_EQ(whole.h2d_bytes, 0);
    Workload base = at(batch, OverlapMode::kLayerWise);
    base.offload = false;
    const StepResult resident = sm.run(base);
    EXPECT_NEAR(whole.step_us, resident.step_us, 0.005 * resident.step_us) << "batch " << batch;
    w.residency = Residency::kSparse;
    EXPECT_GT(sm.run(w).step_us, whole.step_us) << "batch " << batch;
  }
  Workload w = at(0, OverlapMode::kLayerWise);
  w.ratio = 0.2;
  w.residency = Residency::kAdaptive;
  const StepResult most = sm.run(w);  // the largest batch: no room for a whole request
  EXPECT_EQ(most.whole_requests, 0);
  // Every request whole up to some batch; past it, fewer whole ones the larger the batch, more misses.
  int last = -1;
  double last_misses = -1;
  for (int batch = 8; batch <= most.batch; batch += 8) {
    w.batch = batch;
    const StepResult r = sm.run(w);
    if (r.whole_requests == batch) {
      EXPECT_EQ(last_misses, -1) << "batch " << batch << ": every request whole after a batch that was not";
      continue;
    }
    if (last >= 0) {
      EXPECT_LE(r.whole_requests, last) << "batch " << batch;
      EXPECT_GT(r.misses_per_request_layer, last_misses) << "batch " << batch;
    }
    last = r.whole_requests;
    last_misses = r.misses_per_request_layer;
  }
  EXPECT_GE(last, 0) << "no batch was past the room for every request";
  w.residency = Residency::kWhole;
  EXPECT_THROW(sm.run(w), Error);
}

TEST(sim_step, MoreMissesNeverMakeAStepFaster) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  double prev = 0;
  for (double m : {0.0, 100.0, 400.0, 1600.0, 4096.0}) {
    const double t = sm.run(at(160, OverlapMode::kLayerWise, m)).step_us;
    EXPECT_GE(t, prev * (1 - 1e-12)) << m;
    prev = t;
  }
}

// Misses beyond what T query tokens select are impossible: refused at the reference point; at a
// pool far below it the model's value is capped, and the cap is reported with the misses shown.
TEST(sim_step, MissesBeyondTheSelectionAreRefusedOrCapped) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  EXPECT_NE(test::error_of([&] { (void)sm.run(at(16, OverlapMode::kDualAttention, 6400)); }).find("exceed"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { (void)sm.run(at(16, OverlapMode::kDualAttention, 1e300)); }).find("exceed"),
            std::string::npos);
  Workload w = at(16, OverlapMode::kDualAttention, 4000);
  w.slots = 4096;  // the smallest pool of a step: the model gives ~7000 misses there
  const StepResult r = sm.run(w);
  EXPECT_GT(r.miss_capped_layers, 0);
  EXPECT_LE(r.misses_per_request_layer, 2.0 * 2048);
  w.slots = 8192;
  EXPECT_EQ(sm.run(w).miss_capped_layers, 0);
  Workload shaped = at(16, OverlapMode::kDualAttention);
  shaped.misses.layer_shape = {1.0, 1.0, 1.0};  // a profile of another layer count
  EXPECT_NE(test::error_of([&] { (void)sm.run(shaped); }).find("3 per-layer values for a model of 61 layers"),
            std::string::npos);
  shaped.misses.layer_shape.clear();
  shaped.misses.profile_topk = 1024;  // measured at another top-k
  EXPECT_NE(test::error_of([&] { (void)sm.run(shaped); }).find("top-1024"), std::string::npos);
}

// MTP 4 with a measured working set: a pool below T x K (the paper's ratio 0.21 of 32K) is
// accepted; below the working set's max the query groups are charged, never making a step
// faster; the floor itself is refused below it.
TEST(sim_step, PoolsBelowTxKFollowTheMeasuredWorkingSet) {
  Deployment dep = paper_dep();
  dep.mtp_tokens = 4;
  dep.accept_ratio = 1.7;
  const StepModel sm(dsv32(), paper_hw(), dep);
  Workload w = at(64, OverlapMode::kLayerWise);
  w.slots = 6882;  // 0.21 x 32768, below T x K = 8192
  EXPECT_THROW(sm.run(w), Error);  // nothing measured: the floor is T x K
  w.misses.reference_tokens = 4;  // the working set measured at T = 4
  w.misses.working_set_p99 = 3500;
  w.misses.working_set_max = 3700;
  const StepResult fits = sm.run(w);
  EXPECT_EQ(fits.slots, 6882);
  EXPECT_EQ(fits.split_calls_per_layer, 0);
  // The same pool against a larger measured working set: steps split and cost more.
  Workload split = w;
  split.misses.pool_floor = "p99";
  split.misses.floor_margin = 0;
  split.misses.working_set_p99 = 6800;
  split.misses.working_set_max = 7000;
  const StepResult r = sm.run(split);
  EXPECT_GT(r.split_calls_per_layer, 0);
  EXPECT_GT(r.step_us, fits.step_us);
  split.slots = 6700;  // below the p99 floor
  EXPECT_THROW(sm.run(split), Error);
  // One query token per group at 4000 slots (< 2 x 2048): up to 4 groups, 3 extra calls,
  // for the 1 % of request-layer-steps above the p99, at most over the dense layers' whole batch
  // of 64 requests (the MoE layers run two micro-batches of 32).
  Workload one = w;
  one.slots = 4000;
  one.misses.pool_floor = "p99";
  one.misses.floor_margin = 0;
  one.misses.working_set_p99 = 3900;
  one.misses.working_set_max = 4100;
  EXPECT_NEAR(sm.run(one).split_calls_per_layer, (1 - std::pow(0.99, 64)) * 3, 1e-12);
  // The executor rig runs steps whole: a pool below T x K is refused there.
  Deployment rig = dep;
  rig.rig_layers = 2;
  const StepModel rig_sm(dsv32(), paper_hw(), rig);
  Workload r8 = at(8, OverlapMode::kLayerWise);
  r8.slots = 6882;
  EXPECT_NE(test::error_of([&] { (void)rig_sm.run(r8); }).find("the executor rig runs steps whole"), std::string::npos);
}

TEST(sim_step, MtpDraftsAreCharged) {
  Deployment d1 = paper_dep();
  d1.mtp_tokens = 1;
  d1.accept_ratio = 1;
  Deployment d3 = paper_dep();
  d3.mtp_tokens = 3;
  d3.accept_ratio = 2.2;
  const StepResult r1 = StepModel(dsv32(), paper_hw(), d1).run(at(64, OverlapMode::kLayerWise));
  const StepResult r2 = StepModel(dsv32(), paper_hw(), paper_dep()).run(at(64, OverlapMode::kLayerWise));
  const StepResult r3 = StepModel(dsv32(), paper_hw(), d3).run(at(64, OverlapMode::kLayerWise));
  EXPECT_EQ(r1.mtp_draft_us, 0);
  EXPECT_GT(r2.mtp_draft_us, 0);
  EXPECT_GT(r3.mtp_draft_us, 1.5 * r2.mtp_draft_us);
  EXPECT_LT(r1.step_us, r2.step_us);
  EXPECT_LT(r2.step_us, r3.step_us);
}

TEST(sim_step, TwoBatchOverlapHidesCommunication) {
  Deployment no_tbo = paper_dep();
  no_tbo.two_batch_overlap = false;
  const StepResult on = StepModel(dsv32(), paper_hw(), paper_dep()).run(at(128, OverlapMode::kLayerWise));
  const StepResult off = StepModel(dsv32(), paper_hw(), no_tbo).run(at(128, OverlapMode::kLayerWise));
  EXPECT_LT(on.exposed_comm_us, off.exposed_comm_us);
  EXPECT_GT(off.exposed_comm_us, 0.8 * off.comm_us);  // serial: most of it exposed (shared expert overlaps dispatch)
  // Both micro-batches' attention is booked as attention: the same work as without TBO (its
  // ops run at half the tokens, so a little more launch overhead), never half of it.
  EXPECT_GT(on.attention_us, 0.95 * off.attention_us);
  // Each micro-batch streams the experts' weights again: at most twice the MoE time.
  EXPECT_LT(on.moe_us, 2.0 * off.moe_us);
}

TEST(sim_step, LongerContextCostsIndexerTimeAndBatch) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  Workload w = at(32, OverlapMode::kLayerWise);
  const StepResult r32 = sm.run(w);
  w.context = 131072;
  const StepResult r128 = sm.run(w);
  EXPECT_GT(r128.attention_us, r32.attention_us);
  Workload base;
  base.offload = false;
  base.context = 131072;
  const StepResult wall = sm.run(base);
  EXPECT_LT(wall.batch, 20);
}

TEST(sim_step, TimelineHasOneTrackPerStreamAndFitsTheStep) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  Timeline tl;
  const StepResult r = sm.run(at(160, OverlapMode::kDualBatchAttention), &tl);
  bool seen[4] = {false, false, false, false};
  for (const auto& e : tl.events) {
    seen[static_cast<int>(e.stream)] = true;
    EXPECT_GE(e.start_us, 0);
    EXPECT_LE(e.start_us + e.dur_us, r.step_us * (1 + 1e-9)) << e.name;
  }
  for (bool s : seen) EXPECT_TRUE(s);
  const nlohmann::json j = tl.to_chrome_trace("t");
  ASSERT_TRUE(j.contains("traceEvents"));
  EXPECT_GT(j["traceEvents"].size(), tl.events.size());  // + track names
  // Recording changes nothing.
  EXPECT_DOUBLE_EQ(sm.run(at(160, OverlapMode::kDualBatchAttention)).step_us, r.step_us);
}

TEST(sim_step, InvalidWorkloadsAreClearErrors) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  Workload w;
  w.batch = 64;
  w.ratio = 1.5;
  EXPECT_THROW(sm.run(w), Error);
  w.ratio = -0.1;
  EXPECT_THROW(sm.run(w), Error);
  w.ratio = 0;
  w.context = -5;
  EXPECT_THROW(sm.run(w), Error);
  w.context = 32768;
  w.batch = -1;
  EXPECT_THROW(sm.run(w), Error);
  w.batch = 64;
  w.slots = 40000;  // more than the context
  EXPECT_THROW(sm.run(w), Error);
  w.slots = 0;
  w.batch = 1000;  // cannot fit at any ratio
  EXPECT_THROW(sm.run(w), Error);
  w.batch = 160;
  w.ratio = 0.5;  // fits in principle, not at this ratio
  try {
    sm.run(w);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot fit"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_overlap_mode("fast"), Error);
}

}  // namespace
}  // namespace ess::sim

namespace ess::sim {
namespace {

Deployment rig(int layers) {
  Deployment d;
  d.name = "rig";
  d.nodes = 1;
  d.gpus_per_node = 1;
  d.expert_parallel = 32;
  d.attention_data_parallel = 1;
  d.mtp_tokens = 2;
  d.accept_ratio = 1.0;
  d.two_batch_overlap = false;
  d.rig_layers = layers;
  return d;
}

// The executor rig (`ess bench step`): EP is emulated on one GPU, so it is valid only there.
TEST(sim_rig, EmulatedExpertParallelismIsOnlyValidOnTheRig) {
  Deployment d = rig(4);
  EXPECT_EQ(test::error_of([&] { d.validate("rig"); }), "no error");
  d.rig_layers = 0;
  EXPECT_NE(test::error_of([&] { d.validate("rig"); }).find("expert_parallel = 32"), std::string::npos);
  d.rig_layers = -1;
  EXPECT_NE(test::error_of([&] { d.validate("rig"); }).find("rig_layers = -1"), std::string::npos);
}

// Deployments that cannot exist, or that the simulator does not model, are refused by name.
TEST(sim_deployment, ImpossibleConfigurationsAreRefused) {
  auto refused = [](auto change, const char* word) {
    Deployment d = paper_dep();
    change(d);
    const std::string m = test::error_of([&] { d.validate("dep"); });
    EXPECT_NE(m.find(word), std::string::npos) << m;
  };
  refused([](Deployment& d) { d.nodes = 65537; d.gpus_per_node = 65537; }, "nodes = 65537");
  refused([](Deployment& d) { d.gpus_per_node = 65; }, "gpus_per_node = 65");
  refused([](Deployment& d) { d.expert_parallel = 7; }, "does not divide the 32 GPUs");
  refused([](Deployment& d) { d.attention_data_parallel = 8; }, "attention_data_parallel = 8");
  Deployment big = paper_dep();
  big.nodes = 64;
  big.expert_parallel = 512;
  big.attention_data_parallel = 512;
  EXPECT_NE(test::error_of([&] { StepModel(dsv32(), paper_hw(), big); }).find("exceeds the model's 256 routed experts"),
            std::string::npos);
}

TEST(sim_rig, StepIsItsLayersWithoutCommunicationOrLmHead) {
  const StepModel four(testing::dsv32(), testing::paper_hw(), rig(4));
  const StepModel eight(testing::dsv32(), testing::paper_hw(), rig(8));
  Workload w;
  w.batch = 64;
  w.slots = 6554;
  w.overlap = OverlapMode::kDualAttention;
  const StepResult a = four.run(w);
  const StepResult b = eight.run(w);
  EXPECT_EQ(a.comm_us, 0.0);
  EXPECT_EQ(a.exposed_comm_us, 0.0);
  EXPECT_EQ(a.mtp_draft_us, 0.0);
  // Uniform misses: eight layers take twice four layers' time.
  EXPECT_NEAR(b.step_us, 2 * a.step_us, 1e-6 * a.step_us);
  // Compute is attention + MoE only (no dense layers, no LM head).
  EXPECT_NEAR(a.compute_us, a.attention_us + a.moe_us, 1e-9 * a.compute_us);
  EXPECT_EQ(a.other_us, 0.0);
  // The rig holds only its own layers: a batch the whole model could never hold still runs,
  // up to what its layers' caches take on the one GPU.
  w.batch = 500;
  w.offload = false;
  w.slots = 0;
  EXPECT_GT(four.run(w).step_us, 0.0);
  w.batch = 2000;
  EXPECT_NE(test::error_of([&] { four.run(w); }).find("cannot hold batch 2000"), std::string::npos);
  w.batch = 0;
  EXPECT_NE(test::error_of([&] { four.run(w); }).find("explicit batch"), std::string::npos);
}

// The swap engine's op has no analytical launch cost (the paper calibration is unchanged)
// but takes a measured table's time when there is one.
TEST(sim_rig, SwapOpTakesItsMeasuredTime) {
  const MeasuredTables t = MeasuredTables::from_csv_text("op,context,tokens,time_us\nswap.lru+split,0,1,100\nswap.lru+split,0,1000,100\n", "test");
  Workload w;
  w.batch = 64;
  w.slots = 6554;
  w.overlap = OverlapMode::kNone;
  const StepResult plain = StepModel(testing::dsv32(), testing::paper_hw(), rig(2)).run(w);
  const StepResult measured = StepModel(testing::dsv32(), testing::paper_hw(), rig(2), &t).run(w);
  EXPECT_EQ(measured.ops_measured, 2);  // one per layer
  EXPECT_GT(measured.step_us - plain.step_us, 2 * 100 - 2 * 10.0);
}

// A model without shared experts (n_shared_experts 0) runs no shared-expert GEMM; one with them runs one per MoE
// layer and micro-batch.
TEST(sim_step, NoSharedExpertRunsNone) {
  auto shared_ops = [](const ModelSpec& m) {
    Workload w;
    w.batch = 64;
    w.overlap = OverlapMode::kNone;
    Timeline tl;
    StepModel(m, paper_hw(), paper_dep()).run(w, &tl);
    int n = 0;
    for (const TimelineEvent& e : tl.events) n += e.name.find(op::kSharedExpert) != std::string::npos ? 1 : 0;
    return n;
  };
  EXPECT_GT(shared_ops(dsv32()), 0);
  nlohmann::json j = dsv32().to_json();
  j["n_shared_experts"] = 0;
  EXPECT_EQ(shared_ops(ModelSpec::from_json(j, "no shared experts")), 0);
}

}  // namespace
}  // namespace ess::sim
