// The synthetic generator: structural guarantees, determinism, metadata, profile validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "ess/model/model_spec.h"
#include "ess/trace/format.h"
#include "ess/trace/generator.h"
#include "test_util.h"

namespace ess::trace {
namespace {

using testing::expect_error;
using testing::temp_path;
using testing::tiny_profile;

// Every query selects exactly min(K, visible) distinct valid ids, -1 for the rest.
void check_row(const std::int32_t* row, int K, std::int64_t visible, const std::string& where) {
  std::set<std::int32_t> seen;
  int valid = 0;
  for (int k = 0; k < K; ++k) {
    if (row[k] == -1) continue;
    ASSERT_GE(row[k], 0) << where;
    ASSERT_LT(row[k], visible) << where;
    ASSERT_TRUE(seen.insert(row[k]).second) << where << ": id " << row[k] << " twice";
    ++valid;
  }
  ASSERT_EQ(valid, std::min<std::int64_t>(K, visible)) << where;
}

TEST(Generator, EveryQuerySelectsExactlyMinKDistinctValidIds) {
  const auto p = tiny_profile();
  for (std::int64_t context : {1, 5, 40, 61, 62, 63, 64, 65, 70, 200, 3000}) {
    const auto r = generate_request(p, context, 40, 11, 0);
    ASSERT_EQ(r.lengths.size(), 40u);
    ASSERT_EQ(r.lengths.front(), context + p.mtp);
    const int W = r.prefill_windows;
    ASSERT_EQ(W, std::min<std::int64_t>(p.prefill_windows, context));
    for (int l = 0; l < p.layers; ++l) {
      for (int w = 0; w < W; ++w) {
        check_row(r.prefill.data() + (static_cast<std::size_t>(l) * W + w) * 64, 64, context - W + w + 1,
                  "prefill context " + std::to_string(context));
      }
    }
    for (std::size_t s = 0; s < r.lengths.size(); ++s) {
      if (s > 0) {
        const auto grew = r.lengths[s] - r.lengths[s - 1];
        ASSERT_GE(grew, 1);
        ASSERT_LE(grew, p.mtp);
      }
      for (int l = 0; l < p.layers; ++l) {
        for (int t = 0; t < p.mtp; ++t) {
          const std::int64_t visible = r.lengths[s] - (p.mtp - 1 - t);
          check_row(r.topk.data() + ((s * p.layers + static_cast<std::size_t>(l)) * p.mtp + static_cast<std::size_t>(t)) * 64,
                    64, visible, "context " + std::to_string(context) + " step " + std::to_string(s));
        }
      }
    }
  }
}

TEST(Generator, IsDeterministicInItsSeed) {
  const auto p = tiny_profile();
  const auto a = generate_request(p, 500, 20, 5, 1);
  const auto b = generate_request(p, 500, 20, 5, 1);
  const auto c = generate_request(p, 500, 20, 6, 1);
  EXPECT_EQ(a.topk, b.topk);
  EXPECT_EQ(a.prefill, b.prefill);
  EXPECT_EQ(a.lengths, b.lengths);
  EXPECT_NE(a.topk, c.topk);
}

TEST(Generator, HigherDriftLayersChangeMore) {
  const auto p = tiny_profile();
  const auto r = generate_request(p, 3000, 60, 3, 0);
  auto changed = [&](int layer) {
    std::int64_t n = 0;
    for (std::size_t s = 1; s < 60; ++s) {
      const auto* a = r.topk.data() + ((s - 1) * p.layers + static_cast<std::size_t>(layer)) * p.mtp * 64;
      const auto* b = r.topk.data() + (s * p.layers + static_cast<std::size_t>(layer)) * p.mtp * 64;
      const std::set<std::int32_t> prev(a, a + 64);
      for (int k = 0; k < 64; ++k) n += prev.contains(b[k]) ? 0 : 1;
    }
    return n;
  };
  EXPECT_GT(changed(0), changed(2));
  EXPECT_GT(changed(2), changed(1));
  EXPECT_GT(changed(1), changed(3));
}

// Index sharing (`ess trace gen --model`): a shared layer's queries and prefill windows are its
// leader's, id for id; the others are generated as before (a layer's ids do not depend on which
// other layers are shared); the pattern travels in the profile the trace's metadata keeps.
TEST(Generator, SharedIndexLayersSelectTheirLeadersIds) {
  GeneratorProfile p = tiny_profile();
  const auto own = generate_request(p, 800, 12, 2, 0);
  p.shared_index = {false, true, false, true};
  p.validate("test");
  const auto r = generate_request(p, 800, 12, 2, 0);
  const std::size_t row = static_cast<std::size_t>(p.mtp) * 64, window = static_cast<std::size_t>(p.prefill_windows) * 64;
  auto query = [&](const RequestData& x, std::size_t s, int layer) {
    const auto* a = x.topk.data() + (s * static_cast<std::size_t>(p.layers) + static_cast<std::size_t>(layer)) * row;
    return std::vector<std::int32_t>(a, a + row);
  };
  auto prefill = [&](const RequestData& x, int layer) {
    const auto* a = x.prefill.data() + static_cast<std::size_t>(layer) * window;
    return std::vector<std::int32_t>(a, a + window);
  };
  for (std::size_t s = 0; s < 12; ++s) {
    EXPECT_EQ(query(r, s, 1), query(r, s, 0)) << s;
    EXPECT_EQ(query(r, s, 3), query(r, s, 2)) << s;
    EXPECT_EQ(query(r, s, 0), query(own, s, 0)) << s;
    EXPECT_EQ(query(r, s, 2), query(own, s, 2)) << s;
    EXPECT_NE(query(own, s, 1), query(own, s, 0)) << s;
  }
  EXPECT_EQ(prefill(r, 1), prefill(r, 0));
  EXPECT_EQ(prefill(r, 3), prefill(r, 2));
  EXPECT_EQ(GeneratorProfile::from_json(p.to_json(), "round trip").shared_index, p.shared_index);
  p.shared_index = {true, false, false, false};
  expect_error([&] { p.validate("test"); }, {"layer 0 shared: true"});
  p.shared_index = {false, true};
  expect_error([&] { p.validate("test"); }, {"has 2 layers"});
}

// Units (MiniMax-M3's blocks, DeepSeek-V4's C4 entries): every query at length L selects exactly
// min(K, ceil(L / n)) distinct ids below ceil(L / n).
TEST(Generator, IdsOfUnitsLieBelowTheUnitsEachQuerySees) {
  GeneratorProfile p = tiny_profile();
  p.unit_tokens = 4;
  p.validate("test");
  for (std::int64_t context : {1, 3, 4, 5, 250, 257, 1000}) {
    const auto r = generate_request(p, context, 20, 5, 0);
    const std::size_t row = static_cast<std::size_t>(p.mtp) * static_cast<std::size_t>(p.topk);
    for (std::size_t s = 0; s < r.lengths.size(); ++s) {
      const std::int64_t first = r.lengths[s] - p.mtp + 1;  // query 0 sees this many tokens
      for (int l = 0; l < p.layers; ++l) {
        for (int q = 0; q < p.mtp; ++q) {
          const auto* ids = r.topk.data() + (s * static_cast<std::size_t>(p.layers) + static_cast<std::size_t>(l)) * row +
                            static_cast<std::size_t>(q) * static_cast<std::size_t>(p.topk);
          check_row(ids, p.topk, p.ids_of(first + q), fmt::format("context {} step {} layer {} query {}", context, s, l, q));
        }
      }
    }
  }
  const auto meta = synthetic_meta(p, GenerateConfig{});
  EXPECT_EQ(meta.unit_tokens, 4);
  EXPECT_NE(meta.note.find("units of 4 tokens"), std::string::npos);
  EXPECT_EQ(GeneratorProfile::from_json(p.to_json(), "round trip").unit_tokens, 4);
  p.unit_tokens = 0;
  expect_error([&] { p.validate("test"); }, {"unit_tokens"});
}

// `ess trace gen --model`: the model's offloaded layers, top-k and units.
TEST(Generator, ModelsSetTheirLayersTopkAndUnits) {
  GeneratorProfile m3 = GeneratorProfile::shipped_default();
  apply_model(m3, ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/minimax-m3.json"));
  m3.validate("m3");
  EXPECT_EQ(m3.layers, 57);        // its sparse layers
  EXPECT_EQ(m3.unit_tokens, 128);  // blocks
  EXPECT_EQ(m3.topk, 16);          // the top 16, the query's own block forced among them
  EXPECT_EQ(m3.sink_tokens, 0);
  EXPECT_EQ(m3.recent_window, 1);
  EXPECT_EQ(m3.mtp, 1);  // no next-n layer
  GeneratorProfile v4 = GeneratorProfile::shipped_default();
  const GeneratorProfile dsa = v4;
  apply_model(v4, ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/deepseek-v4-flash.json"));
  v4.validate("v4");
  EXPECT_EQ(v4.layers, 21);  // its C4 layers
  EXPECT_EQ(v4.unit_tokens, 4);
  EXPECT_EQ(v4.topk, 512);
  EXPECT_EQ(v4.recent_window, (dsa.recent_window + 3) / 4);
  EXPECT_EQ(v4.reference_context, dsa.reference_context / 4);
  EXPECT_EQ(v4.mtp, 1);  // served without speculative decoding
  GeneratorProfile v32 = dsa;
  apply_model(v32, ModelSpec::deepseek_v32_exp());
  EXPECT_EQ(v32.unit_tokens, 1);
  EXPECT_EQ(v32.topk, 2048);
  EXPECT_EQ(v32.recent_window, dsa.recent_window);
  EXPECT_EQ(v32.layers, 61);
}

TEST(Generator, TracesSayTheyAreSynthetic) {
  const auto path = temp_path("gen.safetensors");
  GenerateConfig c;
  c.contexts = {300, 900};
  c.requests = 3;
  c.steps = 6;
  generate_trace(tiny_profile(), c, path);
  const TraceReader r(path);
  EXPECT_TRUE(r.meta().synthetic);
  EXPECT_NE(r.meta().note.find("SYNTHETIC"), std::string::npos);
  EXPECT_NE(r.meta().provenance.find("synthetic"), std::string::npos);
  EXPECT_NE(r.meta().generator.find("\"drift\""), std::string::npos);
  ASSERT_EQ(r.requests(), 3u);
  EXPECT_EQ(r.request(0).context, 300);
  EXPECT_EQ(r.request(1).context, 900);
  EXPECT_EQ(r.request(2).context, 300);
  r.validate_all();
}

TEST(Generator, ShippedDefaultProfileLoads) {
  const auto p = GeneratorProfile::shipped_default();
  EXPECT_EQ(p.layers, 61);
  EXPECT_EQ(p.topk, 2048);
  EXPECT_EQ(p.mtp, 2);
  EXPECT_EQ(p.drift.size(), 61u);
  const auto again = GeneratorProfile::from_json(p.to_json(), "round trip");
  EXPECT_EQ(again.drift, p.drift);
  EXPECT_EQ(GeneratorProfile::from_file(std::string(ESS_SOURCE_DIR) + "/configs/trace-profiles/default.json").drift, p.drift);
}

TEST(Generator, BadProfilesAreRefusedWithTheField) {
  auto j = tiny_profile().to_json();
  j["drfit"] = 1;
  expect_error([&] { GeneratorProfile::from_json(j, "p.json"); }, {"p.json", "unknown generator profile field 'drfit'"});
  j = tiny_profile().to_json();
  j["drift"] = {0.1, 1.5};
  expect_error([&] { GeneratorProfile::from_json(j, "p.json"); }, {"p.json", "'drift'[1] = 1.5"});
  j = tiny_profile().to_json();
  j["synthetic"] = false;
  expect_error([&] { GeneratorProfile::from_json(j, "p.json"); }, {"'synthetic' must be true"});
  j = tiny_profile().to_json();
  j["topk"] = "many";
  expect_error([&] { GeneratorProfile::from_json(j, "p.json"); }, {"'topk'", "wrong type"});
  j = tiny_profile().to_json();
  j["recent_window"] = 70;
  expect_error([&] { GeneratorProfile::from_json(j, "p.json"); }, {"'recent_window' = 70"});
  j = tiny_profile().to_json();
  j.erase("drift");
  expect_error([&] { GeneratorProfile::from_json(j, "p.json"); }, {"'drift'", "missing"});
  expect_error([&] { GeneratorProfile::from_file("/nonexistent.json"); }, {"/nonexistent.json"});
  expect_error([&] { generate_request(tiny_profile(), 0, 5, 1, 0); }, {"context 0"});
}

TEST(Generator, DriftIsResampledForAnotherLayerCount) {
  auto p = tiny_profile();
  p.drift = {0.0, 1.0};
  p.layers = 5;
  EXPECT_DOUBLE_EQ(p.drift_of(0), 0.0);
  EXPECT_DOUBLE_EQ(p.drift_of(2), 0.5);
  EXPECT_DOUBLE_EQ(p.drift_of(4), 1.0);
}

}  // namespace
}  // namespace ess::trace
