#include "ess/cuda/attention_bench.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>

#include "ess/cuda/check.h"
#include "ess/cuda/device_buffer.h"
#include "ess/cuda/sparse_mla.h"
#include "ess/cuda/swap_bench.h"
#include "ess/model/entry_layout.h"
#include "ess/model/numerics.h"

namespace ess::cuda {

// ---- accuracy contract (derivation in attention_bench.h) ----------------------------------------
DecodeCheck check_decode_token(const ref::SparseMlaParams& p, std::span<const std::uint16_t> q,
                               std::span<const std::uint8_t* const> entries, std::span<const float> out,
                               bool out_is_bf16, std::span<const float> lse, double slack, bool merged) {
  const int H = p.heads;
  const int V = p.layout.nope_dim;
  const int R = p.layout.rope_dim;
  const std::size_t D = static_cast<std::size_t>(V + R);
  ESS_CHECK(H > 0 && q.size() == static_cast<std::size_t>(H) * D && out.size() == static_cast<std::size_t>(H) * V &&
                lse.size() == static_cast<std::size_t>(H),
            "check_decode_token: q {} / out {} / lse {} values do not match {} heads", q.size(), out.size(), lse.size(), H);
  std::vector<float> o_ref(static_cast<std::size_t>(H) * V);
  std::vector<float> lse_ref(static_cast<std::size_t>(H));
  ref::sparse_mla_decode_f32(p, q, entries, o_ref, lse_ref);

  // Valid entries, dequantized as [n][nope ++ rope]; V_d = max_j |v_jd|.
  std::vector<double> kv;
  std::size_t n = 0;
  std::vector<float> nope(static_cast<std::size_t>(V)), rope(static_cast<std::size_t>(R));
  std::vector<double> vmax(static_cast<std::size_t>(V), 0.0);
  for (const std::uint8_t* e : entries) {
    if (e == nullptr) continue;
    dequantize_latent(p.layout, {e, p.layout.bytes()}, nope, rope);
    for (int d = 0; d < V; ++d) {
      kv.push_back(nope[static_cast<std::size_t>(d)]);
      vmax[static_cast<std::size_t>(d)] = std::max(vmax[static_cast<std::size_t>(d)], std::fabs(static_cast<double>(nope[static_cast<std::size_t>(d)])));
    }
    for (int d = 0; d < R; ++d) kv.push_back(rope[static_cast<std::size_t>(d)]);
    ++n;
  }
  const double u23 = std::ldexp(1.0, -23);
  const double acc_n = 2.0 * static_cast<double>(n) * u23;
  DecodeCheck c;
  const auto note = [&](double err, double bound, const std::string& where) {
    const double r = err / bound;
    if (!(r <= c.worst)) {  // also records NaN
      c.worst = std::isnan(r) ? std::numeric_limits<double>::infinity() : r;
      c.worst_at = where;
    }
  };
  std::vector<double> qh(D);
  for (int h = 0; h < H; ++h) {
    const std::size_t hs = static_cast<std::size_t>(h);
    const float* oh = out.data() + hs * V;
    const float* rh = o_ref.data() + hs * V;
    if (n == 0) {
      if (!(lse[hs] == -std::numeric_limits<float>::infinity()) && c.structural.empty()) {
        c.structural = fmt::format("head {}: lse {} for a token with no valid entry (want -inf)", h, lse[hs]);
      }
      for (int d = 0; d < V; ++d) {
        if (oh[d] != 0.0f && c.structural.empty()) {
          c.structural = fmt::format("head {} dim {}: o = {} for a token with no valid entry (want 0)", h, d, oh[d]);
        }
      }
      continue;
    }
    if (!std::isfinite(lse[hs]) && c.structural.empty()) {
      c.structural = fmt::format("head {}: lse {} is not finite", h, lse[hs]);
    }
    for (std::size_t d = 0; d < D; ++d) qh[d] = bf16_to_float(q[hs * D + d]);
    double dq_max = 0.0, s_max = 0.0;
    for (std::size_t j = 0; j < n; ++j) {
      const double* k = kv.data() + j * D;
      double dot = 0.0, mag = 0.0;
      for (std::size_t d = 0; d < D; ++d) {
        dot += qh[d] * k[d];
        mag += std::fabs(qh[d] * k[d]);
      }
      dq_max = std::max(dq_max, mag);
      s_max = std::max(s_max, std::fabs(dot) * p.softmax_scale);
    }
    const double delta = p.softmax_scale * 577.0 * u23 * dq_max + std::ldexp(s_max, -20) + std::ldexp(1.0, -21);
    const double lb = delta + acc_n + std::ldexp(1.0 + std::fabs(static_cast<double>(lse_ref[hs])), -20) + slack;
    const double eps = std::ldexp(1.0, -8) + std::expm1(2.0 * delta) + acc_n + std::ldexp(1.0, -20) + slack +
                       (merged ? std::expm1(2.0 * lb) : 0.0);
    for (int d = 0; d < V; ++d) {
      const double got = oh[d];
      const double want = rh[d];
      if (!std::isfinite(got) && c.structural.empty()) {
        c.structural = fmt::format("head {} dim {}: o = {} is not finite", h, d, got);
      }
      const double vb = eps * vmax[static_cast<std::size_t>(d)];
      const double bound = vb + (out_is_bf16 ? std::ldexp(std::fabs(want) + vb, -8) : 0.0) + 1e-30;
      note(std::fabs(got - want), bound, fmt::format("head {} dim {} (got {}, want {})", h, d, got, want));
    }
    note(std::fabs(static_cast<double>(lse[hs]) - lse_ref[hs]), lb,
         fmt::format("head {} lse (got {}, want {})", h, lse[hs], lse_ref[hs]));
  }
  return c;
}

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

}  // namespace

