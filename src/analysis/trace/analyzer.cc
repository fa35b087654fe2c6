// analyze(): the stages that run the per request-layer kernels (layer_replay.cc) and reduce them
// (docs/trace-analysis.md). The reports (to_json, to_table, ...) are in report.cc.
#include "ess/trace/analyzer.h"

#include <tbb/blocked_range.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <map>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>

#include "ess/core/error.h"
#include "ess/trace/layer_replay.h"

namespace ess::trace {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

using detail::PrefetchLayer;
using detail::Similarity;

// Nearest-rank percentile q of v (reorders v).
double percentile(std::vector<std::int32_t>& v, double q) {
  if (v.empty()) return 0;
  // Nearest rank.
  const auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size())));
  const std::size_t i = rank == 0 ? 0 : std::min(rank - 1, v.size() - 1);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
  return v[i];
}

// What the stages need to know about the requests, found once before any replay.
struct RequestSummary {
  std::vector<std::int64_t> max_ws;    // per request: its largest step working set
  std::vector<std::int64_t> contexts;  // distinct, ascending
  std::int64_t steps = 0;              // decode steps, all requests
  std::int64_t max_steps = 0;          // of the longest request
  std::int64_t steady_from = 0;
};

// One pool size: as given (ratio or slots) and as a slot count per request.
struct Pool {
  std::optional<double> ratio;
  std::optional<std::int32_t> slots;
  std::vector<std::int32_t> per_request;
};

// The replays of every (pool, policy, request, layer), stored in that index order.
struct Replays {
  std::vector<LayerReplay> runs;
  std::size_t policies = 0, per_policy = 0, layers = 0;  // per_policy = requests x layers
  double seconds = 0;

  const LayerReplay& at(std::size_t pool, std::size_t q, std::size_t i, std::size_t l) const {
    return runs[(pool * policies + q) * per_policy + i * layers + l];
  }
};

// Caps oneTBB's parallelism at `threads` for the lifetime of the result (0: no cap).
std::unique_ptr<tbb::global_control> limit_threads(int threads) {
  if (threads <= 0) return nullptr;
  return std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism,
                                               static_cast<std::size_t>(threads));
}

// Rejects an empty trace and inconsistent options (pool sizes, policy names).
void check_config(const TraceReader& trace, const AnalyzeConfig& cfg) {
  ESS_CHECK(trace.requests() > 0, "{}: the trace holds no requests", trace.path());
  ESS_CHECK(cfg.ratios.empty() || cfg.slots.empty(), "trace analyze: give pool sizes as ratios or as slots, not both");
  for (double x : cfg.ratios) ESS_CHECK(x > 0 && x <= 1, "trace analyze: ratio {} is outside (0, 1]", x);
  for (auto x : cfg.slots) ESS_CHECK(x > 0, "trace analyze: slots {} must be positive", x);
  std::int64_t longest = 0;  // ids of the longest request at its last step
  for (std::size_t i = 0; i < trace.requests(); ++i) {
    const RequestView r = trace.request(i);
    longest = std::max({longest, r.ids_of(r.context), r.lengths.empty() ? 0 : r.ids_of(r.lengths.back())});
  }
  const int unit = trace.meta().unit_tokens;
  for (auto x : cfg.slots) {
    // More slots than any request has ids only cost memory: every pool holds all its slots.
    ESS_CHECK(x <= longest, "trace analyze: slots {} exceed the longest request ({} {}); --ratio 1 holds everything",
              x, longest, unit > 1 ? fmt::format("ids of {} tokens", unit) : std::string("tokens"));
  }
  ESS_CHECK(std::isfinite(cfg.target_misses) && cfg.target_misses >= 0,
            "trace analyze: --target {} must be a finite number >= 0", cfg.target_misses);
  ESS_CHECK(cfg.recommend_granularity >= 1, "trace analyze: --granularity {} must be >= 1", cfg.recommend_granularity);
  ESS_CHECK(cfg.steady_from >= -1, "trace analyze: --steady-from {} must be >= 0", cfg.steady_from);
  ESS_CHECK(cfg.threads >= 0 && cfg.threads <= 1024, "trace analyze: --threads {} must be in [0, 1024] (0 = all cores)",
            cfg.threads);
  static const std::vector<std::string> known{"lru", "lru_warmup", "fifo", "clock", "lfu", "s3fifo", "belady"};
  for (std::size_t i = 0; i < cfg.policies.size(); ++i) {
    const std::string& p = cfg.policies[i];
    ESS_CHECK(std::find(cfg.policies.begin(), cfg.policies.begin() + static_cast<std::ptrdiff_t>(i), p) ==
                  cfg.policies.begin() + static_cast<std::ptrdiff_t>(i),
              "trace analyze: policy '{}' is named twice", p);
    ESS_CHECK(std::find(known.begin(), known.end(), p) != known.end(),
              "trace analyze: unknown policy '{}' (known: lru, lru_warmup, fifo, clock, lfu, s3fifo, belady)", p);
  }
}

