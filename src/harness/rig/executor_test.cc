// The decode-step executor on the GPU: every output written and finite, chosen tokens against
// the CPU reference on the rig's own data, offloaded outputs against all-resident ones (None:
// bit-identical; DA / DBA / layer-wise: within the merge's tolerance), graph replay against
// eager launches, a rearmed executor replaying its steps exactly, the GPU LRU's misses against
// the CPU profile, the per-op timings, and the stand-in GEMMs capturable without allocating.
// Skipped without a CUDA device; the host half is executor_host_test.cc.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ess/model/numerics.h"
#include "executor_problem.h"
#include "harness/rig/executor.h"
#include "harness/rig/gemm.h"
#include "runtime/cuda/check.h"
#include "testing/testing.h"

namespace ess::executor_test {
namespace {

using rig::ExecutorReport;
using rig::StepExecutor;

// One run's outputs: [step][layer].
struct Outputs {
  std::vector<std::vector<std::vector<std::uint16_t>>> out;
  std::vector<std::vector<std::vector<float>>> lse;
};

// Runs `ex` and checks what every run must give: each step's outputs written and finite, and
// the checked tokens within the accuracy contract of the reference.
Outputs collect(StepExecutor& ex, const ExecutorConfig& c, const StepInputs& in, ExecutorReport* report = nullptr) {
  Outputs o;
  const ExecutorReport r = ex.run([&](int) {
    o.out.emplace_back();
    o.lse.emplace_back();
    for (int l = 0; l < c.layers; ++l) {
      o.out.back().push_back(ex.attention_output(l));
      o.lse.back().push_back(ex.attention_lse(l));
    }
  });
  if (report != nullptr) *report = r;
  const std::string what = c.offload ? std::string(to_string(c.overlap)) : "resident";
  for (std::size_t s = 0; s < o.out.size(); ++s) {
    for (std::size_t l = 0; l < o.out[s].size(); ++l) expect_written(o.out[s][l], fmt::format("{} step {} layer {}", what, s, l));
  }
  const rig::RigData rig(ModelSpec::deepseek_v32_exp(), c.batch, in.mtp, c.seed);
  const bool merged = c.offload && c.overlap != OverlapMode::kNone;
  for (const TokenAt& at : checked_tokens(in)) {
    const auto s = static_cast<std::size_t>(at.step), l = static_cast<std::size_t>(at.layer);
    const test::DecodeCheck chk = check_token(rig, in, at, o.out[s][l], o.lse[s][l], merged);
    EXPECT_TRUE(chk.ok()) << what << " step " << at.step << " layer " << at.layer << " request " << at.b << " token " << at.t
                          << ": " << chk.structural << " worst " << chk.worst << " at " << chk.worst_at;
  }
  return o;
}

Outputs run(const ExecutorConfig& c, const StepInputs& in, ExecutorReport* report = nullptr) {
  StepExecutor ex(c, ModelSpec::deepseek_v32_exp(), in);
  return collect(ex, c, in, report);
}

TEST(executor, OffloadedNoneIsBitIdenticalToResident) {
  ESS_SKIP_WITHOUT_GPU();
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const StepInputs in = load_inputs(tiny(OverlapMode::kNone), m);
  const Outputs res = run(tiny(OverlapMode::kNone, false), in);
  ExecutorReport r;
  const Outputs off = run(tiny(OverlapMode::kNone), in, &r);
  ASSERT_EQ(res.out.size(), off.out.size());
  for (std::size_t s = 0; s < res.out.size(); ++s) {
    for (std::size_t l = 0; l < res.out[s].size(); ++l) {
      EXPECT_TRUE(res.out[s][l] == off.out[s][l]) << "step " << s << " layer " << l;
    }
  }
  // The run had misses to fetch, so the check covered FlashTrans (and the new entries' D2H).
  EXPECT_GT(r.h2d_bytes_per_step, 0.0);
  // The same with each step's newest tokens in the reserved rows: still bit-identical, and the
  // newest tokens no longer miss.
  ExecutorConfig reserved = tiny(OverlapMode::kNone);
  reserved.reserve_newest = true;
  ExecutorReport rr;
  const Outputs off_r = run(reserved, in, &rr);
  for (std::size_t s = 0; s < res.out.size(); ++s) {
    for (std::size_t l = 0; l < res.out[s].size(); ++l) {
      EXPECT_TRUE(res.out[s][l] == off_r.out[s][l]) << "reserve_newest step " << s << " layer " << l;
    }
  }
  EXPECT_LE(rr.h2d_bytes_per_step, r.h2d_bytes_per_step);
}

// DA / DBA merge two partial states: both outputs are bf16 roundings of the same softmax,
// the merged one through two fp32 partials whose probabilities are rounded to bf16 against
// a different running maximum. Per element: |a - b| <= 2^-7 max|o| over the head's row + one
// bf16 ulp of each value (2^-8 |o|). Both outputs are finite (collect checked it).
void expect_close(const Outputs& a, const Outputs& b, const char* what) {
  ASSERT_EQ(a.out.size(), b.out.size());
  const std::size_t dim = 512;
  for (std::size_t s = 0; s < a.out.size(); ++s) {
    for (std::size_t l = 0; l < a.out[s].size(); ++l) {
      const auto& x = a.out[s][l];
      const auto& y = b.out[s][l];
      ASSERT_EQ(x.size(), y.size());
      int bad = 0;
      for (std::size_t row = 0; row < x.size() / dim; ++row) {
        float rmax = 0;
        for (std::size_t d = 0; d < dim; ++d) rmax = std::max(rmax, std::fabs(bf16_to_float(x[row * dim + d])));
        for (std::size_t d = 0; d < dim; ++d) {
          const float u = bf16_to_float(x[row * dim + d]), v = bf16_to_float(y[row * dim + d]);
          if (!(std::fabs(u - v) <= 0x1p-7f * rmax + 0x1p-8f * (std::fabs(u) + std::fabs(v)))) ++bad;
        }
      }
      EXPECT_EQ(bad, 0) << what << ": step " << s << " layer " << l;
    }
  }
}

TEST(executor, DualAttentionSchedulesMatchResident) {
  ESS_SKIP_WITHOUT_GPU();
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const StepInputs in = load_inputs(tiny(OverlapMode::kDualAttention), m);
  const Outputs res = run(tiny(OverlapMode::kNone, false), in);
  expect_close(res, run(tiny(OverlapMode::kDualAttention), in), "DA");
  expect_close(res, run(tiny(OverlapMode::kDualBatchAttention), in), "DBA");  // odd batch: halves 2 + 1
  ExecutorConfig lw = tiny(OverlapMode::kLayerWise);
  lw.layerwise_threshold = in.profile_misses[0];  // layer 0 (at least) runs DBA
  expect_close(res, run(lw, in), "layer-wise");
  ExecutorConfig dba_reserved = tiny(OverlapMode::kDualBatchAttention);
  dba_reserved.reserve_newest = true;
  expect_close(res, run(dba_reserved, in), "DBA with reserved newest rows");
  for (const OverlapMode mode : {OverlapMode::kDualAttention, OverlapMode::kDualBatchAttention}) {
    ExecutorConfig sglang = tiny(mode);  // PreAttn before the indexer, as SGLang runs it
    sglang.preattn_in_copy_window = false;
    expect_close(res, run(sglang, in), fmt::format("{} with PreAttn before the indexer", to_string(mode)).c_str());
  }
}

TEST(executor, GraphReplayEqualsEagerLaunches) {
  ESS_SKIP_WITHOUT_GPU();
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  for (const OverlapMode mode : {OverlapMode::kNone, OverlapMode::kDualBatchAttention}) {
    ExecutorConfig g = tiny(mode), e = tiny(mode);
    g.stand_in_gemms = e.stand_in_gemms = true;
    e.graph = false;
    const StepInputs in = load_inputs(g, m);
    EXPECT_TRUE(run(g, in).out == run(e, in).out) << to_string(mode);
  }
}

// A rearmed executor replays its steps from the start: the same schedule again gives the same
// bits and misses; rearmed to None it is bit-identical to all-resident.
TEST(executor, RearmReplaysTheStepsExactly) {
  ESS_SKIP_WITHOUT_GPU();
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const ExecutorConfig c = tiny(OverlapMode::kDualAttention);
  const StepInputs in = load_inputs(c, m);
  StepExecutor ex(c, m, in);
  ExecutorReport r1, r2;
  const Outputs first = collect(ex, c, in, &r1);
  ex.rearm(OverlapMode::kDualAttention, false);
  const Outputs again = collect(ex, c, in, &r2);
  EXPECT_TRUE(first.out == again.out);
  EXPECT_EQ(r1.misses, r2.misses);
  ex.rearm(OverlapMode::kNone, false);
  const Outputs none = collect(ex, tiny(OverlapMode::kNone), in);
  EXPECT_TRUE(none.out == run(tiny(OverlapMode::kNone, false), in).out);
  // Rearming validates like construction: an all-resident executor has no transfers to skip.
  StepExecutor resident(tiny(OverlapMode::kNone, false), m, in);
  EXPECT_NE(test::error_of([&] { resident.rearm(OverlapMode::kNone, true); }).find("skip_transfers"), std::string::npos);
}

// The GPU swap engine on the trace's ids misses exactly what the CPU LRU profile counted.
TEST(executor, MissesEqualTheCpuProfile) {
  ESS_SKIP_WITHOUT_GPU();
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  ExecutorConfig c = tiny(OverlapMode::kDualAttention);
  c.batch = 5;
  c.steps = 6;
  const StepInputs in = load_inputs(c, m);
  ExecutorReport r;
  run(c, in, &r);
  ASSERT_EQ(r.misses.size(), in.profile_misses.size());
  for (std::size_t l = 0; l < r.misses.size(); ++l) EXPECT_NEAR(r.misses[l], in.profile_misses[l], 1e-9) << "layer " << l;
}

TEST(executor, SingleRequestAndTimedSteps) {
  ESS_SKIP_WITHOUT_GPU();
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  ExecutorConfig c = tiny(OverlapMode::kDualBatchAttention);
  c.batch = 1;  // DBA with one request runs as DA
  c.steps = 5;
  c.warm_steps = 2;
  const StepInputs in = load_inputs(c, m);
  StepExecutor ex(c, m, in);
  ExecutorReport r;
  collect(ex, c, in, &r);
  EXPECT_EQ(r.step_us.size(), 3u);
  EXPECT_GT(r.step.min, 0.0);
  EXPECT_LE(r.step.min, r.step.median);
  EXPECT_LE(r.step.median, r.step.max);
}

TEST(executor, ProfileTimesEveryOp) {
  ESS_SKIP_WITHOUT_GPU();
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  ExecutorConfig c = tiny(OverlapMode::kDualAttention);
  c.stand_in_gemms = true;
  const StepInputs in = load_inputs(c, m);
  StepExecutor ex(c, m, in);
  ex.run();
  for (const char* op : {"attn.norm+proj0 (q_a kv_a idx_k idx_w)", "moe.routed_experts", "indexer.logits", "indexer.topk",
                         "swap.lru+split", "attn.sparse_mla", "attn.merge_lse"}) {
    const test::Summary s = ex.time_op(op, 2, 3);
    EXPECT_GT(s.median, 0.0) << op;
  }
  EXPECT_GT(ex.time_op("attn.sparse_mla", 3, 3, 512).median, 0.0);
  EXPECT_NE(test::error_of([&] { ex.time_op("attn.flash", 1, 1); }).find("unknown op 'attn.flash'"), std::string::npos);
  EXPECT_NE(test::error_of([&] { ex.time_op("indexer.topk", 4, 1); }).find("4 requests"), std::string::npos);
}

TEST(executor, BatchThatDoesNotFitIsRefusedByName) {
  ESS_SKIP_WITHOUT_GPU();
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  ExecutorConfig c = tiny(OverlapMode::kNone, false);
  c.batch = 4000;
  c.context = 65536;
  c.layers = 8;
  c.steps = 1;
  // The inputs are valid; the device memory check names the batch before allocating.
  ExecutorConfig small = c;
  small.batch = 1;
  const StepInputs in1 = load_inputs(small, m);
  StepInputs in = in1;
  in.batch = c.batch;
  in.ids.resize(static_cast<std::size_t>(c.steps) * c.layers * c.batch * in.mtp * in.topk, -1);
  in.lengths.assign(static_cast<std::size_t>(c.steps) * c.batch, in1.lengths[0]);
  const std::string e = test::error_of([&] { StepExecutor ex(c, m, in); });
  EXPECT_NE(e.find("batch 4000"), std::string::npos) << e;
  EXPECT_NE(e.find("device memory"), std::string::npos) << e;
}

// A graph capture of the stand-in GEMMs on a stream cuBLAS has not seen allocates nothing:
// the handle keeps the workspace given at construction across stream changes (cublasSetStream
// alone would fall back to cuBLAS's own per-stream pool, which allocates, also in a capture).
TEST(executor, StandInGemmsCaptureWithoutAllocating) {
  ESS_SKIP_WITHOUT_GPU();
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  rig::StandInGemms gemms(m, 8, 32);
  cudaStream_t first = nullptr, second = nullptr;
  ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&first, cudaStreamNonBlocking), "stream");
  ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking), "stream");
  for (const GemmOp op : kAllGemmOps) gemms.run(op, 8, first);
  ESS_CUDA_CHECK(cudaStreamSynchronize(first), "eager GEMMs");
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(second, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string error = "no error";
  try {
    for (const GemmOp op : kAllGemmOps) gemms.run(op, 8, second);
  } catch (const Error& e) {
    error = e.what();
  }
  const cudaError_t end = cudaStreamEndCapture(second, &graph);
  EXPECT_EQ(error, "no error");
  ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
  std::size_t n = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &n), cudaSuccess);
  std::vector<cudaGraphNode_t> nodes(n);
  ASSERT_EQ(cudaGraphGetNodes(graph, nodes.data(), &n), cudaSuccess);
  EXPECT_GT(n, 0u);
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    ASSERT_EQ(cudaGraphNodeGetType(node, &type), cudaSuccess);
    EXPECT_NE(type, cudaGraphNodeTypeMemAlloc) << "the capture allocates device memory";
  }
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, second), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(second), cudaSuccess);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(first);
  cudaStreamDestroy(second);
}

}  // namespace
}  // namespace ess::executor_test
