#include "ess/sim/sweep.h"

namespace ess::sim {

std::span<const PaperRow> paper_table2_32k() {
  static constexpr PaperRow kRows[] = {
      {52, 1.00, 9647.71, 23.19},   {64, 0.82, 10693.31, 20.89},  {96, 0.48, 13155.98, 17.13},
      {128, 0.31, 15620.14, 15.25}, {160, 0.21, 16347.88, 12.77},
  };
  return kRows;
}

std::vector<StepResult> sweep(const StepModel& model, std::span<const Workload> workloads,
                              const std::function<void(std::size_t, std::size_t)>& progress) {
  std::vector<StepResult> out;
  out.reserve(workloads.size());
  for (std::size_t i = 0; i < workloads.size(); ++i) {
    out.push_back(model.run(workloads[i]));
    if (progress && (i % 4096 == 4095 || i + 1 == workloads.size())) progress(i + 1, workloads.size());
  }
  return out;
}

}  // namespace ess::sim
