// `ess verify`: a decode loop over a batch of requests and layers that runs the ESS offload
// path (the runtime's per-layer step, ess/runtime/offload.h, on its CPU or CUDA backend) side
// by side with the all-resident path and checks they agree bit for bit.
//
// Per step and layer: indexer (reference kernel; a shared-index layer reuses its leader's top-k)
// -> top-k -> Offload::step (swap decision,
// misses fetched from the Total Memory Pool into the layer buffer's rows; once per query
// group when the step's working set exceeds the pool) -> sparse MLA (reference kernel) over
// the rows it returns; and, with the same top-k ids, sparse MLA over
// the full cache, a copy of every entry the loop generated, kept apart from the Offload. With
// reserve_newest, each step's new entries are written into the reserved rows and reach the
// host pool by Offload::write_back, so the write-back is checked too. The inputs are random;
// the indexer queries drift slowly from step to step so that the top-k sets have the temporal
// locality ESS relies on.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ess/cache/types.h"
#include "ess/model/model_spec.h"
#include "ess/runtime/offload.h"

namespace ess {

struct VerifyConfig {
  int requests = 2;
  int layers = 3;             // the model's first `layers` offloaded layers (DeepSeek-V4: with a C4 cache)
  std::int64_t context = 2048;  // prompt length at the prefill -> decode hand-over, tokens
  // (a compressed cache holds context / 4 entries, top-k ids and lengths in entries)
  int steps = 8;
  int mtp = 2;                // T: query tokens per request per step
  int topk = 128;             // K (the model's index_topk is 2048; smaller keeps the default fast)
  std::int32_t slots = 0;     // per request-layer; 0 = from `ratio`
  double ratio = 0.2;         // Sparse Memory Ratio x context
  int warmup_windows = 32;    // LRU-Warmup windows (0 = cold start)
  std::uint64_t seed = 1;
  double query_drift = 0.15;  // 0 = the same indexer query every step, 1 = a fresh one
  bool inject_fault = false;  // tests only: corrupt one row byte to prove the check can fail
  bool reserve_newest = false;  // OffloadConfig::reserve_newest (new entries via write_back)
  // The fraction of the prompt every request shares with request 0 (a common system prompt):
  // requests 1.. are admitted on request 0's prefix (Offload::admit_shared), its host pages
  // shared, not copied.
  double prefix_share = 0.0;
  // OffloadConfig::residency (needs reserve_newest unless kSparse) over `pool_rows` pool rows (0:
  // `requests` for kSparse; enough for every request whole for kWhole; for kAdaptive, request 0
  // whole at the start and every other request sparse, so that its growth finds no free row and
  // it is demoted). With kAdaptive the last request finishes after half the steps, freeing rows
  // so that demoted requests may be promoted back.
  Residency residency = Residency::kSparse;
  std::int32_t pool_rows = 0;
  // A model with index sharing (ModelSpec::shared_index): a shared layer runs no indexer and
  // attends over its leader's top-k. With this set its step is issued right after its leader's
  // (before the layers in between, as the SGLang adapter issues it on its prefetch stream), when
  // the leader's step is one call (not split into query groups); else at its own turn.
  bool shared_index_prefetch = true;
  // The Offload's backend: kCuda checks the device path (swap kernels, split, FlashTrans) end to end.
  Backend backend = Backend::kCpu;
  int device = 0;
  // Called after each request's warm-up and each decode step, when set (done, total).
  std::function<void(std::size_t done, std::size_t total)> progress;

  void validate(const ModelSpec& model) const;
};

struct VerifyLayerStats {
  int layer = 0;
  std::int64_t hits = 0;
  std::int64_t misses = 0;
  int model_layer = 0;  // the model's layer (DeepSeek-V4: the C4 layers in order)
};

struct VerifyReport {
  bool bitwise_equal = true;
  std::int64_t compared_outputs = 0;  // query-token x layer attention outputs compared
  std::int64_t mismatched_outputs = 0;
  std::int64_t mismatched_host_entries = 0;  // host pool entries that differ from the generated ones
  std::int32_t slots = 0;
  std::int64_t steps = 0;
  std::int64_t hits = 0;
  std::int64_t misses = 0;
  std::int64_t warmup_fills = 0;
  // Request-layer-steps whose working set (the union of the T query tokens' top-k) exceeded
  // the slots, served in query groups; and the step calls beyond one per layer-step that the
  // batch's query groups took.
  std::int64_t split_steps = 0;
  std::int64_t group_calls = 0;
  std::vector<VerifyLayerStats> per_layer;
  std::vector<std::int64_t> misses_per_step;  // summed over requests and layers
  std::string first_mismatch;                 // where, when not bitwise equal
  std::uint64_t host_bytes = 0;           // the host pool's pages in use at the end
  std::uint64_t host_bytes_unshared = 0;  // what the requests would hold without sharing
  std::string host_memory;                    // "pinned" or "aligned"
  std::string backend;                        // the Offload's backend ("cpu", "cuda")
  // Residency: the pool rows; position-layer-steps served whole and sparse; step calls that ran a
  // swap decision; demotions and promotions.
  std::int32_t pool_rows = 0;
  std::int64_t whole_steps = 0, sparse_steps = 0, swap_launches = 0, demotions = 0, promotions = 0;
  // Index sharing: the verified layers that reuse their leader's top-k, and the layer-steps of
  // theirs issued at their leader's step.
  std::vector<int> shared_layers;
  std::int64_t prefetched_steps = 0;
  int tokens_per_entry = 1;  // 4 for DeepSeek-V4's C4 cache (its entries, positions and lengths)
  double seconds = 0.0;
};

VerifyReport run_verify(const ModelSpec& model, const VerifyConfig& config);

}  // namespace ess
