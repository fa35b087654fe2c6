// `ess trace analyze`: locality metrics and replacement-policy replays of a top-k trace
// (docs/trace-analysis.md). Every request-layer is replayed through its own ess::LayerCache
// (the swap engine's per request-layer decision logic) with the policy under study; the
// request-layer pairs are independent and run in parallel (oneTBB).
//
// Definitions:
//   * working set of a step (of one request-layer): the distinct ids its mtp query tokens
//     select; misses and hits count distinct tokens, as in the swap engine;
//   * intra-layer similarity: |WS(s) n WS(s-1)| / |WS(s)|, same request-layer, steps s >= 1;
//   * inter-layer similarity: |WS_l(s) n WS_{l-1}(s)| / |WS_l(s)|, same request-step, l >= 1;
//   * steady state: decode steps >= steady_from (warm-up windows are never counted as misses);
//   * slots of a request: given explicitly, or ceil(ratio x context); at least one query
//     token's top-k. A step whose working set exceeds them is replayed in query groups
//     (ess/cache/query_groups.h), each group one policy step, as the engine runs it;
//   * policies: lru (cold start), lru_warmup (LRU-Warmup with the trace's prefill top-k),
//     fifo, clock, lfu, s3fifo and belady (the offline optimum); all but `lru` start with the
//     warm-up windows when the trace has them and warmup is on;
//   * inter-layer prefetch (first order, at the first pool size, LRU + warm-up): before layer l
//     runs, fetch layer l-1's working set of the same step. Per layer: prefetched = entries of
//     WS_{l-1} not resident in layer l's pool, useful = those in WS_l, wasted = the rest,
//     misses left = misses of WS_l not covered. The prefetch is assumed not to evict anything
//     the step needs (an optimistic bound for the prefetch).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ess/cache/policies.h"
#include "ess/trace/format.h"

