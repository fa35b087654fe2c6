// The decode-step executor's configuration and its host-side inputs: which model
// dimensions, how many layers and requests, offloaded or all-resident, which overlap
// schedule, and the top-k ids every step replays from a trace (recorded or synthetic).
//
// This part is plain C++ (built without CUDA, tested on the CPU); the executor itself
// (executor.h) needs the CUDA target.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ess/model/model_spec.h"
#include "ess/sim/deployment.h"

namespace ess::rig {

struct ExecutorConfig {
  int layers = 4;                  // decoder layers run per step (MoE layers of the model)
  int batch = 32;                  // requests
  std::int64_t context = 32768;    // prompt length of every request (synthetic traces)
  int steps = 16;                  // decode steps replayed from the trace
  int warm_steps = 4;              // of which the first ones are not timed
  bool offload = true;             // false: all-resident (the whole latent cache on the GPU)
  double ratio = 0.2;              // Sparse Memory Ratio (slots = ceil(ratio x context))
  std::int32_t slots = 0;          // overrides ratio when > 0
  OverlapMode overlap = OverlapMode::kDualAttention;
  // Layer-wise: a layer runs DBA when its profiled misses per request (the offline profile:
  // an LRU replay of the same trace on the CPU) reach this many, else DA.
  double layerwise_threshold = 128;
  bool warmup = true;              // LRU-Warmup from the trace's prefill top-k
  int expert_parallel = 32;        // the routed experts this GPU owns: ceil(n_routed / EP)
  bool stand_in_gemms = true;      // false: only the attention stack (indexer .. merge)
  bool skip_transfers = false;     // timing aid: FlashTrans copies nothing (NOT lossless)
  // Offloaded: each step's newest T tokens read from reserved rows outside the LRU
  // (OffloadConfig::reserve_newest), so the H2D no longer waits for their D2H.
  bool reserve_newest = false;
  // Under DA / DBA, PreAttn (q_b_proj, absorb bmm) after the indexer, inside the copy window (the
  // paper); false: before the indexer, where SGLang 0.5.23's model computes q and ESS's adapter
  // leaves it (sim::Deployment::preattn_in_copy_window).
  bool preattn_in_copy_window = true;
  bool graph = true;               // capture each step in a CUDA graph
  int copy_blocks = 0;             // FlashTrans grid of the step's copies (0 = its default)
  std::string trace;               // top-k trace file; empty: synthetic, default profile
  std::uint64_t seed = 1;
  int device = 0;

  // Throws ess::Error naming the field and the value unless the configuration is usable for
  // `model` (e.g. the pool must hold a step's working set: min(T x top-k, context) slots).
  void validate(const ModelSpec& model) const;
  std::int32_t resolved_slots() const;  // slots, or ceil(ratio x context)
};

// What the steps replay, resolved on the host before anything touches the GPU.
struct StepInputs {
  int layers = 0, batch = 0, mtp = 1, topk = 0, steps = 0;
  std::int64_t prompt = 0;                  // tokens in the cache before step 0 (every request)
  std::vector<int> trace_layers;            // the trace layer each executor layer replays
  std::vector<std::int32_t> ids;            // [steps][layers][batch][mtp][topk], -1 = padding
  std::vector<std::int64_t> lengths;        // [steps][batch]: tokens in the cache at the step
  int prefill_windows = 0;
  std::vector<std::int32_t> prefill;        // [layers][batch][windows][topk] (LRU-Warmup)
  std::vector<double> profile_misses;       // [layers]: mean misses per request and step (LRU)
  std::string source;                       // provenance of the ids

  std::int64_t max_length() const;          // longest length over steps and requests
  const std::int32_t* step_ids(int step, int layer) const {
    return ids.data() + (static_cast<std::size_t>(step) * layers + static_cast<std::size_t>(layer)) *
                            static_cast<std::size_t>(batch) * mtp * topk;
  }
};

// Reads config.trace (requests are reused cyclically when the trace has fewer than the
// batch; executor layer i replays trace layer round(i (Lt - 1) / (L - 1)) so that a few
// layers span the trace's per-layer spread), or generates a synthetic trace with the shipped
// generator profile for config.layers layers. Computes the offline LRU miss profile at the
// configured pool size. Throws ess::Error for a trace that does not fit the configuration.
StepInputs load_inputs(const ExecutorConfig& config, const ModelSpec& model);

// The schedule of each layer: the configured mode, or for layer-wise DA / DBA by the
// profile and the threshold.
std::vector<OverlapMode> layer_modes(const ExecutorConfig& config, const StepInputs& inputs);

}  // namespace ess::rig
