// `ess bench swap`: the GPU swap engine's time per layer for a decode batch (one launch for
// all requests), on top-k sequences with decode-like locality. Each timed step launches every
// layer back to back between one pair of CUDA events (every layer's LRU state in device
// memory, as in a decode step); the last launch's slot ids and misses are checked against the
// independent LRU model. Target: <= 20 us per layer at batch 128, T 2, top-k 2048, 6,554 slots.
#pragma once

#include <cstdint>
#include <string>

#include "testing/stats.h"

namespace ess::cuda {

struct SwapEngineBenchConfig {
  int requests = 128;
  int query_tokens = 2;
  int topk = 2048;
  std::int32_t slots = 6554;
  std::int64_t context = 32768;
  int fresh_per_query = 100;  // ids replaced per query per step (sets the miss rate)
  int steps = 64;             // distinct steps cycled through
  int layers = 61;            // layers whose state the launches walk (DeepSeek-V3.2: 61)
  int repeats = 50;
  std::uint64_t seed = 1;
  int device = 0;
  int cluster = 0;            // blocks per request (GpuSwapConfig::cluster; 0 = the engine's choice)
};

struct SwapEngineBenchResult {
  std::string device;
  std::string date;
  test::Summary us_per_layer;
  double misses_per_request_step = 0;
  double hits_per_request_step = 0;
  int checked_requests = 0;   // requests whose last slot ids and misses matched the LRU model
  int blocks_per_request = 1; // the cluster each request's step ran on
};

SwapEngineBenchResult run_swap_engine_bench(const SwapEngineBenchConfig& config);

}  // namespace ess::cuda
