// The reports of `ess trace analyze`: JSON, the simulator's miss profile, the text table and CSV
// (docs/trace-analysis.md). Declared in analyzer.h.
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <iterator>

#include "ess/core/error.h"
#include "ess/trace/analyzer.h"

namespace ess::trace {

namespace {

nlohmann::json nan_to_null(const std::vector<double>& v) {
  nlohmann::json a = nlohmann::json::array();
  for (double x : v) a.push_back(std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr));
  return a;
}

nlohmann::json group_json(const GroupStats& g, bool distribution) {
  nlohmann::json j = {{"context", g.context == 0 ? nlohmann::json(nullptr) : nlohmann::json(g.context)},
                      {"slots", g.slots < 0 ? nlohmann::json(nullptr) : nlohmann::json(g.slots)},
                      {"requests", g.requests},
                      {"mean_misses", g.mean_misses},
                      {"mean_misses_all_steps", g.mean_misses_all},
                      {"hit_rate", g.hit_rate},
                      {"split_fraction", g.split_fraction},
                      {"per_layer", g.per_layer},
                      {"per_step", g.per_step}};
  if (distribution) {
    j["p50"] = g.p50;
    j["p90"] = g.p90;
    j["p99"] = g.p99;
    j["max"] = g.max;
  }
  return j;
}

nlohmann::json policies_json(const PoolResult& p) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& q : p.policies) {
    nlohmann::json j = group_json(q.overall, true);
    j["per_context"] = nlohmann::json::array();
    for (const auto& g : q.per_context) j["per_context"].push_back(group_json(g, false));
    out[q.name] = std::move(j);
  }
  return out;
}

nlohmann::json pool_json(const PoolResult& p) {
  return {{"ratio", p.ratio ? nlohmann::json(*p.ratio) : nlohmann::json(nullptr)},
          {"slots", p.slots ? nlohmann::json(*p.slots) : nlohmann::json(nullptr)}};
}

std::string pool_label(const PoolResult& p) {
  return p.ratio ? fmt::format("ratio {}", *p.ratio) : fmt::format("{} slots", *p.slots);
}

nlohmann::json working_set_json(const WorkingSetStats& w) {
  return {{"context", w.context == 0 ? nlohmann::json("all") : nlohmann::json(w.context)},
          {"mean", w.mean},
          {"p99", w.p99},
          {"max", w.max},
          {"per_layer", {{"mean", w.mean_per_layer}, {"p99", w.p99_per_layer}, {"max", w.max_per_layer}}}};
}

const WorkingSetStats* working_set_of(const AnalysisResult& r, std::int64_t context) {
  for (const auto& w : r.working_sets) {
    if (w.context == context || (r.working_sets.size() == 1 && w.context == 0)) return &w;
  }
  return nullptr;
}

}  // namespace

