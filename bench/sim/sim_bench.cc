// Sweep speed of the simulator (analytical mode): configurations evaluated per second on one
// core. Target: >= 10,000 configurations/s. Each configuration resolves the batch's
// Sparse Memory Ratio through the memory model and times one decode step of the 61-layer
// model (+ MTP draft) with TBO. Report: items_per_second; --benchmark_repetitions=5 for
// min / median / max, --benchmark_format=json for scripts.
#include <benchmark/benchmark.h>

#include <vector>

#include "ess/sim/sweep.h"

namespace {

using namespace ess::sim;
using ess::OverlapMode;

std::vector<Workload> workloads(OverlapMode mode, std::int64_t context) {
  std::vector<Workload> w;
  for (int b = 56; b <= 200; ++b) {
    Workload x;
    x.batch = b;
    x.context = context;
    x.overlap = mode;
    w.push_back(x);
  }
  return w;
}

void BM_SweepConfigurations(benchmark::State& state) {
  const StepModel sm(ess::ModelSpec::deepseek_v32_exp(), HardwareProfile::shipped("paper-table1"),
                     Deployment::shipped("paper-table1"));
  const auto mode = static_cast<OverlapMode>(state.range(0));
  const std::vector<Workload> w = workloads(mode, 32768);
  std::size_t done = 0;
  for (auto _ : state) {
    const auto results = sweep(sm, w);
    benchmark::DoNotOptimize(results.data());
    done += results.size();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(done));
  state.SetLabel(std::string(to_string(mode)));
}
BENCHMARK(BM_SweepConfigurations)
    ->Arg(static_cast<int>(OverlapMode::kNone))
    ->Arg(static_cast<int>(OverlapMode::kDualAttention))
    ->Arg(static_cast<int>(OverlapMode::kDualBatchAttention))
    ->Arg(static_cast<int>(OverlapMode::kLayerWise))
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
