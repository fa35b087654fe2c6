// ess plan: the configuration (batch, Sparse Memory Ratio, overlap mode) with the highest
// throughput that meets a minimum OTPS, for each context length; why the others lose; which
// configurations the host side (DRAM capacity, host-memory bandwidth) refuses.
#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "ess/core/error.h"
#include "ess/sim/report.h"
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
    sim::Plans plans{model, hw, dep, a.min_otps, {}};
    for (std::int64_t ctx : a.contexts) {
      ESS_CHECK(ctx >= 1, "--context: {} must be positive", ctx);
      sim::PlanRequest r = base;
      r.context = ctx;
      r.misses = a.inputs.load_misses(ctx);
      plans.results.push_back(sim::plan(sm, r));
    }
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
