// ess plan: the configuration (batch, Sparse Memory Ratio, overlap mode) with the highest
// throughput that meets a minimum OTPS, for each context length; why the others lose; which
// configurations the host side (DRAM capacity, host-memory bandwidth) refuses.
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "ess/core/error.h"
#include "ess/sim/planner.h"
#include "sim_inputs.h"

namespace ess::cli {
namespace {

struct PlanArgs {
  SimInputs inputs;
  std::vector<std::int64_t> contexts = {32768};
  double min_otps = 0;
  std::vector<std::string> modes = {"none", "da", "dba", "layerwise"};
  int batch_step = 1;
  Format format = Format::kTable;
};

nlohmann::json option_json(const sim::PlanOption& o) {
  nlohmann::json j = {{"label", o.label}, {"found", o.found}, {"why", o.why}};
  if (o.found) {
    const auto& r = o.best;
    j["batch"] = r.batch;
    j["ratio"] = r.ratio;
    j["slots"] = r.slots;
    j["overlap"] = std::string(to_string(r.overlap));
    j["step_ms"] = r.step_us / 1e3;
    j["throughput_tokens_per_s"] = r.throughput_tokens_per_s;
    j["otps"] = r.otps;
    j["exposed_transfer_ms"] = r.exposed_transfer_us / 1e3;
    j["layers_da"] = r.layers_da;
    j["layers_dba"] = r.layers_dba;
    j["layer_modes"] = r.layer_modes;
    j["host_pool_gb_per_node"] = r.host_pool_gb_per_node;
    j["h2d_gbps_per_node"] = r.h2d_gbps_per_node;
  }
  return j;
}

std::string option_line(const sim::PlanOption& o) {
  if (!o.found) return fmt::format("{:<16} -", o.label);
  const auto& r = o.best;
  return fmt::format("{:<16} batch {:>4}  ratio {:.3f}  step {:>7.2f} ms  {:>8.0f} tok/s/node  {:>6.2f} OTPS", o.label,
                     r.batch, r.ratio, r.step_us / 1e3, r.throughput_tokens_per_s, r.otps);
}

}  // namespace

void add_plan(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Capacity planner: per context length, the batch, Sparse Memory Ratio and overlap mode with the highest "
      "throughput that meets --min-otps, why the alternatives lose, and what host DRAM capacity or bandwidth "
      "refuses. Exit status 1 when some context has no configuration.");
  args->inputs.add_to(*cmd);
  cmd->add_option("--context,-c", args->contexts, "Context length(s)")->delimiter(',')->default_str("32768");
  cmd->add_option("--min-otps", args->min_otps, "Minimum output tokens/s per request")->capture_default_str();
  cmd->add_option("--modes", args->modes, "Overlap modes to try (none, da, dba, layerwise)")->delimiter(',');
  cmd->add_option("--batch-step", args->batch_step, "Batch sizes tried: 1, 1 + step, ...")->capture_default_str();
  add_format_option(*cmd, args->format);
  cmd->callback([args, &exit_code] {
    const PlanArgs& a = *args;
    const ModelSpec model = a.inputs.load_model();
    const sim::HardwareProfile hw = sim::HardwareProfile::load(a.inputs.hardware);
    const sim::Deployment dep = a.inputs.load_deployment();
    const auto tables = a.inputs.load_tables();
    const sim::StepModel sm(model, hw, dep, tables.get());
    sim::PlanRequest base;
    base.min_otps = a.min_otps;
    base.batch_step = a.batch_step;
    base.modes.clear();
    for (const auto& m : a.modes) base.modes.push_back(parse_overlap_mode(m));
    ESS_CHECK(!a.contexts.empty(), "--context: no context length given");
    std::vector<sim::PlanResult> results;
    for (std::int64_t ctx : a.contexts) {
      ESS_CHECK(ctx >= 1, "--context: {} must be positive", ctx);
      sim::PlanRequest r = base;
      r.context = ctx;
      r.misses = a.inputs.load_misses(ctx);
      results.push_back(sim::plan(sm, r));
    }
    bool all_found = true;
    for (const auto& r : results) all_found = all_found && r.found;
    if (a.format == Format::kJson || a.format == Format::kCsv) {
      nlohmann::json arr = nlohmann::json::array();
      for (const auto& r : results) {
        nlohmann::json alts = nlohmann::json::array();
        for (const auto& o : r.alternatives) alts.push_back(option_json(o));
        arr.push_back({{"context", r.context},
                       {"min_otps", r.min_otps},
                       {"found", r.found},
                       {"chosen", r.found ? option_json(r.chosen) : nlohmann::json(nullptr)},
                       {"alternatives", alts},
                       {"refusals", r.refusals},
                       {"evaluated", r.evaluated}});
      }
      if (a.format == Format::kJson) {
        fmt::print("{}\n", nlohmann::json{{"model", model.name}, {"hardware", hw.name}, {"deployment", dep.to_json()},
                                          {"plans", arr}}
                               .dump(2));
      } else {
        fmt::print("context,min_otps,found,label,batch,ratio,overlap,step_ms,throughput_tokens_per_s,otps\n");
        for (const auto& r : results) {
          auto line = [&](const sim::PlanOption& o) {
            if (!o.found) return fmt::print("{},{},{},{},,,,,,\n", r.context, r.min_otps, false, o.label);
            fmt::print("{},{},{},{},{},{:.4f},{},{:.3f},{:.1f},{:.3f}\n", r.context, r.min_otps, true, o.label,
                       o.best.batch, o.best.ratio, to_string(o.best.overlap), o.best.step_us / 1e3,
                       o.best.throughput_tokens_per_s, o.best.otps);
          };
          if (r.found) line(r.chosen);
          for (const auto& o : r.alternatives) line(o);
        }
      }
    } else {
      fmt::print("ess plan: {} on {} | {} nodes x {} GPUs, EP {}, MTP {} (accept {}), TBO {} | min OTPS {}\n", model.name,
                 hw.name, dep.nodes, dep.gpus_per_node, dep.expert_parallel, dep.mtp_tokens, dep.accept_ratio,
                 dep.two_batch_overlap ? "on" : "off", a.min_otps);
      for (const auto& r : results) {
        fmt::print("\ncontext {} ({} configurations evaluated)\n", r.context, r.evaluated);
        if (r.found) {
          fmt::print("  chosen: {}\n", option_line(r.chosen));
          if (r.chosen.best.offload && r.chosen.best.overlap == OverlapMode::kLayerWise) {
            fmt::print("          layer-wise: {} micro-batch layers DA, {} DBA; per layer (micro-batch A B; a = DA, "
                       "b = DBA): {}\n",
                       r.chosen.best.layers_da, r.chosen.best.layers_dba, r.chosen.best.layer_modes);
          }
        } else {
          fmt::print("  no configuration meets {} tokens/s per request\n", r.min_otps);
        }
        for (const auto& o : r.alternatives) fmt::print("  {}\n      {}\n", option_line(o), o.why);
        for (const auto& s : r.refusals) fmt::print("  refused: {}\n", s);
      }
    }
    exit_code = all_found ? 0 : 1;
  });
}

}  // namespace ess::cli
