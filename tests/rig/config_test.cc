// The decode-step executor's host side: configuration errors name the field and value, the
// inputs replay the trace exactly (ids, lengths, prefill, layer choice), the offline miss
// profile is the LRU replay of those ids, and layer-wise picks DBA exactly where the profile
// reaches the threshold.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "ess/trace/format.h"
#include "ess/trace/generator.h"
#include "harness/rig/config.h"
#include "testing/cache_fixtures.h"
#include "testing/testing.h"

namespace ess::rig {
namespace {

ExecutorConfig small() {
  ExecutorConfig c;
  c.layers = 3;
  c.batch = 3;
  c.context = 8192;
  c.steps = 5;
  c.warm_steps = 1;
  c.ratio = 0.5;  // 4096 slots: the T = 2 working set of up to 4096 ids fits
  return c;
}

TEST(pipeline_config, BadFieldsAreNamed) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  auto err = [&](auto&& mutate) {
    ExecutorConfig c = small();
    mutate(c);
    return test::error_of([&] { c.validate(m); });
  };
  EXPECT_NE(err([](ExecutorConfig& c) { c.batch = 0; }).find("batch = 0"), std::string::npos);
  EXPECT_NE(err([](ExecutorConfig& c) { c.layers = 0; }).find("layers = 0"), std::string::npos);
  EXPECT_NE(err([](ExecutorConfig& c) { c.ratio = 1.5; }).find("ratio = 1.5"), std::string::npos);
  EXPECT_NE(err([](ExecutorConfig& c) { c.warm_steps = 5; }).find("warm_steps = 5"), std::string::npos);
  EXPECT_NE(err([](ExecutorConfig& c) { c.expert_parallel = 1000; }).find("expert_parallel = 1000"), std::string::npos);
  EXPECT_NE(err([](ExecutorConfig& c) { c.layerwise_threshold = -1; }).find("layerwise_threshold"), std::string::npos);
  EXPECT_NE(err([](ExecutorConfig& c) {
              c.offload = false;
              c.skip_transfers = true;
            }).find("skip_transfers"),
            std::string::npos);
  EXPECT_NE(err([](ExecutorConfig& c) {
              c.offload = false;
              c.reserve_newest = true;
            }).find("reserve_newest"),
            std::string::npos);
  EXPECT_NE(err([](ExecutorConfig& c) { c.copy_blocks = 70000; }).find("copy_blocks = 70000"), std::string::npos);
  // A pool smaller than one query token's top-k cannot place a step.
  EXPECT_NE(err([](ExecutorConfig& c) { c.slots = 1000; }).find("1000"), std::string::npos);
  EXPECT_EQ(err([](ExecutorConfig&) {}), "no error");
}

TEST(pipeline_config, PoolMustHoldTheMtpWorkingSet) {
  // 2500 slots hold one top-2048 but not the up-to-4096 ids of T = 2 query tokens.
  ExecutorConfig c = small();
  c.slots = 2500;
  const std::string e = test::error_of([&] { load_inputs(c, ModelSpec::deepseek_v32_exp()); });
  EXPECT_NE(e.find("2500 slots"), std::string::npos) << e;
}

TEST(pipeline_config, SyntheticInputsReplayTheGeneratedTrace) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const ExecutorConfig c = small();
  const StepInputs in = load_inputs(c, m);
  ASSERT_EQ(in.layers, 3);
  ASSERT_EQ(in.batch, 3);
  ASSERT_EQ(in.steps, 5);
  EXPECT_EQ(in.topk, 2048);
  EXPECT_EQ(in.mtp, 2);  // the shipped generator profile
  EXPECT_EQ(in.trace_layers, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(in.prompt, 8192);
  EXPECT_NE(in.source.find("synthetic"), std::string::npos);
  // The same generator, called directly, gives the same ids.
  trace::GeneratorProfile p = trace::GeneratorProfile::shipped_default();
  p.layers = 3;
  for (int b = 0; b < 3; ++b) {
    const trace::RequestData r = trace::generate_request(p, c.context, c.steps, c.seed, b);
    for (int s = 0; s < c.steps; ++s) {
      EXPECT_EQ(in.lengths[static_cast<std::size_t>(s) * 3 + b], r.lengths[static_cast<std::size_t>(s)]);
      for (int l = 0; l < 3; ++l) {
        const std::int32_t* got = in.step_ids(s, l) + static_cast<std::size_t>(b) * in.mtp * in.topk;
        const std::int32_t* want = r.topk.data() + ((static_cast<std::size_t>(s) * 3 + l) * in.mtp) * in.topk;
        ASSERT_TRUE(std::equal(got, got + in.mtp * in.topk, want)) << "step " << s << " layer " << l << " request " << b;
      }
    }
  }
  // Every id lies below its step's length.
  for (int s = 0; s < c.steps; ++s) {
    for (int l = 0; l < 3; ++l) {
      for (int b = 0; b < 3; ++b) {
        const std::int32_t* ids = in.step_ids(s, l) + static_cast<std::size_t>(b) * in.mtp * in.topk;
        for (int i = 0; i < in.mtp * in.topk; ++i) {
          ASSERT_LT(ids[i], in.lengths[static_cast<std::size_t>(s) * 3 + b]);
          ASSERT_GE(ids[i], -1);
        }
      }
    }
  }
}

// The offline profile is the CPU swap engine's LRU(+warm-up) miss count on the same ids,
// counted here independently by the cache tests' naive LRU model.
TEST(pipeline_config, ProfileIsTheLruReplayOfTheIds) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const ExecutorConfig c = small();
  const StepInputs in = load_inputs(c, m);
  const std::int32_t slots = c.resolved_slots();
  for (int l = 0; l < c.layers; ++l) {
    double total = 0;
    for (int b = 0; b < c.batch; ++b) {
      // The independent LRU model of the cache tests (docs/architecture.md "Exact semantics").
      test::NaiveLru lru(slots);
      auto step = [&](const std::int32_t* ids, int n) {
        std::vector<std::pair<std::int32_t, std::int32_t>> fills;
        lru.step({ids, static_cast<std::size_t>(n)}, fills);
        return static_cast<int>(fills.size());
      };
      for (int w = 0; w < in.prefill_windows; ++w) {
        step(in.prefill.data() + ((static_cast<std::size_t>(l) * c.batch + b) * in.prefill_windows + w) * in.topk, in.topk);
      }
      for (int s = 0; s < c.steps; ++s) {
        total += step(in.step_ids(s, l) + static_cast<std::size_t>(b) * in.mtp * in.topk, in.mtp * in.topk);
      }
    }
    EXPECT_NEAR(in.profile_misses[static_cast<std::size_t>(l)], total / (c.steps * c.batch), 1e-9) << "layer " << l;
    EXPECT_GT(in.profile_misses[static_cast<std::size_t>(l)], 0.0);
  }
}

