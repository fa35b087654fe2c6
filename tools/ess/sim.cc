// ess sim: predicted max batch, Sparse Memory Ratio, step time, throughput and OTPS of ESS
// beside the all-on-GPU baseline, for a model, hardware, deployment and context length.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "ess/core/error.h"
#include "ess/core/json.h"
#include "ess/sim/memory_model.h"
#include "ess/sim/sweep.h"
#include "sim_inputs.h"

namespace ess::cli {
namespace {

using sim::StepResult;

struct SimArgs {
  SimInputs inputs;
  std::int64_t context = 32768;
  std::vector<std::string> batches = {"52", "64", "96", "128", "160"};
  double ratio = 0;
  std::int32_t slots = 0;
  std::string overlap = "layerwise";
  double threshold = -1;
  std::string timeline;
  std::string workload;
  Format format = Format::kTable;
};

// "52,64" / "1-200" / "max" -> batches (0 = max).
std::vector<int> parse_batches(const std::vector<std::string>& items) {
  std::vector<int> out;
  auto to_int = [](const std::string& s) {
    std::size_t used = 0;
    long v = -1;
    try {
      v = std::stol(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    ESS_CHECK(used == s.size() && used > 0 && v >= 1 && v <= 1'000'000,
              "--batch: '{}' is not a batch size (a positive integer, a range A-B, or max)", s);
    return static_cast<int>(v);
  };
  for (const std::string& item : items) {
    if (item == "max") {
      out.push_back(0);
      continue;
    }
    const auto dash = item.find('-');
    if (dash != std::string::npos && dash > 0) {
      const int a = to_int(item.substr(0, dash)), b = to_int(item.substr(dash + 1));
      ESS_CHECK(a <= b, "--batch: range '{}' is empty", item);
      for (int x = a; x <= b; ++x) out.push_back(x);
    } else {
      out.push_back(to_int(item));
    }
  }
  ESS_CHECK(!out.empty(), "--batch: no batch size given");
  return out;
}

struct Row {
  StepResult ess;
  bool baseline_fits = false;
  StepResult baseline;  // all-on-GPU at the same batch
  const sim::PaperRow* paper = nullptr;
};

double ms(double us) { return us / 1e3; }

nlohmann::json row_json(const StepResult& r) {
  return {{"batch", r.batch},
          {"ratio", r.ratio},
          {"slots", r.slots},
          {"offload", r.offload},
          {"overlap", std::string(to_string(r.overlap))},
          {"step_ms", ms(r.step_us)},
          {"throughput_tokens_per_s", r.throughput_tokens_per_s},
          {"otps", r.otps},
          {"compute_ms", ms(r.compute_us)},
          {"exposed_comm_ms", ms(r.exposed_comm_us)},
          {"exposed_transfer_ms", ms(r.exposed_transfer_us)},
          {"breakdown_ms",
           {{"attention", ms(r.attention_us)},
            {"moe", ms(r.moe_us)},
            {"dense_norms_lm_head", ms(r.other_us)},
            {"mtp_draft", ms(r.mtp_draft_us)},
            {"comm_stream_busy", ms(r.comm_us)},
            {"h2d_stream_busy", ms(r.h2d_us)}}},
          {"misses_per_request_layer", r.misses_per_request_layer},
          {"h2d_mb_per_step", r.h2d_bytes / 1e6},
          {"d2h_mb_per_step", r.d2h_bytes / 1e6},
          {"layers_da", r.layers_da},
          {"layers_dba", r.layers_dba},
          {"layer_modes", r.layer_modes},
          {"cache_gb", r.cache_gb},
          {"host_pool_gb_per_node", r.host_pool_gb_per_node},
          {"h2d_gbps_per_node", r.h2d_gbps_per_node},
          {"op_sources", {{"analytical", r.ops_analytical}, {"measured", r.ops_measured}, {"outside_grid", r.ops_outside_grid}}}};
}

}  // namespace

void add_sim(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<SimArgs>();
  CLI::App* cmd = app.add_subcommand(
      "sim",
      "Simulate decode: per batch the Sparse Memory Ratio that fits, step time and its breakdown, throughput "
      "per node and OTPS, ESS beside the all-on-GPU baseline. Default: the paper's deployment (Table 1) at 32K, "
      "MTP 2, accept 1.7, batches 52,64,96,128,160.");
  args->inputs.add_to(*cmd);
  cmd->add_option("--context,-c", args->context, "Context length (tokens per request)")->capture_default_str();
  cmd->add_option("--batch,-b", args->batches, "Requests per GPU: list, ranges A-B, or max (the largest that fits the given --ratio / --slots; "
                  "ratio 1 when neither is given)")
      ->delimiter(',')
      ->default_str("52,64,96,128,160");
  auto* slots = cmd->add_option("--slots", args->slots, "Sparse Memory Pool slots per request-layer (fixed)");
  cmd->add_option("--ratio", args->ratio, "Sparse Memory Ratio (fixed; default: the most that fits each batch)")
      ->excludes(slots);
  cmd->add_option("--overlap", args->overlap, "Overlap mode: none, da, dba, layerwise")->capture_default_str();
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
    const ModelSpec model = a.inputs.load_model();
    const sim::HardwareProfile hw = sim::HardwareProfile::load(a.inputs.hardware);
    const sim::Deployment dep = a.inputs.load_deployment();
    const auto tables = a.inputs.load_tables();
    const sim::StepModel sm(model, hw, dep, tables.get());
    // The workload: the file's values, then every flag given on the command line (without a
    // file, the flags' defaults).
    const bool file = !a.workload.empty();
    sim::Workload base;
    std::vector<std::string> batch_items = a.batches;
    if (file) {
      base = sim::Workload::from_file(a.workload);
      const nlohmann::json j = read_json_file(a.workload, "workload");
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
    if (given("--miss-threshold")) base.layerwise_threshold = a.threshold;
    if (given("--misses") || given("--miss-exponent") || given("--miss-profile")) {
      base.misses = a.inputs.load_misses(base.context);
    }
    base.batch = 0;
    base.validate();
    const std::int64_t context = base.context;
    const sim::MemoryModel mem(model, hw, dep, context);
    const std::vector<int> batches = parse_batches(batch_items);

    // The memory wall: the all-on-GPU baseline at its largest batch.
    sim::Workload wall = base;
    wall.offload = false;
    wall.ratio = 0;
    wall.slots = 0;
    wall.batch = 0;
    // The executor rig (--rig-layers) has no memory wall of its own: its all-resident step is
    // reported at every batch instead.
    const bool rig = dep.rig_layers > 0;
    const int wall_batch = rig ? 0 : mem.max_batch(static_cast<double>(context));
    const bool wall_fits = wall_batch >= 1;
    StepResult wall_r;
    if (wall_fits) wall_r = sm.run(wall);

    // Paper columns only for the paper's own setup (calibration profile, Table 1 deployment, 32K).
    const bool paper_setup = hw.name == "paper-table1" &&
                             dep.to_json() == sim::Deployment::shipped("paper-table1").to_json() &&
                             context == 32768 && base.ratio == 0 && base.slots == 0;
    std::vector<Row> rows;
    const bool tty = isatty(fileno(stderr)) != 0 && batches.size() >= 2000;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < batches.size(); ++i) {
      Row row;
      sim::Workload w = base;
      w.batch = batches[i];
      sim::Timeline timeline;
      const bool record = i == 0 && !a.timeline.empty();
      row.ess = sm.run(w, record ? &timeline : nullptr);
      if (record) {
        timeline.write(a.timeline, fmt::format("ess sim: {} on {}, batch {}, ratio {:.3f}, {}", model.name, hw.name,
                                               row.ess.batch, row.ess.ratio, to_string(row.ess.overlap)));
      }
      if (rig || (wall_fits && row.ess.batch <= wall_batch)) {
        sim::Workload b = wall;
        b.batch = row.ess.batch;
        row.baseline_fits = true;
        row.baseline = sm.run(b);
      }
      if (paper_setup) {
        for (const auto& p : sim::paper_table2_32k()) {
          if (p.batch == row.ess.batch) row.paper = &p;
        }
      }
      rows.push_back(row);
      if (tty && (i % 1000 == 999 || i + 1 == batches.size())) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        fmt::print(stderr, "\r  {}/{} configurations, {:.0f}/s", i + 1, batches.size(), static_cast<double>(i + 1) / std::max(s, 1e-9));
        if (i + 1 == batches.size()) fmt::print(stderr, "\n");
      }
    }
    auto gain = [&](const StepResult& r) {
      return wall_fits ? r.throughput_tokens_per_s / wall_r.throughput_tokens_per_s - 1.0 : 0.0;
    };

    if (a.format == Format::kJson) {
      nlohmann::json j;
      j["model"] = model.name;
      j["hardware"] = hw.name;
      j["deployment"] = dep.to_json();
      j["context"] = context;
      j["cache_budget_gb"] = mem.cache_budget() / 1e9;
      j["weights_gb"] = mem.weights().total() / 1e9;
      j["baseline"] = wall_fits ? row_json(wall_r) : nlohmann::json(nullptr);
      nlohmann::json arr = nlohmann::json::array();
      for (const Row& r : rows) {
        nlohmann::json e = row_json(r.ess);
        e["host_dram_fits"] = r.ess.host_pool_gb_per_node <= hw.host_dram_gb;
        e["host_bandwidth_fits"] = r.ess.h2d_gbps_per_node <= hw.host_dram_bandwidth_gbps;
        e["gain_vs_baseline"] = wall_fits ? nlohmann::json(gain(r.ess)) : nlohmann::json(nullptr);
        e["all_on_gpu_at_batch"] = r.baseline_fits ? row_json(r.baseline) : nlohmann::json(nullptr);
        if (r.paper != nullptr) {
          e["paper"] = {{"ratio", r.paper->ratio},
                        {"throughput_tokens_per_s", r.paper->throughput_tokens_per_s},
                        {"otps", r.paper->otps}};
        }
        arr.push_back(e);
      }
      j["rows"] = arr;
      fmt::print("{}\n", j.dump(2));
    } else if (a.format == Format::kCsv) {
      fmt::print("batch,ratio,slots,overlap,step_ms,throughput_tokens_per_s,otps,compute_ms,exposed_comm_ms,"
                 "exposed_transfer_ms,misses_per_request_layer,gain_vs_baseline,all_on_gpu_throughput_tokens_per_s\n");
      for (const Row& r : rows) {
        const StepResult& e = r.ess;
        fmt::print("{},{:.4f},{},{},{:.3f},{:.1f},{:.3f},{:.3f},{:.3f},{:.3f},{:.1f},{},{}\n", e.batch, e.ratio, e.slots,
                   to_string(e.overlap), ms(e.step_us), e.throughput_tokens_per_s, e.otps, ms(e.compute_us),
                   ms(e.exposed_comm_us), ms(e.exposed_transfer_us), e.misses_per_request_layer,
                   wall_fits ? fmt::format("{:.4f}", gain(e)) : "",
                   r.baseline_fits ? fmt::format("{:.1f}", r.baseline.throughput_tokens_per_s) : "");
      }
    } else {
      if (rig) {
        fmt::print("ess sim: {} on {} | executor rig: {} MoE layers on one GPU, experts of EP {}, MTP {}, no all-to-all / "
                   "TBO / LM head | context {} | overlap {}\n",
                   model.name, hw.name, dep.rig_layers, dep.expert_parallel, dep.mtp_tokens, context,
                   to_string(base.overlap));
      } else {
        fmt::print("ess sim: {} on {} | {} nodes x {} GPUs, EP {}, MTP {} (accept {}), TBO {} | context {} | overlap {}\n",
                   model.name, hw.name, dep.nodes, dep.gpus_per_node, dep.expert_parallel, dep.mtp_tokens,
                   dep.accept_ratio, dep.two_batch_overlap ? "on" : "off", context, to_string(base.overlap));
      }
      if (rig) {
        fmt::print("no memory model on the rig; all-on-GPU: the rig's all-resident step at the same batch\n\n");
      } else {
        fmt::print("per GPU: {:.1f} GB HBM x {} static = {:.1f} GB weights + {:.1f} GB for the caches\n",
                   hw.hbm_capacity_gb, dep.mem_fraction_static, mem.weights().total() / 1e9, mem.cache_budget() / 1e9);
      }
      if (!rig && wall_fits) {
        fmt::print("all-on-GPU baseline (memory wall): batch {}, step {:.2f} ms, {:.0f} tokens/s per node, {:.2f} "
                   "tokens/s per request\n\n",
                   wall_r.batch, ms(wall_r.step_us), wall_r.throughput_tokens_per_s, wall_r.otps);
      } else if (!rig) {
        fmt::print("all-on-GPU baseline: no request fits without offload at this context\n\n");
      }
      const bool any_paper = std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.paper != nullptr; });
      fmt::print("{:>5} {:>6} {:>6} {:>8} {:>8} {:>7} {:>7} {:>7} {:>11} {:>7} {:>7} {:>11}", "batch", "ratio", "slots",
                 "step ms", "compute", "x-comm", "x-h2d", "misses", "tok/s/node", "OTPS", "gain", "all-on-GPU");
      if (any_paper) fmt::print(" | {:>5} {:>10} {:>7} {:>6}", "paper", "tok/s", "err", "OTPS");
      fmt::print("\n");
      for (const Row& r : rows) {
        const StepResult& e = r.ess;
        fmt::print("{:>5} {:>6.3f} {:>6} {:>8.2f} {:>8.2f} {:>7.2f} {:>7.2f} {:>7.1f} {:>11.0f} {:>7.2f} {:>6.1f}% {:>11}",
                   e.batch, e.ratio, e.slots, ms(e.step_us), ms(e.compute_us), ms(e.exposed_comm_us),
                   ms(e.exposed_transfer_us), e.misses_per_request_layer, e.throughput_tokens_per_s, e.otps,
                   100 * gain(e), r.baseline_fits ? fmt::format("{:.0f}", r.baseline.throughput_tokens_per_s) : "OOM");
        if (r.paper != nullptr) {
          fmt::print(" | {:>5.2f} {:>10.0f} {:>+6.1f}% {:>6.2f}", r.paper->ratio, r.paper->throughput_tokens_per_s,
                     100 * (e.throughput_tokens_per_s / r.paper->throughput_tokens_per_s - 1), r.paper->otps);
        }
        fmt::print("\n");
      }
      for (const Row& r : rows) {
        const StepResult& e = r.ess;
        if (e.host_pool_gb_per_node > hw.host_dram_gb) {
          fmt::print("\nwarning: batch {}: the node's Total Memory Pool ({:.0f} GB) exceeds host DRAM ({} GB)", e.batch,
                     e.host_pool_gb_per_node, hw.host_dram_gb);
        }
        if (e.h2d_gbps_per_node > hw.host_dram_bandwidth_gbps) {
          fmt::print("\nwarning: batch {}: H2D traffic ({:.0f} GB/s per node) exceeds host-memory bandwidth ({} GB/s)",
                     e.batch, e.h2d_gbps_per_node, hw.host_dram_bandwidth_gbps);
        }
      }
      fmt::print("\nratio: Sparse Memory Ratio that fits the batch; x-comm / x-h2d: compute stream idle waiting for the "
                 "all-to-all / the misses' copy; misses: mean per request-layer-step (--miss-profile, else the parametric model); gain: "
                 "throughput vs the all-on-GPU baseline at its largest batch; all-on-GPU: its throughput at the same "
                 "batch (OOM: does not fit).\n");
    }
    exit_code = 0;
  });
}

}  // namespace ess::cli
