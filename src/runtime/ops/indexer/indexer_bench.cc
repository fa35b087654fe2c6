#include "runtime/ops/indexer/indexer_bench.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "ess/model/entry_layout.h"
#include "ess/model/numerics.h"
#include "ess/ops/indexer.h"
#include "ess/ops/reference.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "runtime/ops/gpu_swap/swap_engine_bench.h"
#include "testing/accuracy.h"
#include "testing/device.h"

namespace ess::cuda {
namespace {

constexpr int kDim = 128;

// Fast fill of large buffers: splitmix64.
struct SplitMix {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

// 256 FP8 codes of normally distributed values (amax near 448, as after block scaling):
// a random byte indexes it, so keys and queries look like quantized activations.
std::vector<std::uint8_t> fp8_normal_table(std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 110.0f);
  std::vector<std::uint8_t> t(256);
  for (auto& b : t) b = fp8_e4m3_from_float(normal(rng));
  return t;
}

}  // namespace

namespace {

// Checks query token `row` ([B][T] order) of one step: GPU logits against
// ref::indexer_logits within the tolerance, GPU top-k against ref::topk of the GPU logits.
bool verify_row(const IndexerBenchConfig& c, std::int64_t row, const std::vector<std::uint8_t>& arena,
                const std::vector<std::int32_t>& table, int max_pages, const std::vector<std::uint8_t>& q,
                const std::vector<float>& w, std::int64_t len, const float* d_logits, const std::int32_t* d_topk,
                double& worst, std::string& note) {
  const IndexerLayout layout;
  const auto H = static_cast<std::size_t>(c.heads);
  const std::int64_t b = row / c.query_tokens;
  std::vector<const std::uint8_t*> pages;
  for (int p = 0; p < (len + 63) / 64; ++p) {
    pages.push_back(arena.data() + static_cast<std::size_t>(table[static_cast<std::size_t>(b) * max_pages + p]) *
                                       layout.page_bytes());
  }
  const std::span<const float> wr(w.data() + static_cast<std::size_t>(row) * H, H);
  std::vector<float> ref(static_cast<std::size_t>(len));
  std::vector<double> bounds(static_cast<std::size_t>(len));
  test::indexer_reference({q.data() + static_cast<std::size_t>(row) * H * kDim, H * kDim}, wr, c.heads, pages, len, ref, bounds);
  std::vector<float> gpu(static_cast<std::size_t>(len));
  ESS_CUDA_CHECK(cudaMemcpy(gpu.data(), d_logits + row * c.context, gpu.size() * 4, cudaMemcpyDeviceToHost),
                 "bench indexer: logits");
  for (std::int64_t j = 0; j < len; ++j) {
    const double bound = bounds[static_cast<std::size_t>(j)] + 1e-38;  // absolute floor below any scale * product
    const double err = std::fabs(static_cast<double>(gpu[static_cast<std::size_t>(j)]) -
                                 static_cast<double>(ref[static_cast<std::size_t>(j)]));
    if (!(err <= bound)) {  // also catches NaN
      note = fmt::format("query token {}, key {}: GPU logit {} vs reference {} (bound {:.3g})", row, j,
                         gpu[static_cast<std::size_t>(j)], ref[static_cast<std::size_t>(j)], bound);
      return false;
    }
    worst = std::max(worst, err / bound);
  }
  std::vector<std::int32_t> want(static_cast<std::size_t>(c.topk));
  ref::topk(gpu, c.topk, want);
  std::vector<std::int32_t> got(want.size());
  ESS_CUDA_CHECK(cudaMemcpy(got.data(), d_topk + row * c.topk, got.size() * 4, cudaMemcpyDeviceToHost),
                 "bench indexer: top-k");
  if (got != want) {
    const auto at = std::mismatch(got.begin(), got.end(), want.begin()).first - got.begin();
    note = fmt::format("query token {}: top-k position {} is {}, the reference says {}", row, at,
                       got[static_cast<std::size_t>(at)], want[static_cast<std::size_t>(at)]);
    return false;
  }
  return true;
}

}  // namespace

IndexerBenchResult run_indexer_bench(const IndexerBenchConfig& c) {
  ESS_CHECK(c.batch > 0 && c.batch <= 65535 && c.query_tokens > 0 && c.repeats > 0 && c.warmup >= 0,
            "bench indexer: batch {} (at most 65,535), T {} and repeats {} must be positive, warm-up {} >= 0",
            c.batch, c.query_tokens, c.repeats, c.warmup);
  ESS_CHECK(c.heads >= 16 && c.heads <= 64 && c.heads % 16 == 0, "bench indexer: heads = {} must be 16, 32, 48 or 64",
            c.heads);
  ESS_CHECK(c.topk > 0 && c.topk <= 2048, "bench indexer: top-k = {} out of [1, 2048]", c.topk);
  ESS_CHECK(c.context >= c.query_tokens && c.context <= (std::int64_t{1} << 30),
            "bench indexer: context {} must be at least T = {} and at most 2^30", c.context, c.query_tokens);
  IndexerBenchResult res;
  res.device = test::use_device(c.device, "bench indexer");
  res.date = test::utc_now();

  const IndexerLayout layout;
  const int B = c.batch, T = c.query_tokens, H = c.heads;
  const int pages_per_request = static_cast<int>((c.context + 63) / 64);
  const std::size_t n_pages = static_cast<std::size_t>(B) * pages_per_request;
  const std::size_t page_bytes = layout.page_bytes();

  // Keys: random normal FP8 codes with power-of-two scales, pages in shuffled order.
  std::mt19937_64 rng(c.seed);
  const std::vector<std::uint8_t> codes = fp8_normal_table(rng);
  std::vector<std::uint8_t> arena(n_pages * page_bytes);
  SplitMix mix{c.seed};
  for (std::size_t p = 0; p < n_pages; ++p) {
    std::uint8_t* page = arena.data() + p * page_bytes;
    for (std::size_t i = 0; i < static_cast<std::size_t>(64 * kDim); i += 8) {
      const std::uint64_t r = mix.next();
      for (std::size_t u = 0; u < 8; ++u) page[i + u] = codes[(r >> (8 * u)) & 0xffu];
    }
    for (int j = 0; j < 64; ++j) {
      const float scale = std::ldexp(1.0f, -8 - static_cast<int>(mix.next() % 4));
      std::memcpy(page + layout.scale_offset(j), &scale, 4);
    }
  }
  std::vector<std::int32_t> perm(n_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const std::vector<std::int32_t>& table = perm;  // [B][pages_per_request]
  const std::size_t q_rows = static_cast<std::size_t>(B) * T * H;
  std::vector<std::uint8_t> q(q_rows * kDim);
  for (auto& v : q) v = codes[mix.next() & 0xffu];
  std::vector<float> w(q_rows);
  std::normal_distribution<float> normal(0.0f, 0.125f);
  for (auto& v : w) v = normal(rng);
  std::vector<std::int32_t> lengths;
  double keys = 0;
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      lengths.push_back(static_cast<std::int32_t>(c.context - (T - 1 - t)));
      keys += static_cast<double>(lengths.back());
    }
  }
  const std::size_t rows = static_cast<std::size_t>(B) * T;

