#include "runtime/ops/sparse_mla/sparse_mla_bench.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>

#include "ess/model/entry_layout.h"
#include "ess/model/numerics.h"
#include "ess/ops/sparse_mla.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "runtime/ops/gpu_swap/swap_engine_bench.h"
#include "runtime/ops/sparse_mla/sparse_mla_workload.h"
#include "testing/accuracy.h"
#include "testing/device.h"

namespace ess::cuda {

// ---- the benchmark ------------------------------------------------------------------------------
namespace {

struct Events {
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events;  // a start and a stop per timed launch
  ~Events() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    if (stream) cudaStreamDestroy(stream);
  }
};

// A random latent entry: per-128 tile magnitudes 2^-2 .. 2^2 (distinct scales per tile).
void random_entry(std::mt19937_64& rng, std::span<std::uint8_t> out) {
  static const LatentLayout layout{};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> nope(static_cast<std::size_t>(layout.nope_dim)), rope(static_cast<std::size_t>(layout.rope_dim));
  for (int t = 0; t < layout.num_scales(); ++t) {
    const float mag = std::ldexp(1.0f, static_cast<int>(rng() % 5) - 2);
    for (int i = 0; i < kQuantTile; ++i) nope[static_cast<std::size_t>(t * kQuantTile + i)] = mag * normal(rng);
  }
  for (auto& x : rope) x = normal(rng);
  quantize_latent(layout, nope, rope, out);
}

void check_workload(const SparseMlaBenchConfig& c) {
  ESS_CHECK(c.query_tokens > 0 && c.topk > 0, "attention workload: T {}, top-k {} must be positive", c.query_tokens,
            c.topk);
  ESS_CHECK(c.heads == 64 || c.heads == 128, "attention workload: heads = {} (the kernel takes 64 or 128)", c.heads);
  ESS_CHECK(c.slots >= c.topk, "attention workload: {} slots per request cannot hold {} distinct ids", c.slots, c.topk);
  ESS_CHECK(c.softmax_scale >= 0.0f && std::isfinite(c.softmax_scale), "attention workload: softmax scale {} must be >= 0",
            c.softmax_scale);
}

}  // namespace

SparseMlaWorkload::SparseMlaWorkload(const SparseMlaBenchConfig& c, int max_batch) : config_(c), max_batch_(max_batch) {
  ESS_CHECK(max_batch > 0, "attention workload: batch {} must be positive", max_batch);
  check_workload(c);
  const LatentLayout layout{};
  const std::size_t E = layout.bytes();
  const int T = c.query_tokens, H = c.heads, K = c.topk;
  scale_ = c.softmax_scale > 0.0f ? c.softmax_scale : 1.0f / std::sqrt(192.0f);
  const std::size_t tokens = static_cast<std::size_t>(max_batch) * T;
  std::mt19937_64 rng(c.seed);

  // Slot array: request b's slot s holds pattern entry (b * slots + s) % P.
  const std::size_t total_entries = static_cast<std::size_t>(max_batch) * static_cast<std::size_t>(c.slots);
  const std::size_t P = std::min<std::size_t>(4096, total_entries);
  pattern_.resize(P * E);
  for (std::size_t i = 0; i < P; ++i) random_entry(rng, {pattern_.data() + i * E, E});
  kv_ = DeviceBuffer<std::uint8_t>(total_entries * E);
  for (std::size_t at = 0; at < total_entries; at += P) {
    const std::size_t n = std::min(P, total_entries - at);
    ESS_CUDA_CHECK(cudaMemcpy(kv_.get() + at * E, pattern_.data(), n * E, cudaMemcpyHostToDevice), "attention workload: slots");
  }
  std::vector<std::uint64_t> offsets(static_cast<std::size_t>(max_batch));
  for (int b = 0; b < max_batch; ++b) offsets[static_cast<std::size_t>(b)] = static_cast<std::uint64_t>(b) * c.slots * E;

  // K distinct random slots per query token; q ~ N(0, 1) in bf16.
  ids_.resize(tokens * static_cast<std::size_t>(K));
  std::vector<std::int32_t> perm(static_cast<std::size_t>(c.slots));
  std::iota(perm.begin(), perm.end(), 0);
  for (std::size_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < K; ++k) {
      const std::size_t pick = static_cast<std::size_t>(k) + rng() % (perm.size() - static_cast<std::size_t>(k));
      std::swap(perm[static_cast<std::size_t>(k)], perm[pick]);
      ids_[t * static_cast<std::size_t>(K) + static_cast<std::size_t>(k)] = perm[static_cast<std::size_t>(k)];
    }
  }
  const std::size_t qdim = static_cast<std::size_t>(layout.nope_dim + layout.rope_dim);
  q_.resize(tokens * static_cast<std::size_t>(H) * qdim);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : q_) x = bf16_from_float(normal(rng));

  d_offsets_ = DeviceBuffer<std::uint64_t>(offsets.size());
  d_ids_ = DeviceBuffer<std::int32_t>(ids_.size());
  d_q_ = DeviceBuffer<std::uint16_t>(q_.size());
  const std::size_t rows = tokens * static_cast<std::size_t>(H);
  d_out_ = DeviceBuffer<std::uint16_t>(rows * static_cast<std::size_t>(layout.nope_dim));
  d_lse_ = DeviceBuffer<float>(rows);
  ESS_CUDA_CHECK(cudaMemcpy(d_offsets_.get(), offsets.data(), offsets.size() * 8, cudaMemcpyHostToDevice),
                 "attention workload: offsets");
  ESS_CUDA_CHECK(cudaMemcpy(d_ids_.get(), ids_.data(), ids_.size() * 4, cudaMemcpyHostToDevice), "attention workload: ids");
  ESS_CUDA_CHECK(cudaMemcpy(d_q_.get(), q_.data(), q_.size() * 2, cudaMemcpyHostToDevice), "attention workload: q");
}

