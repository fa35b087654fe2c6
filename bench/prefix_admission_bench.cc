// Admission of a request into the Total Memory Pool, DeepSeek-V3.2's geometry (62 cache
// layers, 656-B entries), against the prompt length: a fresh admission (every page taken and
// zeroed; the engine then copies every entry in) beside one on the host prefix cache (the
// cached pages shared, only the rest taken and zeroed), at a share of 0, 50 and 90 % of the
// prompt. The arena is touched once before the timing (steady state, no first-touch faults).
//
//   prefix_admission_bench [--benchmark_format=json] [--benchmark_repetitions=5]
#include <benchmark/benchmark.h>

#include <vector>

#include "ess/cache/total_pool.h"
#include "ess/model/entry_layout.h"
#include "ess/model/model_spec.h"

namespace {

using namespace ess;

constexpr int kLayers = 62;

void BM_Admission(benchmark::State& state) {
  const std::int64_t tokens = state.range(0);
  const int percent = static_cast<int>(state.range(1));
  const LatentLayout layout = LatentLayout::for_model(ModelSpec::deepseek_v32_exp());
  TotalPool pool(kLayers, layout, static_cast<std::uint64_t>((2 * tokens / 64 + 4) * kLayers) * 64 * layout.bytes(),
                 HostMemoryKind::kAligned);
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(tokens));
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(i * 2654435761u % 100000);
  std::vector<std::int32_t> shared(prompt.begin(), prompt.begin() + tokens * percent / 100);
  pool.admit(0, static_cast<std::int64_t>(shared.size()) + 1);
  pool.publish(0, prefix_page_hashes(shared));
  const std::vector<std::uint64_t> hashes = prefix_page_hashes(prompt);
  pool.admit(1, tokens);  // touch the arena once: the timing is of admissions, not of page faults
  pool.release(1);
  std::int64_t reused = 0;
  for (auto _ : state) {
    reused = pool.admit_cached(1, tokens, hashes);
    state.PauseTiming();
    pool.release(1);
    state.ResumeTiming();
  }
  state.counters["reused_tokens"] = static_cast<double>(reused);
  state.counters["pages_taken"] = static_cast<double>(pool.pages_for(tokens) - reused / 64 * kLayers);
}

// Args: prompt tokens, percent of it on the prefix cache.
BENCHMARK(BM_Admission)->ArgNames({"tokens", "shared%"})->Args({32768, 0})->Args({32768, 50})->Args({32768, 90})
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
