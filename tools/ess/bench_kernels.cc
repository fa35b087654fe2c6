// ess bench attention | indexer: the sparse MLA decode and the lightning indexer + top-k on
// the GPU, timed with CUDA events.
#include <fmt/format.h>

#include <limits>

#include <memory>
#include <vector>

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
    int batch = 128, mtp = 2, heads = 128, topk = 2048, slots = 6554, repeats = 20, warmup = 5, device = 0;
    std::vector<int> batches;
    bool sweep = false;
    float softmax_scale = 0.0f;
    std::uint64_t seed = 1;
    Format format = Format::kTable;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--batch,-b", a->batch, "Requests in the batch (the checked call and the headline numbers)")
      ->capture_default_str()
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  cmd->add_option("--mtp,-t", a->mtp, "Query tokens per request (MTP T)")->capture_default_str()
      ->check(in_range(1, 32));
  cmd->add_option("--heads", a->heads, "Attention heads (64 or 128)")->capture_default_str()
      ->check(in_range(64, 128));
  cmd->add_option("--topk,-k", a->topk, "Slot ids per query token")->capture_default_str()
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  cmd->add_option("--slots", a->slots, "Slots per request (ids are distinct, so at least --topk)")->capture_default_str()
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  add_list_option(*cmd, "--batches", a->batches, "Batch sizes to time, comma-separated (default: --batch)");
  cmd->add_flag("--batch-sweep", a->sweep, "Time batch sizes 1, 8, 32, 64 and 128");
  cmd->add_option("--softmax-scale", a->softmax_scale, "Softmax scale (0: 1/sqrt(192), DeepSeek-V3.2's)")
      ->capture_default_str()
      ->check(in_range(0, std::numeric_limits<float>::max()));
  cmd->add_option("--repeats,-r", a->repeats, "Timed launches per batch size")->capture_default_str()
      ->check(in_range(1, 1 << 20));
  cmd->add_option("--warmup", a->warmup, "Untimed launches first, per batch size")->capture_default_str()
      ->check(in_range(0, 1 << 20));
  cmd->add_option("--device", a->device, "CUDA device")->capture_default_str()
      ->check(in_range(0, 1023));
  cmd->add_option("--seed", a->seed, "Random seed")->capture_default_str()->check(unsigned_integer());
  add_format_option(*cmd, a->format, false);
  cmd->callback([a, &exit_code] {
    cuda::AttentionBenchConfig c;
    c.batch = a->batch;
    c.query_tokens = a->mtp;
    c.heads = a->heads;
    c.topk = a->topk;
    c.slots = a->slots;
    c.softmax_scale = a->softmax_scale;
    c.repeats = a->repeats;
    c.warmup = a->warmup;
    c.device = a->device;
    c.seed = a->seed;
    const std::vector<int> batches = a->sweep ? std::vector<int>{1, 8, 32, 64, 128} : a->batches;
    const cuda::AttentionBenchResult r = harness::gpu_benchmarks("bench attention").attention(c, batches);
    if (a->format == Format::kJson) {
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
    int requests = 64, mtp = 2, heads = 64, topk = 2048, repeats = 50, warmup = 5, device = 0;
    long long context = 32768;
    std::uint64_t seed = 1;
    Format format = Format::kTable;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--requests,-b", a->requests, "Requests in the batch")->capture_default_str()
      ->check(in_range(1, 65535));
  cmd->add_option("--mtp,-t", a->mtp, "Query tokens per request (MTP T)")->capture_default_str()
      ->check(in_range(1, 32));
  cmd->add_option("--context,-c", a->context, "Tokens per request")->capture_default_str()
      ->check(in_range(2, 1 << 30));
  cmd->add_option("--heads", a->heads, "Indexer heads (16, 32, 48 or 64)")->capture_default_str()
      ->check(in_range(16, 64));
  cmd->add_option("--topk,-k", a->topk, "Entries selected per query token (at most 2048)")->capture_default_str()
      ->check(in_range(1, 2048));
  cmd->add_option("--repeats,-r", a->repeats, "Timed steps")->capture_default_str()
      ->check(in_range(1, 1 << 20));
  cmd->add_option("--warmup", a->warmup, "Untimed steps first")->capture_default_str()
      ->check(in_range(0, 1 << 20));
  cmd->add_option("--device", a->device, "CUDA device")->capture_default_str()
      ->check(in_range(0, 1023));
  cmd->add_option("--seed", a->seed, "Random seed")->capture_default_str()->check(unsigned_integer());
  add_format_option(*cmd, a->format, false);
  cmd->callback([a, &exit_code] {
    cuda::IndexerBenchConfig c;
    c.batch = a->requests;
    c.query_tokens = a->mtp;
    c.context = a->context;
    c.heads = a->heads;
    c.topk = a->topk;
    c.repeats = a->repeats;
    c.warmup = a->warmup;
    c.device = a->device;
    c.seed = a->seed;
    const cuda::IndexerBenchResult r = harness::gpu_benchmarks("bench indexer").indexer(c);
    if (a->format == Format::kJson) {
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
