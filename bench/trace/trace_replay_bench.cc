// Trace replay throughput: top-k lookups per second through LayerCache + a policy.
//   BM_ReplayLayer/<policy>: one request-layer at a time on one core (the analyzer's unit of work);
//   BM_AnalyzeLru/threads:N: the analyzer's parallel replay (LRU only) over all request-layers.
// items_per_second is lookups/s (T x K ids per step, warm-up windows included).
// The trace: the shipped synthetic profile at 32K, MTP 2, 16 layers, 4 requests x 128 steps.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <memory>
#include <string>

#include "ess/cache/policies.h"
#include "ess/trace/analyzer.h"
#include "ess/trace/generator.h"

namespace {

using namespace ess;
using namespace ess::trace;

const std::string& trace_path() {
  static const std::string path = [] {
    const auto p = (std::filesystem::temp_directory_path() / "ess_trace_replay_bench.safetensors").string();
    GeneratorProfile prof = GeneratorProfile::shipped_default();
    prof.layers = 16;  // the drift curve is resampled over 16 layers
    GenerateConfig g;
    g.contexts = {32768};
    g.requests = 4;
    g.steps = 128;
    g.seed = 9;
    generate_trace(prof, g, p);
    return p;
  }();
  return path;
}

const TraceReader& reader() {
  static const TraceReader r(trace_path());
  return r;
}

void BM_ReplayLayer(benchmark::State& state, const std::string& policy) {
  const auto& r = reader();
  const std::int32_t slots = 6554;
  std::int64_t lookups = 0;
  int layer = 0;
  for (auto _ : state) {
    const auto& req = r.request(static_cast<std::size_t>(layer / 16) % r.requests());
    LayerReplay x = policy == "belady"
                        ? replay_layer_belady(req, layer % 16, slots, true)
                        : replay_layer(req, layer % 16, slots, make_policy_factory(policy)(0, 0, slots), true);
    benchmark::DoNotOptimize(x.misses.data());
    lookups += x.lookups;
    ++layer;
  }
  state.SetItemsProcessed(lookups);
  state.counters["lookups_per_s"] = benchmark::Counter(static_cast<double>(lookups), benchmark::Counter::kIsRate);
}

void BM_AnalyzeLru(benchmark::State& state) {
  const auto& r = reader();
  AnalyzeConfig c;
  c.policies = {"lru_warmup"};
  c.slots = {6554};
  c.similarity = c.prefetch = c.recommend = false;
  c.threads = static_cast<int>(state.range(0));
  std::int64_t lookups = 0;
  double replay = 0;
  for (auto _ : state) {
    const auto res = analyze(r, c);
    lookups += res.lookups;
    replay += res.replay_seconds;
  }
  state.SetItemsProcessed(lookups);
  state.counters["replay_lookups_per_s"] = benchmark::Counter(static_cast<double>(lookups) / replay);
}

}  // namespace

BENCHMARK_CAPTURE(BM_ReplayLayer, lru, std::string("lru"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ReplayLayer, fifo, std::string("fifo"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ReplayLayer, clock, std::string("clock"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ReplayLayer, lfu, std::string("lfu"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ReplayLayer, s3fifo, std::string("s3fifo"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ReplayLayer, belady, std::string("belady"))->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AnalyzeLru)->Arg(1)->Arg(2)->Arg(4)->Arg(8)->Arg(16)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
