// Capacity planner: for a model, hardware, deployment, context length and minimum OTPS, the
// configuration (batch, Sparse Memory Ratio, overlap mode) with the highest throughput that
// meets the OTPS target, and why the alternatives lose. Configurations whose Total Memory
// Pool does not fit host DRAM, or whose aggregate H2D traffic exceeds the node's host-memory
// bandwidth, are refused.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ess/sim/step_model.h"

namespace ess::sim {

struct PlanRequest {
  std::int64_t context = 32768;
  double min_otps = 0;  // output tokens/s per request
  std::vector<OverlapMode> modes = {OverlapMode::kNone, OverlapMode::kDualAttention,
                                    OverlapMode::kDualBatchAttention, OverlapMode::kLayerWise};
  MissModel misses;
  double prefix_share = 0;  // Workload::prefix_share
  int batch_step = 1;   // batches tried: 1, 1 + step, ... and the largest that fits (at most 4096
                        // per kind: a wider step when more would fit, said in PlanResult::notes)
};

struct PlanOption {
  std::string label;     // "all-on-GPU", "ESS none", "ESS da", ...
  bool found = false;    // some configuration of this kind meets every constraint
  StepResult best;       // its best (when found)
  std::string why;       // why it loses to the chosen one, or why none qualifies
  // What stops its best from a larger batch: GPU memory (the indexer cache or the latent pool the
  // larger share), host DRAM capacity, host-memory bandwidth, the OTPS target, or throughput
  // falling past the best; each with its numbers.
  std::string limit;
  // The memory behind it, per GPU at the best batch: the caches' budget and its two parts.
  double cache_budget_gb = 0, indexer_gb = 0, latent_gb = 0;
  // What indexer_gb holds: "indexer cache", or (DeepSeek-V4) "resident caches" (indexer keys, C128
  // cache, windows, compressor states).
  std::string resident_what = "indexer cache";
  double host_dram_usable_gb = 0;
  bool two_batch_overlap = false;  // the deployment it ran in
  bool shared_index_prefetch = true;  // Deployment::shared_index_prefetch of the deployment it ran in
};

// The chosen ESS configuration at low load, with adaptive residency (Workload::residency) at its
// pool: up to which batch every request stays whole, and batch 1 beside the all-on-GPU step.
struct LowLoad {
  bool found = false;           // the chosen configuration offloads (else nothing to say)
  int all_whole_up_to = 0;      // the largest batch whose requests are all whole (0: not even one)
  double batch1_adaptive = 0;   // ESS's throughput at batch 1 over all-on-GPU's, adaptive residency
  double batch1_sparse = 0;     // the same with every request in a Sparse Memory Pool
};

struct PlanResult {
  std::int64_t context = 0;
  double min_otps = 0;
  bool found = false;
  PlanOption chosen;
  std::vector<PlanOption> alternatives;  // one per kind, best first
  std::vector<std::string> refusals;     // host-side limits that cut the search
  std::vector<std::string> notes;        // how the search was bounded (a widened batch step)
  LowLoad low_load;                      // the chosen configuration at low load
  std::size_t evaluated = 0;
};

PlanResult plan(const StepModel& model, const PlanRequest& request);
// The same over several deployments of the model (Two-Batch Overlap on and off): every kind under each, the
// labels of all but the first suffixed with `suffixes[i]` (" TBO off").
PlanResult plan(const std::vector<const StepModel*>& models, const std::vector<std::string>& suffixes,
                const PlanRequest& request);

}  // namespace ess::sim
