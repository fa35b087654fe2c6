// The simulator and planner over a model whose layers share an indexer's top-k (GLM-5.2,
// ModelSpec::shared_index): what a follower layer costs, holds and copies, with the prefetch (its
// decision and copy issued at its leader's layer) and without.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "ess/sim/inputs.h"
#include "ess/sim/launch.h"
#include "ess/sim/memory_model.h"
#include "ess/sim/op_names.h"
#include "ess/sim/step_model.h"
#include "ess/sim/timeline.h"
#include "sim/sim_test_util.h"

namespace ess::sim {
namespace {

using testing::paper_dep;
using testing::paper_hw;

const ModelSpec& glm5() {
  static const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/glm-5.json");
  return m;
}
const ModelSpec& glm52() {
  static const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/glm-5.2.json");
  return m;
}

// GLM-5 and GLM-5.2 have the same shape; GLM-5.2's 57 shared layers hold no indexer keys and no
// indexer weights (SGLang's index-K pool gives a skip_topk layer no pages).
TEST(sim_index_sharing, OnlyIndexerLayersHoldIndexerKeysAndWeights) {
  const MemoryModel a(glm5(), paper_hw(), paper_dep(), 32768), b(glm52(), paper_hw(), paper_dep(), 32768);
  EXPECT_EQ(a.indexer_layers(), 78 + 1);  // + the MTP layer (MTP 2)
  EXPECT_EQ(b.indexer_layers(), 21 + 1);
  EXPECT_EQ(a.cache_layers(), b.cache_layers());
  EXPECT_DOUBLE_EQ(a.indexer_bytes_per_request(), 32768.0 * 79 * 132);
  EXPECT_DOUBLE_EQ(b.indexer_bytes_per_request(), 32768.0 * 22 * 132);
  const ModelSpec& m = glm5();
  const double indexer_params = double(m.q_lora_rank) * m.index_n_heads * m.index_head_dim +
                                double(m.hidden_size) * m.index_head_dim + double(m.hidden_size) * m.index_n_heads;
  EXPECT_NEAR(a.weights().attention - b.weights().attention, 57 * indexer_params * (1 + 4.0 / (128 * 128)), 1.0);
  EXPECT_DOUBLE_EQ(a.latent_bytes_per_request(1000), b.latent_bytes_per_request(1000));
}

struct Ops {
  std::map<std::string, int> per_op;  // op name -> events
  int on_layer(const Timeline& tl, int layer, std::string_view op) const {
    const std::string prefix = fmt::format("L{}A {}", layer, op);
    return static_cast<int>(std::count_if(tl.events.begin(), tl.events.end(),
                                          [&](const TimelineEvent& e) { return e.name == prefix; }));
  }
};

Workload none_at(int batch, double misses) {
  Workload w;
  w.batch = batch;
  w.overlap = OverlapMode::kNone;
  w.slots = 6554;
  w.misses.reference_misses = misses;
  return w;
}

Deployment no_tbo(bool prefetch) {
  Deployment d = paper_dep();
  d.two_batch_overlap = false;
  d.shared_index_prefetch = prefetch;
  return d;
}

// A follower runs no indexer; with the prefetch its decision and copy are issued among its
// leader's ops (its copy named for it), and at its own turn none are; without, it swaps at its
// turn. Its misses are its leader's either way, so the bytes moved are the same.
TEST(sim_index_sharing, FollowersRunNoIndexerAndTheirCopyIsIssuedAtTheLeader) {
  Timeline on_tl, off_tl;
  const StepResult on = StepModel(glm52(), paper_hw(), no_tbo(true)).run(none_at(64, 200), &on_tl);
  const StepResult off = StepModel(glm52(), paper_hw(), no_tbo(false)).run(none_at(64, 200), &off_tl);
  const Ops ops;
  for (int l = 0; l < 78; ++l) {
    const bool shared = glm52().index_shared(l);
    for (const Timeline* tl : {&on_tl, &off_tl}) {
      EXPECT_EQ(ops.on_layer(*tl, l, op::kIndexerLogits), shared ? 0 : 1) << l;
      EXPECT_EQ(ops.on_layer(*tl, l, op::kSwap), 1) << l;
    }
    EXPECT_EQ(ops.on_layer(on_tl, l, op::kH2DPrefetch), shared ? 1 : 0) << l;
    EXPECT_EQ(ops.on_layer(on_tl, l, op::kH2DMisses), shared ? 0 : 1) << l;
    EXPECT_EQ(ops.on_layer(off_tl, l, op::kH2DPrefetch), 0) << l;
    EXPECT_EQ(ops.on_layer(off_tl, l, op::kH2DMisses), 1) << l;
  }
  // Issued in the leader's place: layer 3's prefetch starts before layer 3's attention input
  // projection, and right after layer 2's own copy.
  const auto start = [&](const std::string& name) {
    const auto it = std::find_if(on_tl.events.begin(), on_tl.events.end(), [&](const TimelineEvent& e) { return e.name == name; });
    EXPECT_NE(it, on_tl.events.end()) << name;
    return it == on_tl.events.end() ? 0.0 : it->start_us;
  };
  EXPECT_LT(start("L3A h2d prefetch"), start("L3A attn.norm+proj0 (q_a kv_a idx_k idx_w)"));
  EXPECT_GE(start("L3A h2d prefetch"), start("L2A h2d misses"));
  EXPECT_DOUBLE_EQ(on.h2d_bytes, off.h2d_bytes);
  EXPECT_DOUBLE_EQ(on.misses_per_request_layer, off.misses_per_request_layer);
  // Without Two-Batch Overlap mode none exposes every copy at its turn; the prefetch hides the
  // followers' under the layers between.
  EXPECT_LT(on.exposed_transfer_us, 0.5 * off.exposed_transfer_us);
}

// Under Two-Batch Overlap a dense leader runs the whole batch and the MoE layers after it run
// micro-batches: its followers there swap at their own turn (a whole-batch copy would serve
// neither micro-batch); MoE leaders prefetch their followers per micro-batch.
TEST(sim_index_sharing, UnderTwoBatchOverlapADenseLeadersFollowersSwapAtTheirTurn) {
  Deployment d = paper_dep();
  ASSERT_TRUE(d.two_batch_overlap);
  ASSERT_EQ(glm52().first_k_dense_replace, 3);
  Timeline tl;
  StepModel(glm52(), paper_hw(), d).run(none_at(64, 200), &tl);
  const auto count = [&](const std::string& name) {
    return std::count_if(tl.events.begin(), tl.events.end(), [&](const TimelineEvent& e) { return e.name == name; });
  };
  for (const char mb : {'A', 'B'}) {
    for (int l : {3, 4, 5}) {  // layer 2's (dense)
      EXPECT_EQ(count(fmt::format("L{}{} {}", l, mb, op::kH2DPrefetch)), 0) << l << mb;
      EXPECT_EQ(count(fmt::format("L{}{} {}", l, mb, op::kH2DMisses)), 1) << l << mb;
    }
    for (int l : {7, 8, 9}) {  // layer 6's (MoE)
      EXPECT_EQ(count(fmt::format("L{}{} {}", l, mb, op::kH2DPrefetch)), 1) << l << mb;
      EXPECT_EQ(count(fmt::format("L{}{} {}", l, mb, op::kH2DMisses)), 0) << l << mb;
    }
  }
}

// A follower has no indexer to split, so DBA runs as DA there (as the adapter runs it), and a
// layer-wise plan gives it DA; its leader keeps DBA.
TEST(sim_index_sharing, AFollowerWithoutThePrefetchRunsDbaAsDa) {
  for (const OverlapMode mode : {OverlapMode::kDualBatchAttention, OverlapMode::kLayerWise}) {
    Workload w = none_at(64, 400);
    w.overlap = mode;
    w.layerwise_threshold = mode == OverlapMode::kLayerWise ? 0 : -1;  // layer-wise: DBA wherever it may
    Timeline tl;
    const StepResult r = StepModel(glm52(), paper_hw(), no_tbo(false)).run(w, &tl);
    const Ops ops;
    EXPECT_EQ(ops.on_layer(tl, 2, op::kH2DMissesHalf0), 1) << to_string(mode);  // a leader
    EXPECT_EQ(ops.on_layer(tl, 3, op::kH2DMissesHalf0), 0) << to_string(mode);  // its follower
    EXPECT_EQ(ops.on_layer(tl, 3, op::kAttn0), 1) << to_string(mode);
    if (mode == OverlapMode::kLayerWise) {
      EXPECT_EQ(r.layers_da, 57) << r.layer_modes;
      EXPECT_EQ(r.layer_modes.substr(0, 12), "b b b a a a ") << r.layer_modes;
    }
  }
}

// A follower's pool sees its leader's ids, so it misses what its leader misses: with a miss
// profile that differs per layer, each follower takes its leader's value.
TEST(sim_index_sharing, FollowersMissWhatTheirLeaderMisses) {
  Workload w = none_at(64, 200);
  for (int l = 0; l < 78; ++l) w.misses.layer_shape.push_back(0.5 + l % 4);  // leaders (l % 4 = 2) miss more
  const StepResult shared = StepModel(glm52(), paper_hw(), no_tbo(true)).run(w);
  const StepResult own = StepModel(glm5(), paper_hw(), no_tbo(true)).run(w);
  double own_shape = 0, leader_shape = 0;
  for (int l = 0; l < 78; ++l) {
    own_shape += w.misses.layer_shape[static_cast<std::size_t>(l)];
    leader_shape += w.misses.layer_shape[static_cast<std::size_t>(glm52().index_leader(l))];
  }
  ASSERT_GT(own.misses_per_request_layer, 0);
  EXPECT_NEAR(shared.misses_per_request_layer / own.misses_per_request_layer, leader_shape / own_shape, 1e-12);
  EXPECT_GT(std::abs(leader_shape - own_shape), 1.0);
}

// `ess plan --engine sglang` searches the prefetch on and off for a sharing model and says which;
// off, its launch line sets SGLang's own switch (resolve_shared_index_layers then passes no
// pattern); vLLM's connector issues no prefetch, so its plan never turns it on.
TEST(sim_index_sharing, ThePlanSearchesThePrefetchAndTheLaunchLineSaysItsChoice) {
  Inputs in;
  in.hardware = "h200";
  in.model = ESS_SOURCE_DIR "/configs/models/glm-5.2.json";
  PlanOptions o;
  o.contexts = {32768};
  o.min_otps = 15;
  o.engine = "sglang";
  const Plans p = plan_contexts(in, o);
  ASSERT_TRUE(p.results[0].found);
  std::vector<bool> seen;
  for (const PlanOption& a : p.results[0].alternatives) {
    seen.push_back(a.shared_index_prefetch);
    EXPECT_EQ(a.label.find("no prefetch") != std::string::npos, !a.shared_index_prefetch) << a.label;
  }
  EXPECT_NE(std::find(seen.begin(), seen.end(), true), seen.end());
  EXPECT_NE(std::find(seen.begin(), seen.end(), false), seen.end());
  // SGLang refuses two-batch overlap with index sharing (arg_groups/model_hook.py): the search keeps it off.
  for (const PlanOption& a : p.results[0].alternatives) EXPECT_FALSE(a.two_batch_overlap) << a.label;
  EXPECT_NE(std::find_if(p.engine_notes.begin(), p.engine_notes.end(),
                         [](const std::string& n) { return n.starts_with("TBO off (SGLang 0.5.23 refuses"); }),
            p.engine_notes.end());
  for (const bool prefetch : {true, false}) {
    PlanResult r = p.results[0];
    r.chosen.shared_index_prefetch = prefetch;
    const std::vector<std::string> env = launch_for("sglang", glm52(), p.hardware, p.deployment, r).env;
    EXPECT_EQ(std::count(env.begin(), env.end(), "SGLANG_DISABLE_HISPARSE_PREFETCH=1"), prefetch ? 0 : 1);
    const std::vector<std::string> dsv32 = launch_for("sglang", testing::dsv32(), p.hardware, p.deployment, r).env;
    EXPECT_EQ(std::count(dsv32.begin(), dsv32.end(), "SGLANG_DISABLE_HISPARSE_PREFETCH=1"), 0);  // nothing shared
  }
  o.engine = "vllm";
  const Plans vllm = plan_contexts(in, o);
  for (const PlanOption& a : vllm.results[0].alternatives) EXPECT_FALSE(a.shared_index_prefetch) << a.label;
}

}  // namespace
}  // namespace ess::sim