nlohmann::json to_json(const AnalysisResult& r) {
  nlohmann::json j;
  j["trace"] = r.path;
  j["synthetic"] = r.meta.synthetic;
  j["model"] = r.meta.model;
  j["provenance"] = r.meta.provenance;
  if (!r.meta.note.empty()) j["note"] = r.meta.note;
  j["requests"] = r.requests;
  j["layers"] = r.meta.layers;
  j["mtp"] = r.meta.mtp;
  j["topk"] = r.meta.topk;
  if (r.meta.unit_tokens != 1) j["unit_tokens"] = r.meta.unit_tokens;  // a trace of units says so
  j["steps"] = r.steps;
  j["steady_from"] = r.steady_from;
  j["contexts"] = r.contexts;
  j["similarity"] = {{"intra", nan_to_null(r.intra)},
                     {"inter", nan_to_null(r.inter)},
                     {"intra_mean", r.intra_mean},
                     {"inter_mean", r.inter_mean}};
  if (!r.pools.empty()) {
    j["pool"] = pool_json(r.pools.front());
    j["policies"] = policies_json(r.pools.front());
  }
  nlohmann::json ws = nlohmann::json::array();
  for (const auto& w : r.working_sets) ws.push_back(working_set_json(w));
  if (r.prefix_sharing) {
    const PrefixSharing& p = *r.prefix_sharing;
    j["prefix_sharing"] = {{"unit", "64-token host pages per layer, every request at its context"},
                           {"groups", p.groups},
                           {"requests", p.requests},
                           {"pages_unshared", p.pages_unshared},
                           {"pages_shared", p.pages_shared},
                           {"saved_fraction", p.saved_fraction()}};
  }
  j["working_set"] = {{"unit", "distinct ids per request-layer-step: the union of its T query tokens' top-k sets, "
                                "every decode step"},
                      {"bound", static_cast<std::int64_t>(r.meta.mtp) * r.meta.topk},
                      {"groups", std::move(ws)}};
  j["sweep"] = nlohmann::json::array();
  for (const auto& p : r.pools) {
    nlohmann::json e = pool_json(p);
    e["policies"] = policies_json(p);
    j["sweep"].push_back(std::move(e));
  }
  if (r.prefetch) {
    const auto& p = *r.prefetch;
    j["prefetch"] = {{"model", "first order: layer l-1's working set fetched before layer l, pool otherwise undisturbed"},
                     {"per_layer",
                      {{"prefetched", p.prefetched},
                       {"useful", p.useful},
                       {"wasted", p.wasted},
                       {"wasted_max", p.wasted_max},
                       {"misses", p.misses},
                       {"misses_left", p.misses_left}}},
                     {"mean_useful", p.mean_useful},
                     {"mean_wasted", p.mean_wasted},
                     {"max_wasted", p.max_wasted},
                     {"mean_misses", p.mean_misses},
                     {"mean_misses_left", p.mean_misses_left},
                     {"index_sharing",
                      {{"shared_layers", p.shared_layers},
                       {"shared_misses_per_request_step", p.shared_misses},
                       {"misses_per_request_step", p.layer_misses}}}};
  }
  nlohmann::json rec = nlohmann::json::array();
  for (const auto& x : r.recommended) {
    rec.push_back({{"context", x.context},
                   {"slots", x.slots < 0 ? nlohmann::json(nullptr) : nlohmann::json(x.slots)},
                   {"ratio", x.slots < 0 ? nlohmann::json(nullptr) : nlohmann::json(x.ratio)},
                   {"mean_misses", x.mean_misses}});
  }
  j["recommended_pool"] = {{"policy", "lru_warmup"}, {"target_misses", r.target_misses}, {"per_context", rec}};
  j["performance"] = {{"lookups", r.lookups},
                      {"replay_seconds", r.replay_seconds},
                      {"lookups_per_second", r.replay_seconds > 0 ? static_cast<double>(r.lookups) / r.replay_seconds : 0},
                      {"seconds", r.seconds}};
  return j;
}

nlohmann::json miss_profile_json(const AnalysisResult& r, const std::string& policy) {
  ESS_CHECK(!r.pools.empty(), "miss profile: no pool size was analyzed");
  const auto& pool = r.pools.front();
  const auto it = std::find_if(pool.policies.begin(), pool.policies.end(), [&](const auto& p) { return p.name == policy; });
  ESS_CHECK(it != pool.policies.end(), "miss profile: policy '{}' was not analyzed", policy);
  nlohmann::json contexts = nlohmann::json::array();
  for (const auto& g : it->per_context) {
    nlohmann::json layers = nlohmann::json::array();
    for (std::size_t l = 0; l < g.per_layer.size(); ++l) {
      layers.push_back({{"layer", l}, {"mean", g.per_layer[l]}, {"p50", g.p50[l]}, {"p90", g.p90[l]}, {"p99", g.p99[l]},
                        {"max", g.max[l]}});
    }
    nlohmann::json entry = {{"context", g.context},
                            {"slots", g.slots < 0 ? nlohmann::json(nullptr) : nlohmann::json(g.slots)},
                            {"ratio", pool.ratio ? nlohmann::json(*pool.ratio) : nlohmann::json(nullptr)},
                            {"mean_misses", g.mean_misses},
                            {"split_fraction", g.split_fraction},
                            {"layers", std::move(layers)}};
    if (const WorkingSetStats* w = working_set_of(r, g.context)) {
      entry["working_set"] = {{"mean", w->mean}, {"p99", w->p99}, {"max", w->max}};
    }
    contexts.push_back(std::move(entry));
  }
  nlohmann::json j{{"format", "ess-miss-profile"},
                   {"version", 1},
                   {"unit", "distinct missed entries per request per layer per decode step (steady state)"},
                   {"policy", policy},
                   {"model", r.meta.model},
                   {"mtp", r.meta.mtp},
                   {"topk", r.meta.topk},
                   {"synthetic", r.meta.synthetic},
                   {"source", r.path},
                   {"provenance", r.meta.provenance},
                   {"steady_from", r.steady_from},
                   {"contexts", std::move(contexts)}};
  if (r.meta.unit_tokens != 1) j["unit_tokens"] = r.meta.unit_tokens;  // its slots and misses count units
  return j;
}

