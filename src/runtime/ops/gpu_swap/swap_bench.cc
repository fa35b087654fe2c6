#include "runtime/ops/gpu_swap/swap_bench.h"

#include <cuda_runtime.h>

#include <memory>
#include <random>
#include <set>
#include <vector>

#include "harness/support/device.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "runtime/ops/gpu_swap/swap_engine_gpu.h"

namespace ess::cuda {

SwapBenchResult run_swap_bench(const SwapBenchConfig& c) {
  ESS_CHECK(c.requests > 0 && c.query_tokens > 0 && c.topk > 0 && c.steps > 0 && c.repeats > 0 && c.context >= c.topk,
            "bench swap: requests {}, T {}, top-k {}, steps {}, repeats {} must be positive and context {} >= top-k",
            c.requests, c.query_tokens, c.topk, c.steps, c.repeats, c.context);
  ESS_CHECK(c.fresh_per_query >= 0 && c.fresh_per_query <= c.topk, "bench swap: fresh ids per query {} out of [0, {}]",
            c.fresh_per_query, c.topk);
  // Each step's T rows are orderings of one set of K ids, so the pool must hold K of them.
  ESS_CHECK(c.slots >= c.topk && c.slots <= c.context, "bench swap: --slots {} must be in [top-k {}, context {}]", c.slots,
            c.topk, c.context);
  SwapBenchResult res;
  res.device = use_device(c.device, "bench swap");
  res.date = utc_now();

  // Host-generated id sequence: [steps][B][T][K].
  const int B = c.requests, T = c.query_tokens, K = c.topk;
  const std::size_t P = static_cast<std::size_t>(T) * K;
  std::mt19937_64 rng(c.seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(c.steps) * B * P);
  std::vector<std::vector<std::int32_t>> cur(static_cast<std::size_t>(B));
  const auto rand_id = [&] { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.context)); };
  for (int st = 0; st < c.steps; ++st) {
    for (int b = 0; b < B; ++b) {
      std::set<std::int32_t> q(cur[static_cast<std::size_t>(b)].begin(), cur[static_cast<std::size_t>(b)].end());
      std::vector<std::int32_t> v(q.begin(), q.end());
      std::shuffle(v.begin(), v.end(), rng);
      for (int i = 0; i < c.fresh_per_query && i < static_cast<int>(v.size()); ++i) q.erase(v[static_cast<std::size_t>(i)]);
      while (static_cast<int>(q.size()) < K) q.insert(rand_id());
      cur[static_cast<std::size_t>(b)].assign(q.begin(), q.end());
      for (int t = 0; t < T; ++t) {
        std::vector<std::int32_t> row(cur[static_cast<std::size_t>(b)]);
        std::shuffle(row.begin(), row.end(), rng);
        std::copy(row.begin(), row.end(), ids.begin() + static_cast<std::ptrdiff_t>(((static_cast<std::size_t>(st) * B + b) * T + t) * K));
      }
    }
  }

  GpuSwapConfig gc;
  gc.rows = B;
  gc.layers = 1;
  gc.slots = c.slots;
  gc.max_positions = T * K;
  gc.device = c.device;
  cudaStream_t stream = nullptr;
  ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const std::unique_ptr<CUstream_st, decltype(&cudaStreamDestroy)> stream_owner(stream, &cudaStreamDestroy);
  GpuSwapEngine engine(gc, stream);
  const DeviceBuffer<std::int32_t> ids_buf(ids.size()), rows_buf(static_cast<std::size_t>(B)),
      slots_buf(static_cast<std::size_t>(B) * P), ft_buf(static_cast<std::size_t>(B) * P), fs_buf(static_cast<std::size_t>(B) * P),
      counts_buf(static_cast<std::size_t>(B) * 2);
  std::int32_t* d_ids = ids_buf.get();
  std::int32_t* d_counts = counts_buf.get();
  std::vector<std::int32_t> rows(static_cast<std::size_t>(B));
  for (int b = 0; b < B; ++b) rows[static_cast<std::size_t>(b)] = b;
  ESS_CUDA_CHECK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), "upload ids");
  ESS_CUDA_CHECK(cudaMemcpy(rows_buf.get(), rows.data(), rows.size() * 4, cudaMemcpyHostToDevice), "upload rows");
  GpuSwapStep s;
  s.layer = 0;
  s.batch = B;
  s.query_tokens = T;
  s.topk = K;
  s.rows = rows_buf.get();
  s.slot_ids = slots_buf.get();
  s.fill_tokens = ft_buf.get();
  s.fill_slots = fs_buf.get();
  s.counts = d_counts;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  ESS_CUDA_CHECK(cudaEventCreate(&e0), "event");
  const std::unique_ptr<CUevent_st, decltype(&cudaEventDestroy)> e0_owner(e0, &cudaEventDestroy);
  ESS_CUDA_CHECK(cudaEventCreate(&e1), "event");
  const std::unique_ptr<CUevent_st, decltype(&cudaEventDestroy)> e1_owner(e1, &cudaEventDestroy);
  // One pass to reach steady state, then timed steps; misses counted over the timed steps.
  std::vector<double> us;
  std::vector<std::int32_t> counts(static_cast<std::size_t>(B) * 2);
  std::int64_t hits = 0, misses = 0, request_steps = 0;
  for (int it = 0; it < c.steps + c.repeats; ++it) {
    s.ids = d_ids + static_cast<std::size_t>(it % c.steps) * B * P;
    ESS_CUDA_CHECK(cudaEventRecord(e0, stream), "event");
    engine.step_async(s);
    ESS_CUDA_CHECK(cudaEventRecord(e1, stream), "event");
    ESS_CUDA_CHECK(cudaEventSynchronize(e1), "swap step");
    if (it < c.steps) continue;
    float ms = 0;
    ESS_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1), "event time");
    us.push_back(1000.0 * ms);
    ESS_CUDA_CHECK(cudaMemcpy(counts.data(), d_counts, counts.size() * 4, cudaMemcpyDeviceToHost), "counts");
    for (int b = 0; b < B; ++b) {
      hits += counts[2 * static_cast<std::size_t>(b)];
      misses += counts[2 * static_cast<std::size_t>(b) + 1];
    }
    request_steps += B;
  }
  res.us_per_layer = summarize(us);
  res.hits_per_request_step = static_cast<double>(hits) / static_cast<double>(request_steps);
  res.misses_per_request_step = static_cast<double>(misses) / static_cast<double>(request_steps);
  return res;
}

}  // namespace ess::cuda
