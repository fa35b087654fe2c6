// `ess bench step` and `ess bench profile`: the decode-step executor measured
// across batches and schedules, the op times the simulator needs measured on this GPU, and
// the simulator's predictions set beside the measurements. CUDA target only.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "harness/rig/config.h"
#include "harness/rig/executor.h"

namespace ess::rig {

// ---- bench profile ----------------------------------------------------------------------

struct ProfileConfig {
  ExecutorConfig base;                      // model-side settings (context, trace, seed, device)
  std::vector<int> requests{1, 2, 4, 8, 16, 32, 64, 128};  // grid (tokens = requests x T)
  int repeats = 20;
  std::string base_hardware = "h100";       // fields the profile does not measure come from it
};

struct ProfileResult {
  std::string device, date;
  std::string csv;               // op,context,tokens,time_us (the simulator's --op-table)
  nlohmann::json hardware;       // a hardware profile (the simulator's --hardware)
  nlohmann::json report;         // everything measured, with the fits
};

ProfileResult run_profile(const ProfileConfig& config);

// ---- bench step -------------------------------------------------------------------------

struct StepBenchConfig {
  ExecutorConfig base;                      // layers, context, ratio, steps, trace, ...
  std::vector<int> batches{16, 32, 64, 128};
  std::vector<OverlapMode> modes{OverlapMode::kNone, OverlapMode::kDualAttention,
                                 OverlapMode::kDualBatchAttention, OverlapMode::kLayerWise};
  bool resident = true;                     // the all-resident baseline at every batch
  bool exposed = true;                      // also run each offloaded point without transfers
  // Simulator predictions of every point from a measured profile (`ess bench profile`
  // output: hardware JSON + op table CSV); empty: no predictions.
  std::string profile_hardware, profile_table;
  // Max batch of the whole model on this GPU (the memory model) for the throughput gain.
  std::string hardware = "h100";
  std::string deployment = "paper-table1";
  bool gain = true;                         // run the two max-batch points
};

struct StepPoint {
  int batch = 0;
  std::string mode;              // resident | none | da | dba | layerwise
  ExecutorReport report;
  double exposed_us = -1;        // step - step without transfers (< 0: not measured)
  double predicted_us = -1;      // simulator (< 0: no profile)
  double vs_resident = -1;       // step / all-resident step at the same batch (< 0: not run)
  nlohmann::json to_json() const;  // self-contained: device and date included
};

struct StepBenchResult {
  std::string device, date;
  std::vector<StepPoint> points;
  int max_batch_resident = 0, max_batch_ess = 0;
  std::int32_t ess_slots = 0;
  std::vector<StepPoint> gain_points;  // resident at its max batch, ESS at its max batch
  double throughput_gain = 0;          // (B_ess / t_ess) / (B_res / t_res), 0 when not measured
  nlohmann::json to_json(const StepBenchConfig& config) const;
};

// Measures every point; on_point, when given, receives each one as soon as it is measured
// (`ess bench step --points FILE` appends it there, so a run stopped at a time limit keeps
// what it finished). Each batch builds one all-resident executor and one offloaded executor
// that every schedule reuses (StepExecutor::rearm).
StepBenchResult run_step_bench(const StepBenchConfig& config,
                               const std::function<void(const StepPoint&)>& on_point = {});

}  // namespace ess::rig
