// The simulator's model of one executor run (`ess bench step --profile-*`): the rig
// deployment (sim `rig_layers`), the run's batch, pool, schedule and measured misses per
// layer, priced with a measured hardware profile and op table. Host code.
#pragma once

#include "ess/model/model_spec.h"
#include "ess/sim/hardware.h"
#include "ess/sim/op_cost.h"
#include "ess/sim/step_model.h"
#include "harness/rig/config.h"
#include "harness/rig/executor.h"

namespace ess::rig {

// The deployment and workload that describe the run `r` of configuration `c`.
sim::Deployment rig_deployment(const ExecutorConfig& c, const ExecutorReport& r);
sim::Workload rig_workload(const ExecutorConfig& c, const ExecutorReport& r);

// The predicted step.
sim::StepResult predict_step(const ModelSpec& model, const sim::HardwareProfile& hw, const sim::MeasuredTables& tables,
                             const ExecutorConfig& c, const ExecutorReport& r);

}  // namespace ess::rig
