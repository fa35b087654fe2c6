// `ess bench transfer`: moves the misses of one layer of a decode batch between the pinned
// Total Memory Pool and device slots with every method we compare, on the same entries:
//   flashtrans        one zero-copy kernel launch for all misses (FlashTrans)
//   memcpy_per_entry  one cudaMemcpyAsync per 656-byte entry (the paper's baseline)
//   memcpy_batch      one cudaMemcpyBatchAsync of all entries (CUDA 12.8+)
//   bulk              one contiguous pinned copy of the same byte count (the ceiling)
// in both directions (h2d: host pool -> slots; d2h: slots -> host pool), timed with CUDA
// events, repeated, reported as median / min / max GB/s. FlashTrans's copies are verified
// byte for byte against the host pool before timing.
//
// With `blocks`, FlashTrans is also swept over grid sizes: bandwidth against block count in
// both directions, alone and (with `concurrent`) launched just before a sparse MLA decode on
// another stream, as the DA schedule runs them (the copy on a high-priority stream): the
// copy's bandwidth beside the attention and the attention's slowdown. The recommended grid
// per direction is the smallest block count within 5 % of the best bandwidth alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ess::cuda {

struct FlashTransBenchConfig {
  int requests = 64;
  int misses_per_request = 256;
  std::int64_t context = 32768;   // tokens per request in the host pool (one layer)
  std::int32_t slots = 6554;      // device slots per request
  int entry_bytes = 656;
  int repeats = 20;
  int warmup = 3;
  std::uint64_t seed = 1;
  int device = 0;
  std::vector<int> blocks;       // FlashTrans grids to sweep (empty: no sweep)
  bool concurrent = false;       // the sweep also beside a sparse MLA decode
  int attention_batch = 128;     // that decode: B requests, T 2, 128 heads, top-k 2048, `slots` slots
};

struct TransferSweepPoint {
  int blocks = 0;
  std::string direction;                 // h2d, d2h
  double gbps = 0, gbps_min = 0, gbps_max = 0;  // alone: median (min, max)
  double concurrent_gbps = -1;           // beside the attention (median); < 0: not measured
  double attention_us = -1;              // the attention beside this copy (median)
  double attention_slowdown = -1;        // attention_us / the attention alone
};

struct TransferStat {
  std::string method;     // flashtrans, memcpy_per_entry, memcpy_batch, bulk
  std::string direction;  // h2d, d2h
  double median_gbps = 0, min_gbps = 0, max_gbps = 0;
  double median_us = 0;
  bool available = true;  // false when the method is missing (e.g. no cudaMemcpyBatchAsync)
  std::string note;
};

struct FlashTransBenchResult {
  std::string device;
  std::string date;  // UTC, ISO 8601
  std::uint64_t bytes_per_run = 0;
  std::int64_t entries_per_run = 0;
  bool verified = false;  // FlashTrans copies equal the host entries
  int default_blocks = 0;  // FlashTrans's grid in `stats`
  std::vector<TransferStat> stats;
  std::vector<TransferSweepPoint> sweep;
  double attention_alone_us = -1;  // the concurrent sweep's decode alone (median)
  int recommended_blocks_h2d = 0, recommended_blocks_d2h = 0;  // 0: no sweep
};

FlashTransBenchResult run_flashtrans_bench(const FlashTransBenchConfig& config);

}  // namespace ess::cuda