std::string to_table(const AnalysisResult& r) {
  std::string out;
  auto it = std::back_inserter(out);
  fmt::format_to(it, "ess trace analyze: {}{}\n", r.path, r.meta.synthetic ? "  [SYNTHETIC trace]" : "");
  fmt::format_to(it, "model {} | {} requests | {} layers | MTP {} | top-k {} | {} decode steps | contexts {} | steady state from step {}\n",
      r.meta.model, r.requests, r.meta.layers, r.meta.mtp, r.meta.topk, r.steps, fmt::join(r.contexts, ","), r.steady_from);
  if (r.meta.unit_tokens > 1) {
    fmt::format_to(it, "ids name units of {} tokens: top-k, slots, misses and working sets count them (contexts stay "
                   "tokens; a ratio is of the context's ids)\n", r.meta.unit_tokens);
  }
  fmt::format_to(it, "provenance: {}\n\n", r.meta.provenance);
  if (!r.intra.empty()) {
    fmt::format_to(it, "similarity: intra-layer {:.3f}, inter-layer {:.3f} (mean over layers and steps)\n\n", r.intra_mean, r.inter_mean);
  }
  if (r.prefix_sharing) {
    const PrefixSharing& p = *r.prefix_sharing;
    fmt::format_to(it, "prefix sharing: {} groups, {} requests in them; host pages per layer {} -> {} ({:.1f}% saved)\n\n",
                   p.groups, p.requests, p.pages_unshared, p.pages_shared, 100 * p.saved_fraction());
  }
  if (!r.working_sets.empty()) {
    fmt::format_to(it, "MTP working set (distinct ids per request-layer-step: the union of its {} query tokens' top-k, at "
        "most T x K = {}; a pool below it serves the larger steps in query groups):\n", r.meta.mtp, static_cast<std::int64_t>(r.meta.mtp) * r.meta.topk);
    for (const auto& w : r.working_sets) {
      fmt::format_to(it, "  {:<16} mean {:.1f}, p99 {:.0f}, max {}\n",
          w.context == 0 ? std::string("all requests:") : fmt::format("context {}:", w.context), w.mean, w.p99, w.max);
    }
    fmt::format_to(it, "\n");
  }
  for (const auto& p : r.pools) {
    fmt::format_to(it, "pool: {}\n{:>12} {:>14} {:>14} {:>9} {:>10} {:>10}\n", pool_label(p), "policy", "mean misses", "all steps",
        "hit rate", "min layer", "max layer");
    for (const auto& q : p.policies) {
      const auto& g = q.overall;
      fmt::format_to(it, "{:>12} {:>14.1f} {:>14.1f} {:>8.2f}% {:>10.1f} {:>10.1f}\n", q.name, g.mean_misses, g.mean_misses_all,
          100 * g.hit_rate, *std::min_element(g.per_layer.begin(), g.per_layer.end()),
          *std::max_element(g.per_layer.begin(), g.per_layer.end()));
    }
    if (!p.policies.empty() && p.policies.front().overall.split_fraction > 0) {
      fmt::format_to(it, "{:>12} {:.2f}% of steady-state request-layer-steps exceed the pool and run in query groups\n",
          "split steps:", 100 * p.policies.front().overall.split_fraction);
    }
    if (r.contexts.size() > 1) {
      for (const auto& q : p.policies) {
        for (const auto& g : q.per_context) {
          fmt::format_to(it, "{:>12} context {:>7}: {:>8.1f} misses ({} slots)\n", q.name, g.context, g.mean_misses, g.slots);
        }
      }
    }
    fmt::format_to(it, "\n");
  }
  if (!r.pools.empty()) {
    const auto& p = r.pools.front();
    fmt::format_to(it, "per layer at {} (steady-state mean misses per request-step):\n{:>6} {:>7} {:>7}", pool_label(p), "layer", "intra",
        "inter");
    for (const auto& q : p.policies) fmt::format_to(it, " {:>10}", q.name);
    fmt::format_to(it, "\n");
    for (int l = 0; l < r.meta.layers; ++l) {
      const auto k = static_cast<std::size_t>(l);
      fmt::format_to(it, "{:>6} {:>7} {:>7}", l, r.intra.empty() ? std::string("-") : fmt::format("{:.3f}", r.intra[k]),
          r.inter.empty() || !std::isfinite(r.inter[k]) ? std::string("-") : fmt::format("{:.3f}", r.inter[k]));
      for (const auto& q : p.policies) fmt::format_to(it, " {:>10.1f}", q.overall.per_layer[k]);
      fmt::format_to(it, "\n");
    }
    fmt::format_to(it, "\n");
  }
  if (r.prefetch) {
    fmt::format_to(it, "inter-layer prefetch (layer l-1's top-k before layer l, LRU + warm-up, first pool): per request-layer-step "
        "{:.1f} useful, {:.1f} wasted (max {:.0f}), misses {:.1f} -> {:.1f}\n",
        r.prefetch->mean_useful, r.prefetch->mean_wasted, r.prefetch->max_wasted, r.prefetch->mean_misses,
        r.prefetch->mean_misses_left);
    const auto& p = *r.prefetch;
    if (!p.shared_layers.empty()) {
      fmt::format_to(it, "index sharing: layers {} select exactly the previous layer's top-k at every step: exact prefetch "
                         "(their copy issued at their leader) takes their {:.1f} misses per request-step, {:.1f}% of the "
                         "{:.1f} of layers 1..{}, off their own layer's critical path\n",
                     fmt::join(p.shared_layers, ","), p.shared_misses,
                     p.layer_misses > 0 ? 100 * p.shared_misses / p.layer_misses : 0.0, p.layer_misses,
                     r.meta.layers - 1);
    }
  }
  for (const auto& x : r.recommended) {
    if (x.slots < 0) {
      fmt::format_to(it, "recommended pool, context {}: none meets {} misses (LRU + warm-up at the full context: {:.1f})\n", x.context,
          r.target_misses, x.mean_misses);
    } else {
      fmt::format_to(it, "recommended pool, context {}: {} slots (ratio {:.3f}) keeps LRU + warm-up steady-state misses at {:.1f} <= {}\n",
          x.context, x.slots, x.ratio, x.mean_misses, r.target_misses);
    }
  }
  fmt::format_to(it, "\nreplayed {} top-k lookups in {:.2f} s ({:.1f} M lookups/s); total {:.2f} s\n", r.lookups, r.replay_seconds,
      r.replay_seconds > 0 ? static_cast<double>(r.lookups) / r.replay_seconds / 1e6 : 0.0, r.seconds);
  return out;
}

