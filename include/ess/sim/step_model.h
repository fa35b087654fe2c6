// Step model: one decode step of a DeepSeek-V3.2-style model on one GPU of the deployment,
// built from its operations per layer for B x T tokens, scheduled on four streams (compute,
// EP comm, H2D, D2H) with Two-Batch Overlap, MTP and the offload overlap mode.
//
//   attention block (per micro-batch): proj0 (q_a, kv_a, indexer k / weights) -> Indexer
//     (wq_b, FP8 logits over the whole context, top-k) -> PreAttn (q_b, absorb bmm) -> sparse
//     MLA over top-k entries -> PostAttn (output bmm, o_proj); the misses' H2D copy and the new
//     tokens' D2H write-back on their own streams, placed by the OverlapMode (brief §2.5);
//   MoE: gate -> dispatch all-to-all -> shared expert, routed experts -> combine;
//   TBO: each MoE layer in SGLang's five decode stages, the second micro-batch two stages
//     behind, so one half's all-to-all is in flight while the other computes;
//   per step: the LM head over B x T tokens, sampling + verification, the MTP draft-extend
//     pass and T - 2 draft passes of the next-n layer, the host's per-step time.
// Fixed costs are kept by cause (launch gaps, all-to-all latency, step overhead) and so is
// the compute FlashTrans's SMs take.
#pragma once

#include <cstdint>
#include <string>

#include "ess/model/model_spec.h"
#include "ess/sim/deployment.h"
#include "ess/sim/hardware.h"
#include "ess/sim/memory_model.h"
#include "ess/sim/op_cost.h"
#include "ess/sim/timeline.h"

namespace ess::sim {

struct StepResult {
  int batch = 0;            // requests per GPU
  std::int32_t slots = 0;   // Sparse Memory Pool slots per request-layer
  double ratio = 0;         // slots / context
  bool offload = true;
  OverlapMode overlap = OverlapMode::kLayerWise;
  double step_us = 0;
  double compute_us = 0;            // busy time of the compute stream
  double exposed_comm_us = 0;       // compute stream idle waiting for the all-to-all
  double exposed_transfer_us = 0;   // compute stream idle waiting for H2D misses
  double attention_us = 0;          // compute breakdown
  double moe_us = 0;
  double other_us = 0;              // dense FFN, norms, LM head
  double mtp_draft_us = 0;
  double comm_us = 0;               // busy time of the comm stream
  double h2d_us = 0;                // busy time of the H2D stream
  // Fixed costs by cause: kernels launched on the compute stream and the launch gaps of those
  // timed analytically (inside compute_us; a measured time holds its own), the all-to-all
  // start-up per call (inside comm_us), the host time per step.
  double kernels = 0;
  double launch_us = 0;
  double comm_latency_us = 0;
  double step_overhead_us = 0;
  double transfer_sm_us = 0;        // compute time lost to the SMs FlashTrans copies hold
  double misses_per_request_layer = 0;   // mean over every request (whole ones have none)
  // Workload::residency kAdaptive: the requests whole (their entries in pool rows of their own).
  int whole_requests = 0;
  // Layers whose miss model gave more than T x K (every selected entry missing): those are
  // taken as T x K, here as in the step time.
  int miss_capped_layers = 0;
  // Expected step calls past the first per layer and micro-batch (the most of any layer): a
  // pool below the MTP working set serves the larger steps in query groups.
  double split_calls_per_layer = 0;
  double h2d_bytes = 0;             // per step per GPU
  double d2h_bytes = 0;
  int layers_da = 0;                // layer-wise choices (per micro-batch layer)
  int layers_dba = 0;
  // Layer-wise only: the choice per layer, one character per micro-batch ('a' = DA, 'b' =
  // DBA, '-' = no misses), layers separated by spaces; then one group per MTP draft pass.
  std::string layer_modes;
  int ops_measured = 0;             // op times by source
  int ops_analytical = 0;
  int ops_outside_grid = 0;
  double throughput_tokens_per_s = 0;  // per node
  double otps = 0;                     // per request
  double cache_gb = 0;                 // indexer + latent per GPU
  double host_pool_gb_per_node = 0;
  double host_pool_gb_per_node_unshared = 0;  // the same without the workload's shared prefix
  double h2d_gbps_per_node = 0;        // aggregate H2D demand over the step
};

class StepModel {
 public:
  StepModel(const ModelSpec& model, const HardwareProfile& hw, const Deployment& dep,
            const MeasuredTables* tables = nullptr);

  // `misses` in this model's entries: the built-in model (tokens of a DSA model at top-2048) scaled
  // for a cache of entries of several tokens (DeepSeek-V4's C4: the same share of the top-k missed at
  // the same share of the context held); a profile, which counts its own ids, as it is.
  MissModel misses_in_entries(const MissModel& misses) const;
  static constexpr int kBuiltinTopk = 2048;
  // The fewest slots a request-layer's pool may have at `context` tokens (MissModel::min_slots of
  // `misses` in this model's entries, at its T and top-k).
  double pool_floor(const MissModel& misses, std::int64_t context) const;

  // Resolves the batch (0: largest that fits) and the slots (ratio / slots / the most that
  // fit the batch), checks the memory, and times one step. Records the events when
  // `timeline` is given.
  // Throws ess::Error unless the miss model fits this model (layers, top-k, at most T x K).
  void check_misses(const MissModel& misses) const;
  StepResult run(const Workload& workload, Timeline* timeline = nullptr) const;

  const ModelSpec& model() const { return model_; }
  const HardwareProfile& hardware() const { return hw_; }
  const Deployment& deployment() const { return dep_; }

 private:
  ModelSpec model_;
  HardwareProfile hw_;
  Deployment dep_;
  OpCostModel cost_;
};

}  // namespace ess::sim
