// StepExecutor::time_op: the op times `ess bench profile` measures, each op of the step run
// alone on the compute stream over the executor's own buffers.
#include <cuda_runtime.h>

#include <functional>

#include "ess/core/error.h"
#include "ess/ops/indexer.h"
#include "ess/ops/sparse_mla.h"
#include "harness/rig/executor.h"
#include "harness/rig/executor_impl.h"
#include "runtime/cuda/check.h"

namespace ess::rig {

test::Summary StepExecutor::time_op(std::string_view op, int requests, int repeats, int entries) {
  Impl& x = *impl_;
  ESS_CHECK(requests >= 1 && requests <= x.B, "profile: {} requests outside [1, {}] (the executor's batch)", requests, x.B);
  ESS_CHECK(repeats >= 1, "profile: repeats = {} must be >= 1", repeats);
  ESS_CHECK(entries >= 0 && entries <= x.K, "profile: {} entries per query token outside [0, top-k = {}]", entries, x.K);
  const int n = requests * x.T;
  std::function<void(int)> launch;
  for (const GemmOp g : kAllGemmOps) {
    if (op == op_name(g)) {
      ESS_CHECK(x.gemms != nullptr, "profile: {} needs the stand-in GEMMs (stand_in_gemms = true)", op);
      launch = [&x, g, n](int) { x.gemms->run(g, n, x.cs); };
    }
  }
  DeviceBuffer<std::int32_t> row_len;
  if (launch) {
    // a stand-in GEMM
  } else if (op == op::kIndexerLogits || op == op::kIndexerTopk) {
    x.run_indexer(0, 0, 0, requests);  // logits for the top-k timing
    const cuda::IndexerArgs ia = x.indexer_args(0, 0, 0, requests);
    if (op == op::kIndexerLogits) {
      launch = [&x, ia](int) {
        ESS_CUDA_CHECK(static_cast<cudaError_t>(cuda::indexer_logits(ia, x.cs)), "profile: indexer logits");
      };
    } else {
      launch = [&x, ta = x.topk_args(ia, 0)](int) {
        ESS_CUDA_CHECK(static_cast<cudaError_t>(cuda::topk(ta, x.cs)), "profile: top-k");
      };
    }
  } else if (op == op::kSwap) {
    ESS_CHECK(x.c.offload, "profile: {} needs an offloaded executor", op);
    launch = [&x, requests](int rep) { x.offload_step(rep % x.c.steps, 0, 0, requests, 0, false); };
  } else if (op == op::kSparseMla) {
    // Step 0's ids of layer 0; with `entries` < top-k only the first `entries` of each row
    // are read (row lengths, as the DA halves pass their compacted lists).
    const std::int32_t* ids = x.c.offload ? x.slot_ids.get() : x.ids.get();
    if (x.c.offload) {
      x.offload_step(0, 0, 0, x.B, 0, true);
      ESS_CUDA_CHECK(cudaDeviceSynchronize(), "profile: the rows of step 0");
    }
    const std::int32_t* lengths = nullptr;
    if (entries > 0 && entries < x.K) {
      const std::vector<std::int32_t> h(x.bt(), entries);
      row_len = DeviceBuffer<std::int32_t>(h.size());
      ESS_CUDA_CHECK(cudaMemcpy(row_len.get(), h.data(), h.size() * 4, cudaMemcpyHostToDevice), "profile: row lengths");
      lengths = row_len.get();
    }
    cuda::SparseMlaArgs a = x.mla_args(0, ids, lengths);
    a.batch = requests;
    a.out = x.out.get();
    a.lse = x.lse.get();
    launch = [&x, a](int) {
      ESS_CUDA_CHECK(static_cast<cudaError_t>(cuda::sparse_mla_decode(a, x.cs)), "profile: sparse MLA");
    };
  } else if (op == op::kMerge) {
    ESS_CHECK(x.c.offload, "profile: {} needs an offloaded executor (the partial states)", op);
    cuda::MergeArgs mg = x.merge_args(0, x.out.get());
    mg.rows = static_cast<std::int64_t>(n) * x.H;
    launch = [&x, mg](int) {
      ESS_CUDA_CHECK(static_cast<cudaError_t>(cuda::merge_states(mg, x.cs)), "profile: merge");
    };
  } else {
    ESS_THROW("profile: unknown op '{}'", op);
  }
  cudaEvent_t a = nullptr, b = nullptr;
  ESS_CUDA_CHECK(cudaEventCreate(&a), "profile: events");
  ESS_CUDA_CHECK(cudaEventCreate(&b), "profile: events");
  std::vector<double> us;
  try {
    for (int r = 0; r < 3; ++r) launch(r);
    for (int r = 0; r < repeats; ++r) {
      ESS_CUDA_CHECK(cudaEventRecord(a, x.cs), "profile: timing");
      launch(3 + r);
      ESS_CUDA_CHECK(cudaEventRecord(b, x.cs), "profile: timing");
      ESS_CUDA_CHECK(cudaEventSynchronize(b), "profile: {}", op);
      float ms = 0;
      ESS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b), "profile: timing");
      us.push_back(static_cast<double>(ms) * 1e3);
    }
  } catch (...) {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    throw;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return test::summarize(us);
}

}  // namespace ess::rig
