#include "ess/cache/swap_engine.h"

#include <algorithm>
#include <unordered_set>

#include "ess/core/digest.h"
#include "ess/core/error.h"

namespace ess {

SwapEngine::SwapEngine(const TotalPool& total, SparsePool& sparse) : SwapEngine(total, sparse, Config{}) {}

SwapEngine::SwapEngine(const TotalPool& total, SparsePool& sparse, Config config)
    : total_(total), sparse_(sparse), config_(std::move(config)) {
  ESS_CHECK(total.num_layers() == sparse.num_layers(),
            "swap engine: total pool has {} layers but sparse pool has {}", total.num_layers(),
            sparse.num_layers());
  ESS_CHECK(total.entry_bytes() == sparse.config().layout.bytes(),
            "swap engine: total pool entries are {} B but sparse pool entries are {} B",
            total.entry_bytes(), sparse.config().layout.bytes());
  ESS_CHECK(config_.policy != nullptr, "swap engine: no policy factory");
  ESS_CHECK(config_.warmup_windows > 0, "swap engine: warmup_windows = {} must be positive",
            config_.warmup_windows);
}

void SwapEngine::admit(RequestId id) {
  ESS_CHECK(!requests_.contains(id), "swap engine: request {} is already admitted", id);
  ESS_CHECK(total_.contains(id), "swap engine: request {} must be admitted to the total pool first", id);
  ESS_CHECK(!sparse_.contains(id), "swap engine: request {} already holds a sparse pool row", id);
  ESS_CHECK(sparse_.free_rows() > 0, "sparse pool full: all {} request rows are taken (request {})",
            sparse_.config().max_requests, id);
  Request r;
  r.layers.reserve(static_cast<std::size_t>(sparse_.num_layers()));
  for (int l = 0; l < sparse_.num_layers(); ++l) {
    auto policy = config_.policy(id, l, sparse_.slots());
    ESS_CHECK(policy != nullptr, "swap engine: policy factory returned no policy for request {} layer {}", id, l);
    r.layers.emplace_back(sparse_.slots(), std::move(policy));
    r.layers.back().reserve_tokens(total_.length(id));
  }
  auto [it, inserted] = requests_.emplace(id, std::move(r));
  (void)inserted;
  try {
    it->second.row = sparse_.admit(id);
  } catch (...) {
    requests_.erase(it);
    throw;
  }
}

void SwapEngine::release(RequestId id) {
  auto it = requests_.find(id);
  ESS_CHECK(it != requests_.end(), "swap engine: release of unknown request {}", id);
  sparse_.release(id);
  requests_.erase(it);
}

SwapEngine::Request& SwapEngine::find(RequestId id, const char* what) {
  auto it = requests_.find(id);
  ESS_CHECK(it != requests_.end(), "swap engine: {} of unknown request {}", what, id);
  return it->second;
}

const LayerCache& SwapEngine::layer_cache(RequestId id, int layer) const {
  auto it = requests_.find(id);
  ESS_CHECK(it != requests_.end(), "swap engine: unknown request {}", id);
  ESS_CHECK(layer >= 0 && layer < sparse_.num_layers(), "swap engine: layer {} out of [0, {})", layer,
            sparse_.num_layers());
  return it->second.layers[static_cast<std::size_t>(layer)];
}

std::int64_t SwapEngine::validate_ids(RequestId id, int layer, std::span<const std::int32_t> ids, int rows, int K,
                                      std::int64_t length, const char* what) {
  if (seen_.size() < static_cast<std::size_t>(length)) seen_.resize(static_cast<std::size_t>(length), 0);
  // Row t stamps its ids with first + t: a stamp equal to that is a repeat within the row, one
  // in [first, first + t) an id an earlier row of this call selected already.
  const auto n_rows = static_cast<std::uint32_t>(rows);
  if (seen_epoch_ > UINT32_MAX - n_rows) {  // would wrap: clear so that no stale stamp matches
    std::fill(seen_.begin(), seen_.end(), 0);
    seen_epoch_ = 0;
  }
  const std::uint32_t first = seen_epoch_ + 1;
  seen_epoch_ += n_rows;
  std::uint32_t* const seen = seen_.data();
  std::int64_t distinct = 0;
  for (int t = 0; t < rows; ++t) {
    const std::uint32_t stamp = first + static_cast<std::uint32_t>(t);
    const std::int32_t* row = ids.data() + static_cast<std::size_t>(t) * K;
    for (int k = 0; k < K; ++k) {
      const std::int32_t tok = row[k];
      if (tok == -1) continue;
      if (tok < -1 || tok >= length) [[unlikely]] {
        ESS_THROW("swap engine: {} of request {} layer {}: {} {} position {} selects token {}, "
                  "outside [0, {}) (-1 = padding)",
                  what, id, layer, what[0] == 'w' ? "window" : "query token", t, k, tok, length);
      }
      const std::uint32_t was = seen[tok];
      if (was == stamp) [[unlikely]] {
        ESS_THROW("swap engine: {} of request {} layer {}: {} {} selects token {} twice (position {})",
                  what, id, layer, what[0] == 'w' ? "window" : "query token", t, tok, k);
      }
      distinct += was < first;
      seen[tok] = stamp;
    }
  }
  return distinct;
}

SwapResult SwapEngine::step(const SwapStep& in) {
  SwapResult out;
  step(in, out);
  return out;
}

void SwapEngine::step(const SwapStep& in, SwapResult& out) {
  const int T = query_tokens();
  const int K = topk();
  const std::size_t B = in.requests.size();
  const std::size_t per_request = static_cast<std::size_t>(T) * K;
  // ---- validate everything before touching any state ----
  ESS_CHECK(in.layer >= 0 && in.layer < sparse_.num_layers(), "swap engine: step layer {} out of [0, {})",
            in.layer, sparse_.num_layers());
  ESS_CHECK(in.topk.size() == B * per_request,
            "swap engine: layer {}: top-k ids hold {} values, expected [B={}][T={}][K={}] = {}", in.layer,
            in.topk.size(), B, T, K, B * per_request);
  ESS_CHECK(in.lengths.size() == B, "swap engine: layer {}: {} lengths for a batch of {}", in.layer,
            in.lengths.size(), B);
  std::vector<Request*>& reqs = batch_;
  reqs.assign(B, nullptr);
  for (std::size_t b = 0; b < B; ++b) {
    const RequestId id = in.requests[b];
    auto it = requests_.find(id);
    ESS_CHECK(it != requests_.end(), "swap engine: layer {}: batch position {} names unknown request {}",
              in.layer, b, id);
    reqs[b] = &it->second;
    for (std::size_t p = 0; p < b; ++p) {
      ESS_CHECK(in.requests[p] != id, "swap engine: layer {}: request {} appears twice in the batch (positions {} and {})",
                in.layer, id, p, b);
    }
    const std::int64_t len = in.lengths[b];
    const std::int64_t host_len = total_.length(id);
    ESS_CHECK(len >= 0 && len <= host_len,
              "swap engine: layer {}: request {} length {} outside [0, {}] (its tokens in the total pool)",
              in.layer, id, len, host_len);
    const std::int64_t max_ctx = sparse_.config().max_context;
    ESS_CHECK(max_ctx == 0 || len <= max_ctx,
              "swap engine: layer {}: request {} length {} exceeds the sparse pool's max_context {}",
              in.layer, id, len, max_ctx);
    const auto ids = in.topk.subspan(b * per_request, per_request);
    const std::int64_t distinct = validate_ids(id, in.layer, ids, T, K, len, "step");
    if (T > 1) {
      ESS_CHECK(distinct <= sparse_.slots(),
                "swap engine: layer {}: request {} (batch position {}): its {} query tokens select {} distinct ids, "
                "more than its {} slots; serve the step in query groups (ess/cache/query_groups.h)",
                in.layer, id, b, T, distinct, sparse_.slots());
    }
  }
  for (std::size_t b = 0; b < B; ++b) {
    reqs[b]->layers[static_cast<std::size_t>(in.layer)].reserve_tokens(in.lengths[b]);  // unobservable
  }
  out.slot_ids.resize(B * per_request);
  out.per_request.assign(B, StepCounts{});
  out.total = StepCounts{};
  out.plan.layer = in.layer;
  out.plan.entries.clear();

  // ---- decide (cannot fail past this point) ----
  for (std::size_t b = 0; b < B; ++b) {
    Request& r = *reqs[b];
    fills_.clear();
    const StepCounts c = r.layers[static_cast<std::size_t>(in.layer)].access(
        in.topk.subspan(b * per_request, per_request), T, K,
        std::span<std::int32_t>(out.slot_ids).subspan(b * per_request, per_request), fills_);
    out.per_request[b] = c;
    out.total += c;
    // Every filled token was checked against the request's length, within its pages.
    const auto pages = total_.page_table(in.requests[b], in.layer);
    for (const Fill& f : fills_) {
      out.plan.entries.push_back(
          MissEntry{static_cast<std::int32_t>(b), r.row, f.token, f.slot, total_.entry_offset(pages, f.token)});
    }
  }
}

WarmupResult SwapEngine::warmup(RequestId id, int layer, std::span<const std::int32_t> windows,
                                std::int64_t length) {
  const int K = topk();
  Request& r = find(id, "warmup");
  ESS_CHECK(layer >= 0 && layer < sparse_.num_layers(), "swap engine: warmup of request {}: layer {} out of [0, {})",
            id, layer, sparse_.num_layers());
  ESS_CHECK(windows.size() % static_cast<std::size_t>(K) == 0,
            "swap engine: warmup of request {} layer {}: {} ids is not a whole number of top-{} windows", id,
            layer, windows.size(), K);
  const std::int64_t host_len = total_.length(id);
  ESS_CHECK(length >= 0 && length <= host_len,
            "swap engine: warmup of request {} layer {}: length {} outside [0, {}]", id, layer, length, host_len);
  const int W = static_cast<int>(windows.size() / static_cast<std::size_t>(K));
  const int use = std::min(W, config_.warmup_windows);
  const auto used = windows.subspan(static_cast<std::size_t>(W - use) * K);
  validate_ids(id, layer, used, use, K, length, "warmup");

  LayerCache& cache = r.layers[static_cast<std::size_t>(layer)];
  cache.reserve_tokens(length);
  const std::vector<std::int32_t> before(cache.token_of_slot().begin(), cache.token_of_slot().end());
  WarmupResult res;
  res.windows_used = use;
  res.plan.layer = layer;
  std::vector<std::int32_t> slot_ids(static_cast<std::size_t>(K));
  for (int w = 0; w < use; ++w) {
    fills_.clear();
    res.counts += cache.access(used.subspan(static_cast<std::size_t>(w) * K, static_cast<std::size_t>(K)), 1, K,
                               slot_ids, fills_);
  }
  const auto after = cache.token_of_slot();
  for (std::int32_t s = 0; s < cache.slots(); ++s) {
    if (after[s] >= 0 && after[s] != before[static_cast<std::size_t>(s)]) {
      res.plan.entries.push_back(MissEntry{0, r.row, after[s], s, total_.offset(id, layer, after[s])});
    }
  }
  return res;
}

void SwapEngine::check_invariants() const {
  std::unordered_set<std::int32_t> rows;
  for (const auto& [id, r] : requests_) {
    ESS_ASSERT(sparse_.contains(id) && sparse_.row(id) == r.row, "request {} row mismatch", id);
    ESS_ASSERT(rows.insert(r.row).second, "row {} used twice", r.row);
    for (const LayerCache& c : r.layers) c.check_invariants();
  }
}

std::uint64_t SwapEngine::digest() const {
  std::vector<RequestId> ids;
  ids.reserve(requests_.size());
  for (const auto& [id, r] : requests_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  Digest d;
  for (RequestId id : ids) {
    const Request& r = requests_.at(id);
    d.value(id);
    d.value(r.row);
    for (const LayerCache& c : r.layers) c.hash(d);
  }
  d.value(sparse_.digest());
  return d.get();
}

}  // namespace ess
