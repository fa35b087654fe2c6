// The inputs `ess sim` and `ess plan` share: model, hardware profile, deployment (with
// overrides), miss model and measured op tables.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <optional>
#include <string>

#include "ess/model/model_spec.h"
#include "ess/sim/deployment.h"
#include "ess/sim/hardware.h"
#include "ess/sim/op_cost.h"

namespace ess::cli {

struct SimInputs {
  std::string model;                   // config.json path; empty: the shipped DeepSeek-V3.2-Exp
  std::string hardware = "paper-table1";
  std::string deployment = "paper-table1";
  std::optional<int> mtp;
  std::optional<double> accept;
  std::optional<int> nodes;
  std::optional<int> gpus_per_node;
  std::optional<int> ep;
  std::optional<double> mem_fraction;
  bool no_tbo = false;
  std::optional<int> rig_layers;
  std::optional<double> reference_misses;
  std::optional<double> miss_exponent;
  std::string miss_profile;
  std::string op_table;

  void add_to(CLI::App& cmd) {
    cmd.add_option("--model", model, "Model config.json (default: the shipped DeepSeek-V3.2-Exp)");
    cmd.add_option("--hardware", hardware,
                   "Hardware profile: a shipped name (h100, h200, h20-141gb, h800, paper-table1) or a JSON file")
        ->capture_default_str();
    cmd.add_option("--deployment", deployment, "Deployment: a shipped name (paper-table1) or a JSON file")
        ->capture_default_str();
    cmd.add_option("--mtp", mtp, "Override: MTP query tokens per request per step (1 = no MTP)");
    cmd.add_option("--accept", accept, "Override: MTP accept ratio (tokens kept per step, in [1, T])");
    cmd.add_option("--nodes", nodes, "Override: nodes");
    cmd.add_option("--gpus-per-node", gpus_per_node, "Override: GPUs per node");
    cmd.add_option("--ep", ep, "Override: expert-parallel degree");
    cmd.add_option("--mem-fraction", mem_fraction, "Override: mem_fraction_static (weights + caches)");
    cmd.add_flag("--no-tbo", no_tbo, "Turn Two-Batch Overlap off");
    cmd.add_option("--rig-layers", rig_layers,
                   "Model the single-GPU executor rig of `ess bench step` with this many MoE layers (no all-to-all, "
                   "TBO, LM head or MTP drafts; needs --batch)");
    cmd.add_option("--misses", reference_misses,
                   "Parametric miss model: mean misses per request-layer-step at 6554 slots (ratio 0.2 of 32K), "
                   "T = 2 (default 200)");
    cmd.add_option("--miss-exponent", miss_exponent, "Parametric miss model: exponent of (6554 / slots) (default 1)");
    cmd.add_option("--miss-profile", miss_profile,
                   "Miss profile: `ess trace analyze --miss-profile` output (per-layer means at a pool size), or JSON "
                   "with per_layer_misses (e.g. `ess verify --format json`: per-layer shape only)");
    cmd.add_option("--op-table", op_table, "Measured op times: CSV op,context,tokens,time_us (see docs/simulator.md)");
  }

  sim::Deployment load_deployment() const {
    sim::Deployment d = sim::Deployment::load(deployment);
    if (mtp) d.mtp_tokens = *mtp;
    if (accept) d.accept_ratio = *accept;
    if (mtp && !accept) d.accept_ratio = std::min(d.accept_ratio, static_cast<double>(*mtp));
    if (nodes) d.nodes = *nodes;
    if (gpus_per_node) d.gpus_per_node = *gpus_per_node;
    if (ep) d.expert_parallel = *ep;
    if ((nodes || gpus_per_node) && !ep) d.expert_parallel = d.gpus();
    d.attention_data_parallel = std::min(d.attention_data_parallel, d.gpus());
    if (nodes || gpus_per_node) d.attention_data_parallel = d.gpus();
    if (mem_fraction) d.mem_fraction_static = *mem_fraction;
    if (no_tbo) d.two_batch_overlap = false;
    if (rig_layers) d.rig_layers = *rig_layers;
    d.validate("deployment (after command-line overrides)");
    return d;
  }

  sim::MissModel load_misses(std::int64_t context) const {
    sim::MissModel m;
    if (reference_misses) m.reference_misses = *reference_misses;
    if (miss_exponent) m.exponent = *miss_exponent;
    if (!miss_profile.empty()) m = sim::MissModel::load_profile(miss_profile, context, m);
    m.validate("--misses / --miss-exponent / --miss-profile");
    return m;
  }

  ModelSpec load_model() const {
    return model.empty() ? ModelSpec::deepseek_v32_exp() : ModelSpec::from_file(model);
  }

  std::unique_ptr<sim::MeasuredTables> load_tables() const {
    if (op_table.empty()) return nullptr;
    return std::make_unique<sim::MeasuredTables>(sim::MeasuredTables::from_csv(op_table));
  }
};

}  // namespace ess::cli