// Validates every id (in parallel) and collects each request's largest working set, the step
// counts, the distinct contexts and the first steady-state step.
RequestSummary summarize_requests(const TraceReader& trace, const AnalyzeConfig& cfg) {
  const auto R = trace.requests();
  RequestSummary out;
  out.max_ws.resize(R);
  tbb::parallel_for(std::size_t{0}, R, [&](std::size_t i) { out.max_ws[i] = trace.validate_request(i); });

  std::int64_t min_steps = std::numeric_limits<std::int64_t>::max();
  for (std::size_t i = 0; i < R; ++i) {
    const auto& r = trace.request(i);
    out.steps += r.steps;
    min_steps = std::min(min_steps, r.steps);
    out.max_steps = std::max(out.max_steps, r.steps);
    if (std::find(out.contexts.begin(), out.contexts.end(), r.context) == out.contexts.end()) {
      out.contexts.push_back(r.context);
    }
  }
  std::sort(out.contexts.begin(), out.contexts.end());
  out.steady_from = cfg.steady_from >= 0 ? cfg.steady_from : std::min<std::int64_t>(32, min_steps / 4);
  ESS_CHECK(out.steady_from < out.max_steps,
            "trace analyze: steady state from step {} but the longest request has {} steps", out.steady_from,
            out.max_steps);
  return out;
}

// Slots of a pool of `ratio` x the request's context in ids (at least one).
std::int32_t slots_for(const RequestView& r, double ratio) {
  const double x = std::ceil(ratio * static_cast<double>(r.ids_of(r.context)) - 1e-9);
  return static_cast<std::int32_t>(std::max(1.0, x));
}

// The pool sizes to replay (the ratios, default 0.2, or the slot counts), each checked to hold
// one query token's top-k of every request (a step whose working set exceeds the pool is
// replayed in query groups).
std::vector<Pool> make_pools(const TraceReader& trace, const AnalyzeConfig& cfg, const std::vector<std::int64_t>& max_ws) {
  const auto R = trace.requests();
  std::vector<Pool> pools;
  if (cfg.slots.empty()) {
    const std::vector<double> ratios = cfg.ratios.empty() ? std::vector<double>{0.2} : cfg.ratios;
    for (double x : ratios) {
      Pool p;
      p.ratio = x;
      for (std::size_t i = 0; i < R; ++i) p.per_request.push_back(slots_for(trace.request(i), x));
      pools.push_back(std::move(p));
    }
  } else {
    for (auto x : cfg.slots) {
      Pool p;
      p.slots = x;
      p.per_request.assign(R, x);
      pools.push_back(std::move(p));
    }
  }
  const std::int64_t K = trace.meta().topk;
  for (const auto& p : pools) {
    for (std::size_t i = 0; i < R; ++i) {
      // A query row holds at most K ids and at most the step's distinct ids.
      const std::int64_t floor = std::min(K, max_ws[i]);
      ESS_CHECK(p.per_request[i] >= floor,
                "{}: request {} (context {}): a pool of {} slots{} cannot hold one query token's top-k ({} distinct "
                "ids); use at least {} slots",
                trace.path(), i, trace.request(i).context, p.per_request[i],
                p.ratio ? fmt::format(" (ratio {})", *p.ratio) : std::string(), floor, floor);
    }
  }
  return pools;
}

