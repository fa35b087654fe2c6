#include "runtime/ops/gpu_swap/swap_engine_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <span>
#include <random>
#include <set>
#include <vector>

#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "runtime/ops/gpu_swap/swap_engine_gpu.h"
#include "testing/cache_fixtures.h"
#include "testing/device.h"

namespace ess::cuda {

SwapEngineBenchResult run_swap_engine_bench(const SwapEngineBenchConfig& c) {
  ESS_CHECK(c.requests > 0 && c.query_tokens > 0 && c.topk > 0 && c.steps > 0 && c.repeats > 0 && c.layers > 0 &&
                c.context >= c.topk,
            "bench swap: requests {}, T {}, top-k {}, steps {}, repeats {}, layers {} must be positive and context {} >= "
            "top-k",
            c.requests, c.query_tokens, c.topk, c.steps, c.repeats, c.layers, c.context);
  ESS_CHECK(c.fresh_per_query >= 0 && c.fresh_per_query <= c.topk, "bench swap: fresh ids per query {} out of [0, {}]",
            c.fresh_per_query, c.topk);
  // Each step's T rows are orderings of one set of K ids, so the pool must hold K of them.
  ESS_CHECK(c.slots >= c.topk && c.slots <= c.context, "bench swap: --slots {} must be in [top-k {}, context {}]", c.slots,
            c.topk, c.context);
  SwapEngineBenchResult res;
  res.device = test::use_device(c.device, "bench swap");
  res.date = test::utc_now();

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

  // Every layer's state (61 for DeepSeek-V3.2: far more than L2 holds at production shapes),
  // each layer stepped with the same ids (its own LRU state, in its own memory).
  GpuSwapConfig gc;
  gc.rows = B;
  gc.layers = c.layers;
  gc.slots = c.slots;
  gc.max_positions = T * K;
  gc.device = c.device;
  gc.cluster = c.cluster;
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
  ESS_CUDA_CHECK(cudaMemcpyAsync(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, stream), "upload ids");
  ESS_CUDA_CHECK(cudaMemcpyAsync(rows_buf.get(), rows.data(), rows.size() * 4, cudaMemcpyHostToDevice, stream), "upload rows");
  ESS_CUDA_CHECK(cudaStreamSynchronize(stream), "upload");
  GpuSwapStep s;
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
  // The independent LRU model of the first requests (every layer sees the same ids, so
  // layer 0's model stands for all): the outputs of the last launch are checked against it.
  const int checked = std::min(B, 2);
  std::vector<test::NaiveLru> model;
  for (int b = 0; b < checked; ++b) model.emplace_back(c.slots);
  std::vector<std::int32_t> want_slots;
  std::vector<std::int64_t> want_misses(static_cast<std::size_t>(checked));
  // One pass over the steps to reach steady state, then `repeats` timed steps: each is every
  // layer's launch back to back between one pair of events (the device never idles between
  // them, as in a decode step), and the time per layer is that span over the layers.
  std::vector<double> us;
  std::vector<std::int32_t> counts(static_cast<std::size_t>(B) * 2);
  std::int64_t hits = 0, misses = 0, request_steps = 0;
  for (int it = 0; it < c.steps + c.repeats; ++it) {
    const std::size_t step_ids = static_cast<std::size_t>(it % c.steps) * static_cast<std::size_t>(B) * P;
    s.ids = d_ids + step_ids;
    ESS_CUDA_CHECK(cudaEventRecord(e0, stream), "event");
    for (int l = 0; l < c.layers; ++l) {
      s.layer = l;
      engine.step_async(s);
    }
    ESS_CUDA_CHECK(cudaEventRecord(e1, stream), "event");
    want_slots.clear();
    for (int b = 0; b < checked; ++b) {
      std::vector<std::pair<std::int32_t, std::int32_t>> fills;
      const auto got = model[static_cast<std::size_t>(b)].step(
          std::span<const std::int32_t>(ids.data() + step_ids + static_cast<std::size_t>(b) * P, P), fills);
      want_slots.insert(want_slots.end(), got.begin(), got.end());
      want_misses[static_cast<std::size_t>(b)] = static_cast<std::int64_t>(fills.size());
    }
    ESS_CUDA_CHECK(cudaEventSynchronize(e1), "swap step");
    if (it < c.steps) continue;
    float ms = 0;
    ESS_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1), "event time");
    us.push_back(1000.0 * ms / c.layers);
    ESS_CUDA_CHECK(cudaMemcpy(counts.data(), d_counts, counts.size() * 4, cudaMemcpyDeviceToHost), "counts");
    for (int b = 0; b < B; ++b) {
      hits += counts[2 * static_cast<std::size_t>(b)];
      misses += counts[2 * static_cast<std::size_t>(b) + 1];
    }
    request_steps += B;
  }
  // The last layer's launch of the last step, against the model.
  std::vector<std::int32_t> got_slots(want_slots.size());
  ESS_CUDA_CHECK(cudaMemcpy(got_slots.data(), slots_buf.get(), got_slots.size() * 4, cudaMemcpyDeviceToHost), "slot ids");
  for (std::size_t i = 0; i < got_slots.size(); ++i) {
    ESS_CHECK(got_slots[i] == want_slots[i], "bench swap: request {} position {}: the GPU gave slot {}, the LRU model {}",
              i / P, i % P, got_slots[i], want_slots[i]);
  }
  for (int b = 0; b < checked; ++b) {
    ESS_CHECK(counts[2 * static_cast<std::size_t>(b) + 1] == want_misses[static_cast<std::size_t>(b)],
              "bench swap: request {}: the GPU counted {} misses, the LRU model {}", b, counts[2 * static_cast<std::size_t>(b) + 1],
              want_misses[static_cast<std::size_t>(b)]);
  }
  res.checked_requests = checked;
  res.blocks_per_request = engine.cluster_size(s);
  res.us_per_layer = test::summarize(us);
  res.hits_per_request_step = static_cast<double>(hits) / static_cast<double>(request_steps);
  res.misses_per_request_step = static_cast<double>(misses) / static_cast<double>(request_steps);
  return res;
}

}  // namespace ess::cuda
