#include "runtime/ops/gpu_swap/swap_engine_gpu.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "runtime/ops/gpu_swap/swap_engine_launch.h"

namespace ess::cuda {

GpuSwapEngine::GpuSwapEngine(const GpuSwapConfig& config, Stream stream) : config_(config), stream_(stream) {
  const std::string bad = check_args(config);
  ESS_CHECK(bad.empty(), "{}", bad);
  ESS_CUDA_CHECK(cudaSetDevice(config.device), "gpu swap engine: selecting device {}", config.device);
  const std::size_t smem = swap_step_smem_bytes(config.max_positions, config.slots) + kSwapStepStaticSmemBound;
  int optin = 0;
  ESS_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, config.device), "shared memory limit");
  ESS_CHECK(smem <= static_cast<std::size_t>(optin),
            "gpu swap engine: {} slots and {} positions need {} bytes of shared memory per block; the device allows {}",
            config.slots, config.max_positions, smem, optin);
  ESS_CUDA_CHECK(static_cast<cudaError_t>(swap_step_raise_smem_limit()), "gpu swap engine: raising the shared-memory limit");
  ESS_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, config.device),
                 "gpu swap engine: the device's multiprocessors");
  cluster_limit_ = swap_step_cluster_limit(config.max_positions, config.slots);
  ESS_CHECK(config.cluster <= cluster_limit_,
            "gpu swap engine: cluster = {} blocks per request, but device {} holds clusters of at most {} step blocks "
            "({} positions, {} slots)",
            config.cluster, config.device, cluster_limit_, config.max_positions, config.slots);
  const std::size_t n = static_cast<std::size_t>(config.rows) * config.layers * config.slots;
  try {
    ESS_CUDA_CHECK(cudaMalloc(&order_, n * 4), "gpu swap engine: order");
    ESS_CUDA_CHECK(cudaMalloc(&stamp_, n * 4), "gpu swap engine: recency");
    ESS_CUDA_CHECK(cudaMalloc(&token_, n * 4), "gpu swap engine: residency");
    ESS_CUDA_CHECK(cudaMalloc(&clock_, static_cast<std::size_t>(config.rows) * config.layers * 4), "gpu swap engine: clocks");
    for (int r = 0; r < config.rows; ++r) reset_row(r);
  } catch (...) {
    free_state();  // a refused construction gives back what it took
    throw;
  }
}

void GpuSwapEngine::free_state() {
  cudaFree(order_);
  cudaFree(stamp_);
  cudaFree(token_);
  cudaFree(clock_);
  order_ = stamp_ = token_ = clock_ = nullptr;
}

std::uint64_t GpuSwapEngine::device_bytes() const {
  const std::uint64_t row_layers = static_cast<std::uint64_t>(config_.rows) * static_cast<std::uint64_t>(config_.layers);
  return 3 * row_layers * static_cast<std::uint64_t>(config_.slots) * 4 + row_layers * 4;
}

SwapState GpuSwapEngine::state() const {
  return SwapState{order_, stamp_, token_, clock_, config_.slots, config_.layers};
}

GpuSwapEngine::~GpuSwapEngine() { free_state(); }

void GpuSwapEngine::reset_row(int row) { reset_row(row, stream_); }

void GpuSwapEngine::reset_row(int row, Stream stream) {
  ESS_CHECK(row >= 0 && row < config_.rows, "gpu swap engine: row {} out of [0, {})", row, config_.rows);
  ESS_CUDA_CHECK(static_cast<cudaError_t>(launch_swap_reset(state(), row, stream)), "gpu swap engine: reset of row {}", row);
}

void GpuSwapEngine::step_async(const GpuSwapStep& s) { step_async(s, stream_); }

int GpuSwapEngine::cluster_size(const GpuSwapStep& s) const {
  if (config_.cluster > 0) return config_.cluster;
  return swap_cluster_size(s.batch, s.query_tokens * s.topk, config_.slots, multiprocessors_, cluster_limit_);
}

void GpuSwapEngine::step_async(const GpuSwapStep& s, Stream stream) {
  const std::string bad = check_args(config_, s);
  ESS_CHECK(bad.empty(), "{}", bad);
  if (s.batch == 0) return;
  const int ranks = cluster_size(s);
  ESS_CUDA_CHECK(static_cast<cudaError_t>(launch_swap_step(s, state(), ranks, stream)),
                 "gpu swap engine: step of layer {} for {} requests on {} blocks each", s.layer, s.batch, ranks);
}

