#include "runtime/ops/flashtrans/flashtrans_bench.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <unordered_set>

#include "ess/ops/flashtrans.h"
#include "runtime/cuda/check.h"
#include "runtime/ops/gpu_swap/swap_engine_bench.h"
#include "runtime/ops/launch_args.h"
#include "runtime/ops/sparse_mla/sparse_mla_workload.h"
#include "testing/device.h"
#include "testing/stats.h"

namespace ess::cuda {
namespace {

// Owns CUDA allocations for the duration of the benchmark.
struct Buffers {
  std::uint8_t* host = nullptr;       // pinned, mapped: the host pool (requests x context entries)
  std::uint8_t* dev = nullptr;        // device slots (requests x slots entries)
  std::uint8_t* host_bulk = nullptr;  // pinned contiguous staging for the bulk baseline
  std::uint8_t* dev_bulk = nullptr;
  std::uint64_t* dev_offsets = nullptr;  // [2][n]: host offsets, then device offsets
  cudaStream_t stream = nullptr;
  cudaStream_t copy_stream = nullptr, attn_stream = nullptr;  // the concurrent sweep's
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaEvent_t events[4] = {};  // copy start / stop, attention start / stop
  ~Buffers() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    for (cudaEvent_t e : events) {
      if (e) cudaEventDestroy(e);
    }
    if (stream) cudaStreamDestroy(stream);
    if (copy_stream) cudaStreamDestroy(copy_stream);
    if (attn_stream) cudaStreamDestroy(attn_stream);
    if (dev_offsets) cudaFree(dev_offsets);
    if (dev_bulk) cudaFree(dev_bulk);
    if (host_bulk) cudaFreeHost(host_bulk);
    if (dev) cudaFree(dev);
    if (host) cudaFreeHost(host);
  }
};

}  // namespace

namespace {

double elapsed_us(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  ESS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b), "bench transfer: event time");
  return 1000.0 * static_cast<double>(ms);
}