TEST(pipeline_config, LayerWisePicksDbaWhereTheProfileReachesTheThreshold) {
  StepInputs in;
  in.layers = 4;
  in.profile_misses = {10, 100, 99.5, 500};
  ExecutorConfig c = small();
  c.overlap = OverlapMode::kLayerWise;
  c.layerwise_threshold = 100;
  const std::vector<OverlapMode> m = layer_modes(c, in);
  EXPECT_EQ(m, (std::vector<OverlapMode>{OverlapMode::kDualAttention, OverlapMode::kDualBatchAttention,
                                          OverlapMode::kDualAttention, OverlapMode::kDualBatchAttention}));
  c.overlap = OverlapMode::kDualAttention;
  EXPECT_EQ(layer_modes(c, in), std::vector<OverlapMode>(4, OverlapMode::kDualAttention));
  c.offload = false;
  EXPECT_EQ(layer_modes(c, in), std::vector<OverlapMode>(4, OverlapMode::kNone));
}

// A recorded trace: fewer requests than the batch are reused in turn, its layers are spread
// over the executor's, and a trace that does not fit is refused with its name in the message.
TEST(pipeline_config, TraceFileRequestsAndLayers) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  trace::GeneratorProfile p = trace::GeneratorProfile::shipped_default();
  p.layers = 7;
  trace::GenerateConfig g;
  g.contexts = {6000};
  g.requests = 2;
  g.steps = 4;
  const std::string path = (std::filesystem::temp_directory_path() / "ess_pipeline_config_test.safetensors").string();
  trace::generate_trace(p, g, path);
  ExecutorConfig c = small();
  c.trace = path;
  c.context = 6000;
  c.ratio = 0.7;
  c.steps = 4;
  c.batch = 5;
  const StepInputs in = load_inputs(c, m);
  EXPECT_EQ(in.trace_layers, (std::vector<int>{0, 3, 6}));
  const std::size_t row = static_cast<std::size_t>(in.mtp) * in.topk;
  for (int b = 2; b < 5; ++b) {  // request b replays trace request b % 2
    EXPECT_TRUE(std::equal(in.step_ids(1, 1) + b * row, in.step_ids(1, 1) + (b + 1) * row, in.step_ids(1, 1) + (b % 2) * row));
  }
  c.steps = 9;
  const std::string e = test::error_of([&] { load_inputs(c, m); });
  EXPECT_NE(e.find("4 steps, 9 requested"), std::string::npos) << e;
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace ess::rig
