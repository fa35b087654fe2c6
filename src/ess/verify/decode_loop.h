// `ess verify`: a CPU decode loop over a batch of requests and layers that runs the ESS
// offload path side by side with the all-resident path and checks they agree bit for bit.
//
// Per step and layer: indexer (reference kernel) -> top-k -> swap engine -> copy misses from
// the Total Memory Pool into Sparse Memory Pool slots -> sparse MLA over the slots; and, with
// the same top-k ids, sparse MLA over the full cache (the Total Memory Pool's entries). The
// inputs are random; the indexer queries drift slowly from step to step so that the top-k
// sets have the temporal locality ESS relies on.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ess/cache/sparse_pool.h"
#include "ess/cache/types.h"
#include "ess/model/model_spec.h"

namespace ess {

struct VerifyConfig {
  int requests = 2;
  int layers = 3;             // the model's first `layers` layers
  std::int64_t context = 2048;  // prompt length at the prefill -> decode hand-over
  int steps = 8;
  int mtp = 2;                // T: query tokens per request per step
  int topk = 128;             // K (the model's index_topk is 2048; smaller keeps the default fast)
  std::int32_t slots = 0;     // per request-layer; 0 = from `ratio`
  double ratio = 0.2;         // Sparse Memory Ratio x context
  int warmup_windows = 32;    // LRU-Warmup windows (0 = cold start)
  std::uint64_t seed = 1;
  double query_drift = 0.15;  // 0 = the same indexer query every step, 1 = a fresh one
  bool inject_fault = false;  // tests only: corrupt one slot byte to prove the check can fail
  // Where the Sparse Memory Pool's bytes live; empty = CpuSlotStorage. `ess verify --backend
  // cuda` passes the device backend, so the same loop checks FlashTrans end to end.
  std::function<std::unique_ptr<SlotStorage>()> storage;

  void validate(const ModelSpec& model) const;
};

struct VerifyLayerStats {
  int layer = 0;
  std::int64_t hits = 0;
  std::int64_t misses = 0;
  std::int64_t warmup_fills = 0;
};

struct VerifyReport {
  bool bitwise_equal = true;
  std::int64_t compared_outputs = 0;  // query-token x layer attention outputs compared
  std::int64_t mismatched_outputs = 0;
  std::int32_t slots = 0;
  std::int64_t steps = 0;
  std::int64_t hits = 0;
  std::int64_t misses = 0;
  std::int64_t warmup_fills = 0;
  std::vector<VerifyLayerStats> per_layer;
  std::vector<std::int64_t> misses_per_step;  // summed over requests and layers
  std::string first_mismatch;                 // where, when not bitwise equal
  std::string host_memory;                    // "pinned" or "aligned"
  std::string backend;                        // the slot storage backend ("cpu", "cuda")
  double seconds = 0.0;
};

VerifyReport run_verify(const ModelSpec& model, const VerifyConfig& config);

}  // namespace ess