// FlashTrans over grid sizes, alone and beside a sparse MLA decode (see flashtrans_bench.h).
void sweep_grids(const FlashTransBenchConfig& c, Buffers& b, const EntryCopy& h2d, const EntryCopy& d2h,
                 FlashTransBenchResult& res) {
  int least = 0, greatest = 0;
  ESS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest), "bench transfer: stream priorities");
  ESS_CUDA_CHECK(cudaStreamCreateWithPriority(&b.copy_stream, cudaStreamNonBlocking, greatest), "bench transfer: copy stream");
  ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&b.attn_stream, cudaStreamNonBlocking), "bench transfer: attention stream");
  for (cudaEvent_t& e : b.events) ESS_CUDA_CHECK(cudaEventCreate(&e), "bench transfer: event");
  const double gb = static_cast<double>(res.bytes_per_run) / 1e9;

  std::unique_ptr<SparseMlaWorkload> attn;
  SparseMlaArgs aa;
  const auto launch_attention = [&] {
    ESS_CUDA_CHECK(static_cast<cudaError_t>(sparse_mla_decode(aa, b.attn_stream)), "bench transfer: sparse MLA");
  };
  if (c.concurrent) {
    SparseMlaBenchConfig ac;
    ac.batch = c.attention_batch;
    ac.slots = c.slots;
    ac.seed = c.seed + 1;
    attn = std::make_unique<SparseMlaWorkload>(ac, ac.batch);
    aa = attn->args(ac.batch);
    std::vector<double> us;
    for (int it = 0; it < c.warmup + c.repeats; ++it) {
      ESS_CUDA_CHECK(cudaEventRecord(b.events[2], b.attn_stream), "bench transfer: event");
      launch_attention();
      ESS_CUDA_CHECK(cudaEventRecord(b.events[3], b.attn_stream), "bench transfer: event");
      ESS_CUDA_CHECK(cudaEventSynchronize(b.events[3]), "bench transfer: sparse MLA alone");
      if (it >= c.warmup) us.push_back(elapsed_us(b.events[2], b.events[3]));
    }
    res.attention_alone_us = test::summarize(us).median;
  }

  for (const std::string dir : {"h2d", "d2h"}) {
    double best = 0;
    const std::size_t first = res.sweep.size();
    for (const int blocks : c.blocks) {
      EntryCopy e = dir == "h2d" ? h2d : d2h;
      e.blocks = blocks;
      const auto launch_copy = [&](cudaStream_t s) {
        ESS_CUDA_CHECK(static_cast<cudaError_t>(dir == "h2d" ? flashtrans_gather(e, s) : flashtrans_scatter(e, s)),
                       "bench transfer: FlashTrans {} with {} blocks", dir, blocks);
      };
      TransferSweepPoint p;
      p.blocks = flashtrans_grid(e).blocks;
      p.direction = dir;
      std::vector<double> alone, beside, attn_us;
      for (int it = 0; it < c.warmup + c.repeats; ++it) {
        ESS_CUDA_CHECK(cudaEventRecord(b.events[0], b.copy_stream), "bench transfer: event");
        launch_copy(b.copy_stream);
        ESS_CUDA_CHECK(cudaEventRecord(b.events[1], b.copy_stream), "bench transfer: event");
        ESS_CUDA_CHECK(cudaEventSynchronize(b.events[1]), "bench transfer: FlashTrans {}", dir);
        if (it >= c.warmup) alone.push_back(elapsed_us(b.events[0], b.events[1]));
      }
      if (attn) {
        // The copy first (high priority), then the attention on its own stream, as the DA
        // schedule issues them; each timed on its own stream.
        for (int it = 0; it < c.warmup + c.repeats; ++it) {
          ESS_CUDA_CHECK(cudaEventRecord(b.events[0], b.copy_stream), "bench transfer: event");
          launch_copy(b.copy_stream);
          ESS_CUDA_CHECK(cudaEventRecord(b.events[1], b.copy_stream), "bench transfer: event");
          ESS_CUDA_CHECK(cudaEventRecord(b.events[2], b.attn_stream), "bench transfer: event");
          launch_attention();
          ESS_CUDA_CHECK(cudaEventRecord(b.events[3], b.attn_stream), "bench transfer: event");
          ESS_CUDA_CHECK(cudaEventSynchronize(b.events[1]), "bench transfer: FlashTrans {} beside attention", dir);
          ESS_CUDA_CHECK(cudaEventSynchronize(b.events[3]), "bench transfer: attention beside FlashTrans {}", dir);
          if (it >= c.warmup) {
            beside.push_back(elapsed_us(b.events[0], b.events[1]));
            attn_us.push_back(elapsed_us(b.events[2], b.events[3]));
          }
        }
      }
      const test::Summary t = test::summarize(alone);
      p.gbps = gb / (t.median * 1e-6);
      p.gbps_max = gb / (t.min * 1e-6);
      p.gbps_min = gb / (t.max * 1e-6);
      if (attn) {
        p.concurrent_gbps = gb / (test::summarize(beside).median * 1e-6);
        p.attention_us = test::summarize(attn_us).median;
        p.attention_slowdown = p.attention_us / res.attention_alone_us;
      }
      best = std::max(best, p.gbps);
      res.sweep.push_back(p);
    }
    int pick = 0;
    for (std::size_t i = first; i < res.sweep.size(); ++i) {
      const TransferSweepPoint& p = res.sweep[i];
      if (p.gbps >= 0.95 * best && (pick == 0 || p.blocks < pick)) pick = p.blocks;
    }
    (dir == "h2d" ? res.recommended_blocks_h2d : res.recommended_blocks_d2h) = pick;
  }
}

}  // namespace

