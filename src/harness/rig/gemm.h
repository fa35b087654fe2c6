// Stand-in GEMMs for the parts of a DeepSeek-V3.2 decoder layer around the attention stack
// (projections, MoE gate, shared and routed experts), so that the executor's schedules have
// real tensor-core work to overlap with. Shapes follow the model; values are a fixed pseudo-
// random pattern; outputs are discarded (the attention stack's inputs are separate tensors).
//
// Each op carries the simulator's op name (src/analysis/sim/step_model.cc), so that what
// `ess bench profile` measures feeds `ess sim` table for table.
//
// Stand-ins run in BF16 through cuBLAS (the model runs most of them in FP8 via DeepGEMM):
// per op, twice the weight bytes and half the peak rate of the FP8 original. Weights are
// shared by all layers (the real ones are not): the large ones (o_proj, q_b, the experts)
// exceed L2 and still stream from HBM each layer; the small gate and proj0 weights may stay
// partly in L2, a little faster than a real model. CUDA target only.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "ess/model/model_spec.h"
#include "ess/ops/flashtrans.h"
#include "ess/sim/op_names.h"

namespace ess::rig {

// Floating-point operations of the op for n tokens (what the simulator charges).
double gemm_flops(const ModelSpec& m, int expert_parallel, GemmOp op, int n);

class StandInGemms {
 public:
  // Sized for up to max_tokens tokens per call. Allocates the weights (about 1.2 GB in BF16
  // for DeepSeek-V3.2 with EP 32) and a cuBLAS workspace, so that calls can be captured.
  StandInGemms(const ModelSpec& model, int max_tokens, int expert_parallel);
  ~StandInGemms();
  StandInGemms(const StandInGemms&) = delete;
  StandInGemms& operator=(const StandInGemms&) = delete;

  // Enqueues the op for n tokens (1 <= n <= max_tokens) on the stream, with the workspace
  // allocated at construction (so that a graph capture of the call allocates nothing). Not
  // thread-safe: one caller at a time.
  void run(GemmOp op, int n, cuda::Stream stream);
  std::uint64_t weight_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ess::rig