SparseMlaArgs SparseMlaWorkload::args(int batch) const {
  ESS_CHECK(batch >= 1 && batch <= max_batch_, "attention workload: batch {} outside [1, {}]", batch, max_batch_);
  SparseMlaArgs a;
  a.batch = batch;
  a.query_tokens = config_.query_tokens;
  a.heads = config_.heads;
  a.topk = config_.topk;
  a.softmax_scale = scale_;
  a.q = d_q_.get();
  a.kv = kv_.get();
  a.kv_offsets = d_offsets_.get();
  a.slots = config_.slots;
  a.indices = d_ids_.get();
  a.out = d_out_.get();
  a.lse = d_lse_.get();
  return a;
}

const std::uint8_t* SparseMlaWorkload::host_entry(int b, std::int32_t slot) const {
  const std::size_t E = LatentLayout{}.bytes();
  const std::size_t P = pattern_.size() / E;
  return pattern_.data() + ((static_cast<std::size_t>(b) * static_cast<std::size_t>(config_.slots) + static_cast<std::size_t>(slot)) % P) * E;
}

SparseMlaBenchResult run_sparse_mla_bench(const SparseMlaBenchConfig& c, const std::vector<int>& batches_in) {
  ESS_CHECK(c.batch > 0 && c.query_tokens > 0 && c.topk > 0 && c.repeats > 0 && c.warmup >= 0 && c.verify_tokens >= 0,
            "bench attention: batch {}, T {}, top-k {}, repeats {} must be positive (warm-up {}, verify {} >= 0)", c.batch,
            c.query_tokens, c.topk, c.repeats, c.warmup, c.verify_tokens);
  const std::vector<int> batches = batches_in.empty() ? std::vector<int>{c.batch} : batches_in;
  for (int b : batches) ESS_CHECK(b > 0, "bench attention: batch size {} must be positive", b);
  const int max_b = std::max(c.batch, *std::max_element(batches.begin(), batches.end()));

  check_workload(c);  // before the device: a bad flag costs no device time
  SparseMlaBenchResult res;
  res.device = test::use_device(c.device, "bench attention");
  res.date = test::utc_now();
  const SparseMlaWorkload w(c, max_b);
  const LatentLayout layout{};
  const std::size_t E = layout.bytes();
  const int T = c.query_tokens, H = c.heads, K = c.topk;
  const float scale = w.softmax_scale();
  res.softmax_scale = scale;
  const std::size_t qdim = static_cast<std::size_t>(layout.nope_dim + layout.rope_dim);
  const std::vector<std::int32_t>& ids = w.ids();
  const std::vector<std::uint16_t>& q = w.queries();

  Events ev;
  ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&ev.stream, cudaStreamNonBlocking), "bench attention: stream");
  for (int i = 0; i < 2 * c.repeats; ++i) {
    cudaEvent_t e = nullptr;
    ESS_CUDA_CHECK(cudaEventCreate(&e), "bench attention: event");
    ev.events.push_back(e);
  }
  const auto launch = [&](int batch) {
    ESS_CUDA_CHECK(static_cast<cudaError_t>(sparse_mla_decode(w.args(batch), ev.stream)),
                   "bench attention: launching the decode (batch {})", batch);
  };
  const SparseMlaArgs a = w.args(c.batch);
  const std::uint16_t* d_out = a.out;
  const float* d_lse = a.lse;
  const auto host_entry = [&](int b, std::int32_t s) { return w.host_entry(b, s); };

  // ---- one call checked against the CPU reference ----
  launch(c.batch);
  ESS_CUDA_CHECK(cudaStreamSynchronize(ev.stream), "bench attention: decode");
  {
    const std::size_t bt = static_cast<std::size_t>(c.batch) * T;
    std::vector<std::size_t> pick;
    for (std::size_t i = 0; i < static_cast<std::size_t>(c.verify_tokens) && i < bt; ++i) {
      pick.push_back(i == 0 ? 0 : i == 1 ? bt - 1 : (i * 7919) % bt);
    }
    const std::size_t V = static_cast<std::size_t>(layout.nope_dim);
    std::vector<std::uint16_t> o16(static_cast<std::size_t>(H) * V);
    std::vector<float> o(o16.size()), l(static_cast<std::size_t>(H));
    std::vector<const std::uint8_t*> ptrs(static_cast<std::size_t>(K));
    res.verified = true;
    for (std::size_t tok : pick) {
      const std::size_t row0 = tok * static_cast<std::size_t>(H);
      ESS_CUDA_CHECK(cudaMemcpy(o16.data(), d_out + row0 * V, o16.size() * 2, cudaMemcpyDeviceToHost), "bench attention: out");
      ESS_CUDA_CHECK(cudaMemcpy(l.data(), d_lse + row0, l.size() * 4, cudaMemcpyDeviceToHost), "bench attention: lse");
      for (std::size_t i = 0; i < o.size(); ++i) o[i] = bf16_to_float(o16[i]);
      const int b = static_cast<int>(tok / static_cast<std::size_t>(T));
      for (int k = 0; k < K; ++k) ptrs[static_cast<std::size_t>(k)] = host_entry(b, ids[tok * static_cast<std::size_t>(K) + static_cast<std::size_t>(k)]);
      const test::DecodeCheck chk = test::check_decode_token(ref::SparseMlaParams{layout, H, scale},
                                                 {q.data() + row0 * qdim, static_cast<std::size_t>(H) * qdim}, ptrs, o, true, l);
      res.verified = res.verified && chk.ok();
      res.verify_worst = std::max(res.verify_worst, chk.structural.empty() ? chk.worst : std::numeric_limits<double>::infinity());
      ++res.verified_tokens;
    }
  }

  // ---- timing ----
  res.flops_per_call = sparse_mla_flops(c.batch, T, H, K);
  // Launches are queued back to back, each between its own pair of events, and synchronized
  // once: the host stays ahead of the GPU, so each interval is the kernel alone.
  for (int batch : batches) {
    for (int i = 0; i < c.warmup; ++i) launch(batch);
    for (int r = 0; r < c.repeats; ++r) {
      ESS_CUDA_CHECK(cudaEventRecord(ev.events[2 * static_cast<std::size_t>(r)], ev.stream), "bench attention: event");
      launch(batch);
      ESS_CUDA_CHECK(cudaEventRecord(ev.events[2 * static_cast<std::size_t>(r) + 1], ev.stream), "bench attention: event");
    }
    ESS_CUDA_CHECK(cudaStreamSynchronize(ev.stream), "bench attention: decode (batch {})", batch);
    std::vector<double> us;
    for (int r = 0; r < c.repeats; ++r) {
      float ms = 0.0f;
      ESS_CUDA_CHECK(cudaEventElapsedTime(&ms, ev.events[2 * static_cast<std::size_t>(r)], ev.events[2 * static_cast<std::size_t>(r) + 1]),
                     "bench attention: event time");
      us.push_back(1000.0 * ms);
    }
    SparseMlaBenchPoint pt;
    pt.batch = batch;
    pt.us = test::summarize(us);
    const double flops = sparse_mla_flops(batch, T, H, K);
    const double bt = static_cast<double>(batch) * T;
    pt.bytes_per_call = bt * K * static_cast<double>(E) + bt * H * (static_cast<double>(qdim) * 2 + layout.nope_dim * 2 + 4);
    pt.tflops = flops / (pt.us.median * 1e-6) / 1e12;
    pt.tflops_best = flops / (pt.us.min * 1e-6) / 1e12;
    pt.gbps = pt.bytes_per_call / (pt.us.median * 1e-6) / 1e9;
    res.points.push_back(pt);
  }
  return res;
}

}  // namespace ess::cuda
