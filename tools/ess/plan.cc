// ess plan: the configuration (batch, Sparse Memory Ratio, overlap mode) with the highest
// throughput that meets a minimum OTPS, for each context length; why the others lose; which
// configurations the host side (DRAM capacity, host-memory bandwidth) refuses.
#include <fmt/format.h>

#include <limits>
#include <memory>

#include "commands.h"
#include "ess/sim/report.h"
#include "progress.h"
#include "sim_inputs.h"

namespace ess::cli {
namespace {

struct PlanArgs {
  SimInputs inputs;
  sim::PlanOptions options;
  Format format = Format::kTable;
  bool explain = false;
};

}  // namespace

void add_plan(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Capacity planner: per context length, the batch, Sparse Memory Ratio and overlap mode with the highest "
      "throughput that meets --min-otps, why the alternatives lose, and what host DRAM capacity or bandwidth "
      "refuses. Exit status 1 when some context has no configuration.");
  args->inputs.add_to(*cmd);
  add_list_option(*cmd, "--context,-c", args->options.contexts, "Context length(s)",
                  item_in<std::int64_t>(1, std::int64_t{1} << 24))
      ->default_str("32768");
  cmd->add_option("--min-otps", args->options.min_otps, "Minimum output tokens/s per request")
      ->capture_default_str()
      ->check(in_range(0, std::numeric_limits<double>::max()));
  add_list_option(*cmd, "--modes", args->options.modes, "Overlap modes to try (none, da, dba, layerwise)",
                  item_of({"none", "da", "dba", "layerwise"}));
  cmd->add_option("--engine", args->options.engine,
                  "Plan for a serving engine: sglang (0.5.23) or vllm (0.33.0; TBO off): the search limited to what "
                  "ESS serves inside it (the T x top-k pool floor with MTP) and each context's launch line")
      ->check(CLI::IsMember({"sglang", "vllm"}));
  cmd->add_option("--batch-step", args->options.batch_step, "Batch sizes tried: 1, 1 + step, ...")
      ->capture_default_str()
      ->check(in_range(1, 1 << 20));
  cmd->add_flag("--explain", args->explain,
                "Show every option's figures behind its limit: the GPU's cache memory (indexer and latent), the node's "
                "host pool against the host DRAM it may use, H2D against host-memory bandwidth, OTPS");
  add_format_option(*cmd, args->format);
  cmd->callback([args, &exit_code] {
    PlanArgs& a = *args;
    Progress progress("contexts planned");
    a.options.progress = [&](std::size_t done, std::size_t total) { progress(done, total); };
    sim::Plans plans = sim::plan_contexts(a.inputs, a.options);
    plans.explain = a.explain;
    a.options.progress = nullptr;
    if (a.format == Format::kJson) {
      fmt::print("{}\n", sim::to_json(plans).dump(2));
    } else if (a.format == Format::kCsv) {
      fmt::print("{}", sim::to_csv(plans));
    } else {
      fmt::print("{}", sim::to_table(plans));
    }
    exit_code = plans.all_found() ? 0 : 1;
  });
}

}  // namespace ess::cli