AttentionBenchResult run_attention_bench(const AttentionBenchConfig& c, const std::vector<int>& batches_in) {
  ESS_CHECK(c.batch > 0 && c.query_tokens > 0 && c.topk > 0 && c.repeats > 0 && c.warmup >= 0 && c.verify_tokens >= 0,
            "bench attention: batch {}, T {}, top-k {}, repeats {} must be positive (warm-up {}, verify {} >= 0)", c.batch,
            c.query_tokens, c.topk, c.repeats, c.warmup, c.verify_tokens);
  ESS_CHECK(c.heads == 64 || c.heads == 128, "bench attention: heads = {} (the kernel takes 64 or 128)", c.heads);
  ESS_CHECK(c.slots >= c.topk, "bench attention: {} slots per request cannot hold {} distinct ids", c.slots, c.topk);
  ESS_CHECK(c.softmax_scale >= 0.0f && std::isfinite(c.softmax_scale), "bench attention: softmax scale {} must be >= 0",
            c.softmax_scale);
  const std::vector<int> batches = batches_in.empty() ? std::vector<int>{c.batch} : batches_in;
  for (int b : batches) ESS_CHECK(b > 0, "bench attention: batch size {} must be positive", b);
  const int max_b = std::max(c.batch, *std::max_element(batches.begin(), batches.end()));

  AttentionBenchResult res;
  res.device = use_device(c.device, "bench attention");
  res.date = utc_now();
  const LatentLayout layout{};
  const std::size_t E = layout.bytes();
  const int T = c.query_tokens, H = c.heads, K = c.topk;
  const float scale = c.softmax_scale > 0.0f ? c.softmax_scale : 1.0f / std::sqrt(192.0f);
  res.softmax_scale = scale;
  const std::size_t tokens = static_cast<std::size_t>(max_b) * T;
  std::mt19937_64 rng(c.seed);

  // Slot array: request b's slot s holds pattern entry (b * slots + s) % P.
  const std::size_t total_entries = static_cast<std::size_t>(max_b) * static_cast<std::size_t>(c.slots);
  const std::size_t P = std::min<std::size_t>(4096, total_entries);
  std::vector<std::uint8_t> pattern(P * E);
  for (std::size_t i = 0; i < P; ++i) random_entry(rng, {pattern.data() + i * E, E});
  const DeviceBuffer<std::uint8_t> kv(total_entries * E);
  for (std::size_t at = 0; at < total_entries; at += P) {
    const std::size_t n = std::min(P, total_entries - at);
    ESS_CUDA_CHECK(cudaMemcpy(kv.get() + at * E, pattern.data(), n * E, cudaMemcpyHostToDevice), "bench attention: slots");
  }
  const auto host_entry = [&](int b, std::int32_t s) {
    return pattern.data() + ((static_cast<std::size_t>(b) * static_cast<std::size_t>(c.slots) + static_cast<std::size_t>(s)) % P) * E;
  };
  std::vector<std::uint64_t> offsets(static_cast<std::size_t>(max_b));
  for (int b = 0; b < max_b; ++b) offsets[static_cast<std::size_t>(b)] = static_cast<std::uint64_t>(b) * c.slots * E;

  // K distinct random slots per query token; q ~ N(0, 1) in bf16.
  std::vector<std::int32_t> ids(tokens * static_cast<std::size_t>(K));
  std::vector<std::int32_t> perm(static_cast<std::size_t>(c.slots));
  std::iota(perm.begin(), perm.end(), 0);
  for (std::size_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < K; ++k) {
      const std::size_t pick = static_cast<std::size_t>(k) + rng() % (perm.size() - static_cast<std::size_t>(k));
      std::swap(perm[static_cast<std::size_t>(k)], perm[pick]);
      ids[t * static_cast<std::size_t>(K) + static_cast<std::size_t>(k)] = perm[static_cast<std::size_t>(k)];
    }
  }
  const std::size_t qdim = static_cast<std::size_t>(layout.nope_dim + layout.rope_dim);
  std::vector<std::uint16_t> q(tokens * static_cast<std::size_t>(H) * qdim);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : q) x = bf16_from_float(normal(rng));

  const DeviceBuffer<std::uint64_t> d_offsets(offsets.size());
  const DeviceBuffer<std::int32_t> d_ids(ids.size());
  const DeviceBuffer<std::uint16_t> d_q(q.size());
  const std::size_t rows = tokens * static_cast<std::size_t>(H);
  const DeviceBuffer<std::uint16_t> d_out(rows * static_cast<std::size_t>(layout.nope_dim));
  const DeviceBuffer<float> d_lse(rows);
  ESS_CUDA_CHECK(cudaMemcpy(d_offsets.get(), offsets.data(), offsets.size() * 8, cudaMemcpyHostToDevice), "bench attention: offsets");
  ESS_CUDA_CHECK(cudaMemcpy(d_ids.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), "bench attention: ids");
  ESS_CUDA_CHECK(cudaMemcpy(d_q.get(), q.data(), q.size() * 2, cudaMemcpyHostToDevice), "bench attention: q");

  Events ev;
  ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&ev.stream, cudaStreamNonBlocking), "bench attention: stream");
  for (int i = 0; i < 2 * c.repeats; ++i) {
    cudaEvent_t e = nullptr;
    ESS_CUDA_CHECK(cudaEventCreate(&e), "bench attention: event");
    ev.events.push_back(e);
  }
  SparseMlaArgs a;
  a.query_tokens = T;
  a.heads = H;
  a.topk = K;
  a.softmax_scale = scale;
  a.q = d_q.get();
  a.kv = kv.get();
  a.kv_offsets = d_offsets.get();
  a.slots = c.slots;
  a.indices = d_ids.get();
  a.out = d_out.get();
  a.lse = d_lse.get();
  const auto launch = [&](int batch) {
    a.batch = batch;
    ESS_CUDA_CHECK(static_cast<cudaError_t>(sparse_mla_decode(a, ev.stream)), "bench attention: launching the decode (batch {})",
                   batch);
  };

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
      ESS_CUDA_CHECK(cudaMemcpy(o16.data(), d_out.get() + row0 * V, o16.size() * 2, cudaMemcpyDeviceToHost), "bench attention: out");
      ESS_CUDA_CHECK(cudaMemcpy(l.data(), d_lse.get() + row0, l.size() * 4, cudaMemcpyDeviceToHost), "bench attention: lse");
      for (std::size_t i = 0; i < o.size(); ++i) o[i] = bf16_to_float(o16[i]);
      const int b = static_cast<int>(tok / static_cast<std::size_t>(T));
      for (int k = 0; k < K; ++k) ptrs[static_cast<std::size_t>(k)] = host_entry(b, ids[tok * static_cast<std::size_t>(K) + static_cast<std::size_t>(k)]);
      const DecodeCheck chk = check_decode_token(ref::SparseMlaParams{layout, H, scale},
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
    for (int w = 0; w < c.warmup; ++w) launch(batch);
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
    AttentionBenchPoint pt;
    pt.batch = batch;
    pt.us = summarize(us);
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
