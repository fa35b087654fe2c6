// ess bench attention | indexer: the sparse MLA decode and the lightning indexer + top-k on
// the GPU, timed with CUDA events.
#include "commands.h"

// bench indexer
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ess/core/error.h"
#include "ess/ops/sparse_mla.h"
#include "harness/gpu_benchmarks.h"

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
      ->capture_default_str();
  cmd->add_option("--mtp,-t", a->mtp, "Query tokens per request (MTP T)")->capture_default_str();
  cmd->add_option("--heads", a->heads, "Attention heads (64 or 128)")->capture_default_str();
  cmd->add_option("--topk,-k", a->topk, "Slot ids per query token")->capture_default_str();
  cmd->add_option("--slots", a->slots, "Slots per request (ids are distinct, so at least --topk)")->capture_default_str();
  cmd->add_option("--batches", a->batches, "Batch sizes to time, comma-separated (default: --batch)")->delimiter(',');
  cmd->add_flag("--batch-sweep", a->sweep, "Time batch sizes 1, 8, 32, 64 and 128");
  cmd->add_option("--softmax-scale", a->softmax_scale, "Softmax scale (0: 1/sqrt(192), DeepSeek-V3.2's)")
      ->capture_default_str();
  cmd->add_option("--repeats,-r", a->repeats, "Timed launches per batch size")->capture_default_str();
  cmd->add_option("--warmup", a->warmup, "Untimed launches first, per batch size")->capture_default_str();
  cmd->add_option("--device", a->device, "CUDA device")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Random seed")->capture_default_str();
  add_format_option(*cmd, a->format);
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
    // Headline: the point at --batch when it was timed, else the last one.
    const cuda::AttentionBenchPoint* head = &r.points.back();
    for (const auto& pt : r.points) head = pt.batch == c.batch ? &pt : head;
    constexpr double kFlashMlaH800 = 410, kTarget = 150;
    if (a->format == Format::kJson) {
      const auto summary = [](const Summary& s) {
        return nlohmann::json{{"median", s.median}, {"min", s.min}, {"max", s.max}};
      };
      nlohmann::json points = nlohmann::json::array();
      for (const auto& pt : r.points) {
        points.push_back({{"batch", pt.batch},
                          {"us", summary(pt.us)},
                          {"tflops", pt.tflops},
                          {"tflops_best", pt.tflops_best},
                          {"bytes_per_call", pt.bytes_per_call},
                          {"gbps", pt.gbps}});
      }
      const nlohmann::json j = {
          {"benchmark", "attention"},
          {"device", r.device},
          {"date", r.date},
          {"statistic", fmt::format("median (min, max) of {} launches after {} warm-up launches, CUDA events, per "
                                    "batch size",
                                    c.repeats, c.warmup)},
          {"params",
           {{"batch", c.batch},
            {"query_tokens", c.query_tokens},
            {"heads", c.heads},
            {"topk", c.topk},
            {"slots", c.slots},
            {"softmax_scale", r.softmax_scale},
            {"seed", c.seed}}},
          {"verified", r.verified},
          {"verified_tokens", r.verified_tokens},
          {"worst_error_over_bound", r.verify_worst},
          {"headline_batch", head->batch},
          {"us", summary(head->us)},
          {"tflops", head->tflops},
          {"tflops_best", head->tflops_best},
          {"flops_per_call", cuda::sparse_mla_flops(head->batch, c.query_tokens, c.heads, c.topk)},
          {"bytes_per_call", head->bytes_per_call},
          {"gbps", head->gbps},
          {"flashmla_h800_tflops", kFlashMlaH800},
          {"target_tflops", kTarget},
          {"batches", points}};
      fmt::print("{}\n", j.dump(2));
    } else {
      fmt::print("ess bench attention on {} ({}): T {} x {} heads x top-k {}, {} slots per request; median (min, max) "
                 "of {} launches\n",
                 r.device, r.date, c.query_tokens, c.heads, c.topk, c.slots, c.repeats);
      fmt::print("checked against the CPU reference at batch {} ({} query tokens, worst error / bound {:.3f}): {}\n\n",
                 c.batch, r.verified_tokens, r.verify_worst, r.verified ? "yes" : "NO");
      fmt::print("{:>6} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}\n", "batch", "median us", "min", "max", "TFLOP/s",
                 "best", "GB/s");
      for (const auto& pt : r.points) {
        fmt::print("{:>6} {:>10.1f} {:>10.1f} {:>10.1f} {:>9.1f} {:>9.1f} {:>9.0f}\n", pt.batch, pt.us.median, pt.us.min,
                   pt.us.max, pt.tflops, pt.tflops_best, pt.gbps);
      }
      fmt::print("\ntarget >= {:.0f} TFLOP/s at batch 128, T 2, 128 heads, top-k 2048 (FlashMLA's FP8 sparse decode on "
                 "H800: {:.0f}); GB/s counts each selected entry once per query token\n",
                 kTarget, kFlashMlaH800);
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
  cmd->add_option("--requests,-b", a->requests, "Requests in the batch")->capture_default_str();
  cmd->add_option("--mtp,-t", a->mtp, "Query tokens per request (MTP T)")->capture_default_str();
  cmd->add_option("--context,-c", a->context, "Tokens per request")->capture_default_str();
  cmd->add_option("--heads", a->heads, "Indexer heads (16, 32, 48 or 64)")->capture_default_str();
  cmd->add_option("--topk,-k", a->topk, "Entries selected per query token (at most 2048)")->capture_default_str();
  cmd->add_option("--repeats,-r", a->repeats, "Timed steps")->capture_default_str();
  cmd->add_option("--warmup", a->warmup, "Untimed steps first")->capture_default_str();
  cmd->add_option("--device", a->device, "CUDA device")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Random seed")->capture_default_str();
  add_format_option(*cmd, a->format);
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
    const double hbm_fraction = r.hbm_peak_gbps > 0 ? r.logits_gbps / r.hbm_peak_gbps : 0.0;
    const auto summary = [](const Summary& s) {
      return nlohmann::json{{"median", s.median}, {"min", s.min}, {"max", s.max}};
    };
    if (a->format == Format::kJson) {
      nlohmann::json j = {
          {"benchmark", "indexer"},
          {"device", r.device},
          {"date", r.date},
          {"statistic", fmt::format("median (min, max) of {} steps after {} warm-up steps, CUDA events, per layer",
                                    c.repeats, c.warmup)},
          {"params",
           {{"requests", c.batch},
            {"query_tokens", c.query_tokens},
            {"context", c.context},
            {"heads", c.heads},
            {"head_dim", 128},
            {"page_tokens", 64},
            {"topk", c.topk},
            {"seed", c.seed}}},
          {"verified", r.verified},
          {"results",
           {{"logits_us", summary(r.logits_us)},
            {"topk_us", summary(r.topk_us)},
            {"indexer_us", summary(r.indexer_us)},
            {"logits_gbps", r.logits_gbps},
            {"hbm_peak_gbps", r.hbm_peak_gbps},
            {"logits_fraction_of_hbm_peak", hbm_fraction},
            {"logits_tflops", r.logits_tflops},
            {"bytes_read_per_layer", r.bytes_read},
            {"page_bytes_per_layer", r.page_bytes},
            {"bytes_written_per_layer", r.bytes_written},
            {"keys_per_layer", r.keys},
            {"flops_per_layer", r.flops},
            {"worst_logit_error_over_bound", r.worst_error_over_bound}}}};
      if (!r.verified) j["verify_note"] = r.verify_note;
      fmt::print("{}\n", j.dump(2));
    } else {
      fmt::print("ess bench indexer on {} ({}): batch {} x T {}, context {}, {} heads, top-k {}; per layer, median "
                 "(min, max) of {} steps\n",
                 r.device, r.date, c.batch, c.query_tokens, c.context, c.heads, c.topk, c.repeats);
      fmt::print("verified against the CPU reference (logits within bound, top-k bit for bit): {}{}\n\n",
                 r.verified ? "yes" : "NO", r.verified ? std::string() : fmt::format(" ({})", r.verify_note));
      fmt::print("{:<16} {:>10} {:>10} {:>10}\n", "", "median us", "min", "max");
      const auto line = [](const char* what, const Summary& s) {
        fmt::print("{:<16} {:>10.1f} {:>10.1f} {:>10.1f}\n", what, s.median, s.min, s.max);
      };
      line("logits", r.logits_us);
      line("top-k", r.topk_us);
      line("logits + top-k", r.indexer_us);
      fmt::print("\nlogits: {:.1f} MB read per layer, {:.0f} GB/s ({:.0f} % of the {:.0f} GB/s HBM peak), {:.1f} TFLOP/s\n",
                 r.bytes_read / 1e6, r.logits_gbps, 100.0 * hbm_fraction, r.hbm_peak_gbps, r.logits_tflops);
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
