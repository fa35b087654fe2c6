#include <gtest/gtest.h>

#include "ess/core/error.h"
#include "ess/sim/memory_model.h"
#include "ess/sim/inputs.h"
#include "ess/sim/planner.h"
#include "sim/sim_test_util.h"

namespace ess::sim {
namespace {

using testing::dsv32;
using testing::paper_dep;
using testing::paper_hw;

PlanRequest request(double min_otps) {
  PlanRequest r;
  r.min_otps = min_otps;
  r.batch_step = 8;
  return r;
}

TEST(sim_plan, PicksTheHighestThroughputThatMeetsTheTarget) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  for (double target : {0.0, 15.0, 22.0}) {
    const PlanResult p = plan(sm, request(target));
    ASSERT_TRUE(p.found) << target;
    EXPECT_GE(p.chosen.best.otps, target);
    for (const auto& o : p.alternatives) {
      if (!o.found) continue;
      EXPECT_LE(o.best.throughput_tokens_per_s, p.chosen.best.throughput_tokens_per_s) << o.label;
      EXPECT_FALSE(o.why.empty()) << o.label;
    }
  }
  // With no latency target, offload wins (more batch than the memory wall allows).
  const PlanResult loose = plan(sm, request(0));
  EXPECT_TRUE(loose.chosen.best.offload);
  EXPECT_GT(loose.chosen.best.batch, 54);
}

// The chosen ESS configuration at low load: requests whole at its pool up to a batch (no more than
// the all-on-GPU step holds: a whole request takes at least its context), every request whole just
// below it and not all just above; batch 1 costs next to nothing whole, more with every request sparse.
TEST(sim_plan, TheChosenPoolAtLowLoadKeepsRequestsWhole) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  const PlanResult p = plan(sm, request(0));
  ASSERT_TRUE(p.found && p.chosen.best.offload);
  const LowLoad& l = p.low_load;
  ASSERT_TRUE(l.found);
  const MemoryModel mem(dsv32(), paper_hw(), paper_dep(), 32768);
  EXPECT_GE(l.all_whole_up_to, 1);
  EXPECT_LE(l.all_whole_up_to, mem.max_batch(32768.0));
  Workload w;
  w.slots = p.chosen.best.slots;
  w.overlap = p.chosen.best.overlap;
  w.residency = Residency::kAdaptive;
  w.batch = l.all_whole_up_to;
  EXPECT_EQ(sm.run(w).whole_requests, w.batch);
  w.batch = l.all_whole_up_to + 1;
  EXPECT_LT(sm.run(w).whole_requests, w.batch);
  EXPECT_GE(l.batch1_adaptive, 0.99);
  EXPECT_LE(l.batch1_adaptive, 1.0);
  EXPECT_LT(l.batch1_sparse, l.batch1_adaptive);
  // All-on-GPU chosen (a short context): nothing to say.
  PlanRequest short_context = request(15);
  short_context.context = 4096;
  const PlanResult q = plan(sm, short_context);
  ASSERT_TRUE(q.found);
  EXPECT_EQ(q.low_load.found, q.chosen.best.offload);
}

TEST(sim_plan, ImpossibleTargetFindsNothingAndSaysWhy) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  const PlanResult p = plan(sm, request(1000));
  EXPECT_FALSE(p.found);
  for (const auto& o : p.alternatives) EXPECT_NE(o.why.find("no batch meets"), std::string::npos) << o.why;
}