  const DeviceBuffer<std::uint8_t> d_arena(arena.size()), d_q(q.size());
  const DeviceBuffer<float> d_w(w.size()), d_logits(rows * static_cast<std::size_t>(c.context));
  const DeviceBuffer<std::int32_t> d_table(table.size()), d_len(lengths.size()),
      d_topk(rows * static_cast<std::size_t>(c.topk));
  const DeviceBuffer<int> d_nan(1);
  ESS_CUDA_CHECK(cudaMemcpy(d_arena.get(), arena.data(), arena.size(), cudaMemcpyHostToDevice), "bench indexer: pages");
  ESS_CUDA_CHECK(cudaMemcpy(d_q.get(), q.data(), q.size(), cudaMemcpyHostToDevice), "bench indexer: q");
  ESS_CUDA_CHECK(cudaMemcpy(d_w.get(), w.data(), w.size() * 4, cudaMemcpyHostToDevice), "bench indexer: weights");
  ESS_CUDA_CHECK(cudaMemcpy(d_table.get(), table.data(), table.size() * 4, cudaMemcpyHostToDevice),
                 "bench indexer: page table");
  ESS_CUDA_CHECK(cudaMemcpy(d_len.get(), lengths.data(), lengths.size() * 4, cudaMemcpyHostToDevice),
                 "bench indexer: lengths");
  const int minus_one = -1;
  ESS_CUDA_CHECK(cudaMemcpy(d_nan.get(), &minus_one, 4, cudaMemcpyHostToDevice), "bench indexer: nan_row");

  IndexerArgs ia;
  ia.batch = B;
  ia.query_tokens = T;
  ia.heads = H;
  ia.head_dim = kDim;
  ia.q = d_q.get();
  ia.weights = d_w.get();
  ia.pages = d_arena.get();
  ia.page_table = d_table.get();
  ia.max_pages = pages_per_request;
  ia.lengths = d_len.get();
  ia.logits = d_logits.get();
  ia.logits_stride = c.context;
  TopkArgs ta;
  ta.rows = static_cast<std::int64_t>(rows);
  ta.k = c.topk;
  ta.logits = d_logits.get();
  ta.stride = c.context;
  ta.lengths = d_len.get();
  ta.out = d_topk.get();
  ta.nan_row = d_nan.get();

