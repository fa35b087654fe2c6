// ess bench attention | indexer: the sparse MLA decode and the lightning indexer + top-k on
// the GPU, timed with CUDA events.
#include <fmt/format.h>

#include <limits>

#include <memory>
#include <vector>

#include "bench_options.h"
#include "commands.h"
#include "harness/gpu_benchmarks.h"
#include "harness/report/report.h"

namespace ess::cli {
namespace {

// ---- bench attention -----------------------------------------------------------------------
void add_bench_attention(CLI::App& bench, int& exit_code) {
  CLI::App* cmd = bench.add_subcommand(
      "attention",
      "Time the sparse MLA decode (FP8 latent entries gathered by slot id, bf16 tensor cores) at decode-batch "
      "shapes, after checking one call against the CPU reference");
  struct Args {
    BenchOptions o;
    int heads = 128;
    std::vector<int> batches;
    bool sweep = false;
    float softmax_scale = 0.0f;
  };
  auto a = std::make_shared<Args>();
  a->o.requests = 128;
  a->o.add_requests(*cmd, "Requests in the batch (the checked call and the headline numbers)", BenchOptions::kInt32Max,
                    "--batch,-b");
  a->o.add_mtp(*cmd);
  cmd->add_option("--heads", a->heads, "Attention heads (64 or 128)")->capture_default_str()
      ->check(in_range(64, 128));
  a->o.add_topk(*cmd, "Slot ids per query token");
  a->o.add_slots(*cmd, "Slots per request (ids are distinct, so at least --topk)");
  add_list_option(*cmd, "--batches", a->batches, "Batch sizes to time, comma-separated (default: --batch)");
  cmd->add_flag("--batch-sweep", a->sweep, "Time batch sizes 1, 8, 32, 64 and 128");
  cmd->add_option("--softmax-scale", a->softmax_scale, "Softmax scale (0: 1/sqrt(192), DeepSeek-V3.2's)")
      ->capture_default_str()
      ->check(in_range(0, std::numeric_limits<float>::max()));
  a->o.add_repeats(*cmd, "Timed launches per batch size");
  a->o.add_warmup(*cmd, "Untimed launches first, per batch size");
  a->o.add_run(*cmd);
  cmd->callback([a, &exit_code] {
    cuda::SparseMlaBenchConfig c;
    c.batch = a->o.requests;
    c.query_tokens = a->o.mtp;
    c.heads = a->heads;
    c.topk = a->o.topk;
    c.slots = a->o.slots;
    c.softmax_scale = a->softmax_scale;
    c.repeats = a->o.repeats;
    c.warmup = a->o.warmup;
    c.device = a->o.device;
    c.seed = a->o.seed;
    const std::vector<int> batches = a->sweep ? std::vector<int>{1, 8, 32, 64, 128} : a->batches;
    const cuda::SparseMlaBenchResult r = harness::gpu_benchmarks("bench attention").attention(c, batches);
    if (a->o.format == Format::kJson) {
      fmt::print("{}\n", harness::to_json(c, r).dump(2));
    } else {
      fmt::print("{}", harness::to_table(c, r));
    }
    exit_code = r.verified ? 0 : 1;
  });
}

// ---- bench indexer -------------------------------------------------------------------------
void add_bench_indexer(CLI::App& bench, int& exit_code) {
  CLI::App* cmd = bench.add_subcommand(
      "indexer",
      "Time one layer's lightning indexer: FP8 logits of every query token over its request's paged indexer "
      "cache, then the top-k per query token (verified against the CPU references first)");
  struct Args {
    BenchOptions o;
    int heads = 64;
  };
  auto a = std::make_shared<Args>();
  a->o.repeats = 50;
  a->o.add_requests(*cmd, "Requests in the batch", 65535);
  a->o.add_mtp(*cmd);
  a->o.add_context(*cmd, "Tokens per request", 2);
  cmd->add_option("--heads", a->heads, "Indexer heads (16, 32, 48 or 64)")->capture_default_str()
      ->check(in_range(16, 64));
  a->o.add_topk(*cmd, "Entries selected per query token (at most 2048)", 2048);
  a->o.add_repeats(*cmd, "Timed steps");
  a->o.add_warmup(*cmd, "Untimed steps first");
  a->o.add_run(*cmd);
  cmd->callback([a, &exit_code] {
    cuda::IndexerBenchConfig c;
    c.batch = a->o.requests;
    c.query_tokens = a->o.mtp;
    c.context = a->o.context;
    c.heads = a->heads;
    c.topk = a->o.topk;
    c.repeats = a->o.repeats;
    c.warmup = a->o.warmup;
    c.device = a->o.device;
    c.seed = a->o.seed;
    const cuda::IndexerBenchResult r = harness::gpu_benchmarks("bench indexer").indexer(c);
    if (a->o.format == Format::kJson) {
      fmt::print("{}\n", harness::to_json(c, r).dump(2));
    } else {
      fmt::print("{}", harness::to_table(c, r));
    }
    exit_code = r.verified ? 0 : 1;
  });
}

}  // namespace

void add_bench_kernels(CLI::App& bench, int& exit_code) {
  add_bench_attention(bench, exit_code);
  add_bench_indexer(bench, exit_code);
}

}  // namespace ess::cli