TEST(sim_plan, HostLimitsRefuseConfigurations) {
  HardwareProfile small_host = paper_hw();
  small_host.host_dram_gb = 600;  // 8 GPUs x batch x 1.33 GB: ~56 requests per GPU at most
  const StepModel sm(dsv32(), small_host, paper_dep());
  PlanRequest every_batch = request(0);
  every_batch.batch_step = 1;
  const PlanResult p = plan(sm, every_batch);
  ASSERT_FALSE(p.refusals.empty());
  EXPECT_NE(p.refusals.front().find("host DRAM"), std::string::npos) << p.refusals.front();
  // ESS's host pool stays within the DRAM left after the reserve (10 % by default), which is what
  // binds it; without the reserve it takes more.
  auto ess_best = [](const PlanResult& r) {
    const PlanOption* best = r.chosen.best.offload ? &r.chosen : nullptr;
    for (const auto& o : r.alternatives) {
      if (best == nullptr && o.found && o.best.offload) best = &o;
    }
    return best;
  };
  const PlanOption* e = ess_best(p);
  ASSERT_NE(e, nullptr);
  EXPECT_LE(e->best.host_pool_gb_per_node, 600 * 0.9);
  EXPECT_NE(e->limit.find("host DRAM: batch"), std::string::npos) << e->limit;
  EXPECT_NE(e->limit.find("more than the 540 GB it may use"), std::string::npos) << e->limit;
  HardwareProfile no_reserve = small_host;
  no_reserve.host_dram_reserve = 0;
  const PlanResult all = plan(StepModel(dsv32(), no_reserve, paper_dep()), every_batch);
  const PlanOption* f = nullptr;  // the same kind without the reserve
  for (const PlanOption* o : {&all.chosen}) {
    if (o->label == e->label) f = o;
  }
  for (const auto& o : all.alternatives) {
    if (o.label == e->label) f = &o;
  }
  ASSERT_TRUE(f != nullptr && f->found);
  EXPECT_GT(f->best.batch, e->best.batch);
  EXPECT_GT(f->best.host_pool_gb_per_node, e->best.host_pool_gb_per_node);
  EXPECT_LE(f->best.host_pool_gb_per_node, 600);

  HardwareProfile slow_host = paper_hw();
  slow_host.host_dram_bandwidth_gbps = 20;
  const PlanResult q = plan(StepModel(dsv32(), slow_host, paper_dep()), request(0));
  bool bandwidth = false;
  for (const auto& s : q.refusals) bandwidth = bandwidth || s.find("host-memory bandwidth") != std::string::npos;
  EXPECT_TRUE(bandwidth);
}

// A shared prompt prefix holds its host pages once per GPU: where host DRAM bounds the batch,
// sharing raises it, and the host pool is what the shares say.
TEST(sim_plan, SharedPrefixesLowerHostMemoryAndRaiseTheBatch) {
  HardwareProfile small_host = paper_hw();
  small_host.host_dram_gb = 600;
  const StepModel sm(dsv32(), small_host, paper_dep());
  PlanRequest r = request(0);
  const PlanResult none = plan(sm, r);
  r.prefix_share = 0.5;
  const PlanResult half = plan(sm, r);
  ASSERT_TRUE(none.found && half.found);
  EXPECT_GT(half.chosen.best.batch, none.chosen.best.batch);
  EXPECT_LE(half.chosen.best.host_pool_gb_per_node, 600);
  EXPECT_GT(half.chosen.best.host_pool_gb_per_node_unshared, 600);
  const MemoryModel mem(dsv32(), paper_hw(), paper_dep(), 32768);
  const double per_token = 8.0 * 62 * 656;  // 8 GPUs x 61 layers + the MTP layer x 656 B
  EXPECT_DOUBLE_EQ(mem.host_pool_bytes_per_node(10), 10 * 32768 * per_token);
  EXPECT_DOUBLE_EQ(mem.host_pool_bytes_per_node(10, 0.5), (16384 + 10 * 16384.0) * per_token);
  EXPECT_DOUBLE_EQ(mem.host_pool_bytes_per_node(10, 0.001), (0 + 10 * 32768.0) * per_token);  // no whole page
  EXPECT_THROW(mem.host_pool_bytes_per_node(10, 1.5), Error);
}

