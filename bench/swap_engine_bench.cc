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
#include "ess/cache/sparse_pool.h"
#include "ess/cache/swap_engine.h"
#include "ess/cache/total_pool.h"

namespace {

using namespace ess;
using bench::make_steps;
using bench::Shape;

void BM_SwapEngineStep(benchmark::State& state) {
  const Shape s{static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), static_cast<int>(state.range(2)),
                state.range(3), 0.2, static_cast<int>(state.range(4))};
  const LatentLayout layout;
  TotalPool total(1, layout, static_cast<std::uint64_t>(s.B) * ((s.context + 63) / 64) * 64 * layout.bytes());
  SparsePoolConfig sc;
  sc.num_layers = 1;
  sc.layout = layout;
  sc.max_requests = s.B;
  sc.slots = slots_for_ratio(s.ratio, s.context);
  sc.query_tokens = s.T;
  sc.topk = s.K;
  SparsePool sparse(sc, std::make_unique<CpuSlotStorage>());
  SwapEngine engine(total, sparse);
  std::vector<RequestId> batch;
  std::vector<std::int64_t> lengths;
  for (int b = 0; b < s.B; ++b) {
    total.admit(b, s.context);
    engine.admit(b);
    batch.push_back(b);
    lengths.push_back(s.context);
  }
  const auto steps = make_steps(s, 96, 1);
  SwapResult r;
  // Warm the pools to steady state outside the timing.
  for (const auto& ids : steps) engine.step({0, batch, ids, lengths}, r);
  std::size_t i = 0;
  std::int64_t misses = 0, request_steps = 0;
  for (auto _ : state) {
    engine.step({0, batch, steps[i], lengths}, r);
    benchmark::DoNotOptimize(r.slot_ids.data());
    misses += r.total.misses;
    request_steps += s.B;
    i = (i + 1) % steps.size();
  }
  state.SetItemsProcessed(state.iterations() * s.B * s.T * s.K);  // top-k lookups
  state.counters["slots"] = sc.slots;
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
