// Host cost of one Offload::step call on the CPU backend (ess/runtime/offload.h): the front's
// checks, the swap engine's decision, the fetch of the misses (memcpy of 656-byte entries from
// the Total Memory Pool into the layer buffer) and every output (physical rows, counts and,
// with the DA split, the resident / fetched lists). One layer, decode-like top-k sequences
// (decode_ids.h) at steady state. Beside it, in the same run, the swap engine's decision alone
// (SwapEngine::step), so the ratio of the two is the step's cost over the decision's. The
// fetch variant "copy = 0" (LayerStep::fetch = false) takes the memcpy out.
//
//   offload_step_bench [--benchmark_format=json] [--benchmark_repetitions=5]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "decode_ids.h"
#include "ess/runtime/offload.h"

namespace {

using namespace ess;
using bench::make_steps;
using bench::Shape;

Shape shape_of(const benchmark::State& state) {
  return {static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), 2048, state.range(2), 0.2,
          static_cast<int>(state.range(3))};
}

// Admits the shape's B requests of `context` tokens (one layer), their prompts' entries written as an engine
// writes them (the pages are then resident, as in use) and loaded by warm-up (a whole request's into its rows).
void admit_prompts(Offload& o, const Shape& s, std::vector<std::int32_t>& rows, std::vector<std::int32_t>& lengths) {
  for (int b = 0; b < s.B; ++b) {
    rows.push_back(o.admit(b, s.context));
    lengths.push_back(static_cast<std::int32_t>(s.context));
    for (std::int64_t t = 0; t < s.context; ++t) std::ranges::fill(o.host_entry(b, 0, t), static_cast<std::uint8_t>(b + t));
    o.warmup(b, {}, 0);
  }
}

void BM_OffloadStep(benchmark::State& state) {
  const Shape s = shape_of(state);
  const bool split = state.range(4) != 0, fetch = state.range(5) != 0;
  OffloadConfig c;
  c.layers = 1;
  c.max_requests = s.B;
  c.query_tokens = s.T;
  c.topk = s.K;
  c.slots = slots_for_ratio(s.ratio, s.context);
  c.max_context = s.context;
  Offload o(c);
  std::vector<std::int32_t> rows, lengths;
  admit_prompts(o, s, rows, lengths);
  const auto steps = make_steps(s, 96, 1);
  const std::size_t n = static_cast<std::size_t>(s.B) * s.T * s.K;
  std::vector<std::int32_t> physical(n), resident(n), fetched(n), counts(2 * static_cast<std::size_t>(s.B));
  std::vector<std::int32_t> resident_count(static_cast<std::size_t>(s.B) * s.T), fetched_count(resident_count.size());
  LayerStep st;
  st.batch = s.B;
  st.rows = rows.data();
  st.lengths = lengths.data();
  st.physical = physical.data();
  st.counts = counts.data();
  st.fetch = fetch;
  if (split) {
    st.resident = resident.data();
    st.fetched = fetched.data();
    st.resident_count = resident_count.data();
    st.fetched_count = fetched_count.data();
  }
  for (const auto& ids : steps) {  // steady state, outside the timing
    st.topk = ids.data();
    o.step(st);
  }
  std::size_t i = 0;
  std::int64_t misses = 0;
  for (auto _ : state) {
    st.topk = steps[i].data();
    o.step(st);
    benchmark::DoNotOptimize(physical.data());
    for (int b = 0; b < s.B; ++b) misses += counts[2 * static_cast<std::size_t>(b) + 1];
    i = (i + 1) % steps.size();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));  // top-k ids placed
  state.counters["slots"] = c.slots;
  state.counters["misses_per_request_step"] =
      static_cast<double>(misses) / static_cast<double>(std::max<std::int64_t>(state.iterations() * s.B, 1));
}

// The decision alone: SwapEngine::step over the same sequences (no fetch, no outputs).
void BM_SwapDecision(benchmark::State& state) {
  const Shape s = shape_of(state);
  bench::SwapDecision d(s, make_steps(s, 96, 1));
  std::size_t i = 0;
  for (auto _ : state) benchmark::DoNotOptimize(d.step(i++).slot_ids.data());
  state.SetItemsProcessed(state.iterations() * s.B * s.T * s.K);
}

// Residency (OffloadConfig::residency): the same step with every request whole (its ids mapped to
// its own rows: no decision, no copy) against every request sparse (the swap engine and the
// fetch), at small batches; reserved newest rows in both.
void BM_OffloadResidency(benchmark::State& state) {
  const Shape s{static_cast<int>(state.range(0)), 2, 2048, 32768, 0.2, 100};
  const bool whole = state.range(1) != 0;
  OffloadConfig c;
  c.layers = 1;
  c.query_tokens = s.T;
  c.topk = s.K;
  c.slots = slots_for_ratio(s.ratio, s.context);
  c.max_context = s.context + 2 * s.T;
  c.reserve_newest = true;
  c.residency = whole ? Residency::kWhole : Residency::kSparse;
  c.max_requests = whole ? s.B * c.whole_rows(s.context) : s.B;
  Offload o(c);
  std::vector<std::int32_t> rows, lengths;
  admit_prompts(o, s, rows, lengths);
  const auto steps = make_steps(s, 96, 1);
  const std::size_t n = static_cast<std::size_t>(s.B) * s.T * s.K;
  std::vector<std::int32_t> physical(n), counts(2 * static_cast<std::size_t>(s.B));
  LayerStep st;
  st.batch = s.B;
  st.rows = rows.data();
  st.lengths = lengths.data();
  st.physical = physical.data();
  st.counts = counts.data();
  for (const auto& ids : steps) {  // steady state, outside the timing
    st.topk = ids.data();
    o.step(st);
  }
  std::size_t i = 0;
  for (auto _ : state) {
    st.topk = steps[i].data();
    o.step(st);
    benchmark::DoNotOptimize(physical.data());
    i = (i + 1) % steps.size();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));
  const OffloadStats stats = o.stats();
  state.counters["swap_launches"] = static_cast<double>(stats.swap_launches);
  state.counters["misses"] = static_cast<double>(stats.misses);
}

// Args: B, T, context, fresh ids per query per step[, DA split, copy].
BENCHMARK(BM_OffloadStep)
    ->ArgNames({"B", "T", "ctx", "new", "split", "copy"})
    ->Args({1, 1, 32768, 100, 0, 1})
    ->Args({8, 2, 32768, 100, 0, 1})
    ->Args({64, 2, 32768, 100, 0, 1})
    ->Args({64, 2, 32768, 100, 1, 1})
    ->Args({64, 2, 32768, 100, 0, 0})
    ->Args({64, 2, 32768, 400, 0, 1})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_OffloadResidency)
    ->ArgNames({"B", "whole"})
    ->ArgsProduct({{1, 2, 8}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SwapDecision)
    ->ArgNames({"B", "T", "ctx", "new"})
    ->Args({1, 1, 32768, 100})
    ->Args({8, 2, 32768, 100})
    ->Args({64, 2, 32768, 100})
    ->Args({64, 2, 32768, 400})
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
