// ess bench: measurements on the GPU (CUDA target + a device). `transfer` compares
// FlashTrans with per-entry, batched and bulk copies, `swap` times the GPU swap engine;
// attention and indexer are in bench_kernels.cc, step and profile in bench_step.cc.
#include <fmt/format.h>

#include <limits>

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
    int requests = 64, misses = 256, repeats = 20, device = 0;
    long long context = 32768;
    int slots = 6554;
    std::uint64_t seed = 1;
    std::vector<int> blocks;
    bool concurrent = false;
    int attention_batch = 128;
    Format format = Format::kTable;
  };
  auto a = std::make_shared<Args>();
  transfer->add_option("--requests,-b", a->requests, "Requests in the batch")->capture_default_str()
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  transfer->add_option("--misses,-m", a->misses, "Misses per request")->capture_default_str()
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  transfer->add_option("--context,-c", a->context, "Host-pool tokens per request")->capture_default_str()
      ->check(in_range(1, 1 << 30));
  transfer->add_option("--slots", a->slots, "Device slots per request")->capture_default_str()
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  transfer->add_option("--repeats,-r", a->repeats, "Timed runs per method")->capture_default_str()
      ->check(in_range(1, 1 << 20));
  transfer->add_option("--device", a->device, "CUDA device")->capture_default_str()
      ->check(in_range(0, 1023));
  transfer->add_option("--seed", a->seed, "Random seed")->capture_default_str()->check(unsigned_integer());
  add_list_option(*transfer, "--blocks", a->blocks, "FlashTrans grid sizes to sweep, comma-separated (e.g. 8,16,32,64,132,1056)");
  transfer->add_flag("--concurrent", a->concurrent, "Sweep also beside a sparse MLA decode (copy bandwidth, attention slowdown)");
  transfer->add_option("--attention-batch", a->attention_batch, "Batch of that decode (T 2, 128 heads, top-k 2048)")
      ->capture_default_str()
      ->check(in_range(1, 4096));
  add_format_option(*transfer, a->format, false);
  transfer->callback([a, &exit_code] {
    cuda::TransferBenchConfig c;
    c.requests = a->requests;
    c.misses_per_request = a->misses;
    c.context = a->context;
    c.slots = a->slots;
    c.repeats = a->repeats;
    c.device = a->device;
    c.seed = a->seed;
    for (int b : a->blocks) ESS_CHECK(b >= 1 && b <= 65535, "--blocks: {} must be in [1, 65535]", b);
    c.blocks = a->blocks;
    c.concurrent = a->concurrent;
    c.attention_batch = a->attention_batch;
    const auto r = harness::gpu_benchmarks("bench transfer").transfer(c);
    print_report(c, r, a->format);
    exit_code = r.verified ? 0 : 1;
  });

  CLI::App* swap = bench->add_subcommand(
      "swap", "Time the GPU swap engine: one launch decides hits, misses and victims for a whole batch");
  struct SwapArgs {
    int requests = 128, mtp = 2, topk = 2048, fresh = 100, repeats = 50, device = 0, layers = 61;
    int slots = 6554;
    long long context = 32768;
    std::uint64_t seed = 1;
    Format format = Format::kTable;
  };
  auto sa = std::make_shared<SwapArgs>();
  swap->add_option("--requests,-b", sa->requests, "Requests in the batch")->capture_default_str()
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  swap->add_option("--mtp,-t", sa->mtp, "Query tokens per request (MTP T)")->capture_default_str()
      ->check(in_range(1, 32));
  swap->add_option("--topk,-k", sa->topk, "Entries per query token")->capture_default_str()
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  swap->add_option("--slots", sa->slots, "Slots per request")->capture_default_str()
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  swap->add_option("--context,-c", sa->context, "Tokens per request")->capture_default_str()
      ->check(in_range(1, 1 << 30));
  swap->add_option("--fresh", sa->fresh, "Ids replaced per query per step (sets the miss rate)")->capture_default_str()
      ->check(in_range(0, std::numeric_limits<std::int32_t>::max()));
  swap->add_option("--repeats,-r", sa->repeats, "Timed steps (each launches every layer)")->capture_default_str()
      ->check(in_range(1, 1 << 20));
  swap->add_option("--layers", sa->layers, "Layers whose state the launches walk")->capture_default_str()
      ->check(in_range(1, 4096));
  swap->add_option("--device", sa->device, "CUDA device")->capture_default_str()
      ->check(in_range(0, 1023));
  swap->add_option("--seed", sa->seed, "Random seed")->capture_default_str()->check(unsigned_integer());
  add_format_option(*swap, sa->format, false);
  swap->callback([sa] {
    cuda::SwapBenchConfig c;
    c.requests = sa->requests;
    c.query_tokens = sa->mtp;
    c.topk = sa->topk;
    c.slots = sa->slots;
    c.context = sa->context;
    c.fresh_per_query = sa->fresh;
    c.repeats = sa->repeats;
    c.layers = sa->layers;
    c.device = sa->device;
    c.seed = sa->seed;
    print_report(c, harness::gpu_benchmarks("bench swap").swap(c), sa->format);
  });
  add_bench_kernels(*bench, exit_code);
  add_bench_step(*bench, exit_code);
}

}  // namespace ess::cli
