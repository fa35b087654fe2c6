// The unit of work of analyze(): one request-layer replayed through its own LayerCache
// (replay_layer, replay_layer_belady), its similarity counts and its prefetch replay.
#include "ess/trace/layer_replay.h"

#include <algorithm>
#include <memory>

#include "ess/cache/layer_cache.h"
#include "ess/cache/query_groups.h"
#include "ess/trace/analyzer.h"

namespace ess::trace {

namespace {

// The longest sequence length of the request (the id range of its replays).
std::int64_t max_length(const RequestView& r) {
  std::int64_t n = 0;
  for (auto l : r.lengths) n = std::max(n, l);
  return n;
}

struct StepOutcome {
  std::int64_t misses = 0;
  std::int64_t working_set = 0;  // the union of the step's query tokens' ids
};

// One decode step through `cache`: whole when its working set fits the slots, else in query
// groups (ess/cache/query_groups.h), each group one step of the policy, as the engine runs it.
StepOutcome step_through(LayerCache& cache, std::span<const std::int32_t> ids, int T, int K, QueryGrouper& grouper,
                         std::span<std::int32_t> slot_ids, std::vector<Fill>& fills) {
  const GroupStarts starts = static_cast<std::int64_t>(T) * K > cache.slots() ? grouper.split(ids, T, K, cache.slots()) : 0;
  if (starts == 0) {
    const StepCounts c = cache.access(ids, T, K, slot_ids, fills);
    fills.clear();
    return {c.misses, c.working_set()};
  }
  StepOutcome out;
  const std::vector<int> b = group_bounds(starts, T);
  for (std::size_t g = 0; g + 1 < b.size(); ++g) {
    const auto first = static_cast<std::size_t>(b[g]) * K, n = static_cast<std::size_t>(b[g + 1] - b[g]) * K;
    out.misses += cache.access(ids.subspan(first, n), b[g + 1] - b[g], K, slot_ids.first(n), fills).misses;
    fills.clear();
  }
  out.working_set = grouper.union_size(ids, K, 0, T);
  return out;
}

// Replays request-layer `layer` through `cache`: the warm-up windows first when `warmup`, then
// every decode step; misses and working set per step.
LayerReplay run(const RequestView& r, int layer, LayerCache& cache, bool warmup) {
  const auto K = static_cast<std::size_t>(r.topk);
  const auto T = static_cast<std::size_t>(r.mtp);
  cache.reserve_tokens(max_length(r));
  LayerReplay out;
  out.misses.resize(static_cast<std::size_t>(r.steps));
  out.working_set.resize(static_cast<std::size_t>(r.steps));
  std::vector<std::int32_t> slot_ids(T * K);
  std::vector<Fill> fills;
  fills.reserve(T * K);
  if (warmup && r.prefill_windows > 0) {
    const auto pf = r.prefill(layer);
    for (int w = 0; w < r.prefill_windows; ++w) {
      cache.access(pf.subspan(static_cast<std::size_t>(w) * K, K), 1, r.topk, std::span(slot_ids).first(K), fills);
      fills.clear();
    }
    out.lookups += static_cast<std::int64_t>(r.prefill_windows) * r.topk;
  }
  QueryGrouper grouper;
  for (std::int64_t s = 0; s < r.steps; ++s) {
    const StepOutcome c = step_through(cache, r.step(s, layer), r.mtp, r.topk, grouper, slot_ids, fills);
    out.misses[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(c.misses);
    out.working_set[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(c.working_set);
  }
  out.lookups += r.steps * r.mtp * r.topk;
  return out;
}

// Distinct ids of each policy step (warm-up windows first when `warmup`; a decode step whose
// working set exceeds `slots` is one policy step per query group), in canonical order.
std::vector<std::vector<std::int32_t>> future_of(const RequestView& r, int layer, bool warmup, std::int32_t slots) {
  std::vector<std::vector<std::int32_t>> f;
  std::vector<std::int32_t> stamp(static_cast<std::size_t>(max_length(r)), -1);
  std::int32_t epoch = 0;
  auto add = [&](std::span<const std::int32_t> ids) {
    auto& v = f.emplace_back();
    v.reserve(ids.size());
    for (const std::int32_t tok : ids) {
      if (tok < 0 || stamp[static_cast<std::size_t>(tok)] == epoch) continue;
      stamp[static_cast<std::size_t>(tok)] = epoch;
      v.push_back(tok);
    }
    ++epoch;
  };
  const auto K = static_cast<std::size_t>(r.topk);
  if (warmup && r.prefill_windows > 0) {
    const auto pf = r.prefill(layer);
    for (int w = 0; w < r.prefill_windows; ++w) add(pf.subspan(static_cast<std::size_t>(w) * K, K));
  }
  QueryGrouper grouper;
  for (std::int64_t s = 0; s < r.steps; ++s) {
    const auto ids = r.step(s, layer);
    const GroupStarts starts =
        static_cast<std::int64_t>(r.mtp) * r.topk > slots ? grouper.split(ids, r.mtp, r.topk, slots) : 0;
    const std::vector<int> b = group_bounds(starts, r.mtp);
    for (std::size_t g = 0; g + 1 < b.size(); ++g) {
      add(ids.subspan(static_cast<std::size_t>(b[g]) * K, static_cast<std::size_t>(b[g + 1] - b[g]) * K));
    }
  }
  return f;
}

}  // namespace

namespace detail {

Similarity similarity_of(const RequestView& r, int layer) {
  Similarity out;
  const auto n = static_cast<std::size_t>(max_length(r));
  std::vector<std::int32_t> last(n, -1);  // step that last selected the token in this layer
  std::vector<std::int32_t> prev(n, -1);  // step at which layer-1 selected it
  for (std::int64_t s = 0; s < r.steps; ++s) {
    const auto step = static_cast<std::int32_t>(s);
    if (layer > 0) {
      for (const std::int32_t tok : r.step(s, layer - 1)) {
        if (tok >= 0) prev[static_cast<std::size_t>(tok)] = step;
      }
    }
    for (const std::int32_t tok : r.step(s, layer)) {
      if (tok < 0) continue;
      auto& l = last[static_cast<std::size_t>(tok)];
      if (l == step) continue;  // already counted (another query token)
      if (s > 0) {
        ++out.intra_total;
        if (l == step - 1) ++out.intra_overlap;
      }
      if (layer > 0) {
        ++out.inter_total;
        if (prev[static_cast<std::size_t>(tok)] == step) ++out.inter_overlap;
      }
      l = step;
    }
  }
  return out;
}

// LRU + warm-up replay of layer `layer` with the first-order inter-layer prefetch counted.
PrefetchLayer prefetch_of(const RequestView& r, int layer, std::int32_t slots, bool warmup) {
  LayerCache cache(slots, std::make_unique<LruPolicy>(slots));
  const auto K = static_cast<std::size_t>(r.topk);
  const auto T = static_cast<std::size_t>(r.mtp);
  const auto n = static_cast<std::size_t>(max_length(r));
  cache.reserve_tokens(static_cast<std::int64_t>(n));
  std::vector<std::int32_t> slot_ids(T * K);
  std::vector<Fill> fills;
  if (warmup && r.prefill_windows > 0) {
    const auto pf = r.prefill(layer);
    for (int w = 0; w < r.prefill_windows; ++w) {
      cache.access(pf.subspan(static_cast<std::size_t>(w) * K, K), 1, r.topk, std::span(slot_ids).first(K), fills);
      fills.clear();
    }
  }
  PrefetchLayer out;
  out.same_selection = std::ranges::equal(r.prefill(layer), r.prefill(layer - 1));
  // A query that sees at most K tokens selects them all, in every layer: only a step whose queries
  // see more tells a shared selection from an independent one.
  bool chose = false;
  const auto S = static_cast<std::size_t>(r.steps);
  out.prefetched.resize(S);
  out.useful.resize(S);
  out.wasted.resize(S);
  out.misses.resize(S);
  std::vector<std::int32_t> mine(n, -1), theirs(n, -1);
  QueryGrouper grouper;
  for (std::int64_t s = 0; s < r.steps; ++s) {
    const auto step = static_cast<std::int32_t>(s);
    for (const std::int32_t tok : r.step(s, layer)) {
      if (tok >= 0) mine[static_cast<std::size_t>(tok)] = step;
    }
    std::int32_t pre = 0, use = 0;
    for (const std::int32_t tok : r.step(s, layer - 1)) {
      if (tok < 0 || theirs[static_cast<std::size_t>(tok)] == step) continue;
      theirs[static_cast<std::size_t>(tok)] = step;
      if (cache.slot_of(tok) >= 0) continue;  // already resident: nothing to fetch
      ++pre;
      if (mine[static_cast<std::size_t>(tok)] == step) ++use;
    }
    out.same_selection = out.same_selection && std::ranges::equal(r.step(s, layer), r.step(s, layer - 1));
    // The last query token sees lengths[s] tokens, ids_of them ids: a choice when more than the top-k.
    chose = chose || r.ids_of(r.lengths[static_cast<std::size_t>(s)]) > r.topk;
    const StepOutcome c = step_through(cache, r.step(s, layer), r.mtp, r.topk, grouper, slot_ids, fills);
    out.prefetched[static_cast<std::size_t>(s)] = pre;
    out.useful[static_cast<std::size_t>(s)] = use;
    out.wasted[static_cast<std::size_t>(s)] = pre - use;
    out.misses[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(c.misses);
  }
  out.same_selection = out.same_selection && chose;
  return out;
}

}  // namespace detail


LayerReplay replay_layer(const RequestView& request, int layer, std::int32_t slots,
                         std::unique_ptr<ReplacementPolicy> policy, bool warmup) {
  LayerCache cache(slots, std::move(policy));
  return run(request, layer, cache, warmup);
}

LayerReplay replay_layer_belady(const RequestView& request, int layer, std::int32_t slots, bool warmup) {
  LayerCache cache(slots, std::make_unique<BeladyPolicy>(slots, future_of(request, layer, warmup, slots)));
  return run(request, layer, cache, warmup);
}


}  // namespace ess::trace
