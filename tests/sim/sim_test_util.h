// Shared fixtures for the simulator tests: the shipped model, calibration profile and paper
// deployment.
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "ess/model/model_spec.h"
#include "ess/sim/deployment.h"
#include "ess/sim/hardware.h"
#include "ess/sim/step_model.h"
#include "ess/trace/analyzer.h"
#include "ess/trace/generator.h"

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

// A miss profile of the model's own selections, as a user makes one (`ess trace gen --model`, then
// `ess trace analyze --miss-profile` under LRU-Warmup at ratio 0.2): a trace of 2 requests x 48
// steps at 32K written to the test's temp folder as `stem`.safetensors, the profile as `stem`.json
// (its path in `path`). Returns the profile; `mean` is its mean over layers at its one context.
inline nlohmann::json own_miss_profile(const ModelSpec& model, const std::string& stem, std::string& path,
                                       double& mean) {
  trace::GeneratorProfile p = trace::GeneratorProfile::shipped_default();
  trace::apply_model(p, model);
  p.validate(stem);
  trace::GenerateConfig g;
  g.contexts = {32768};
  g.requests = 2;
  g.steps = 48;
  const std::string dir = ::testing::TempDir();
  trace::generate_trace(p, g, dir + "/" + stem + ".safetensors");
  trace::AnalyzeConfig c;
  c.policies = {"lru_warmup"};
  c.ratios = {0.2};
  c.recommend = false;
  c.similarity = false;
  c.prefetch = false;
  const trace::AnalysisResult a = trace::analyze(trace::TraceReader(dir + "/" + stem + ".safetensors"), c);
  const nlohmann::json profile = trace::miss_profile_json(a, "lru_warmup");
  path = dir + "/" + stem + ".json";
  std::ofstream(path) << profile.dump();
  double sum = 0;
  for (const auto& l : profile["contexts"][0]["layers"]) sum += l["mean"].get<double>();
  mean = sum / static_cast<double>(profile["contexts"][0]["layers"].size());
  return profile;
}

}  // namespace ess::sim::testing