  cudaStream_t stream = nullptr;
  ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "bench indexer: stream");
  const std::unique_ptr<CUstream_st, decltype(&cudaStreamDestroy)> stream_owner(stream, &cudaStreamDestroy);

  // One verified step: the first and the last query token of the batch.
  ESS_CUDA_CHECK(static_cast<cudaError_t>(indexer_logits(ia, stream)), "bench indexer: logits launch");
  ESS_CUDA_CHECK(static_cast<cudaError_t>(topk(ta, stream)), "bench indexer: top-k launch");
  ESS_CUDA_CHECK(cudaStreamSynchronize(stream), "bench indexer: first step");
  int nan_row = 0;
  ESS_CUDA_CHECK(cudaMemcpy(&nan_row, d_nan.get(), 4, cudaMemcpyDeviceToHost), "bench indexer: nan_row");
  res.verified = nan_row == -1;
  if (!res.verified) res.verify_note = fmt::format("NaN logit in query token {}", nan_row);
  for (const std::int64_t row : {std::int64_t{0}, static_cast<std::int64_t>(rows) - 1}) {
    if (!res.verified) break;
    res.verified = verify_row(c, row, arena, table, pages_per_request, q, w, lengths[static_cast<std::size_t>(row)],
                              d_logits.get(), d_topk.get(), res.worst_error_over_bound, res.verify_note);
  }

  cudaEvent_t ev[3] = {nullptr, nullptr, nullptr};
  std::vector<std::unique_ptr<CUevent_st, decltype(&cudaEventDestroy)>> ev_owner;
  for (auto& e : ev) {
    ESS_CUDA_CHECK(cudaEventCreate(&e), "bench indexer: event");
    ev_owner.emplace_back(e, &cudaEventDestroy);
  }
  std::vector<double> logits_us, topk_us, both_us;
  for (int it = 0; it < c.warmup + c.repeats; ++it) {
    ESS_CUDA_CHECK(cudaEventRecord(ev[0], stream), "bench indexer: event");
    ESS_CUDA_CHECK(static_cast<cudaError_t>(indexer_logits(ia, stream)), "bench indexer: logits launch");
    ESS_CUDA_CHECK(cudaEventRecord(ev[1], stream), "bench indexer: event");
    ESS_CUDA_CHECK(static_cast<cudaError_t>(topk(ta, stream)), "bench indexer: top-k launch");
    ESS_CUDA_CHECK(cudaEventRecord(ev[2], stream), "bench indexer: event");
    ESS_CUDA_CHECK(cudaEventSynchronize(ev[2]), "bench indexer: step");
    if (it < c.warmup) continue;
    float ms01 = 0, ms12 = 0, ms02 = 0;
    ESS_CUDA_CHECK(cudaEventElapsedTime(&ms01, ev[0], ev[1]), "bench indexer: event time");
    ESS_CUDA_CHECK(cudaEventElapsedTime(&ms12, ev[1], ev[2]), "bench indexer: event time");
    ESS_CUDA_CHECK(cudaEventElapsedTime(&ms02, ev[0], ev[2]), "bench indexer: event time");
    logits_us.push_back(1000.0 * ms01);
    topk_us.push_back(1000.0 * ms12);
    both_us.push_back(1000.0 * ms02);
  }
  res.logits_us = test::summarize(logits_us);
  res.topk_us = test::summarize(topk_us);
  res.indexer_us = test::summarize(both_us);

  // Traffic of the logits kernel: every needed page once per request, q and w once per
  // request (the CTAs of a request re-read them from L2); the logits written.
  res.keys = keys;
  res.page_bytes = static_cast<double>(n_pages) * static_cast<double>(page_bytes);
  res.bytes_read = res.page_bytes + static_cast<double>(q.size()) + 4.0 * static_cast<double>(w.size());
  res.bytes_written = 4.0 * keys;
  res.flops = indexer_flops(keys, H, kDim);
  int mem_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, c.device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, c.device) != cudaSuccess) {
    (void)cudaGetLastError();
    mem_khz = bus_bits = 0;
  }
  res.hbm_peak_gbps = 2.0 * mem_khz * 1e3 * (bus_bits / 8.0) / 1e9;  // double data rate
  res.logits_gbps = res.bytes_read / (res.logits_us.median * 1e-6) / 1e9;
  res.logits_tflops = res.flops / (res.logits_us.median * 1e-6) / 1e12;
  return res;
}

}  // namespace ess::cuda