// The policies in replay order: Belady first (its replays are the longest), the others as given.
std::vector<std::string> replay_order(const std::vector<std::string>& policies) {
  std::vector<std::string> order = policies;
  std::stable_sort(order.begin(), order.end(),
                   [](const std::string& a, const std::string& b) { return (a == "belady") > (b == "belady"); });
  return order;
}

// Replays every (pool, policy, request, layer) in parallel, one task each; times the replays.
Replays replay_all(const TraceReader& trace, const AnalyzeConfig& cfg, const std::vector<Pool>& pools,
                   const std::vector<std::string>& policies) {
  const auto L = static_cast<std::size_t>(trace.meta().layers);
  Replays rp;
  rp.policies = policies.size();
  rp.per_policy = trace.requests() * L;
  rp.layers = L;
  const std::size_t ntasks = pools.size() * policies.size() * rp.per_policy;
  rp.runs.resize(ntasks);
  std::vector<PolicyFactory> factories;
  for (const auto& name : policies) {
    factories.push_back(name == "belady" ? PolicyFactory{}
                                         : make_policy_factory(name == "lru_warmup" ? "lru" : name, cfg.policy_options));
  }
  const auto t_replay = Clock::now();
  std::atomic<std::size_t> done{0};
  std::mutex progress_mutex;
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, ntasks, 1), [&](const tbb::blocked_range<std::size_t>& range) {
    for (std::size_t task = range.begin(); task != range.end(); ++task) {
      const std::size_t finished = done.fetch_add(1) + 1;
      if (cfg.progress) {
        const std::unique_lock lock(progress_mutex, std::try_to_lock);
        if (lock.owns_lock() && finished < ntasks) cfg.progress(finished, ntasks);
      }
      const std::size_t pool = task / (policies.size() * rp.per_policy);
      const std::size_t q = task / rp.per_policy % policies.size();
      const std::size_t i = task % rp.per_policy / L;
      const int layer = static_cast<int>(task % L);
      const auto& r = trace.request(i);
      const std::int32_t slots = pools[pool].per_request[i];
      const bool warm = policies[q] == "lru_warmup" || (policies[q] != "lru" && cfg.warmup);
      if (policies[q] == "belady") {
        rp.runs[task] = replay_layer_belady(r, layer, slots, warm);
      } else {
        rp.runs[task] = replay_layer(r, layer, slots, factories[q](static_cast<RequestId>(i), layer, slots), warm);
      }
    }
  });
  if (cfg.progress) cfg.progress(ntasks, ntasks);
  rp.seconds = seconds_since(t_replay);
  return rp;
}

// Turns the per-layer sums of `g` and the steady-state samples into per-layer means and the
// p50/p90/p99/max distribution (the miss profile).
void finish_layers(GroupStats& g, std::vector<std::vector<std::int32_t>>& samples) {
  for (std::size_t k = 0; k < samples.size(); ++k) {
    auto& v = samples[k];
    g.per_layer[k] = v.empty() ? 0 : g.per_layer[k] / static_cast<double>(v.size());
    g.p50[k] = percentile(v, 0.50);
    g.p90[k] = percentile(v, 0.90);
    g.p99[k] = percentile(v, 0.99);
    g.max[k] = v.empty() ? 0 : *std::max_element(v.begin(), v.end());
  }
}

