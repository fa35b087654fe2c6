// What `ess sim` and `ess plan` (and the C ABI's ess_plan) read: the model, hardware profile,
// deployment with its overrides, the miss model and measured op tables, each loaded and
// validated once here; the command line and the C ABI only fill the fields.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ess/model/model_spec.h"
#include "ess/sim/deployment.h"
#include "ess/sim/hardware.h"
#include "ess/sim/op_cost.h"
#include "ess/sim/report.h"

namespace ess::sim {

// The shipped deployment MiniMax-M3 is simulated under when none is given (attention tensor parallel
// over a node: its HiSparse holds one KV head per rank).
inline constexpr std::string_view kMiniMaxM3Deployment = "minimax-m3-tp8";

struct Inputs {
  std::string model;                   // config.json path; empty: the shipped DeepSeek-V3.2-Exp
  std::string hardware = "paper-table1";
  std::string deployment;                // "": the model's shipped default (paper-table1; kMiniMaxM3Deployment)
  std::optional<int> mtp;
  std::optional<double> accept;
  std::optional<int> nodes;
  std::optional<int> gpus_per_node;
  std::optional<int> ep;
  std::optional<double> mem_fraction;
  bool no_tbo = false;
  bool no_prefetch = false;                // Deployment::shared_index_prefetch off
  std::optional<int> rig_layers;
  std::optional<double> reference_misses;
  std::optional<double> miss_exponent;
  std::string miss_profile;
  std::optional<std::string> pool_floor;   // MissModel::pool_floor
  std::optional<double> pool_floor_margin;
  std::optional<double> prefix_share;      // Workload::prefix_share
  std::optional<double> host_reserve;      // HardwareProfile::host_dram_reserve
  std::string op_table;

  ModelSpec load_model() const;
  HardwareProfile load_hardware() const;
  // The deployment with the overrides applied, validated (MiniMax-M3's default: kMiniMaxM3Deployment).
  Deployment load_deployment() const;
  MissModel load_misses(std::int64_t context) const;
  // Sets the pool floor fields that were given on `m` (load_misses does it too), validated.
  void apply_pool_floor(MissModel& m) const;
  std::unique_ptr<MeasuredTables> load_tables() const;  // nullptr without an op table
};

// What `ess plan` searches: per context length, the best configuration that meets min_otps.
struct PlanOptions {
  std::vector<std::int64_t> contexts = {32768};
  double min_otps = 0;
  std::vector<std::string> modes = {"none", "da", "dba", "layerwise"};
  int batch_step = 1;
  // The serving engine the plan is for ("" = ESS's own model; "sglang"): the search limited to what its adapter
  // serves (ess/sim/launch.h), and each context's launch line.
  std::string engine;
  std::function<void(std::size_t done, std::size_t total)> progress;  // after each context, when set
};

Plans plan_contexts(const Inputs& inputs, const PlanOptions& options);

// A plan request as JSON (the C ABI's ess_plan): optional keys named like the fields above
// (contexts, min_otps, modes, batch_step, model, hardware, deployment, mtp, accept, nodes,
// gpus_per_node, ep, mem_fraction, no_tbo, no_prefetch, misses, miss_exponent, miss_profile, pool_floor,
// pool_floor_margin, prefix_share, host_reserve, op_table);
// an unknown key or a value of the wrong type is refused by name.
void read_plan_request(const nlohmann::json& request, Inputs& inputs, PlanOptions& options);

}  // namespace ess::sim
