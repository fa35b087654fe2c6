// ess trace gen | analyze | info: the trace toolkit (docs/trace-format.md, docs/trace-analysis.md).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "ess/core/error.h"
#include "ess/io/lists.h"
#include "ess/io/output_file.h"
#include "ess/model/model_spec.h"
#include "ess/trace/analyzer.h"
#include "ess/trace/format.h"
#include "ess/trace/generator.h"
#include "progress.h"

namespace ess::cli {
namespace {

struct GenArgs {
  std::string output;
  std::string profile;
  trace::GenerateConfig config;
  std::optional<int> layers;  // the profile's unless given
  std::string model;          // a model config.json: its layers and index sharing
  std::uint64_t seed = 1;
  Format format = Format::kTable;
};

struct AnalyzeArgs {
  std::string input;
  trace::AnalyzeConfig config;
  std::string policies;
  bool no_warmup = false;
  bool no_recommend = false;
  bool no_prefetch = false;
  bool no_similarity = false;
  std::string miss_profile;
  std::string output;
  Format format = Format::kTable;
};

void add_gen(CLI::App& parent) {
  auto a = std::make_shared<GenArgs>();
  CLI::App* cmd = parent.add_subcommand(
      "gen",
      "Generate a SYNTHETIC top-k trace from a parametric locality model (sinks, recency window, drifting heavy "
      "hitters, topic shifts, MTP, prefill windows). The default profile is calibrated to the statistics the ESS "
      "paper reports for DeepSeek-V3.2-Exp; the traces are not real model selections, and their metadata says so.");
  cmd->add_option("--output,-o", a->output, "Trace file to write (.safetensors)")->required();
  cmd->add_option("--profile", a->profile, "Generator profile JSON (default: configs/trace-profiles/default.json, built in)");
  add_list_option(*cmd, "--context,-c", a->config.contexts, "Prompt length(s); request i uses the (i mod n)-th",
                  item_in<std::int64_t>(1, trace::kMaxGeneratedContext))
      ->default_str("32768");
  cmd->add_option("--requests,-b", a->config.requests, "Requests")->capture_default_str()->check(in_range(1, 1 << 20));
  cmd->add_option("--steps,-s", a->config.steps, "Decode steps per request")
      ->capture_default_str()
      ->check(in_range(1, 1 << 24));
  auto* layers =
      cmd->add_option("--layers,-l", a->layers, "Override the profile's layer count (the drift curve is resampled)");
  cmd->add_option("--model", a->model,
                  "A model config.json: its offloaded layers (DeepSeek-V4: those with a C4 cache; MiniMax-M3: its "
                  "sparse layers), its top-k and index sharing (a layer that reuses its leader's top-k selects exactly "
                  "its leader's ids; GLM-5.2's configs/models/glm-5.2.json). Ids name what the model selects: a token, "
                  "a C4 entry of 4 tokens (DeepSeek-V4), a block (MiniMax-M3: its top blocks, its forced init / "
                  "local blocks among them); the profile's token spans become spans of ids; --context stays in tokens")
      ->excludes(layers);
  cmd->add_option("--seed", a->config.seed, "Random seed")->capture_default_str()->check(unsigned_integer());
  add_format_option(*cmd, a->format, false);
  cmd->callback([a] {
    check_output_file(a->output, "--output", {a->profile, a->model});
    trace::GeneratorProfile p =
        a->profile.empty() ? trace::GeneratorProfile::shipped_default() : trace::GeneratorProfile::from_file(a->profile);
    if (a->layers) {
      p.layers = *a->layers;
      p.validate("--layers");
    }
    if (!a->model.empty()) {
      const ModelSpec m = ModelSpec::from_file(a->model);
      trace::apply_model(p, m);
      p.validate("--model " + a->model);
    }
    const auto t0 = std::chrono::steady_clock::now();
    Progress progress("requests generated");
    trace::generate_trace(
        p, a->config, a->output,
        [&](double bytes) {
          // A file of a size worth knowing is announced before it is written.
          if (bytes >= 1e8) fmt::print(stderr, "trace gen: writing {:.2f} GB to {}\n", bytes / 1e9, a->output);
        },
        [&](std::size_t done, std::size_t total) { progress(done, total); });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double ids = static_cast<double>(a->config.requests) * static_cast<double>(a->config.steps) * p.layers * p.mtp * p.topk;
    if (a->format == Format::kJson) {
      nlohmann::json out{{"output", a->output},
                                        {"synthetic", true},
                                        {"profile", p.name},
                                        {"requests", a->config.requests},
                                        {"steps", a->config.steps},
                                        {"contexts", a->config.contexts},
                                        {"layers", p.layers},
                                        {"mtp", p.mtp},
                                        {"topk", p.topk},
                                        {"seconds", secs}};
      if (p.unit_tokens != 1) out["unit_tokens"] = p.unit_tokens;  // a trace of units says so
      fmt::print("{}\n", out.dump(2));
    } else {
      fmt::print("wrote {} (SYNTHETIC: profile '{}'): {} requests x {} steps x {} layers x MTP {} x top-k {} = {:.0f} ids "
                 "{}in {:.2f} s\n",
                 a->output, p.name, a->config.requests, a->config.steps, p.layers, p.mtp, p.topk, ids,
                 p.unit_tokens > 1 ? fmt::format("of {} tokens each ", p.unit_tokens) : std::string(), secs);
    }
  });
}

void add_analyze(CLI::App& parent) {
  auto a = std::make_shared<AnalyzeArgs>();
  CLI::App* cmd = parent.add_subcommand(
      "analyze",
      "Locality (intra/inter-layer similarity), misses per layer / step / policy / pool size (LRU, LRU + warm-up, "
      "FIFO, CLOCK, LFU with aging, S3-FIFO, Belady-optimal), inter-layer prefetch, recommended pool size per "
      "context, and the miss profile the simulator reads.");
  auto& c = a->config;
  cmd->add_option("trace", a->input, "Trace file")->required();
  auto* ratio = cmd->add_option("--ratio,-r", c.ratios, "Sparse Memory Ratio(s); slots = ceil(ratio x context), the context in ids (its tokens; in a trace of units, the units they make) (default 0.2)")
                    ->check(above_at_most(0, 1));
  cmd->add_option("--slots", c.slots, "Slot count(s) per request-layer")
      ->excludes(ratio)
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
  cmd->add_option("--policies", a->policies,
                  "Comma-separated subset of lru,lru_warmup,fifo,clock,lfu,s3fifo,belady (default: all)");
  cmd->add_flag("--no-warmup", a->no_warmup, "Start every policy but lru_warmup cold");
  cmd->add_option("--steady-from", c.steady_from, "First decode step of the steady state (default min(32, steps/4))");
  cmd->add_option("--target", c.target_misses, "Mean-miss target of the recommended pool size")->capture_default_str();
  cmd->add_option("--granularity", c.recommend_granularity, "Slot granularity of the recommended pool size")
      ->capture_default_str();
  cmd->add_flag("--no-recommend", a->no_recommend, "Skip the recommended pool size search");
  cmd->add_flag("--no-prefetch", a->no_prefetch, "Skip the inter-layer prefetch analysis");
  cmd->add_flag("--no-similarity", a->no_similarity, "Skip the similarity metrics");
  cmd->add_option("--lfu-aging", c.policy_options.lfu_aging_period, "Steps between LFU count halvings")
      ->capture_default_str();
  cmd->add_option("--threads,-j", c.threads, "Worker threads (0 = all cores)")->capture_default_str();
  cmd->add_option("--miss-profile", a->miss_profile, "Also write the miss profile JSON (per layer mean/p50/p90/p99)");
  cmd->add_option("--output,-o", a->output, "Write the report to this file instead of stdout");
  add_format_option(*cmd, a->format);
  cmd->callback([a, cmd] {
    auto& cfg = a->config;
    ESS_CHECK(cmd->count("--policies") == 0 || !a->policies.empty(), "--policies is empty: name one or more of {}",
              fmt::join(trace::AnalyzeConfig{}.policies, ","));
    ESS_CHECK(cmd->count("--steady-from") == 0 || cfg.steady_from >= 0, "--steady-from {} must be >= 0",
              cfg.steady_from);
    if (!a->policies.empty()) {
      cfg.policies = split_list(a->policies);
      const std::vector<std::string> known = trace::AnalyzeConfig{}.policies;
      for (const std::string& name : cfg.policies) {
        ESS_CHECK(!name.empty(), "--policies: an empty policy name in '{}'", a->policies);
        ESS_CHECK(std::find(known.begin(), known.end(), name) != known.end(), "--policies: unknown policy '{}' (known: {})",
                  name, fmt::join(known, ", "));
      }
    }
    const auto runs = [&](const char* policy) {
      return std::find(cfg.policies.begin(), cfg.policies.end(), policy) != cfg.policies.end();
    };
    ESS_CHECK(cmd->count("--lfu-aging") == 0 || runs("lfu"), "--lfu-aging applies to the lfu policy, which --policies {} "
              "leaves out", a->policies);
    ESS_CHECK(!a->no_warmup || a->policies.empty() || !runs("lru_warmup"),
              "--no-warmup contradicts --policies {}: lru_warmup is LRU with the warm-up", a->policies);
    cfg.warmup = !a->no_warmup;
    cfg.recommend = !a->no_recommend;
    cfg.prefetch = !a->no_prefetch;
    cfg.similarity = !a->no_similarity;
    // Outputs are checked before the work: never the input, never a directory, never one another.
    if (!a->output.empty()) check_output_file(a->output, "--output", {a->input});
    ESS_CHECK(a->output.empty() || a->miss_profile.empty() || !same_file(a->output, a->miss_profile),
              "--output '{}' and --miss-profile '{}' name the same file", a->output, a->miss_profile);
    if (!a->miss_profile.empty()) check_output_file(a->miss_profile, "--miss-profile", {a->input});
    const trace::TraceReader reader(a->input);
    if (cmd->count("--lfu-aging") > 0) {
      // A period longer than every request's policy steps never ages: plain LFU, said otherwise.
      std::int64_t longest = 0;
      for (std::size_t i = 0; i < reader.requests(); ++i) {
        longest = std::max(longest, reader.request(i).steps + reader.request(i).prefill_windows);
      }
      ESS_CHECK(cfg.policy_options.lfu_aging_period >= 1 && cfg.policy_options.lfu_aging_period <= longest,
                "--lfu-aging {} must be in [1, {}]: the longest request of '{}' has {} decode steps and warm-up "
                "windows, so a longer period never halves a count",
                cfg.policy_options.lfu_aging_period, longest, a->input, longest);
    }
    Progress progress("policy replays (request-layers)");
    cfg.progress = [&](std::size_t done, std::size_t total) { progress(done, total); };
    const trace::AnalysisResult r = trace::analyze(reader, cfg);
    cfg.progress = nullptr;
    std::string text;
    if (a->format == Format::kJson) {
      text = trace::to_json(r).dump(2) + "\n";
    } else if (a->format == Format::kCsv) {
      text = trace::to_csv(r);
    } else {
      text = trace::to_table(r);
    }
    if (a->output.empty()) {
      fmt::print("{}", text);
    } else {
      write_text_file(a->output, text, "--output");
    }
    if (!a->miss_profile.empty()) {
      write_text_file(a->miss_profile,
                      trace::miss_profile_json(r, runs("lru_warmup") ? "lru_warmup" : cfg.policies.front()).dump(2) + "\n",
                      "--miss-profile");
    }
  });
}

void add_info(CLI::App& parent) {
  auto path = std::make_shared<std::string>();
  auto full = std::make_shared<bool>(false);
  CLI::App* cmd = parent.add_subcommand("info", "Check a trace file and print its metadata and shapes");
  cmd->add_option("trace", *path, "Trace file")->required();
  cmd->add_flag("--validate", *full, "Also check every id (range, duplicates within a query)");
  cmd->callback([path, full] {
    const trace::TraceReader r(*path);
    const auto& m = r.meta();
    fmt::print("{}: ESS top-k trace v{} | {} | {} requests | {} layers | MTP {} | top-k {}{} | {}\n", *path,
               m.version, m.model, r.requests(), m.layers, m.mtp, m.topk,
               m.unit_tokens > 1 ? fmt::format(" ids of {} tokens", m.unit_tokens) : std::string(),
               m.synthetic ? "SYNTHETIC" : "recorded");
    fmt::print("provenance: {}\n", m.provenance);
    if (!m.note.empty()) fmt::print("note: {}\n", m.note);
    for (std::size_t i = 0; i < r.requests(); ++i) {
      const auto& q = r.request(i);
      fmt::print("  request {} '{}': context {}, {} steps (length {} -> {}), {} prefill windows\n", i, q.id, q.context,
                 q.steps, q.lengths.front(), q.lengths.back(), q.prefill_windows);
    }
    if (*full) {
      r.validate_all();
      fmt::print("all ids valid\n");
    }
  });
}

}  // namespace

void add_trace(CLI::App& app, int& exit_code) {
  (void)exit_code;
  CLI::App* cmd = app.add_subcommand("trace", "Top-k access traces: generate (synthetic), check, analyze");
  cmd->require_subcommand(1);
  add_gen(*cmd);
  add_analyze(*cmd);
  add_info(*cmd);
}

}  // namespace ess::cli