// Every option says what stops its best from a larger batch, with the numbers.
TEST(sim_plan, EveryOptionNamesItsBindingLimit) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  const PlanResult p = plan(sm, request(0));
  ASSERT_TRUE(p.found);
  bool gpu_memory = false;
  for (const auto& o : p.alternatives) {
    if (!o.found) continue;
    EXPECT_FALSE(o.limit.empty()) << o.label;
    EXPECT_GT(o.cache_budget_gb, 0) << o.label;
    EXPECT_LE(o.indexer_gb + o.latent_gb, o.cache_budget_gb * 1.0001) << o.label;
    if (!o.best.offload) {  // all-on-GPU stops where the whole context no longer fits
      EXPECT_NE(o.limit.find("GPU memory: batch 54 takes"), std::string::npos) << o.limit;
      EXPECT_NE(o.limit.find("the latent cache the larger part"), std::string::npos) << o.limit;
      EXPECT_NE(o.why.find(o.limit), std::string::npos) << o.why;
      gpu_memory = true;
    }
  }
  EXPECT_TRUE(gpu_memory);
  // A target above the larger batches' OTPS binds there.
  const PlanResult q = plan(sm, request(20));
  ASSERT_TRUE(q.found);
  EXPECT_NE(q.chosen.limit.find("OTPS: batch"), std::string::npos) << q.chosen.limit;
  EXPECT_NE(q.chosen.limit.find("below 20.00"), std::string::npos) << q.chosen.limit;
  // At 128K ESS's GPU memory is mostly the indexer cache (the figures --explain prints), and a
  // batch past the peak says so.
  PlanRequest r = request(0);
  r.context = 131072;
  r.modes = {OverlapMode::kNone};
  HardwareProfile big_host = paper_hw();
  big_host.host_dram_gb = 1e5;  // host DRAM out of the way
  const PlanResult l = plan(StepModel(dsv32(), big_host, paper_dep()), r);
  ASSERT_TRUE(l.found && l.chosen.best.offload);
  EXPECT_GT(l.chosen.indexer_gb, l.chosen.latent_gb);
  EXPECT_NE(l.chosen.limit.find("throughput: the larger batches tried give less"), std::string::npos) << l.chosen.limit;
}

TEST(sim_plan, InvalidRequests) {
  const StepModel sm(dsv32(), paper_hw(), paper_dep());
  EXPECT_THROW(plan(sm, request(-1)), Error);
  PlanRequest r = request(0);
  r.batch_step = 0;
  EXPECT_THROW(plan(sm, r), Error);
}

}  // namespace
}  // namespace ess::sim

namespace ess::sim {
namespace {

// With Two-Batch Overlap on in the deployment, the search covers it off too: on an H20 at 128K the
// OTPS target leaves TBO on two requests per GPU, off sixteen (TBO's two micro-batches halve the batch
// each layer computes, and at this context its copies and attention are no longer hidden).
TEST(planner, TheSearchCoversTwoBatchOverlapOff) {
  Inputs in;
  in.hardware = "h20-141gb";
  PlanOptions o;
  o.contexts = {131072};
  o.min_otps = 15;
  const Plans p = plan_contexts(in, o);
  ASSERT_TRUE(p.results[0].found);
  const PlanOption& c = p.results[0].chosen;
  EXPECT_FALSE(c.two_batch_overlap);
  EXPECT_NE(c.label.find(", TBO off"), std::string::npos);
  EXPECT_GE(c.best.batch, 10);
  bool tbo_on_listed = false;
  for (const PlanOption& a : p.results[0].alternatives) {
    tbo_on_listed = tbo_on_listed || (a.two_batch_overlap && a.label.find("TBO off") == std::string::npos);
  }
  EXPECT_TRUE(tbo_on_listed);
  in.no_tbo = true;  // off only: no TBO-on kind is tried
  const Plans off = plan_contexts(in, o);
  for (const PlanOption& a : off.results[0].alternatives) EXPECT_FALSE(a.two_batch_overlap);
}

}  // namespace
}  // namespace ess::sim
