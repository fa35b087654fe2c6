// Shared fixtures for the simulator tests: the shipped model, calibration profile and paper
// deployment.
#pragma once

#include <string>

#include "ess/model/model_spec.h"
#include "ess/sim/deployment.h"
#include "ess/sim/hardware.h"
#include "ess/sim/step_model.h"

namespace ess::sim::testing {

inline const ModelSpec& dsv32() {
  static const ModelSpec m = ModelSpec::deepseek_v32_exp();
  return m;
}
inline HardwareProfile paper_hw() { return HardwareProfile::shipped("paper-table1"); }
inline Deployment paper_dep() { return Deployment::shipped("paper-table1"); }
// A config of configs/models/.
inline ModelSpec shipped_model(const std::string& file) {
  return ModelSpec::from_file(std::string(ESS_SOURCE_DIR "/configs/models/") + file);
}

}  // namespace ess::sim::testing