// Miss statistics of policy q at pool size `pool` over the requests of `context` (0: all).
GroupStats group_stats(const TraceReader& trace, const Replays& rp, const std::vector<Pool>& pools,
                       const RequestSummary& reqs, std::size_t pool, std::size_t q, std::int64_t context) {
  const auto L = static_cast<std::size_t>(trace.meta().layers);
  GroupStats g;
  g.context = context;
  g.per_layer.assign(L, 0);
  g.p50 = g.p90 = g.p99 = g.max = g.per_layer;
  g.per_step.assign(static_cast<std::size_t>(reqs.max_steps), 0);
  std::vector<std::int64_t> step_count(static_cast<std::size_t>(reqs.max_steps), 0);
  double sum = 0, sum_all = 0, ws_sum = 0;
  std::int64_t n = 0, n_all = 0, split = 0;
  std::int32_t slots = 0;
  std::vector<std::vector<std::int32_t>> samples(L);
  for (std::size_t i = 0; i < trace.requests(); ++i) {
    const auto& r = trace.request(i);
    if (context != 0 && r.context != context) continue;
    ++g.requests;
    const auto s_i = pools[pool].per_request[i];
    slots = g.requests == 1 ? s_i : (slots == s_i ? slots : -1);
    for (std::size_t l = 0; l < L; ++l) {
      const auto& x = rp.at(pool, q, i, l);
      for (std::int64_t s = 0; s < r.steps; ++s) {
        const auto m = x.misses[static_cast<std::size_t>(s)];
        g.per_step[static_cast<std::size_t>(s)] += m;
        ++step_count[static_cast<std::size_t>(s)];
        sum_all += m;
        ++n_all;
        if (s >= reqs.steady_from) {
          sum += m;
          ws_sum += x.working_set[static_cast<std::size_t>(s)];
          split += x.working_set[static_cast<std::size_t>(s)] > s_i ? 1 : 0;
          ++n;
          g.per_layer[l] += m;
          samples[l].push_back(m);
        }
      }
    }
  }
  g.slots = slots;
  for (std::size_t s = 0; s < g.per_step.size(); ++s) {
    g.per_step[s] = step_count[s] > 0 ? g.per_step[s] / static_cast<double>(step_count[s]) : 0;
  }
  finish_layers(g, samples);
  g.mean_misses = n > 0 ? sum / static_cast<double>(n) : 0;
  g.mean_misses_all = n_all > 0 ? sum_all / static_cast<double>(n_all) : 0;
  g.hit_rate = ws_sum > 0 ? 1.0 - sum / ws_sum : 0;
  g.split_fraction = n > 0 ? static_cast<double>(split) / static_cast<double>(n) : 0;
  return g;
}

// Per pool size, per policy in the order the user asked for: overall and per-context statistics.
std::vector<PoolResult> aggregate(const TraceReader& trace, const AnalyzeConfig& cfg, const std::vector<Pool>& pools,
                                  const std::vector<std::string>& order, const Replays& rp, const RequestSummary& reqs) {
  std::vector<PoolResult> out;
  for (std::size_t pool = 0; pool < pools.size(); ++pool) {
    PoolResult pr;
    pr.ratio = pools[pool].ratio;
    pr.slots = pools[pool].slots;
    for (const auto& name : cfg.policies) {
      const auto q = static_cast<std::size_t>(std::find(order.begin(), order.end(), name) - order.begin());
      PolicyResult p;
      p.name = name;
      p.overall = group_stats(trace, rp, pools, reqs, pool, q, 0);
      for (auto c : reqs.contexts) p.per_context.push_back(group_stats(trace, rp, pools, reqs, pool, q, c));
      pr.policies.push_back(std::move(p));
    }
    out.push_back(std::move(pr));
  }
  return out;
}

// Host pages of 64 entries with and without the trace's prefix groups (nullopt without any group):
// an entry per id of a trace of units (a C4 entry of 4 tokens), else per token.
std::optional<PrefixSharing> prefix_sharing_of(const TraceReader& trace) {
  PrefixSharing out;
  std::map<std::string, std::int64_t> common;  // group -> its smallest prefix, in whole ids
  for (std::size_t i = 0; i < trace.requests(); ++i) {
    const RequestView& r = trace.request(i);
    const std::int64_t pages = (r.ids_of(r.context) + 63) / 64;
    out.pages_unshared += pages;
    out.pages_shared += pages;
    if (r.prefix_group.empty()) continue;
    ++out.requests;
    const std::int64_t shared = r.prefix_tokens / r.unit_tokens;  // the ids whose tokens all lie in the prefix
    auto [it, fresh] = common.emplace(r.prefix_group, shared);
    if (!fresh) it->second = std::min(it->second, shared);
  }
  if (common.empty()) return std::nullopt;
  std::map<std::string, int> members;
  for (std::size_t i = 0; i < trace.requests(); ++i) {
    if (!trace.request(i).prefix_group.empty()) ++members[trace.request(i).prefix_group];
  }
  for (const auto& [group, ids] : common) out.pages_shared -= (members[group] - 1) * (ids / 64);
  out.groups = static_cast<int>(common.size());
  return out;
}

