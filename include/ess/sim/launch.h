// The launch line of a planned configuration for a serving engine: the engine's own flags and
// ESS's settings for what `ess plan --engine` chose. Which engine releases are served, and
// what each serves, is in docs/integration.md.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "ess/model/model_spec.h"
#include "ess/sim/deployment.h"
#include "ess/sim/hardware.h"
#include "ess/sim/planner.h"

namespace ess::sim {

// The engines `ess plan --engine` knows; "" is ESS's own model (every overlap mode, the pool
// floor as given).
inline constexpr const char* kSglangEngine = "sglang";
inline constexpr const char* kVllmEngine = "vllm";

// What an engine's adapter serves, applied to a plan before the search (every overlap mode runs
// inside both engines): its pool floor rule and what it runs beside ESS. Refuses, by name, an
// engine this build does not plan for and a pool floor below what its adapter needs.
struct EngineLimits {
  std::string pool_floor;          // the floor rule to use ("" = as given)
  bool two_batch_overlap = true;   // whether the engine runs it with ESS (false: the search keeps it off)
  bool whole_residency = true;     // whether its adapter keeps requests whole at low load (ESS_RESIDENCY)
  bool preattn_in_copy_window = true;  // Deployment::preattn_in_copy_window as the engine runs DA / DBA
  bool shared_index_prefetch = true;   // whether its adapter prefetches shared-index layers (Deployment's)
  std::vector<std::string> notes;  // what the engine changed, for the output
};
EngineLimits engine_limits(const std::string& engine, const std::string& pool_floor, bool pool_floor_given,
                           int mtp_tokens);

struct Launch {
  std::string engine;                 // "sglang" or "vllm"
  std::string release;                // the release the adapter is checked against
  std::vector<std::string> env;       // NAME=value settings of ESS
  std::vector<std::string> argv;      // the command and its flags, one element each
  std::vector<std::string> notes;     // what the user fills in, and what the values assume
  std::string command_line() const;   // env, then argv, shell-quoted
  nlohmann::json to_json() const;
};

// The launch of `result`'s chosen configuration (found) on `engine`, for one node of the deployment
// (`hardware`: vLLM's memory budget leaves ESS's rows outside it).
Launch launch_for(const std::string& engine, const ModelSpec& model, const HardwareProfile& hardware,
                  const Deployment& deployment, const PlanResult& result);

// Stock HiSparse on the same GPU at SGLang 0.5.23's defaults (srt/mem_cache/sparsity/factory.py:
// top_k 2048, device_buffer_size 2 x top_k, host_to_device_ratio 2), sized as SGLang sizes it: its
// device pool of D tokens costs, per token, every cache layer's latent entry and
// host_to_device_ratio indexer entries (model_executor/pool_configurator.py: the indexer cache
// covers the logical pool); the logical pool, host_to_device_ratio x D tokens, holds every admitted
// request's context; each request takes padded_buffer_size (device_buffer_size + one page) device
// slots, and with MTP the speculative swap's scratch, min(T x top-k, max(1024, T x top-k -
// device_buffer_size)) (managers/hisparse_coordinator.py). Its step is simulated as the serial
// swap over a pool of device_buffer_size, at the largest batch both pools admit that meets the
// OTPS target.
struct StockHiSparse {
  bool found = false;
  int top_k = 0, device_buffer_size = 0;  // the coordinator's (top_k: the model's index_topk)
  int batch = 0;                // requests per GPU
  int admitted = 0;             // what its pools admit, before the OTPS target
  std::string limit;            // which pool bounds `admitted`, with its numbers (or the OTPS target)
  double device_tokens = 0;     // D
  double logical_tokens = 0;    // host_to_device_ratio x D
  double slots_per_request = 0; // padded_buffer_size (+ the scratch with MTP)
  StepResult step;              // at `batch`
  nlohmann::json to_json() const;
};
// For engine sglang (else not found); `model` runs the deployment as planned (its TBO).
StockHiSparse stock_hisparse(const std::string& engine, const StepModel& model, const PlanRequest& request);

}  // namespace ess::sim