GpuSwapEngine::HostResult GpuSwapEngine::step(int layer, const std::vector<std::int32_t>& rows, int T, int K,
                                              const std::vector<std::int32_t>& ids) {
  const int B = static_cast<int>(rows.size());
  const std::size_t P = static_cast<std::size_t>(T) * K;
  ESS_CHECK(ids.size() == static_cast<std::size_t>(B) * P, "gpu swap engine: {} ids for [B={}][T={}][K={}]", ids.size(), B, T, K);
  const auto stream = static_cast<cudaStream_t>(stream_);
  DeviceBuffer<std::int32_t> d_rows(rows.size()), d_ids(ids.size()), d_slots(ids.size()), d_ft(ids.size()), d_fs(ids.size()),
      d_counts(2 * rows.size());
  ESS_CUDA_CHECK(cudaMemcpyAsync(d_rows.get(), rows.data(), rows.size() * 4, cudaMemcpyHostToDevice, stream), "upload rows");
  ESS_CUDA_CHECK(cudaMemcpyAsync(d_ids.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, stream), "upload ids");
  GpuSwapStep s;
  s.layer = layer;
  s.batch = B;
  s.query_tokens = T;
  s.topk = K;
  s.rows = d_rows.get();
  s.ids = d_ids.get();
  s.slot_ids = d_slots.get();
  s.fill_tokens = d_ft.get();
  s.fill_slots = d_fs.get();
  s.counts = d_counts.get();
  step_async(s);
  HostResult r;
  r.slot_ids.resize(ids.size());
  std::vector<std::int32_t> ft(ids.size()), fs(ids.size()), counts(2 * rows.size());
  ESS_CUDA_CHECK(cudaMemcpyAsync(r.slot_ids.data(), d_slots.get(), ids.size() * 4, cudaMemcpyDeviceToHost, stream), "download");
  ESS_CUDA_CHECK(cudaMemcpyAsync(ft.data(), d_ft.get(), ids.size() * 4, cudaMemcpyDeviceToHost, stream), "download");
  ESS_CUDA_CHECK(cudaMemcpyAsync(fs.data(), d_fs.get(), ids.size() * 4, cudaMemcpyDeviceToHost, stream), "download");
  ESS_CUDA_CHECK(cudaMemcpyAsync(counts.data(), d_counts.get(), counts.size() * 4, cudaMemcpyDeviceToHost, stream), "download");
  ESS_CUDA_CHECK(cudaStreamSynchronize(stream), "gpu swap engine step");
  r.fills.resize(rows.size());
  r.counts.resize(rows.size());
  for (int b = 0; b < B; ++b) {
    r.counts[static_cast<std::size_t>(b)] = StepCounts{counts[2 * static_cast<std::size_t>(b)], counts[2 * static_cast<std::size_t>(b) + 1]};
    for (std::int32_t m = 0; m < counts[2 * static_cast<std::size_t>(b) + 1]; ++m) {
      const std::size_t o = static_cast<std::size_t>(b) * P + static_cast<std::size_t>(m);
      r.fills[static_cast<std::size_t>(b)].push_back(MissEntry{b, rows[static_cast<std::size_t>(b)], ft[o], fs[o], 0});
    }
  }
  return r;
}