// The MTP working set per request-layer-step, from the first replay's per-step counts (every
// policy sees the same ids): all requests, then each context.
std::vector<WorkingSetStats> working_set_stats(const TraceReader& trace, const Replays& rp,
                                               const std::vector<std::int64_t>& contexts) {
  const std::size_t L = rp.layers;
  std::vector<std::int64_t> groups = {0};
  if (contexts.size() > 1) groups.insert(groups.end(), contexts.begin(), contexts.end());
  std::vector<WorkingSetStats> out;
  for (const std::int64_t context : groups) {
    WorkingSetStats w;
    w.context = context;
    std::vector<std::int32_t> all;
    for (std::size_t l = 0; l < L; ++l) {
      std::vector<std::int32_t> v;
      for (std::size_t i = 0; i < trace.requests(); ++i) {
        if (context != 0 && trace.request(i).context != context) continue;
        const auto& ws = rp.runs[i * L + l].working_set;
        v.insert(v.end(), ws.begin(), ws.end());
      }
      const double sum = std::accumulate(v.begin(), v.end(), 0.0);
      w.mean_per_layer.push_back(v.empty() ? 0.0 : sum / static_cast<double>(v.size()));
      w.max_per_layer.push_back(v.empty() ? 0 : *std::max_element(v.begin(), v.end()));
      all.insert(all.end(), v.begin(), v.end());
      w.p99_per_layer.push_back(v.empty() ? 0.0 : percentile(v, 0.99));
    }
    if (!all.empty()) {
      w.mean = std::accumulate(all.begin(), all.end(), 0.0) / static_cast<double>(all.size());
      w.max = *std::max_element(all.begin(), all.end());
      w.p99 = percentile(all, 0.99);
    }
    out.push_back(std::move(w));
  }
  return out;
}

// The policy replays and their statistics (res.pools, lookups, replay time). The replays are
// freed on return, before the later stages run.
void replay_policies(const TraceReader& trace, const AnalyzeConfig& cfg, const std::vector<Pool>& pools,
                     const RequestSummary& reqs, AnalysisResult& res) {
  const std::vector<std::string> order = replay_order(cfg.policies);
  const Replays rp = replay_all(trace, cfg, pools, order);
  res.replay_seconds = rp.seconds;
  for (const auto& x : rp.runs) res.lookups += x.lookups;
  res.pools = aggregate(trace, cfg, pools, order, rp, reqs);
  res.prefix_sharing = prefix_sharing_of(trace);
  res.working_sets = working_set_stats(trace, rp, reqs.contexts);
}

double ratio_of(std::int64_t overlap, std::int64_t total) {
  return total > 0 ? static_cast<double>(overlap) / static_cast<double>(total) : 0;
}

// Intra- and inter-layer similarity per layer and overall (res.intra, res.inter and their means).
void measure_similarity(const TraceReader& trace, AnalysisResult& res) {
  const auto R = trace.requests();
  const auto L = static_cast<std::size_t>(trace.meta().layers);
  std::vector<Similarity> sim(R * L);
  tbb::parallel_for(std::size_t{0}, R * L, [&](std::size_t task) {
    sim[task] = detail::similarity_of(trace.request(task / L), static_cast<int>(task % L));
  });
  res.intra.assign(L, 0);
  res.inter.assign(L, std::numeric_limits<double>::quiet_NaN());
  Similarity all;
  for (std::size_t l = 0; l < L; ++l) {
    Similarity s;
    for (std::size_t i = 0; i < R; ++i) s += sim[i * L + l];
    res.intra[l] = ratio_of(s.intra_overlap, s.intra_total);
    if (l > 0) res.inter[l] = ratio_of(s.inter_overlap, s.inter_total);
    all += s;
  }
  res.intra_mean = ratio_of(all.intra_overlap, all.intra_total);
  res.inter_mean = ratio_of(all.inter_overlap, all.inter_total);
}

