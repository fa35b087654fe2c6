// Running the step model over many configurations, and the paper's reference rows.
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "ess/sim/step_model.h"

namespace ess::sim {

// The brief's Table 2 excerpt (paper: 32K context, MTP 2, accept ratio 1.7, Table 1
// deployment): reference values to compare with, never used by the model.
struct PaperRow {
  int batch;
  double ratio;
  double throughput_tokens_per_s;  // per node
  double otps;
};
std::span<const PaperRow> paper_table2_32k();

// Evaluates every workload; `progress(done, total)` is called now and then when given.
std::vector<StepResult> sweep(const StepModel& model, std::span<const Workload> workloads,
                              const std::function<void(std::size_t, std::size_t)>& progress = {});

}  // namespace ess::sim
