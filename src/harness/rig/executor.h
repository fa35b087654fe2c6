// The ESS decode step on one GPU: for L layers and a batch of requests at
// DeepSeek-V3.2 dimensions, per layer
//
//   proj0 -> [D2H: the step's new latent entries -> pinned Total Memory Pool]
//   indexer (wq_b, FP8 logits over the whole context, top-k)        -- its time, see below
//   swap engine (LRU hit / miss / victim decision for the batch, one launch)
//   split (FlashTrans list; resident vs fetched slot ids)
//   [H2D: FlashTrans gather of the misses into Sparse Memory Pool slots]
//   PreAttn (q_b, absorb bmm) -> sparse MLA -> (DA / DBA: Attn0, Attn1, merge)
//   PostAttn (out bmm, o_proj) -> MoE gate, shared expert, the routed experts this GPU owns
//
// on three streams (compute, H2D, D2H) joined by events, with the None / DA / DBA /
// layer-wise schedules of docs/architecture.md. Each step can be captured in a CUDA graph.
//
// The ids the swap engine and the attention see come from a top-k trace (StepInputs), so
// the locality is a real (or calibrated synthetic) one; the indexer and top-k kernels still
// run on random FP8 queries over a full-size indexer cache for their time, and their output
// is not used. Stand-in GEMMs (gemm.h) give the rest of the layer its compute.
//
// All-resident mode keeps every layer's whole latent cache on the GPU (no swap, no copies;
// new entries are written on the device) and reads entries by token id: the baseline the
// offloaded step is compared with, and the reference of the lossless check.
//
// CUDA target only.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ess/model/model_spec.h"
#include "harness/rig/config.h"
#include "testing/stats.h"

namespace ess::rig {

struct ExecutorReport {
  std::string device;
  std::string date;
  int batch = 0, layers = 0, mtp = 1, topk = 0;
  std::int64_t context = 0;
  bool offload = true;
  std::int32_t slots = 0;
  bool graph = false;
  std::vector<OverlapMode> modes;      // per layer
  std::vector<double> step_us;         // every timed step (after warm_steps)
  test::Summary step;                        // median / min / max of step_us
  std::vector<double> misses;          // per layer: mean misses per request-step (timed steps)
  std::vector<double> profile_misses;  // per layer: the offline LRU profile
  double h2d_bytes_per_step = 0;       // mean over timed steps
  double d2h_bytes_per_step = 0;
  std::uint64_t host_pool_bytes = 0;
  std::uint64_t device_cache_bytes = 0;  // latent slots or the resident cache, + indexer cache
  std::string inputs;                  // provenance of the ids
};

class StepExecutor {
 public:
  // Allocates and fills everything (host pool, device caches, stand-in weights) and runs the
  // LRU-Warmup. Throws ess::Error naming what does not fit or is invalid.
  StepExecutor(const ExecutorConfig& config, const ModelSpec& model, const StepInputs& inputs);
  ~StepExecutor();
  StepExecutor(const StepExecutor&) = delete;
  StepExecutor& operator=(const StepExecutor&) = delete;

  // Runs every step in order; after_step(s), when given, is called once step s finished (the
  // outputs are then readable). Times the steps from warm_steps on. The attention outputs are
  // poisoned (NaN) before the first step, so an output no step wrote cannot pass for one.
  ExecutorReport run(const std::function<void(int step)>& after_step = {});

  // Makes the next run() replay the steps from the start under another schedule, on the same
  // buffers: a fresh LRU in every request-layer and the LRU-Warmup again (offloaded), the
  // graphs captured anew. Saves the host-pool fill and the allocations when one batch is
  // measured under several schedules. skip_transfers applies to the offloaded mode only.
  void rearm(OverlapMode mode, bool skip_transfers);

  // The attention output (bf16 bits, [batch][T][heads][512]) and its log-sum-exp
  // ([batch][T][heads]) of `layer` at the last step run.
  std::vector<std::uint16_t> attention_output(int layer) const;
  std::vector<float> attention_lse(int layer) const;

  // `ess bench profile`: one op of the step timed alone on the compute stream (CUDA events,
  // median / min / max of `repeats` launches after 3 untimed ones), for the first `requests`
  // requests of layer 0. Names are the simulator's (op_name(GemmOp), "indexer.logits",
  // "indexer.topk", "swap.lru+split" (offloaded executors; it cycles through the steps, so
  // the LRU state moves on), "attn.sparse_mla", "attn.merge_lse"); for the attention,
  // `entries` valid ids per query token (0 = top-k). Throws for an op it does not run.
  test::Summary time_op(std::string_view op, int requests, int repeats, int entries = 0);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ess::rig
