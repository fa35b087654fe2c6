// ess bench: measurements on the GPU (CUDA target + a device). `transfer` compares
// FlashTrans with per-entry, batched and bulk copies; later issues add swap, attention,
// indexer (bench_kernels.cc), step and profile (bench_step.cc).
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "ess/core/error.h"

#include "harness/gpu_benchmarks.h"

namespace ess::cli {
namespace {

void print_transfer(const cuda::TransferBenchConfig& c, const cuda::TransferBenchResult& r, Format format) {
  if (format == Format::kJson) {
    nlohmann::json methods = nlohmann::json::object();
    for (const auto& s : r.stats) {
      nlohmann::json d = {{"available", s.available}};
      if (s.available) {
        d["gbps"] = s.median_gbps;
        d["gbps_min"] = s.min_gbps;
        d["gbps_max"] = s.max_gbps;
        d["median_us"] = s.median_us;
      } else {
        d["note"] = s.note;
      }
      methods[s.method][s.direction] = d;
    }
    const nlohmann::json j = {{"benchmark", "transfer"},
                              {"device", r.device},
                              {"date", r.date},
                              {"statistic", fmt::format("median (min, max) of {} runs after {} warm-up runs, CUDA events", c.repeats, c.warmup)},
                              {"params",
                               {{"requests", c.requests},
                                {"misses_per_request", c.misses_per_request},
                                {"entry_bytes", c.entry_bytes},
                                {"context", c.context},
                                {"slots", c.slots}}},
                              {"bytes_per_run", r.bytes_per_run},
                              {"entries_per_run", r.entries_per_run},
                              {"flashtrans_verified", r.verified},
                              {"flashtrans_default_blocks", r.default_blocks},
                              {"methods", methods}};
    nlohmann::json out = j;
    if (!r.sweep.empty()) {
      nlohmann::json pts = nlohmann::json::array();
      for (const auto& p : r.sweep) {
        nlohmann::json q = {{"blocks", p.blocks}, {"direction", p.direction}, {"gbps", p.gbps},
                            {"gbps_min", p.gbps_min}, {"gbps_max", p.gbps_max}};
        if (p.concurrent_gbps >= 0) {
          q["concurrent_gbps"] = p.concurrent_gbps;
          q["attention_us"] = p.attention_us;
          q["attention_slowdown"] = p.attention_slowdown;
        }
        pts.push_back(q);
      }
      out["grid_sweep"] = {{"points", pts},
                           {"attention_alone_us", r.attention_alone_us},
                           {"attention", c.concurrent ? fmt::format("sparse MLA decode, batch {}, T 2, 128 heads, "
                                                                    "top-k 2048, {} slots", c.attention_batch, c.slots)
                                                      : std::string("not run")},
                           {"recommended_blocks", {{"h2d", r.recommended_blocks_h2d}, {"d2h", r.recommended_blocks_d2h}}},
                           {"rule", "smallest block count within 5 % of the best bandwidth alone"}};
    }
    fmt::print("{}\n", out.dump(2));
    return;
  }
  fmt::print("ess bench transfer on {} ({}): {} requests x {} misses x {} B = {:.1f} MB per run; median of {} runs\n",
             r.device, r.date, c.requests, c.misses_per_request, c.entry_bytes, static_cast<double>(r.bytes_per_run) / 1e6,
             c.repeats);
  fmt::print("FlashTrans copies verified byte for byte: {}\n\n", r.verified ? "yes" : "NO");
  fmt::print("{:<18} {:>4} {:>10} {:>10} {:>10} {:>12}\n", "method", "dir", "GB/s", "min", "max", "median us");
  for (const auto& s : r.stats) {
    if (s.available) {
      fmt::print("{:<18} {:>4} {:>10.2f} {:>10.2f} {:>10.2f} {:>12.1f}\n", s.method, s.direction, s.median_gbps, s.min_gbps,
                 s.max_gbps, s.median_us);
    } else {
      fmt::print("{:<18} {:>4} {:>10}  ({})\n", s.method, s.direction, "n/a", s.note);
    }
  }
  fmt::print("(FlashTrans with its default grid: {} blocks)\n", r.default_blocks);
  if (r.sweep.empty()) return;
  fmt::print("\nFlashTrans grid sweep{}\n", c.concurrent ? fmt::format(" (beside: sparse MLA batch {} alone {:.1f} us)",
                                                                      c.attention_batch, r.attention_alone_us)
                                                        : std::string());
  fmt::print("{:>7} {:>4} {:>10} {:>10} {:>10} {:>12} {:>10}\n", "blocks", "dir", "GB/s", "min", "max", "GB/s beside",
             "attn x");
  for (const auto& p : r.sweep) {
    fmt::print("{:>7} {:>4} {:>10.2f} {:>10.2f} {:>10.2f} {:>12} {:>10}\n", p.blocks, p.direction, p.gbps, p.gbps_min,
               p.gbps_max, p.concurrent_gbps >= 0 ? fmt::format("{:.2f}", p.concurrent_gbps) : "",
               p.attention_slowdown >= 0 ? fmt::format("{:.3f}", p.attention_slowdown) : "");
  }
  fmt::print("recommended blocks (smallest within 5 % of the best alone): h2d {}, d2h {}\n", r.recommended_blocks_h2d,
             r.recommended_blocks_d2h);
}

void print_swap(const cuda::SwapBenchConfig& c, const cuda::SwapBenchResult& r, Format format) {
  if (format == Format::kJson) {
    const nlohmann::json j = {
        {"benchmark", "swap"},
        {"device", r.device},
        {"date", r.date},
        {"statistic", fmt::format("median (min, max) of {} launches after {} warm-up launches, CUDA events", c.repeats, c.steps)},
        {"params",
         {{"requests", c.requests},
          {"query_tokens", c.query_tokens},
          {"topk", c.topk},
          {"slots", c.slots},
          {"context", c.context},
          {"fresh_per_query", c.fresh_per_query}}},
        {"us_per_layer", {{"median", r.us_per_layer.median}, {"min", r.us_per_layer.min}, {"max", r.us_per_layer.max}}},
        {"target_us_per_layer", 20},
        {"hits_per_request_step", r.hits_per_request_step},
        {"misses_per_request_step", r.misses_per_request_step}};
    fmt::print("{}\n", j.dump(2));
    return;
  }
  fmt::print("ess bench swap on {} ({}): batch {} x T {} x top-k {}, {} slots, {:.1f} misses per request-step\n", r.device,
             r.date, c.requests, c.query_tokens, c.topk, c.slots, r.misses_per_request_step);
  fmt::print("us per layer (one launch for the batch): median {:.2f}, min {:.2f}, max {:.2f} over {} launches "
             "(target <= 20)\n",
             r.us_per_layer.median, r.us_per_layer.min, r.us_per_layer.max, c.repeats);
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
  transfer->add_option("--requests,-b", a->requests, "Requests in the batch")->capture_default_str();
  transfer->add_option("--misses,-m", a->misses, "Misses per request")->capture_default_str();
  transfer->add_option("--context,-c", a->context, "Host-pool tokens per request")->capture_default_str();
  transfer->add_option("--slots", a->slots, "Device slots per request")->capture_default_str();
  transfer->add_option("--repeats,-r", a->repeats, "Timed runs per method")->capture_default_str();
  transfer->add_option("--device", a->device, "CUDA device")->capture_default_str();
  transfer->add_option("--seed", a->seed, "Random seed")->capture_default_str();
  transfer->add_option("--blocks", a->blocks, "FlashTrans grid sizes to sweep, comma-separated (e.g. 8,16,32,64,132,1056)")
      ->delimiter(',')
      ->check(CLI::Range(1, 65535));
  transfer->add_flag("--concurrent", a->concurrent, "Sweep also beside a sparse MLA decode (copy bandwidth, attention slowdown)");
  transfer->add_option("--attention-batch", a->attention_batch, "Batch of that decode (T 2, 128 heads, top-k 2048)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  add_format_option(*transfer, a->format);
  transfer->callback([a, &exit_code] {
    cuda::TransferBenchConfig c;
    c.requests = a->requests;
    c.misses_per_request = a->misses;
    c.context = a->context;
    c.slots = a->slots;
    c.repeats = a->repeats;
    c.device = a->device;
    c.seed = a->seed;
    c.blocks = a->blocks;
    c.concurrent = a->concurrent;
    c.attention_batch = a->attention_batch;
    const auto r = harness::gpu_benchmarks("bench transfer").transfer(c);
    print_transfer(c, r, a->format);
    exit_code = r.verified ? 0 : 1;
  });

  CLI::App* swap = bench->add_subcommand(
      "swap", "Time the GPU swap engine: one launch decides hits, misses and victims for a whole batch");
  struct SwapArgs {
    int requests = 128, mtp = 2, topk = 2048, fresh = 100, repeats = 50, device = 0;
    int slots = 6554;
    long long context = 32768;
    std::uint64_t seed = 1;
    Format format = Format::kTable;
  };
  auto sa = std::make_shared<SwapArgs>();
  swap->add_option("--requests,-b", sa->requests, "Requests in the batch")->capture_default_str();
  swap->add_option("--mtp,-t", sa->mtp, "Query tokens per request (MTP T)")->capture_default_str();
  swap->add_option("--topk,-k", sa->topk, "Entries per query token")->capture_default_str();
  swap->add_option("--slots", sa->slots, "Slots per request")->capture_default_str();
  swap->add_option("--context,-c", sa->context, "Tokens per request")->capture_default_str();
  swap->add_option("--fresh", sa->fresh, "Ids replaced per query per step (sets the miss rate)")->capture_default_str();
  swap->add_option("--repeats,-r", sa->repeats, "Timed launches")->capture_default_str();
  swap->add_option("--device", sa->device, "CUDA device")->capture_default_str();
  swap->add_option("--seed", sa->seed, "Random seed")->capture_default_str();
  add_format_option(*swap, sa->format);
  swap->callback([sa] {
    cuda::SwapBenchConfig c;
    c.requests = sa->requests;
    c.query_tokens = sa->mtp;
    c.topk = sa->topk;
    c.slots = sa->slots;
    c.context = sa->context;
    c.fresh_per_query = sa->fresh;
    c.repeats = sa->repeats;
    c.device = sa->device;
    c.seed = sa->seed;
    print_swap(c, harness::gpu_benchmarks("bench swap").swap(c), sa->format);
  });
  add_bench_kernels(*bench, exit_code);
  add_bench_step(*bench, exit_code);
}

}  // namespace ess::cli
