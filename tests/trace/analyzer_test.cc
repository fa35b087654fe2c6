// The analyzer on hand-computed traces, and its invariants on generated ones.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "ess/model/model_spec.h"
#include "ess/trace/analyzer.h"
#include "ess/trace/format.h"
#include "ess/trace/generator.h"
#include "test_util.h"

namespace ess::trace {
namespace {

using testing::expect_error;
using testing::temp_path;

// Writes a trace of one request `r` with the given shape; returns its path.
std::string one_request_trace(const std::string& name, int layers, int mtp, int topk, const RequestData& r) {
  const auto path = temp_path(name);
  TraceMeta m;
  m.layers = layers;
  m.mtp = mtp;
  m.topk = topk;
  m.model = name;
  m.provenance = "analyzer_test";
  write_trace(path, m, {r});
  return path;
}

// 1 request, 2 layers, MTP 1, top-k 2, 4 steps, every length 10.
//   layer 0: {0,1} {1,2} {2,3} {0,1}
//   layer 1: {0,1} {0,1} {0,2} {0,2}
std::string hand_trace() {
  RequestData r;
  r.id = "hand";
  const int l0[4][2] = {{0, 1}, {1, 2}, {2, 3}, {0, 1}};
  const int l1[4][2] = {{0, 1}, {0, 1}, {0, 2}, {0, 2}};
  for (int s = 0; s < 4; ++s) {
    r.lengths.push_back(10);
    for (int k = 0; k < 2; ++k) r.topk.push_back(l0[s][k]);
    for (int k = 0; k < 2; ++k) r.topk.push_back(l1[s][k]);
  }
  return one_request_trace("hand.safetensors", 2, 1, 2, r);
}

// A DeepSeek-V4 trace at a context of fewer C4 entries than its top-512: every layer selects every
// entry, so layers agree without sharing an index; no sharing is reported (the test of a choice
// counts ids, not tokens).
TEST(Analyzer, LayersThatSelectEverythingOfATraceOfUnitsShareNothing) {
  GeneratorProfile p = GeneratorProfile::shipped_default();
  apply_model(p, ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/deepseek-v4-flash.json"));
  p.validate("v4");
  GenerateConfig g;
  g.contexts = {1024};
  g.requests = 1;
  g.steps = 6;
  const auto path = temp_path("v4_short.safetensors");
  generate_trace(p, g, path);
  const TraceReader trace(path);
  AnalyzeConfig c;
  c.policies = {"lru"};
  c.slots = {258};  // every id (1,024 tokens + 6 steps x MTP 1 make 258)
  c.steady_from = 0;
  c.recommend = false;
  c.similarity = false;
  const auto r = analyze(trace, c);
  ASSERT_TRUE(r.prefetch.has_value());
  EXPECT_TRUE(r.prefetch->shared_layers.empty());
}

AnalyzeConfig hand_config() {
  AnalyzeConfig c;
  c.slots = {3, 2};
  c.steady_from = 0;
  c.recommend = false;
  return c;
}

const PolicyResult& policy(const PoolResult& p, const std::string& name) {
  for (const auto& q : p.policies) {
    if (q.name == name) return q;
  }
  throw std::runtime_error("no policy " + name);
}

// A trace of blocks (ess.unit_tokens 128): a request of 1,000 tokens has 8 ids, so a ratio's pool
// and the recommended pool's ceiling count blocks; more slots than the longest request's ids are
// refused, naming the unit.
TEST(Analyzer, PoolsOfATraceOfUnitsCountIds) {
  RequestData r;
  r.id = "blocks";
  const int rows[6][2] = {{0, 7}, {1, 7}, {2, 7}, {0, 7}, {3, 7}, {1, 7}};
  for (const auto& row : rows) {
    r.lengths.push_back(1000);
    r.topk.insert(r.topk.end(), {row[0], row[1]});
  }
  const auto path = temp_path("blocks.safetensors");
  TraceMeta m;
  m.layers = 1;
  m.mtp = 1;
  m.topk = 2;
  m.unit_tokens = 128;
  m.model = "blocks";
  m.provenance = "analyzer_test";
  write_trace(path, m, {r});
  const TraceReader trace(path);
  AnalyzeConfig by_ratio;
  by_ratio.ratios = {0.25};  // ceil(0.25 x 8 ids) = 2 slots
  by_ratio.steady_from = 0;
  by_ratio.recommend = true;
  by_ratio.target_misses = 1.0;
  by_ratio.recommend_granularity = 1;
  by_ratio.policies = {"lru"};
  AnalyzeConfig by_slots = by_ratio;
  by_slots.ratios.clear();
  by_slots.slots = {2};
  by_slots.recommend = false;
  const auto a = analyze(trace, by_ratio);
  const auto b = analyze(trace, by_slots);
  // LRU over 2 slots: {0,7} 2 misses, then 1, 1, 1, 1, 1: 7 over 6 steps.
  EXPECT_DOUBLE_EQ(policy(b.pools[0], "lru").overall.mean_misses, 7.0 / 6);
  EXPECT_DOUBLE_EQ(policy(a.pools[0], "lru").overall.mean_misses, policy(b.pools[0], "lru").overall.mean_misses);
  ASSERT_EQ(a.recommended.size(), 1u);
  // The fewest slots with at most one miss a step: 3 slots miss 7, 4 miss 2 + 1 + 1 + 0 + 1 + 1 = 6.
  EXPECT_EQ(a.recommended[0].slots, 4);
  EXPECT_DOUBLE_EQ(a.recommended[0].ratio, 4.0 / 8);
  AnalyzeConfig too_many = by_slots;
  too_many.slots = {9};
  expect_error([&] { analyze(trace, too_many); }, {"slots 9 exceed the longest request (8 ids of 128 tokens)"});
  EXPECT_EQ(to_json(a)["unit_tokens"], 128);
  EXPECT_NE(to_table(a).find("units of 128 tokens"), std::string::npos);
}

TEST(Analyzer, HandComputedMissesAndSimilarity) {
  const TraceReader trace(hand_trace());
  const auto r = analyze(trace, hand_config());
  ASSERT_EQ(r.pools.size(), 2u);
  // 3 slots, LRU: layer 0 misses 2,1,1,1 ; layer 1 misses 2,0,1,0.
  const auto& lru3 = policy(r.pools[0], "lru");
  EXPECT_DOUBLE_EQ(lru3.overall.per_layer[0], 5.0 / 4);
  EXPECT_DOUBLE_EQ(lru3.overall.per_layer[1], 3.0 / 4);
  EXPECT_DOUBLE_EQ(lru3.overall.mean_misses, 8.0 / 8);
  EXPECT_EQ(lru3.overall.per_step, (std::vector<double>{2, 0.5, 1, 0.5}));
  // 2 slots, LRU: layer 0 misses 2,1,1,2 ; layer 1 misses 2,0,1,0.
  const auto& lru2 = policy(r.pools[1], "lru");
  EXPECT_DOUBLE_EQ(lru2.overall.per_layer[0], 6.0 / 4);
  EXPECT_DOUBLE_EQ(lru2.overall.per_layer[1], 3.0 / 4);
  // Belady at 2 slots: nothing can do better here (every step brings a new token or returns
  // after an unavoidable eviction), at 3 slots the same 5 + 3.
  EXPECT_DOUBLE_EQ(policy(r.pools[0], "belady").overall.mean_misses, 1.0);
  EXPECT_DOUBLE_EQ(policy(r.pools[1], "belady").overall.per_layer[0], 6.0 / 4);
  // Intra: layer 0 (1 + 1 + 0) / 6, layer 1 (2 + 1 + 2) / 6. Inter (layer 1 vs 0): (2+1+1+1)/8.
  EXPECT_DOUBLE_EQ(r.intra[0], 2.0 / 6);
  EXPECT_DOUBLE_EQ(r.intra[1], 5.0 / 6);
  EXPECT_TRUE(std::isnan(r.inter[0]));
  EXPECT_DOUBLE_EQ(r.inter[1], 5.0 / 8);
  EXPECT_DOUBLE_EQ(r.intra_mean, 7.0 / 12);
  // Prefetch at 3 slots, layer 1: step 0 fetches layer 0's {0,1} (both useful); step 1 fetches
  // {2} (wasted); step 2 fetches {2,3}: 2 useful, 3 wasted; step 3 {0,1} is resident.
  ASSERT_TRUE(r.prefetch.has_value());
  EXPECT_DOUBLE_EQ(r.prefetch->prefetched[1], (2 + 1 + 2 + 0) / 4.0);
  EXPECT_DOUBLE_EQ(r.prefetch->useful[1], (2 + 0 + 1 + 0) / 4.0);
  EXPECT_DOUBLE_EQ(r.prefetch->wasted[1], (0 + 1 + 1 + 0) / 4.0);
  EXPECT_DOUBLE_EQ(r.prefetch->misses_left[1], (0 + 0 + 0 + 0) / 4.0);
  EXPECT_DOUBLE_EQ(r.prefetch->max_wasted, 1);
}

// Index sharing in a trace: a layer that selects exactly layer l-1's ids at every step and
// prefill window of every request is reported shared; its prefetch is exact (every miss covered,
// nothing wasted), and its misses are the share exact prefetch takes off its critical path. A
// layer that differs in one id of one request is not shared.
TEST(Analyzer, SharedIndexLayersAreFoundAndTheirPrefetchIsExact) {
  GeneratorProfile p = testing::tiny_profile();
  p.shared_index = {false, true, true, false};
  p.validate("test");
  std::vector<RequestData> requests = {generate_request(p, 800, 16, 7, 0), generate_request(p, 800, 16, 7, 1)};
  TraceMeta meta;
  meta.layers = 4;
  meta.mtp = 2;
  meta.topk = 64;
  meta.model = "shared";
  meta.provenance = "analyzer_test";
  const auto path = temp_path("shared.safetensors");
  write_trace(path, meta, requests);
  AnalyzeConfig c;
  c.slots = {160};  // above T x K: no step runs in query groups
  c.steady_from = 0;
  c.recommend = false;
  c.policies = {"lru_warmup"};
  const auto r = analyze(TraceReader(path), c);
  ASSERT_TRUE(r.prefetch.has_value());
  const PrefetchStats& pf = *r.prefetch;
  EXPECT_EQ(pf.shared_layers, (std::vector<int>{1, 2}));
  double shared = 0, all = 0;
  for (int l = 1; l < 4; ++l) {
    all += pf.misses[static_cast<std::size_t>(l)];
    if (l == 3) continue;
    EXPECT_GT(pf.misses[static_cast<std::size_t>(l)], 0) << l;
    EXPECT_DOUBLE_EQ(pf.useful[static_cast<std::size_t>(l)], pf.misses[static_cast<std::size_t>(l)]) << l;
    EXPECT_DOUBLE_EQ(pf.wasted[static_cast<std::size_t>(l)], 0) << l;
    EXPECT_DOUBLE_EQ(pf.misses_left[static_cast<std::size_t>(l)], 0) << l;
    shared += pf.misses[static_cast<std::size_t>(l)];
  }
  EXPECT_GT(pf.misses_left[3], 0);
  EXPECT_DOUBLE_EQ(pf.shared_misses, shared);
  EXPECT_DOUBLE_EQ(pf.layer_misses, all);
  const std::string table = to_table(r);
  EXPECT_NE(table.find("index sharing: layers 1,2 select exactly"), std::string::npos) << table;
  EXPECT_EQ(to_json(r)["prefetch"]["index_sharing"]["shared_layers"], (std::vector<int>{1, 2}));

  // One id of one request's layer 2 changed (to one its row does not hold): layer 2 is no longer shared.
  std::int32_t* row = requests[1].topk.data() + (5 * 4 + 2) * static_cast<std::size_t>(p.mtp) * 64;
  const std::set<std::int32_t> held(row, row + 64);
  std::int32_t fresh = 0;
  while (held.contains(fresh)) ++fresh;
  row[0] = fresh;
  const auto changed = temp_path("shared-changed.safetensors");
  write_trace(changed, meta, requests);
  EXPECT_EQ(analyze(TraceReader(changed), c).prefetch->shared_layers, (std::vector<int>{1}));

  // Queries that see at most top-k tokens select them all in every layer: no sharing to tell.
  p.shared_index.clear();
  const std::vector<RequestData> short_requests = {generate_request(p, 30, 10, 7, 0)};
  ASSERT_LE(short_requests[0].lengths.back(), 64);
  const auto short_path = temp_path("short.safetensors");
  write_trace(short_path, meta, short_requests);
  c.slots = {static_cast<std::int32_t>(short_requests[0].lengths.back())};
  EXPECT_TRUE(analyze(TraceReader(short_path), c).prefetch->shared_layers.empty());
}

// The MTP working set is the union of the T query tokens' top-k, padding left out:
// 1 request, 1 layer, MTP 2, top-k 3, length 10:
//   step 0: {0,1,2} {1,2,3} -> 4;  step 1: {0,1,2} {2,1,0} -> 3;  step 2: {4,5,-1} {6,-1,-1} -> 3.
TEST(Analyzer, MtpWorkingSetIsTheUnionOfTheQueryTokensTopk) {
  RequestData rd;
  rd.id = "u";
  rd.lengths = {10, 10, 10};
  rd.topk = {0, 1, 2, 1, 2, 3, /**/ 0, 1, 2, 2, 1, 0, /**/ 4, 5, -1, 6, -1, -1};
  const TraceReader trace(one_request_trace("union.safetensors", 1, 2, 3, rd));
  AnalyzeConfig c;
  c.slots = {4};
  c.steady_from = 0;
  c.recommend = false;
  c.policies = {"lru"};
  const auto r = analyze(trace, c);
  ASSERT_EQ(r.working_sets.size(), 1u);
  const WorkingSetStats& w = r.working_sets.front();
  EXPECT_DOUBLE_EQ(w.mean, 10.0 / 3);
  EXPECT_EQ(w.max, 4);
  EXPECT_DOUBLE_EQ(w.p99, 4);
  EXPECT_EQ(w.max_per_layer, std::vector<std::int32_t>{4});
  const auto j = to_json(r);
  EXPECT_EQ(j["working_set"]["bound"], 6);
  EXPECT_EQ(j["working_set"]["groups"][0]["max"], 4);
  EXPECT_EQ(miss_profile_json(r, "lru")["contexts"][0]["working_set"]["max"], 4);
  EXPECT_NE(to_table(r).find("mean 3.3, p99 4, max 4"), std::string::npos) << to_table(r);
  EXPECT_EQ(r.pools[0].policies[0].overall.split_fraction, 0);
  // A pool of 3 slots serves step 0 (4 distinct ids) in two query groups, as the engine does:
  // {0,1,2} misses 3, then {1,2,3} misses token 3 (evicting 0); step 1 misses 0 again; step 2 misses
  // 4, 5, 6. Belady has no better choice here.
  c.slots = {3};
  c.policies = {"lru", "belady"};
  const auto split = analyze(trace, c);
  for (const auto& q : split.pools[0].policies) {
    EXPECT_DOUBLE_EQ(q.overall.mean_misses, (4 + 1 + 3) / 3.0) << q.name;
    EXPECT_DOUBLE_EQ(q.overall.split_fraction, 1 / 3.0) << q.name;
  }
  EXPECT_EQ(to_json(split)["policies"]["lru"]["split_fraction"], 1 / 3.0);
  EXPECT_NE(to_table(split).find("33.33% of steady-state request-layer-steps exceed the pool"), std::string::npos)
      << to_table(split);
  // A pool below one query token's top-k cannot serve the step, and says so.
  c.slots = {2};
  expect_error([&] { analyze(trace, c); }, {"2 slots", "one query token's top-k (3 distinct ids)"});
}

TEST(Analyzer, JsonHasTheDocumentedFields) {
  const TraceReader trace(hand_trace());
  const auto j = to_json(analyze(trace, hand_config()));
  for (const char* p : {"lru", "lru_warmup", "fifo", "clock", "lfu", "s3fifo", "belady"}) {
    ASSERT_TRUE(j["policies"].contains(p)) << p;
    EXPECT_TRUE(j["policies"][p]["mean_misses"].is_number());
    EXPECT_EQ(j["policies"][p]["per_layer"].size(), 2u);
  }
  EXPECT_EQ(j["similarity"]["intra"].size(), 2u);
  EXPECT_TRUE(j["similarity"]["inter"][0].is_null());
  EXPECT_EQ(j["sweep"].size(), 2u);
  EXPECT_EQ(j["pool"]["slots"], 3);
  const auto csv = to_csv(analyze(trace, hand_config()));
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 1 + 2 * 2);
  EXPECT_NE(csv.find("pool,layer,intra,inter,lru,lru_warmup"), std::string::npos);
  EXPECT_NE(to_table(analyze(trace, hand_config())).find("belady"), std::string::npos);
}

TEST(Analyzer, BadConfigurationsAreErrors) {
  const TraceReader trace(hand_trace());
  auto c = hand_config();
  c.slots = {1};
  expect_error([&] { analyze(trace, c); }, {"pool of 1 slots", "one query token's top-k (2 distinct ids)"});
  c = hand_config();
  c.slots.clear();
  c.ratios = {1.5};
  expect_error([&] { analyze(trace, c); }, {"ratio 1.5"});
  c = hand_config();
  c.policies = {"lru", "mru"};
  expect_error([&] { analyze(trace, c); }, {"unknown policy 'mru'"});
  c = hand_config();
  c.steady_from = 4;
  expect_error([&] { analyze(trace, c); }, {"steady state from step 4"});
}

TEST(Analyzer, InvalidIdsAreFoundBeforeAnyReplay) {
  RequestData r;
  r.lengths = {5, 5};
  r.topk = {0, 1, 4, 5};
  const auto path = one_request_trace("bad.safetensors", 1, 1, 2, r);
  const TraceReader trace(path);
  expect_error([&] { analyze(trace, hand_config()); }, {path, "request 0", "step 1", "id 5 is out of range [0, 5)"});
}

GeneratorProfile small_profile() {
  GeneratorProfile p = GeneratorProfile::shipped_default();
  p.layers = 6;
  p.topk = 128;
  p.sink_tokens = 2;
  p.recent_window = 8;
  p.candidate_base = 1024;
  p.reference_context = 2048;
  p.prefill_windows = 8;
  p.drift = {0.2, 0.02, 0.08, 0.05, 0.01, 0.1};
  return p;
}

TEST(Analyzer, BeladyIsALowerBoundAndWarmupHelpsEarlySteps) {
  const auto path = temp_path("gen.safetensors");
  GenerateConfig g;
  g.contexts = {2048, 4096};
  g.requests = 2;
  g.steps = 40;
  generate_trace(small_profile(), g, path);
  const TraceReader trace(path);
  AnalyzeConfig c;
  c.ratios = {0.2, 0.4};
  c.threads = 2;
  c.warmup = false;  // every policy but lru_warmup starts cold, Belady included: a strict bound
  const auto r = analyze(trace, c);
  for (const auto& pool : r.pools) {
    const auto& opt = policy(pool, "belady");
    for (const auto& q : pool.policies) {
      if (q.name == "lru_warmup") continue;
      for (int l = 0; l < 6; ++l) {
        EXPECT_LE(opt.overall.per_layer[static_cast<std::size_t>(l)], q.overall.per_layer[static_cast<std::size_t>(l)] + 1e-9)
            << q.name << " layer " << l;
      }
    }
    // Cold start: the first step misses the whole working set; warm-up removes most of it.
    EXPECT_GT(policy(pool, "lru").overall.per_step[0], 3 * policy(pool, "lru_warmup").overall.per_step[0]);
  }
  // A bigger pool never misses more under LRU here, and the recommendation meets its target.
  EXPECT_LE(policy(r.pools[1], "lru_warmup").overall.mean_misses, policy(r.pools[0], "lru_warmup").overall.mean_misses);
  ASSERT_EQ(r.recommended.size(), 2u);
  for (const auto& x : r.recommended) {
    if (x.slots > 0) {
      EXPECT_LE(x.mean_misses, r.target_misses);
    }
  }
  // The miss profile carries per-layer percentiles in order.
  const auto mp = miss_profile_json(r);
  EXPECT_EQ(mp["format"], "ess-miss-profile");
  EXPECT_EQ(mp["contexts"].size(), 2u);
  for (const auto& layer : mp["contexts"][1]["layers"]) {
    EXPECT_TRUE(layer["mean"].is_number());
    EXPECT_LE(layer["p50"].get<double>(), layer["p90"].get<double>());
    EXPECT_LE(layer["p90"].get<double>(), layer["p99"].get<double>());
  }
  for (int l = 0; l < 6; ++l) {
    const auto& g0 = policy(r.pools[0], "lru_warmup").overall;
    EXPECT_LE(g0.p50[static_cast<std::size_t>(l)], g0.p90[static_cast<std::size_t>(l)]);
    EXPECT_LE(g0.p90[static_cast<std::size_t>(l)], g0.p99[static_cast<std::size_t>(l)]);
    EXPECT_LE(g0.p99[static_cast<std::size_t>(l)], g0.max[static_cast<std::size_t>(l)]);
  }
}

TEST(Analyzer, ParallelAndSerialReplaysAgree) {
  const auto path = temp_path("gen.safetensors");
  GenerateConfig g;
  g.contexts = {2048};
  g.requests = 2;
  g.steps = 24;
  generate_trace(small_profile(), g, path);
  const TraceReader trace(path);
  AnalyzeConfig c;
  c.recommend = false;
  c.threads = 1;
  const auto a = to_json(analyze(trace, c));
  c.threads = 4;
  const auto b = to_json(analyze(trace, c));
  EXPECT_EQ(a["policies"], b["policies"]);
  EXPECT_EQ(a["similarity"], b["similarity"]);
}

}  // namespace
}  // namespace ess::trace
