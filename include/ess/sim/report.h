// What `ess sim` and `ess plan` report, and every format they print it in (table, JSON, CSV):
// the question answered once here, the command line only picks a format.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ess/sim/planner.h"
#include "ess/sim/step_model.h"
#include "ess/sim/sweep.h"

namespace ess::sim {

// One batch of a simulation: ESS beside the all-on-GPU step at the same batch.
struct SimulationRow {
  std::string refused;              // why this batch cannot run (the rest of the row is empty); empty: it runs
  StepResult ess;
  bool baseline_fits = false;
  StepResult baseline;              // all-on-GPU at the same batch (when it fits)
  const PaperRow* paper = nullptr;  // the paper's row for this batch (its own setup only)
};

struct Simulation {
  ModelSpec model;
  HardwareProfile hardware;
  Deployment deployment;
  Workload base;                  // the workload every row shares (its batch aside)
  double cache_budget_gb = 0, weights_gb = 0;
  double pool_floor = 0;          // the fewest slots per request-layer (MissModel::min_slots)
  std::string pool_floor_rule;    // and where it comes from
  bool rig = false;               // the executor rig (no memory wall: baseline at every batch)
  bool wall_fits = false;         // the all-on-GPU baseline fits some batch
  StepResult wall;                // its largest batch (the memory wall)
  std::vector<SimulationRow> rows;

  double gain(const StepResult& r) const;  // throughput vs the memory wall - 1 (0 without one)
  // ESS's throughput over the all-on-GPU step's at the row's own batch; 0 where that does not fit.
  static double same_batch(const SimulationRow& r);
  // The smallest batch that runs past the memory wall with more throughput than the wall's
  // (where offload starts to pay); 0 when no row shows one.
  int offload_pays_from() const;
};

struct SimulateOptions {
  std::string timeline;  // write a Chrome-trace JSON of the first row's ESS step here
  std::function<void(std::size_t done, std::size_t total)> progress;
};

// ESS at each batch (0 = the largest that fits base's ratio / slots) beside the all-on-GPU
// baseline at its memory wall and at the same batch.
Simulation simulate(const StepModel& model, const Workload& base, const std::vector<int>& batches,
                    const SimulateOptions& options = {});

// The batches of a load sweep (`ess sim --concurrency`): 1, 2, 4, ... below the all-on-GPU
// memory wall, the wall and the batch after it, then doubling to the largest ESS batch at
// base's pool (ratio or slots, required), and that batch.
std::vector<int> load_batches(const StepModel& model, const Workload& base);

// Batch lists as the command line gives them: "52", ranges "1-200", "max" (0). Throws
// ess::Error naming the item that is none of these.
std::vector<int> parse_batches(const std::vector<std::string>& items);

nlohmann::json to_json(const Simulation& s);
std::string to_csv(const Simulation& s);
std::string to_table(const Simulation& s);

// One plan per context length, for one model, hardware and deployment.
struct Plans {
  ModelSpec model;
  HardwareProfile hardware;
  Deployment deployment;
  double min_otps = 0;
  std::vector<PlanResult> results;
  std::string engine;                 // "" or the engine planned for (PlanOptions::engine)
  std::vector<std::string> engine_notes;
  std::vector<nlohmann::json> launches;  // per result: its launch (Launch::to_json), null when none was found
  std::vector<nlohmann::json> stock;     // per result: stock HiSparse beside it (StockHiSparse::to_json), or null
  bool explain = false;                  // the table shows every option's memory, host and OTPS figures
  bool all_found() const;
};

nlohmann::json to_json(const Plans& p);
std::string to_csv(const Plans& p);
std::string to_table(const Plans& p);

}  // namespace ess::sim
