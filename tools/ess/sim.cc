// ess sim: predicted max batch, Sparse Memory Ratio, step time, throughput and OTPS of ESS
// beside the all-on-GPU baseline, for a model, hardware, deployment and context length.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "ess/core/error.h"
#include "ess/core/json.h"
#include "ess/io/output_file.h"
#include "ess/sim/report.h"
#include "progress.h"
#include "sim_inputs.h"

namespace ess::cli {
namespace {

struct SimArgs {
  SimInputs inputs;
  std::int64_t context = 32768;
  std::vector<std::string> batches = {"52", "64", "96", "128", "160"};
  double ratio = 0;
  std::int32_t slots = 0;
  std::string overlap = "layerwise";
  std::string residency = "sparse";
  bool concurrency = false;
  double threshold = -1;
  std::string timeline;
  std::string workload;
  Format format = Format::kTable;
};

}  // namespace

void add_sim(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<SimArgs>();
  CLI::App* cmd = app.add_subcommand(
      "sim",
      "Simulate decode: per batch the Sparse Memory Ratio that fits, step time and its breakdown, throughput "
      "per node and OTPS, ESS beside the all-on-GPU baseline. Default: the paper's deployment (Table 1) at 32K, "
      "MTP 2, accept 1.7, batches 52,64,96,128,160. A batch that cannot run (it does not fit, its pool is below "
      "the floor) gets a row saying why and exit status 1; when none runs, the reason is the error.");
  args->inputs.add_to(*cmd);
  cmd->add_option("--context,-c", args->context, "Context length (tokens per request)")
      ->capture_default_str()
      ->check(in_range(1, 1 << 24));
  auto* batch = add_list_option(*cmd, "--batch,-b", args->batches,
                                "Requests per GPU: list, ranges A-B, or max (the largest that fits the given --ratio / "
                                "--slots; without either, the largest ESS batch: every request-layer at the pool floor)")
                    ->default_str("52,64,96,128,160");
  cmd->add_flag("--concurrency", args->concurrency,
                "A load sweep: batches from 1 past the all-on-GPU memory wall to the largest ESS batch (1, 2, 4, ..., "
                "the wall, the wall + 1, doubling, the largest) at one pool (--ratio / --slots, default the pool "
                "floor), --residency adaptive unless given: where ESS costs nothing and where offload starts to pay")
      ->excludes(batch);
  auto* slots = cmd->add_option("--slots", args->slots, "Sparse Memory Pool slots per request-layer (fixed)");
  cmd->add_option("--ratio", args->ratio, "Sparse Memory Ratio (fixed; default: the most that fits each batch)")
      ->excludes(slots);
  cmd->add_option("--overlap", args->overlap, "Overlap mode: none, da, dba, layerwise")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "da", "dba", "layerwise"}));
  cmd->add_option("--residency", args->residency,
                  "sparse: every request in a Sparse Memory Pool; adaptive: as many requests whole (no misses, no "
                  "swap) as the cache memory holds beside the others' pools, with --ratio / --slots fixed (the "
                  "engine's pool); the table's `whole` column counts them")
      ->capture_default_str()
      ->check(CLI::IsMember({"sparse", "adaptive"}));
  cmd->add_option("--miss-threshold", args->threshold,
                  "Layer-wise: DBA for layers with at least this many misses per micro-batch (default: the "
                  "faster of DA and DBA per layer)");
  cmd->add_option("--workload", args->workload,
                  "Workload JSON (configs/workloads/*.json): context, batch, ratio/slots, overlap, misses; the "
                  "flags above override it");
  cmd->add_option("--timeline", args->timeline, "Write a Chrome-trace JSON of the first row's ESS step (Perfetto)");
  add_format_option(*cmd, args->format);
  cmd->callback([args, cmd, &exit_code] {
    const SimArgs& a = *args;
    // 0 (and -1 for the threshold) stand for "not given" inside; given on the command line
    // they would be taken silently for that.
    ESS_CHECK(cmd->count("--slots") == 0 || a.slots > 0, "--slots {} must be positive (leave it out to fit the "
              "pool to each batch)", a.slots);
    ESS_CHECK(cmd->count("--ratio") == 0 || (a.ratio > 0 && a.ratio <= 1), "--ratio {} must be in (0, 1] (leave it "
              "out to fit the pool to each batch)", a.ratio);
    ESS_CHECK(cmd->count("--miss-threshold") == 0 || a.threshold >= 0, "--miss-threshold {} must be >= 0 (leave it "
              "out for the faster of DA and DBA per layer)", a.threshold);
    if (!a.timeline.empty()) {
      check_output_file(a.timeline, "--timeline",
                        {a.inputs.model, a.inputs.hardware, a.inputs.deployment, a.inputs.miss_profile,
                         a.inputs.op_table, a.workload});
    }
    const ModelSpec model = a.inputs.load_model();
    const sim::HardwareProfile hw = a.inputs.load_hardware();
    const sim::Deployment dep = a.inputs.load_deployment();
    const auto tables = a.inputs.load_tables();
    const sim::StepModel sm(model, hw, dep, tables.get());
    // The workload: the file's values, then every flag given on the command line (without a
    // file, the flags' defaults).
    const bool file = !a.workload.empty();
    sim::Workload base;
    std::vector<std::string> batch_items = a.batches;
    bool file_overlap = false;  // the workload file names an overlap mode
    if (file) {
      base = sim::Workload::from_file(a.workload);
      const nlohmann::json j = read_json_file(a.workload, "workload");
      file_overlap = j.contains("overlap");
      if (cmd->count("--batch") == 0 && j.contains("batch")) {
        batch_items = {base.batch == 0 ? std::string("max") : std::to_string(base.batch)};
      }
    }
    auto given = [&](const char* flag) { return !file || cmd->count(flag) > 0; };
    if (given("--context")) base.context = a.context;
    if (given("--ratio")) base.ratio = a.ratio;
    if (given("--slots")) base.slots = a.slots;
    if (given("--ratio") && a.ratio > 0) base.slots = 0;
    if (given("--slots") && a.slots > 0) base.ratio = 0;
    if (given("--overlap")) base.overlap = parse_overlap_mode(a.overlap);
    if ((model.is_deepseek_v4() || model.is_minimax_m3()) && cmd->count("--overlap") == 0 && !file_overlap) {
      base.overlap = OverlapMode::kNone;  // DeepSeek-V4's and MiniMax-M3's decode runs whole (the schedules split DSA's)
    }
    if (given("--residency")) base.residency = sim::parse_residency(a.residency);
    if (given("--miss-threshold")) base.layerwise_threshold = a.threshold;
    ESS_CHECK(cmd->count("--miss-threshold") == 0 || base.overlap == OverlapMode::kLayerWise,
              "--miss-threshold applies to the layer-wise overlap only (--overlap {})", to_string(base.overlap));
    if (given("--misses") || given("--miss-exponent") || given("--miss-profile")) {
      base.misses = a.inputs.load_misses(base.context);
    }
    // No measured working set (no trace profile): the built-in locality model's.
    if (base.misses.working_set_max <= 0) base.misses = sim::MissModel::with_builtin_working_set(base.context, base.misses);
    a.inputs.apply_pool_floor(base.misses);
    if (a.inputs.prefix_share) base.prefix_share = *a.inputs.prefix_share;
    if (a.concurrency) {
      // One engine under a rising load: its pool is fixed at launch, the floor's unless given.
      if (cmd->count("--residency") == 0) base.residency = Residency::kAdaptive;
      if (base.slots == 0 && base.ratio == 0) {
        // MissModel::min_slots is at most the context already.
        base.slots = static_cast<std::int32_t>(std::ceil(sm.pool_floor(base.misses, base.context)));
      }
    }
    Progress progress("configurations");
    sim::SimulateOptions options;
    options.timeline = a.timeline;
    options.progress = [&](std::size_t done, std::size_t total) { progress(done, total); };
    const std::vector<int> batches = a.concurrency ? sim::load_batches(sm, base) : sim::parse_batches(batch_items);
    const sim::Simulation result = sim::simulate(sm, base, batches, options);
    if (a.format == Format::kJson) {
      fmt::print("{}\n", sim::to_json(result).dump(2));
    } else if (a.format == Format::kCsv) {
      fmt::print("{}", sim::to_csv(result));
    } else {
      fmt::print("{}", sim::to_table(result));
    }
    const bool all_run = std::all_of(result.rows.begin(), result.rows.end(),
                                     [](const sim::SimulationRow& r) { return r.refused.empty(); });
    exit_code = all_run ? 0 : 1;
  });
}

}  // namespace ess::cli