std::vector<MissEntry> GpuSwapEngine::warmup(int row, int layer, int K, const std::vector<std::int32_t>& windows) {
  ESS_CHECK(K > 0 && windows.size() % static_cast<std::size_t>(K) == 0,
            "gpu swap engine: warmup of row {} layer {}: {} ids is not a whole number of top-{} windows", row, layer,
            windows.size(), K);
  const auto stream = static_cast<cudaStream_t>(stream_);
  const std::size_t S = static_cast<std::size_t>(config_.slots);
  const int W = static_cast<int>(windows.size() / static_cast<std::size_t>(K));
  DeviceBuffer<std::int32_t> d_row(1), d_ids(windows.size() + 1), before(S), out_t(S), out_s(S), count(1),
      d_slots(static_cast<std::size_t>(K)), d_ft(static_cast<std::size_t>(K)), d_fs(static_cast<std::size_t>(K)), d_counts(2);
  ESS_CUDA_CHECK(cudaMemcpyAsync(d_row.get(), &row, 4, cudaMemcpyHostToDevice, stream), "upload row");
  ESS_CUDA_CHECK(cudaMemcpyAsync(d_ids.get(), windows.data(), windows.size() * 4, cudaMemcpyHostToDevice, stream), "upload windows");
  warmup_async(row, layer, K, d_row.get(), d_ids.get(), W,
               WarmupOut{before.get(), out_t.get(), out_s.get(), count.get(), d_slots.get(), d_ft.get(), d_fs.get(), d_counts.get()},
               stream_);
  std::int32_t n = 0;
  ESS_CUDA_CHECK(cudaMemcpyAsync(&n, count.get(), 4, cudaMemcpyDeviceToHost, stream), "download");
  ESS_CUDA_CHECK(cudaStreamSynchronize(stream), "gpu warmup");
  std::vector<std::int32_t> t(static_cast<std::size_t>(n)), sl(static_cast<std::size_t>(n));
  ESS_CUDA_CHECK(cudaMemcpy(t.data(), out_t.get(), t.size() * 4, cudaMemcpyDeviceToHost), "download");
  ESS_CUDA_CHECK(cudaMemcpy(sl.data(), out_s.get(), sl.size() * 4, cudaMemcpyDeviceToHost), "download");
  std::vector<MissEntry> fills;
  for (std::int32_t i = 0; i < n; ++i) fills.push_back(MissEntry{0, row, t[static_cast<std::size_t>(i)], sl[static_cast<std::size_t>(i)], 0});
  return fills;
}

void GpuSwapEngine::warmup_async(int row, int layer, int K, const std::int32_t* row_index, const std::int32_t* ids, int W,
                                 const WarmupOut& out, Stream stream) {
  ESS_CHECK(row >= 0 && row < config_.rows && layer >= 0 && layer < config_.layers,
            "gpu swap engine: warmup row {} layer {} out of range", row, layer);
  ESS_CHECK(K > 0 && W >= 0, "gpu swap engine: warmup of row {} layer {}: {} windows of top-{}", row, layer, W, K);
  const std::size_t S = static_cast<std::size_t>(config_.slots);
  const std::int32_t* after = token_ + (static_cast<std::size_t>(row) * config_.layers + static_cast<std::size_t>(layer)) * S;
  ESS_CUDA_CHECK(cudaMemcpyAsync(out.before, after, S * 4, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)),
                 "gpu swap engine: warmup snapshot of row {} layer {}", row, layer);
  for (int w = 0; w < W; ++w) {
    GpuSwapStep s;
    s.layer = layer;
    s.batch = 1;
    s.query_tokens = 1;
    s.topk = K;
    s.rows = row_index;
    s.ids = ids + static_cast<std::size_t>(w) * static_cast<std::size_t>(K);
    s.slot_ids = out.step_slots;
    s.fill_tokens = out.step_fill_tokens;
    s.fill_slots = out.step_fill_slots;
    s.counts = out.step_counts;
    step_async(s, stream);
  }
  ESS_CUDA_CHECK(static_cast<cudaError_t>(launch_swap_diff(out.before, after, config_.slots, out.tokens, out.slots, out.count, stream)),
                 "gpu swap engine: warmup diff of row {} layer {}", row, layer);
}

GpuSwapEngine::HostState GpuSwapEngine::download(int row, int layer) const {
  ESS_CHECK(row >= 0 && row < config_.rows && layer >= 0 && layer < config_.layers,
            "gpu swap engine: row {} layer {} out of range", row, layer);
  const std::size_t S = static_cast<std::size_t>(config_.slots);
  const std::size_t base = (static_cast<std::size_t>(row) * config_.layers + static_cast<std::size_t>(layer));
  ESS_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "gpu swap engine download");
  HostState h;
  h.order.resize(S);
  h.token_of_slot.resize(S);
  std::vector<std::int32_t> stamps(S);
  ESS_CUDA_CHECK(cudaMemcpy(h.order.data(), order_ + base * S, S * 4, cudaMemcpyDeviceToHost), "download order");
  ESS_CUDA_CHECK(cudaMemcpy(h.token_of_slot.data(), token_ + base * S, S * 4, cudaMemcpyDeviceToHost), "download tokens");
  ESS_CUDA_CHECK(cudaMemcpy(stamps.data(), stamp_ + base * S, S * 4, cudaMemcpyDeviceToHost), "download recency");
  ESS_CUDA_CHECK(cudaMemcpy(&h.clock, clock_ + base, 4, cudaMemcpyDeviceToHost), "download clock");
  h.recency.assign(stamps.begin(), stamps.end());
  return h;
}

}  // namespace ess::cuda