// The prefetch replays of every request-layer l >= 1 at the first pool size, in parallel.
std::vector<PrefetchLayer> prefetch_replays(const TraceReader& trace, const AnalyzeConfig& cfg, const Pool& pool) {
  const auto L = static_cast<std::size_t>(trace.meta().layers);
  const std::size_t ntasks = trace.requests() * L;
  std::vector<PrefetchLayer> pf(ntasks);
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, ntasks, 1), [&](const tbb::blocked_range<std::size_t>& range) {
    for (std::size_t task = range.begin(); task != range.end(); ++task) {
      const std::size_t i = task / L;
      const int layer = static_cast<int>(task % L);
      if (layer == 0) continue;
      pf[task] = detail::prefetch_of(trace.request(i), layer, pool.per_request[i], cfg.warmup);
    }
  });
  return pf;
}

// Steady-state per-layer means, the worst waste and the overall means of the prefetch replays.
PrefetchStats summarize_prefetch(const std::vector<PrefetchLayer>& pf, std::size_t R, std::size_t Lz,
                                 std::int64_t steady_from) {
  PrefetchStats ps;
  ps.prefetched.assign(Lz, 0);
  ps.useful = ps.wasted = ps.misses_left = ps.misses = ps.wasted_max = ps.prefetched;
  double n_all = 0;
  for (std::size_t l = 1; l < Lz; ++l) {
    bool shared = R > 0;
    for (std::size_t i = 0; i < R; ++i) shared = shared && pf[i * Lz + l].same_selection;
    if (shared) ps.shared_layers.push_back(static_cast<int>(l));
    double n = 0;
    for (std::size_t i = 0; i < R; ++i) {
      const auto& x = pf[i * Lz + l];
      for (std::size_t s = static_cast<std::size_t>(steady_from); s < x.useful.size(); ++s) {
        ps.prefetched[l] += x.prefetched[s];
        ps.useful[l] += x.useful[s];
        ps.wasted[l] += x.wasted[s];
        ps.misses[l] += x.misses[s];
        ps.misses_left[l] += x.misses[s] - x.useful[s];
        ps.wasted_max[l] = std::max<double>(ps.wasted_max[l], x.wasted[s]);
        n += 1;
      }
    }
    ps.mean_useful += ps.useful[l];
    ps.mean_wasted += ps.wasted[l];
    ps.mean_misses += ps.misses[l];
    ps.mean_misses_left += ps.misses_left[l];
    ps.max_wasted = std::max(ps.max_wasted, ps.wasted_max[l]);
    n_all += n;
    if (n > 0) {
      for (auto* v : {&ps.prefetched, &ps.useful, &ps.wasted, &ps.misses, &ps.misses_left}) (*v)[l] /= n;
    }
    ps.layer_misses += ps.misses[l];
    if (shared) ps.shared_misses += ps.misses[l];
  }
  if (n_all > 0) {
    ps.mean_useful /= n_all;
    ps.mean_wasted /= n_all;
    ps.mean_misses /= n_all;
    ps.mean_misses_left /= n_all;
  }
  return ps;
}

