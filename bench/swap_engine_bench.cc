// CPU swap engine throughput: top-k lookups per second for one layer of a decode batch.
// Default shape (target >= 50 M lookups/s on one core): B = 64 requests, T = 2 MTP
// query tokens, K = 2048, 6,554 slots (ratio 0.2 of 32K), context 32K. The top-k sequence
// has the temporal locality of decode: each query keeps most of its previous selection and
// draws `new_per_query` fresh ids, about 200 misses per request-step at the defaults.
//
//   swap_engine_bench [--benchmark_format=json] [--benchmark_repetitions=5]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "decode_ids.h"

namespace {

using namespace ess;
using bench::make_steps;
using bench::Shape;

void BM_SwapEngineStep(benchmark::State& state) {
  const Shape s{static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), static_cast<int>(state.range(2)),
                state.range(3), 0.2, static_cast<int>(state.range(4))};
  bench::SwapDecision d(s, make_steps(s, 96, 1));  // warmed to steady state outside the timing
  std::size_t i = 0;
  std::int64_t misses = 0, request_steps = 0;
  for (auto _ : state) {
    const SwapResult& r = d.step(i++);
    benchmark::DoNotOptimize(r.slot_ids.data());
    misses += r.total.misses;
    request_steps += s.B;
  }
  state.SetItemsProcessed(state.iterations() * s.B * s.T * s.K);  // top-k lookups
  state.counters["slots"] = d.sparse.slots();
  state.counters["misses_per_request_step"] = static_cast<double>(misses) / static_cast<double>(std::max<std::int64_t>(request_steps, 1));
}

// Args: B, T, K, context, fresh ids per query per step.
BENCHMARK(BM_SwapEngineStep)
    ->ArgNames({"B", "T", "K", "ctx", "new"})
    ->Args({64, 2, 2048, 32768, 100})
    ->Args({64, 2, 2048, 32768, 400})
    ->Args({128, 2, 2048, 32768, 100})
    ->Args({64, 2, 2048, 32768, 25})
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