namespace ess::trace {

struct AnalyzeConfig {
  std::vector<std::string> policies{"lru", "lru_warmup", "fifo", "clock", "lfu", "s3fifo", "belady"};
  std::vector<double> ratios;         // pool sizes as Sparse Memory Ratios ...
  std::vector<std::int32_t> slots;    // ... or as slot counts (exclusive with ratios)
  bool warmup = true;                 // policies other than `lru` start with the warm-up windows
  std::int64_t steady_from = -1;      // -1: min(32, steps / 4)
  bool similarity = true;
  bool prefetch = true;
  bool recommend = true;              // recommended pool size per context (LRU + warm-up)
  double target_misses = 200;         // for the recommendation: steady-state mean misses
  std::int32_t recommend_granularity = 64;  // slots
  int threads = 0;                    // 0 = all cores
  PolicyOptions policy_options;
  // Called now and then while the policies replay (done, total request-layer replays), from
  // one thread at a time, when set.
  std::function<void(std::size_t done, std::size_t total)> progress;
};

struct GroupStats {               // one policy, one pool size, one group of requests
  std::int64_t context = 0;       // 0 = all contexts together
  std::int32_t slots = 0;         // -1 when the requests of the group have different slot counts
  int requests = 0;
  double mean_misses = 0;         // steady state, per request-layer-step
  double mean_misses_all = 0;     // all decode steps
  double hit_rate = 0;            // steady state, hits / working set
  // Steady state: the request-layer-steps whose working set exceeded the slots, served in
  // query groups (ess/cache/query_groups.h; every policy splits the same steps).
  double split_fraction = 0;
  std::vector<double> per_layer;  // steady-state mean misses per request-step
  std::vector<double> per_step;   // mean misses per request-layer at each decode step
  // Steady-state distribution per layer over request-steps (the miss profile).
  std::vector<double> p50, p90, p99, max;
};

struct PolicyResult {
  std::string name;
  GroupStats overall;
  std::vector<GroupStats> per_context;
};

struct PoolResult {
  std::optional<double> ratio;
  std::optional<std::int32_t> slots;
  std::vector<PolicyResult> policies;
};

struct PrefetchStats {
  std::vector<double> prefetched, useful, wasted, misses_left, misses;  // per layer, mean per request-step
  std::vector<double> wasted_max;                                        // per layer
  double mean_useful = 0, mean_wasted = 0, max_wasted = 0, mean_misses_left = 0, mean_misses = 0;
  // Index sharing seen in the trace: the layers that select exactly layer l-1's ids at every step
  // and prefill window of every request (a shared-index model's followers). Their prefetch is
  // exact: their misses, all of them, can be copied before they run (at their leader). Per
  // request-step, steady state: those misses, and the misses of every layer >= 1.
  std::vector<int> shared_layers;
  double shared_misses = 0, layer_misses = 0;
};

struct Recommendation {
  std::int64_t context = 0;
  std::int32_t slots = 0;  // -1: no pool size up to the context meets the target
  double ratio = 0;
  double mean_misses = 0;
};

// The MTP working set: the distinct ids one request-layer-step reads, i.e. the union of its T
// query tokens' top-k sets (at most T x K), over every decode step. A pool that holds it
// never splits a step.
struct WorkingSetStats {
  std::int64_t context = 0;  // 0 = all requests
  double mean = 0, p99 = 0;
  std::int32_t max = 0;
  std::vector<double> mean_per_layer, p99_per_layer;
  std::vector<std::int32_t> max_per_layer;
};

// Shared prompt prefixes (requests.<i>.prefix_group / prefix_tokens): the host pool's
// 64-token pages per layer for every request at its context, without sharing and with each
// group's common full pages (below its smallest prefix_tokens) held once.
struct PrefixSharing {
  int groups = 0;
  int requests = 0;                 // requests in a group
  std::int64_t pages_unshared = 0;  // all requests
  std::int64_t pages_shared = 0;
  double saved_fraction() const {
    return pages_unshared > 0 ? 1.0 - static_cast<double>(pages_shared) / static_cast<double>(pages_unshared) : 0.0;
  }
};

struct AnalysisResult {
  std::string path;
  TraceMeta meta;
  int requests = 0;
  std::int64_t steps = 0;  // decode steps, all requests
  std::int64_t steady_from = 0;
  std::vector<std::int64_t> contexts;  // distinct, ascending
  std::vector<double> intra, inter;    // per layer (inter[0] = NaN, reported as null)
  double intra_mean = 0, inter_mean = 0;
  std::vector<PoolResult> pools;
  std::vector<WorkingSetStats> working_sets;  // [0] all requests, then one per context (ascending)
  std::optional<PrefetchStats> prefetch;
  std::optional<PrefixSharing> prefix_sharing;  // when the trace has prefix groups
  std::vector<Recommendation> recommended;
  double target_misses = 0;
  std::int64_t lookups = 0;  // ids looked up in all replays
  double seconds = 0;
  double replay_seconds = 0;
};

AnalysisResult analyze(const TraceReader& trace, const AnalyzeConfig& config);

nlohmann::json to_json(const AnalysisResult& r);
// The miss profile the simulator reads: per context, per layer mean/p50/p90/p99 misses per
// request-step at the first pool size, for `policy` (default lru_warmup).
nlohmann::json miss_profile_json(const AnalysisResult& r, const std::string& policy = "lru_warmup");
std::string to_table(const AnalysisResult& r);
std::string to_csv(const AnalysisResult& r);

// Replays one request-layer through a LayerCache with an online policy (optionally after the
// warm-up windows): misses and working-set size per decode step. The unit of work of analyze().
struct LayerReplay {
  std::vector<std::int32_t> misses;  // [steps]
  std::vector<std::int32_t> working_set;  // [steps]
  std::int64_t lookups = 0;          // ids looked up, warm-up included
};
LayerReplay replay_layer(const RequestView& request, int layer, std::int32_t slots,
                         std::unique_ptr<ReplacementPolicy> policy, bool warmup);
// The same with Belady's MIN built from this request-layer's own future.
LayerReplay replay_layer_belady(const RequestView& request, int layer, std::int32_t slots, bool warmup);

}  // namespace ess::trace