FlashTransBenchResult run_flashtrans_bench(const FlashTransBenchConfig& c) {
  ESS_CHECK(c.requests > 0 && c.misses_per_request > 0 && c.context > 0 && c.slots > 0 && c.repeats > 0 && c.warmup >= 0,
            "bench transfer: requests {}, misses {}, context {}, slots {}, repeats {} must be positive", c.requests,
            c.misses_per_request, c.context, c.slots, c.repeats);
  ESS_CHECK(c.misses_per_request <= c.slots && c.misses_per_request <= c.context,
            "bench transfer: {} misses per request exceed the {} slots or the context {}", c.misses_per_request, c.slots,
            c.context);
  ESS_CHECK(c.entry_bytes > 0 && c.entry_bytes % 16 == 0, "bench transfer: entry_bytes = {} must be a multiple of 16",
            c.entry_bytes);
  for (const int blocks : c.blocks) {
    ESS_CHECK(blocks >= 1 && blocks <= 65535, "bench transfer: --blocks {} must be in [1, 65535]", blocks);
  }
  ESS_CHECK(!c.concurrent || !c.blocks.empty(), "bench transfer: the concurrent sweep needs --blocks");
  ESS_CHECK(c.attention_batch >= 1, "bench transfer: attention batch {} must be >= 1", c.attention_batch);
  FlashTransBenchResult res;
  res.device = test::use_device(c.device, "bench transfer");
  res.date = test::utc_now();
  const std::uint64_t E = static_cast<std::uint64_t>(c.entry_bytes);
  const std::int64_t n = static_cast<std::int64_t>(c.requests) * c.misses_per_request;
  res.entries_per_run = n;
  res.bytes_per_run = static_cast<std::uint64_t>(n) * E;

  Buffers b;
  const std::uint64_t host_bytes = static_cast<std::uint64_t>(c.requests) * static_cast<std::uint64_t>(c.context) * E;
  const std::uint64_t dev_bytes = static_cast<std::uint64_t>(c.requests) * static_cast<std::uint64_t>(c.slots) * E;
  ESS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&b.host), host_bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                 "pinning {} bytes of host pool", host_bytes);
  ESS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.dev), dev_bytes), "allocating {} bytes of slots", dev_bytes);
  ESS_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&b.host_bulk), res.bytes_per_run), "bulk staging");
  ESS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.dev_bulk), res.bytes_per_run), "bulk device buffer");
  ESS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.dev_offsets), 2 * static_cast<std::size_t>(n) * sizeof(std::uint64_t)),
                 "offset arrays");
  ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking), "creating a stream");
  ESS_CUDA_CHECK(cudaEventCreate(&b.start), "creating an event");
  ESS_CUDA_CHECK(cudaEventCreate(&b.stop), "creating an event");

  // Recognisable host bytes; scattered, distinct source tokens and destination slots.
  for (std::uint64_t i = 0; i < host_bytes; i += 4096) b.host[i] = static_cast<std::uint8_t>(i >> 12);
  std::mt19937_64 rng(c.seed);
  std::vector<std::uint64_t> offsets(2 * static_cast<std::size_t>(n));
  for (int r = 0; r < c.requests; ++r) {
    std::unordered_set<std::int64_t> toks, slots;
    while (static_cast<int>(toks.size()) < c.misses_per_request) toks.insert(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(c.context)));
    while (static_cast<int>(slots.size()) < c.misses_per_request) slots.insert(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(c.slots)));
    std::vector<std::int64_t> tv(toks.begin(), toks.end()), sv(slots.begin(), slots.end());
    std::sort(tv.begin(), tv.end());
    for (int m = 0; m < c.misses_per_request; ++m) {
      const std::size_t i = static_cast<std::size_t>(r) * c.misses_per_request + m;
      offsets[i] = (static_cast<std::uint64_t>(r) * c.context + static_cast<std::uint64_t>(tv[m])) * E;
      offsets[static_cast<std::size_t>(n) + i] = (static_cast<std::uint64_t>(r) * c.slots + static_cast<std::uint64_t>(sv[m])) * E;
      for (std::uint64_t k = 0; k < E; ++k) b.host[offsets[i] + k] = static_cast<std::uint8_t>(rng());
    }
  }
  ESS_CUDA_CHECK(cudaMemcpy(b.dev_offsets, offsets.data(), offsets.size() * sizeof(std::uint64_t), cudaMemcpyHostToDevice),
                 "uploading offsets");
  const std::uint8_t* host_dev = device_view(b.host);
  ESS_CHECK(host_dev != nullptr, "bench transfer: pinned host pool is not mapped");

  EntryCopy h2d{host_dev, b.dev, b.dev_offsets, b.dev_offsets + n, n, c.entry_bytes};
  EntryCopy d2h{b.dev, const_cast<std::uint8_t*>(host_dev), b.dev_offsets + n, b.dev_offsets, n, c.entry_bytes};

  // Verify FlashTrans H2D byte for byte before timing anything.
  ESS_CUDA_CHECK(cudaMemset(b.dev, 0, dev_bytes), "clearing slots");
  ESS_CUDA_CHECK(static_cast<cudaError_t>(flashtrans_gather(h2d, b.stream)), "FlashTrans gather");
  ESS_CUDA_CHECK(cudaStreamSynchronize(b.stream), "FlashTrans gather");
  {
    std::vector<std::uint8_t> back(E);
    res.verified = true;
    for (std::int64_t i = 0; i < n && res.verified; ++i) {
      ESS_CUDA_CHECK(cudaMemcpy(back.data(), b.dev + offsets[static_cast<std::size_t>(n + i)], E, cudaMemcpyDeviceToHost), "read back");
      res.verified = std::memcmp(back.data(), b.host + offsets[static_cast<std::size_t>(i)], E) == 0;
    }
  }

  std::vector<void*> dsts(static_cast<std::size_t>(n)), srcs(static_cast<std::size_t>(n));
  std::vector<std::size_t> sizes(static_cast<std::size_t>(n), E);
  const auto time_it = [&](const std::string& method, const std::string& dir, const std::function<cudaError_t()>& run) {
    TransferStat s;
    s.method = method;
    s.direction = dir;
    std::vector<double> us;
    for (int it = 0; it < c.warmup + c.repeats; ++it) {
      ESS_CUDA_CHECK(cudaEventRecord(b.start, b.stream), "event");
      const cudaError_t err = run();
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        cudaStreamSynchronize(b.stream);
        s.available = false;
        s.note = cudaGetErrorString(err);
        res.stats.push_back(s);
        return;
      }
      ESS_CUDA_CHECK(cudaEventRecord(b.stop, b.stream), "event");
      ESS_CUDA_CHECK(cudaEventSynchronize(b.stop), "{} {}", method, dir);
      float ms = 0;
      ESS_CUDA_CHECK(cudaEventElapsedTime(&ms, b.start, b.stop), "event time");
      if (it >= c.warmup) us.push_back(1000.0 * ms);
    }
    const test::Summary t = test::summarize(us);
    const double gb = static_cast<double>(res.bytes_per_run) / 1e9;
    s.median_us = t.median;
    s.median_gbps = gb / (t.median * 1e-6);
    s.max_gbps = gb / (t.min * 1e-6);
    s.min_gbps = gb / (t.max * 1e-6);
    res.stats.push_back(s);
  };

  for (const std::string dir : {"h2d", "d2h"}) {
    const bool up = dir == "h2d";
    time_it("flashtrans", dir, [&] { return static_cast<cudaError_t>(up ? flashtrans_gather(h2d, b.stream) : flashtrans_scatter(d2h, b.stream)); });
    time_it("memcpy_per_entry", dir, [&] {
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint8_t* hp = b.host + offsets[static_cast<std::size_t>(i)];
        std::uint8_t* dp = b.dev + offsets[static_cast<std::size_t>(n + i)];
        const cudaError_t e = up ? cudaMemcpyAsync(dp, hp, E, cudaMemcpyHostToDevice, b.stream)
                                 : cudaMemcpyAsync(hp, dp, E, cudaMemcpyDeviceToHost, b.stream);
        if (e != cudaSuccess) return e;
      }
      return cudaSuccess;
    });
    for (std::int64_t i = 0; i < n; ++i) {
      std::uint8_t* hp = b.host + offsets[static_cast<std::size_t>(i)];
      std::uint8_t* dp = b.dev + offsets[static_cast<std::size_t>(n + i)];
      dsts[static_cast<std::size_t>(i)] = up ? static_cast<void*>(dp) : static_cast<void*>(hp);
      srcs[static_cast<std::size_t>(i)] = up ? static_cast<void*>(hp) : static_cast<void*>(dp);
    }
    time_it("memcpy_batch", dir, [&] {
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      std::size_t attr_idx = 0;
      return cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), static_cast<std::size_t>(n), &attr, &attr_idx, 1,
                                  b.stream);
    });
    time_it("bulk", dir, [&] {
      return up ? cudaMemcpyAsync(b.dev_bulk, b.host_bulk, res.bytes_per_run, cudaMemcpyHostToDevice, b.stream)
                : cudaMemcpyAsync(b.host_bulk, b.dev_bulk, res.bytes_per_run, cudaMemcpyDeviceToHost, b.stream);
    });
  }
  res.default_blocks = flashtrans_grid(h2d).blocks;
  if (!c.blocks.empty()) sweep_grids(c, b, h2d, d2h, res);
  return res;
}

}  // namespace ess::cuda
