#include "harness/rig/predict.h"

#include <numeric>

namespace ess::rig {

sim::Deployment rig_deployment(const ExecutorConfig& c, const ExecutorReport& r) {
  sim::Deployment d;
  d.name = "executor rig";
  d.nodes = 1;
  d.gpus_per_node = 1;
  d.expert_parallel = c.expert_parallel;
  d.attention_data_parallel = 1;
  d.mtp_tokens = r.mtp;
  d.accept_ratio = 1.0;
  d.two_batch_overlap = false;
  d.preattn_in_copy_window = c.preattn_in_copy_window;
  d.rig_layers = r.layers;
  d.validate("executor rig");
  return d;
}

sim::Workload rig_workload(const ExecutorConfig& c, const ExecutorReport& r) {
  sim::Workload w;
  w.context = r.context;
  w.batch = r.batch;
  w.offload = r.offload;
  w.overlap = r.offload ? c.overlap : OverlapMode::kNone;
  if (r.offload) {
    w.slots = r.slots;
    w.layerwise_threshold = c.layerwise_threshold * r.batch;  // the sim's threshold is per micro-batch
    const double mean = r.misses.empty() ? 0.0
                                         : std::accumulate(r.misses.begin(), r.misses.end(), 0.0) /
                                               static_cast<double>(r.misses.size());
    w.misses.reference_misses = mean;
    w.misses.reference_slots = r.slots;
    w.misses.reference_context = static_cast<double>(r.context);
    w.misses.reference_tokens = r.mtp;
    w.misses.layer_shape.clear();
    if (mean > 0) {
      for (const double v : r.misses) w.misses.layer_shape.push_back(v / mean);
    }
  }
  w.validate();
  return w;
}

sim::StepResult predict_step(const ModelSpec& model, const sim::HardwareProfile& hw, const sim::MeasuredTables& tables,
                             const ExecutorConfig& c, const ExecutorReport& r) {
  const sim::StepModel sm(model, hw, rig_deployment(c, r), &tables);
  return sm.run(rig_workload(c, r));
}

}  // namespace ess::rig
