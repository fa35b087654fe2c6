// The swap engine: for one decode step of one layer and a batch of requests, decides which
// selected latent entries are hits and which are misses, where each one lives, and which
// host entries must be copied into which slots. See docs/architecture.md, "Swap engine".
//
// Every public call validates all of its input before changing anything: when it throws
// ess::Error, the engine and both pools are exactly as before the call.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "ess/cache/layer_cache.h"
#include "ess/cache/policy.h"
#include "ess/cache/query_groups.h"
#include "ess/cache/sparse_pool.h"
#include "ess/cache/total_pool.h"
#include "ess/cache/types.h"

namespace ess {

struct SwapStep {
  int layer = 0;
  std::span<const RequestId> requests;  // B distinct admitted requests
  std::span<const std::int32_t> topk;   // [B][T][K] selected token ids, -1 = padding
  std::span<const std::int64_t> lengths;  // [B] current length of each request
};

struct SwapResult {
  std::vector<std::int32_t> slot_ids;  // [B][T][K]: the slot attention reads, -1 for padding
  MissPlan plan;                       // the copies that make every slot id valid
  std::vector<StepCounts> per_request;  // [B]
  StepCounts total;
};

struct WarmupResult {
  MissPlan plan;            // one fill per slot whose content changed, in slot order
  StepCounts counts;        // summed over the windows
  int windows_used = 0;
};

class SwapEngine {
 public:
  struct Config {
    PolicyFactory policy = lru_factory();
    int warmup_windows = 32;  // LRU-Warmup uses the last this-many prefill query positions
  };

  SwapEngine(const TotalPool& total, SparsePool& sparse);
  SwapEngine(const TotalPool& total, SparsePool& sparse, Config config);

  // Admits a request already admitted to the Total Memory Pool: takes a Sparse Memory Pool
  // row and creates an empty LRU per layer.
  void admit(RequestId id);
  void release(RequestId id);
  bool contains(RequestId id) const { return requests_.contains(id); }

  // One step of one layer. The returned slot ids are valid once result.plan has been copied
  // (SlotStorage::fill). Each request's step must select at most `slots` distinct ids (its
  // working set); a larger step is refused, to be served in query groups (query_groups.h).
  SwapResult step(const SwapStep& in);
  // The same, reusing `out`'s buffers (no allocation in steady state).
  void step(const SwapStep& in, SwapResult& out);

  // LRU-Warmup: replays the top-k of the last `warmup_windows` prefill query positions
  // (`windows` is [W][K], oldest first, -1 = padding) as one step each, in order, against a
  // request of `length` tokens. Returns the fills that load the resulting residency.
  WarmupResult warmup(RequestId id, int layer, std::span<const std::int32_t> windows,
                      std::int64_t length);

  const LayerCache& layer_cache(RequestId id, int layer) const;
  const TotalPool& total() const { return total_; }
  SparsePool& sparse() { return sparse_; }
  const SparsePool& sparse() const { return sparse_; }
  int query_tokens() const { return sparse_.config().query_tokens; }
  int topk() const { return sparse_.config().topk; }

  void check_invariants() const;
  // Digest of the residency and policy state of every request-layer and of the row map.
  std::uint64_t digest() const;

 private:
  struct Request {
    std::int32_t row = 0;
    std::vector<LayerCache> layers;
  };
  // Throws unless `ids` ([rows][K]) are all -1 or in [0, length) and no row repeats an id;
  // returns the distinct ids of all rows together (the working set when rows are query tokens).
  std::int64_t validate_ids(RequestId id, int layer, std::span<const std::int32_t> ids, int rows, int K,
                    std::int64_t length, const char* what);
  Request& find(RequestId id, const char* what);

  const TotalPool& total_;
  SparsePool& sparse_;
  Config config_;
  std::unordered_map<RequestId, Request> requests_;
  std::vector<Fill> fills_;            // scratch
  std::vector<Request*> batch_;        // scratch
  std::vector<std::uint32_t> seen_;    // scratch: token -> stamp of the row that last selected it
  std::uint32_t seen_epoch_ = 0;       // the last stamp handed out
};

}  // namespace ess