// Steady-state mean misses per request-layer-step of the requests `group`, LRU at `slots`.
double steady_mean_misses(const TraceReader& trace, const std::vector<std::size_t>& group, std::int64_t slots,
                          bool warmup, std::int64_t steady_from) {
  const auto L = static_cast<std::size_t>(trace.meta().layers);
  const std::size_t n = group.size() * L;
  std::vector<double> sums(n, 0);
  std::vector<std::int64_t> counts(n, 0);
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, 1), [&](const tbb::blocked_range<std::size_t>& range) {
    for (std::size_t task = range.begin(); task != range.end(); ++task) {
      const auto& r = trace.request(group[task / L]);
      const auto x = replay_layer(r, static_cast<int>(task % L), static_cast<std::int32_t>(slots),
                                  std::make_unique<LruPolicy>(static_cast<std::int32_t>(slots)), warmup);
      for (std::size_t s = static_cast<std::size_t>(steady_from); s < x.misses.size(); ++s) {
        sums[task] += x.misses[s];
        ++counts[task];
      }
    }
  });
  const double total = std::accumulate(sums.begin(), sums.end(), 0.0);
  const auto cnt = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
  return cnt > 0 ? total / static_cast<double>(cnt) : 0.0;
}

// The recommended pool of one context: a binary search on the slot count, from the largest
// working set of its requests up to the context, for the target steady-state mean misses.
Recommendation recommend_for(const TraceReader& trace, const AnalyzeConfig& cfg, const RequestSummary& reqs,
                             std::int64_t context) {
  std::vector<std::size_t> group;
  std::int64_t lo = 0;
  for (std::size_t i = 0; i < trace.requests(); ++i) {
    if (trace.request(i).context == context) {
      group.push_back(i);
      lo = std::max(lo, reqs.max_ws[i]);
    }
  }
  auto mean_at = [&](std::int64_t slots) { return steady_mean_misses(trace, group, slots, cfg.warmup, reqs.steady_from); };
  Recommendation rec;
  rec.context = context;
  const std::int64_t ids = ids_of(context, trace.meta().unit_tokens);  // the pool's ceiling
  std::int64_t hi = std::max(lo, ids);
  const double at_hi = mean_at(hi);
  if (at_hi > cfg.target_misses) {
    rec.slots = -1;
    rec.mean_misses = at_hi;
  } else {
    double best = at_hi;
    const double at_lo = mean_at(lo);
    if (at_lo <= cfg.target_misses) {
      hi = lo;
      best = at_lo;
    }
    const std::int64_t gran = std::max<std::int64_t>(cfg.recommend_granularity, 1);
    while (hi - lo > gran) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      const double m = mean_at(mid);
      if (m <= cfg.target_misses) {
        hi = mid;
        best = m;
      } else {
        lo = mid;
      }
    }
    rec.slots = static_cast<std::int32_t>(hi);
    rec.mean_misses = best;
  }
  rec.ratio = rec.slots > 0 ? static_cast<double>(rec.slots) / static_cast<double>(ids) : 0;
  return rec;
}

}  // namespace

AnalysisResult analyze(const TraceReader& trace, const AnalyzeConfig& cfg) {
  const auto t0 = Clock::now();
  const auto limit = limit_threads(cfg.threads);
  check_config(trace, cfg);

  AnalysisResult res;
  res.path = trace.path();
  res.meta = trace.meta();
  res.requests = static_cast<int>(trace.requests());
  res.target_misses = cfg.target_misses;

  const RequestSummary reqs = summarize_requests(trace, cfg);
  res.steps = reqs.steps;
  res.steady_from = reqs.steady_from;
  res.contexts = reqs.contexts;
  const std::vector<Pool> pools = make_pools(trace, cfg, reqs.max_ws);

  replay_policies(trace, cfg, pools, reqs, res);
  if (cfg.similarity) measure_similarity(trace, res);
  if (cfg.prefetch && res.meta.layers > 1) {
    const auto L = static_cast<std::size_t>(res.meta.layers);
    res.prefetch = summarize_prefetch(prefetch_replays(trace, cfg, pools.front()), trace.requests(), L, res.steady_from);
  }
  if (cfg.recommend) {
    for (auto context : reqs.contexts) res.recommended.push_back(recommend_for(trace, cfg, reqs, context));
  }
  res.seconds = seconds_since(t0);
  return res;
}

}  // namespace ess::trace
