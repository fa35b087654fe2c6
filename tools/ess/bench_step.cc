// ess bench step | profile: the decode-step executor (src/harness/rig) on the GPU.
#include <fmt/format.h>

#include <limits>

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "ess/core/error.h"
#include "ess/io/lists.h"
#include "ess/io/output_file.h"
#include "harness/gpu_benchmarks.h"
#include "harness/report/report.h"
#include "harness/rig/config.h"

namespace ess::cli {
namespace {

// Options of the executor shared by both subcommands.
struct ExecutorArgs {
  rig::ExecutorConfig c;
  std::string overlap_list = "none,da,dba,layerwise";
  bool no_graph = false, no_gemms = false, no_warmup = false, preattn_before_indexer = false;

  void add_to(CLI::App& cmd) {
    cmd.add_option("--layers", c.layers, "Decoder layers per step (MoE layers)")->capture_default_str()
      ->check(in_range(1, 256));
    cmd.add_option("--context,-c", c.context, "Prompt length (synthetic traces)")->capture_default_str()
      ->check(in_range(64, 1 << 30));
    cmd.add_option("--ratio", c.ratio, "Sparse Memory Ratio")->capture_default_str()
      ->check(above_at_most(0, 1));
    cmd.add_option("--slots", c.slots, "Slots per request-layer (overrides --ratio)")
      ->check(in_range(1, std::numeric_limits<std::int32_t>::max()));
    cmd.add_option("--steps", c.steps, "Decode steps replayed per run")->capture_default_str()
      ->check(in_range(1, 4096));
    cmd.add_option("--warm-steps", c.warm_steps, "Of which untimed")->capture_default_str()
      ->check(in_range(0, 4095));
    cmd.add_option("--threshold", c.layerwise_threshold,
                   "Layer-wise: DBA for layers whose profiled misses per request reach this")
        ->capture_default_str()
      ->check(in_range(0, std::numeric_limits<double>::max()));
    cmd.add_option("--ep", c.expert_parallel, "Expert parallelism emulated: the routed experts one GPU owns")
        ->capture_default_str()
      ->check(in_range(1, 256));
    cmd.add_option("--trace", c.trace, "Top-k trace (default: synthetic, the shipped generator profile)");
    cmd.add_option("--seed", c.seed, "Random seed")->capture_default_str()->check(unsigned_integer());
    cmd.add_option("--device", c.device, "CUDA device")->capture_default_str()
      ->check(in_range(0, 1023));
    cmd.add_option("--copy-blocks", c.copy_blocks, "FlashTrans grid of the step's copies (0 = its default)")
        ->capture_default_str()
      ->check(in_range(0, 65535));
    cmd.add_flag("--no-graph", no_graph, "Launch kernels one by one instead of replaying CUDA graphs");
    cmd.add_flag("--no-gemms", no_gemms, "Attention stack only (no stand-in GEMMs)");
    cmd.add_flag("--no-warmup", no_warmup, "No LRU-Warmup from the trace's prefill top-k");
    cmd.add_flag("--reserve-newest", c.reserve_newest,
                 "Each step's newest tokens in reserved rows outside the LRU (the H2D no longer waits for their D2H)");
  }
  rig::ExecutorConfig config() const {
    rig::ExecutorConfig r = c;
    r.graph = !no_graph;
    r.stand_in_gemms = !no_gemms;
    r.warmup = !no_warmup;
    r.preattn_in_copy_window = !preattn_before_indexer;
    return r;
  }
};

}  // namespace

void add_bench_step(CLI::App& bench, int& exit_code) {
  (void)exit_code;
  // ---- bench step ------------------------------------------------------------------------
  CLI::App* step = bench.add_subcommand(
      "step", "Time the ESS decode step (indexer, swap engine, FlashTrans, sparse MLA, stand-in GEMMs) against the "
              "all-resident step, per batch and overlap schedule; optionally beside the simulator's prediction");
  struct StepArgs {
    ExecutorArgs ex;
    std::string batches = "16,32,64,128";
    bool no_resident = false, no_exposed = false, no_gain = false;
    std::string profile_hw, profile_table, hardware = "h100", deployment = "paper-table1";
    std::string points_file;
    Format format = Format::kTable;
  };
  auto sa = std::make_shared<StepArgs>();
  sa->ex.add_to(*step);
  step->add_option("--batch,-b", sa->batches, "Batches (comma-separated)")->capture_default_str();
  step->add_option("--overlap", sa->ex.overlap_list, "Schedules of the offloaded step: none,da,dba,layerwise")
      ->capture_default_str();
  step->add_flag("--preattn-before-indexer", sa->ex.preattn_before_indexer,
                 "Under DA / DBA, PreAttn before the indexer, outside the copy window (as SGLang 0.5.23 runs it)");
  step->add_flag("--no-resident", sa->no_resident, "Skip the all-resident baseline");
  step->add_flag("--no-exposed", sa->no_exposed, "Skip the runs without transfers (exposed transfer time)");
  step->add_flag("--no-gain", sa->no_gain, "Skip the two max-batch runs (throughput gain)");
  step->add_option("--profile-hardware", sa->profile_hw, "Measured hardware profile (ess bench profile) for predictions");
  step->add_option("--profile-table", sa->profile_table, "Measured op table (ess bench profile) for predictions");
  step->add_option("--hardware", sa->hardware, "Hardware profile for the whole model's max batch")->capture_default_str();
  step->add_option("--deployment", sa->deployment, "Deployment for the whole model's max batch")->capture_default_str();
  step->add_option("--points", sa->points_file,
                   "Append each point to FILE as one JSON line as soon as it is measured (a run stopped early keeps "
                   "what it finished)");
  add_format_option(*step, sa->format, false);
  step->callback([sa] {
    rig::StepBenchConfig sc;
    sc.base = sa->ex.config();
    sc.batches = parse_positive_ints(sa->batches, "--batch");
    sc.modes.clear();
    for (const std::string& m : split_list(sa->ex.overlap_list)) sc.modes.push_back(parse_overlap_mode(m));
    sc.resident = !sa->no_resident;
    sc.exposed = !sa->no_exposed;
    sc.gain = !sa->no_gain;
    sc.profile_hardware = sa->profile_hw;
    sc.profile_table = sa->profile_table;
    sc.hardware = sa->hardware;
    sc.deployment = sa->deployment;
    if (!sa->points_file.empty()) check_output_file(sa->points_file, "--points");
    std::ofstream points;  // opened at the first point: a refused run creates nothing
    const auto on_point = [&](const rig::StepPoint& p) {
      if (sa->points_file.empty()) return;
      if (!points.is_open()) {
        points.open(sa->points_file, std::ios::app);
        ESS_CHECK(points.good(), "bench step: cannot append to --points {}", sa->points_file);
      }
      points << p.to_json().dump() << '\n' << std::flush;
      ESS_CHECK(points.good(), "bench step: writing --points {} failed", sa->points_file);
    };
    const rig::StepBenchResult r = harness::gpu_benchmarks("bench step", true).step(sc, on_point);
    if (sa->format == Format::kJson) {
      fmt::print("{}\n", r.to_json(sc).dump(2));
    } else {
      fmt::print("{}", harness::to_table(sc, r));
    }
  });

  // ---- bench profile ---------------------------------------------------------------------
  CLI::App* profile = bench.add_subcommand(
      "profile", "Measure the op times the simulator uses on this GPU; write them as an op table (CSV) and a "
                 "hardware profile (JSON) that `ess sim --rig-layers` and `ess bench step --profile-*` read");
  struct ProfileArgs {
    ExecutorArgs ex;
    std::string requests = "1,2,4,8,16,32,64,128";
    int repeats = 20;
    std::string base = "h100";
    std::string out;
  };
  auto pa = std::make_shared<ProfileArgs>();
  pa->ex.add_to(*profile);
  profile->add_option("--requests", pa->requests, "Request grid (tokens = requests x T)")->capture_default_str();
  profile->add_option("--repeats,-r", pa->repeats, "Timed launches per op and point")->capture_default_str()
      ->check(in_range(1, 1 << 20));
  profile->add_option("--base-hardware", pa->base, "Profile the unmeasured fields come from")->capture_default_str();
  profile->add_option("--out,-o", pa->out, "Output prefix: writes PREFIX-ops.csv, PREFIX-hardware.json, PREFIX.json")
      ->required();
  profile->callback([pa] {
    for (const char* suffix : {"-ops.csv", "-hardware.json", ".json"}) check_output_file(pa->out + suffix, "--out");
    rig::ProfileConfig pc;
    pc.base = pa->ex.config();
    pc.requests = parse_positive_ints(pa->requests, "--requests");
    pc.repeats = pa->repeats;
    pc.base_hardware = pa->base;
    const rig::ProfileResult r = harness::gpu_benchmarks("bench profile", true).profile(pc);
    auto write = [](const std::string& path, const std::string& text) { write_text_file(path, text, "--out"); };
    write(pa->out + "-ops.csv", r.csv);
    write(pa->out + "-hardware.json", r.hardware.dump(2) + "\n");
    write(pa->out + ".json", r.report.dump(2) + "\n");
    fmt::print("ess bench profile on {} ({}): wrote {}-ops.csv, -hardware.json and .json\n", r.device, r.date, pa->out);
  });
}

}  // namespace ess::cli
