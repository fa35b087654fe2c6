// ess bench: measurements on the GPU (CUDA target + a device). `transfer` compares
// FlashTrans with per-entry, batched and bulk copies, `swap` times the GPU swap engine;
// attention and indexer are in bench_kernels.cc, step and profile in bench_step.cc.
#include <fmt/format.h>

#include <limits>

#include "bench_options.h"
#include "commands.h"
#include "ess/core/error.h"
#include "harness/gpu_benchmarks.h"
#include "harness/report/report.h"

namespace ess::cli {
namespace {

// A benchmark's report in the chosen format (tables and JSON only).
template <typename Config, typename Result>
void print_report(const Config& c, const Result& r, Format format) {
  if (format == Format::kJson) {
    fmt::print("{}\n", harness::to_json(c, r).dump(2));
  } else {
    fmt::print("{}", harness::to_table(c, r));
  }
}

}  // namespace

void add_bench(CLI::App& app, int& exit_code) {
  CLI::App* bench = app.add_subcommand("bench", "GPU benchmarks (need the CUDA target and a CUDA device)");
  bench->require_subcommand(1);
  CLI::App* transfer = bench->add_subcommand(
      "transfer",
      "Copy one layer's misses between the pinned host pool and device slots with FlashTrans, per-entry "
      "cudaMemcpyAsync, cudaMemcpyBatchAsync and one bulk copy, both directions");
  struct Args {
    BenchOptions o;
    int misses = 256;
    std::vector<int> blocks;
    bool concurrent = false;
    int attention_batch = 128;
  };
  auto a = std::make_shared<Args>();
  a->o.add_requests(*transfer, "Requests in the batch");
  transfer->add_option("--misses,-m", a->misses, "Misses per request")->capture_default_str()
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  a->o.add_context(*transfer, "Host-pool tokens per request");
  a->o.add_slots(*transfer, "Device slots per request");
  a->o.add_repeats(*transfer, "Timed runs per method");
  add_list_option(*transfer, "--blocks", a->blocks, "FlashTrans grid sizes to sweep, comma-separated (e.g. 8,16,32,64,132,1056)");
  transfer->add_flag("--concurrent", a->concurrent, "Sweep also beside a sparse MLA decode (copy bandwidth, attention slowdown)");
  transfer->add_option("--attention-batch", a->attention_batch, "Batch of that decode (T 2, 128 heads, top-k 2048)")
      ->capture_default_str()
      ->check(in_range(1, 4096));
  a->o.add_run(*transfer);
  transfer->callback([a, &exit_code] {
    cuda::FlashTransBenchConfig c;
    c.requests = a->o.requests;
    c.misses_per_request = a->misses;
    c.context = a->o.context;
    c.slots = a->o.slots;
    c.repeats = a->o.repeats;
    c.device = a->o.device;
    c.seed = a->o.seed;
    for (int b : a->blocks) ESS_CHECK(b >= 1 && b <= 65535, "--blocks: {} must be in [1, 65535]", b);
    c.blocks = a->blocks;
    c.concurrent = a->concurrent;
    c.attention_batch = a->attention_batch;
    const auto r = harness::gpu_benchmarks("bench transfer").transfer(c);
    print_report(c, r, a->o.format);
    exit_code = r.verified ? 0 : 1;
  });

  CLI::App* swap = bench->add_subcommand(
      "swap", "Time the GPU swap engine: one launch decides hits, misses and victims for a whole batch");
  struct SwapArgs {
    BenchOptions o;
    int fresh = 100, layers = 61, cluster = 0;
  };
  auto sa = std::make_shared<SwapArgs>();
  sa->o.requests = 128;
  sa->o.repeats = 50;
  sa->o.add_requests(*swap, "Requests in the batch");
  sa->o.add_mtp(*swap);
  sa->o.add_topk(*swap, "Entries per query token");
  sa->o.add_slots(*swap, "Slots per request");
  sa->o.add_context(*swap, "Tokens per request");
  swap->add_option("--fresh", sa->fresh, "Ids replaced per query per step (sets the miss rate)")->capture_default_str()
      ->check(in_range(0, std::numeric_limits<std::int32_t>::max()));
  sa->o.add_repeats(*swap, "Timed steps (each launches every layer)");
  swap->add_option("--layers", sa->layers, "Layers whose state the launches walk")->capture_default_str()
      ->check(in_range(1, 4096));
  swap->add_option("--cluster", sa->cluster,
                   "Blocks that decide each request's step (a thread-block cluster): 0 = the engine's choice (up to 8 "
                   "at a small batch, 1 at a large one), or 1, 2, 4, 8")
      ->capture_default_str()
      ->check(CLI::IsMember({0, 1, 2, 4, 8}));
  sa->o.add_run(*swap);
  swap->callback([sa] {
    cuda::SwapEngineBenchConfig c;
    c.requests = sa->o.requests;
    c.query_tokens = sa->o.mtp;
    c.topk = sa->o.topk;
    c.slots = sa->o.slots;
    c.context = sa->o.context;
    c.fresh_per_query = sa->fresh;
    c.repeats = sa->o.repeats;
    c.layers = sa->layers;
    c.device = sa->o.device;
    c.seed = sa->o.seed;
    c.cluster = sa->cluster;
    print_report(c, harness::gpu_benchmarks("bench swap").swap(c), sa->o.format);
  });
  add_bench_kernels(*bench, exit_code);
  add_bench_step(*bench, exit_code);
}

}  // namespace ess::cli