std::string to_csv(const AnalysisResult& r) {
  std::string out = "pool,layer,intra,inter";
  ESS_CHECK(!r.pools.empty(), "trace analyze: nothing to print");
  for (const auto& q : r.pools.front().policies) {
    out.push_back(',');
    out += q.name;
  }
  if (r.prefetch) out += ",prefetch_useful,prefetch_wasted,prefetch_misses_left";
  const bool ws = !r.working_sets.empty();
  if (ws) out += ",working_set_mean,working_set_p99,working_set_max";
  out += "\n";
  for (const auto& p : r.pools) {
    for (int l = 0; l < r.meta.layers; ++l) {
      const auto k = static_cast<std::size_t>(l);
      out += fmt::format("{},{},{}", p.ratio ? fmt::format("ratio={}", *p.ratio) : fmt::format("slots={}", *p.slots), l,
                         r.intra.empty() ? std::string() : fmt::format("{:.6f}", r.intra[k]));
      out.push_back(',');
      if (!r.inter.empty() && std::isfinite(r.inter[k])) out += fmt::format("{:.6f}", r.inter[k]);
      for (const auto& q : p.policies) out += fmt::format(",{:.3f}", q.overall.per_layer[k]);
      if (r.prefetch) {
        out += fmt::format(",{:.3f},{:.3f},{:.3f}", r.prefetch->useful[k], r.prefetch->wasted[k], r.prefetch->misses_left[k]);
      }
      if (ws) {
        const auto& w = r.working_sets.front();
        out += fmt::format(",{:.3f},{:.0f},{}", w.mean_per_layer[k], w.p99_per_layer[k], w.max_per_layer[k]);
      }
      out += "\n";
    }
  }
  return out;
}

}  // namespace ess::trace
