// ess verify: the offloaded decode loop (the runtime's per-layer step on the CPU or CUDA
// backend), checked bit for bit against the full cache.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "ess/core/error.h"
#include "harness/verify/decode_loop.h"

namespace ess::cli {
namespace {

struct VerifyArgs {
  VerifyConfig config;
  std::string model;
  std::string backend = "cpu";
  Format format = Format::kTable;
};

void print_table(const ModelSpec& model, const VerifyConfig& c, const VerifyReport& r) {
  fmt::print("ess verify: {} | {} requests x {} layers | context {} + {} steps x MTP {} | top-k {} | {} slots "
             "per request-layer{} | warm-up {} ({} fills) | host memory {} | backend {}\n\n",
             model.name, c.requests, c.layers, c.context, c.steps, c.mtp, c.topk, r.slots,
             c.reserve_newest ? " + reserved newest" : "",
             c.warmup_windows > 0 ? fmt::format("{} windows", c.warmup_windows) : std::string("off"), r.warmup_fills,
             r.host_memory, r.backend);
  fmt::print("{:>6} {:>12} {:>12} {:>10} {:>22}\n", "layer", "hits", "misses", "hit rate", "misses/request-step");
  const double request_steps = static_cast<double>(c.requests) * static_cast<double>(std::max<std::int64_t>(r.steps, 1));
  for (const auto& l : r.per_layer) {
    const double total = static_cast<double>(l.hits + l.misses);
    fmt::print("{:>6} {:>12} {:>12} {:>9.1f}% {:>22.1f}\n", l.layer, l.hits, l.misses,
               total > 0 ? 100.0 * static_cast<double>(l.hits) / total : 0.0,
               static_cast<double>(l.misses) / request_steps);
  }
  const double total = static_cast<double>(r.hits + r.misses);
  fmt::print("{:>6} {:>12} {:>12} {:>9.1f}% {:>22.1f}\n\n", "all", r.hits, r.misses,
             total > 0 ? 100.0 * static_cast<double>(r.hits) / total : 0.0,
             static_cast<double>(r.misses) / (request_steps * std::max(c.layers, 1)));
  fmt::print("misses per step (all requests and layers): {}\n", fmt::join(r.misses_per_step, " "));
  if (r.bitwise_equal) {
    fmt::print("lossless: all {} attention outputs (bf16 output + fp32 LSE) are bit-identical to the "
               "all-resident cache, and every host pool entry to the generated one  [{:.2f} s]\n",
               r.compared_outputs, r.seconds);
  } else {
    fmt::print("NOT LOSSLESS: {} of {} attention outputs and {} host pool entries differ from the all-resident cache; "
               "first at {}\n",
               r.mismatched_outputs, r.compared_outputs, r.mismatched_host_entries, r.first_mismatch);
  }
}

void print_json(const ModelSpec& model, const VerifyConfig& c, const VerifyReport& r) {
  nlohmann::json per_layer = nlohmann::json::array();
  std::vector<std::int64_t> per_layer_misses;
  for (const auto& l : r.per_layer) {
    per_layer.push_back({{"layer", l.layer}, {"hits", l.hits}, {"misses", l.misses}});
    per_layer_misses.push_back(l.misses);
  }
  const nlohmann::json j = {
      {"bitwise_equal", r.bitwise_equal},
      {"compared_outputs", r.compared_outputs},
      {"mismatched_outputs", r.mismatched_outputs},
      {"mismatched_host_entries", r.mismatched_host_entries},
      {"first_mismatch", r.first_mismatch},
      {"steps", r.steps},
      {"hits", r.hits},
      {"misses", r.misses},
      {"warmup_fills", r.warmup_fills},
      {"per_layer_misses", per_layer_misses},
      {"per_layer", per_layer},
      {"misses_per_step", r.misses_per_step},
      {"config",
       {{"model", model.name},
        {"requests", c.requests},
        {"layers", c.layers},
        {"context", c.context},
        {"mtp", c.mtp},
        {"topk", c.topk},
        {"slots", r.slots},
        {"ratio", c.slots > 0 ? nlohmann::json(nullptr) : nlohmann::json(c.ratio)},
        {"warmup_windows", c.warmup_windows},
        {"reserve_newest", c.reserve_newest},
        {"seed", c.seed}}},
      {"host_memory", r.host_memory},
      {"backend", r.backend},
      {"seconds", r.seconds}};
  fmt::print("{}\n", j.dump(2));
}

void print_csv(const VerifyReport& r) {
  fmt::print("layer,hits,misses,bitwise_equal\n");
  for (const auto& l : r.per_layer) {
    fmt::print("{},{},{},{}\n", l.layer, l.hits, l.misses, r.bitwise_equal);
  }
}

}  // namespace

void add_verify(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* cmd = app.add_subcommand(
      "verify",
      "Run a decode loop with the latent cache offloaded through the runtime's per-layer step (indexer -> "
      "top-k -> Offload::step: swap decision, misses fetched -> sparse attention over the rows it returns) "
      "beside attention over the full cache, and check every output is bit-identical. Exit status 1 if not.");
  VerifyConfig& c = args->config;
  cmd->add_option("--model", args->model, "Model config.json (default: the shipped DeepSeek-V3.2-Exp)");
  cmd->add_option("--requests,-b", c.requests, "Requests in the batch")->capture_default_str();
  cmd->add_option("--layers,-l", c.layers, "Layers (the model's first N)")->capture_default_str();
  cmd->add_option("--context,-c", c.context, "Prompt length at the prefill -> decode hand-over")->capture_default_str();
  cmd->add_option("--steps,-s", c.steps, "Decode steps")->capture_default_str();
  cmd->add_option("--mtp,-t", c.mtp, "Query tokens per request per step (MTP T)")->capture_default_str();
  cmd->add_option("--topk,-k", c.topk, "Entries each query token selects")->capture_default_str();
  auto* slots = cmd->add_option("--slots", c.slots, "Sparse Memory Pool slots per request-layer");
  cmd->add_option("--ratio", c.ratio, "Sparse Memory Ratio: slots = ceil(ratio x context)")
      ->capture_default_str()
      ->excludes(slots);
  cmd->add_option("--warmup", c.warmup_windows, "LRU-Warmup prefill windows (0 = cold start)")->capture_default_str();
  cmd->add_option("--drift", c.query_drift, "Indexer query drift per step in [0, 1]")->capture_default_str();
  cmd->add_option("--seed", c.seed, "Random seed")->capture_default_str();
  cmd->add_flag("--reserve-newest", c.reserve_newest,
               "Each step's new entries in reserved rows outside the LRU, written back to the host pool");
  cmd->add_option("--backend", args->backend,
                  "The Offload's backend: cpu, or cuda (GPU swap engine, device rows filled by FlashTrans; needs a GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  add_format_option(*cmd, args->format);
  cmd->callback([args, &exit_code] {
    args->config.backend = args->backend == "cuda" ? Backend::kCuda : Backend::kCpu;
    const ModelSpec model = args->model.empty() ? ModelSpec::deepseek_v32_exp() : ModelSpec::from_file(args->model);
    const VerifyReport r = run_verify(model, args->config);
    if (args->format == Format::kJson) {
      print_json(model, args->config, r);
    } else if (args->format == Format::kCsv) {
      print_csv(r);
    } else {
      print_table(model, args->config, r);
    }
    exit_code = r.bitwise_equal ? 0 : 1;
  });
}

}  // namespace ess::cli
