// `ess verify`'s report (report.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iterator>

#include "harness/report/report.h"

namespace ess::harness {
namespace {

std::vector<int> model_layers(const VerifyReport& r) {
  std::vector<int> v;
  for (const auto& l : r.per_layer) v.push_back(l.model_layer);
  return v;
}

}  // namespace

std::string to_table(const ModelSpec& model, const VerifyConfig& c, const VerifyReport& r) {
  std::string out;
  auto add = [&out]<typename... A>(fmt::format_string<A...> f, A&&... a) {
    fmt::format_to(std::back_inserter(out), f, std::forward<A>(a)...);
  };
  add("ess verify: {} | {} requests x {} layers | context {} + {} steps x MTP {} | top-k {} | {} slots "
             "per request-layer{} | warm-up {} ({} fills) | host memory {} | backend {}\n\n",
             model.name, c.requests, c.layers, c.context, c.steps, c.mtp, c.topk, r.slots,
             c.reserve_newest ? " + reserved newest" : "",
             c.warmup_windows > 0 ? fmt::format("{} windows", c.warmup_windows) : std::string("off"), r.warmup_fills,
             r.host_memory, r.backend);
  add("{:>6} {:>12} {:>12} {:>10} {:>22}\n", "layer", "hits", "misses", "hit rate", "misses/request-step");
  const double request_steps = static_cast<double>(c.requests) * static_cast<double>(std::max<std::int64_t>(r.steps, 1));
  for (const auto& l : r.per_layer) {
    const double total = static_cast<double>(l.hits + l.misses);
    add("{:>6} {:>12} {:>12} {:>9.1f}% {:>22.1f}\n", l.layer, l.hits, l.misses,
               total > 0 ? 100.0 * static_cast<double>(l.hits) / total : 0.0,
               static_cast<double>(l.misses) / request_steps);
  }
  const double total = static_cast<double>(r.hits + r.misses);
  add("{:>6} {:>12} {:>12} {:>9.1f}% {:>22.1f}\n\n", "all", r.hits, r.misses,
             total > 0 ? 100.0 * static_cast<double>(r.hits) / total : 0.0,
             static_cast<double>(r.misses) / (request_steps * std::max(c.layers, 1)));
  add("misses per step (all requests and layers): {}\n", fmt::join(r.misses_per_step, " "));
  add("host pool: {:.1f} MB in use for {:.1f} MB of entries without sharing{}\n", static_cast<double>(r.host_bytes) / 1e6,
      static_cast<double>(r.host_bytes_unshared) / 1e6,
      c.prefix_share > 0 ? fmt::format(" (requests 1.. share {:.0f}% of request 0's prompt)", 100 * c.prefix_share)
                         : std::string());
  add("split steps: {} of {} request-layer-steps selected more distinct ids than the {} slots and ran in query "
      "groups ({} extra step calls)\n",
      r.split_steps, static_cast<std::int64_t>(c.requests) * c.layers * r.steps, r.slots, r.group_calls);
  add("residency {} over {} pool rows: {} request-layer-steps whole, {} sparse; {} swap decisions launched; {} "
      "demotions, {} promotions\n",
      to_string(c.residency), r.pool_rows, r.whole_steps, r.sparse_steps, r.swap_launches, r.demotions, r.promotions);
  if (r.tokens_per_entry > 1) {
    add("compressed cache: one entry per {} tokens (the model's layers {}), top-k ids, lengths and misses in entries; "
        "rows in two parts (C4 pages: values, then scales)\n",
        r.tokens_per_entry, fmt::join(model_layers(r), ","));
  }
  if (!r.shared_layers.empty()) {
    add("index sharing: layers {} reuse their leader's top-k; {} of their layer-steps issued at their leader's{}\n",
        fmt::join(r.shared_layers, ","), r.prefetched_steps, c.shared_index_prefetch ? "" : " (prefetch off)");
  }
  if (r.bitwise_equal) {
    add("lossless: all {} attention outputs (bf16 output + fp32 LSE) are bit-identical to the "
               "all-resident cache, and every host pool entry to the generated one  [{:.2f} s]\n",
               r.compared_outputs, r.seconds);
  } else {
    add("NOT LOSSLESS: {} of {} attention outputs and {} host pool entries differ from the all-resident cache; "
               "first at {}\n",
               r.mismatched_outputs, r.compared_outputs, r.mismatched_host_entries, r.first_mismatch);
  }
  return out;
}

nlohmann::json to_json(const ModelSpec& model, const VerifyConfig& c, const VerifyReport& r) {
  nlohmann::json per_layer = nlohmann::json::array();
  std::vector<std::int64_t> per_layer_misses;
  for (const auto& l : r.per_layer) {
    per_layer.push_back({{"layer", l.layer}, {"model_layer", l.model_layer}, {"hits", l.hits}, {"misses", l.misses}});
    per_layer_misses.push_back(l.misses);
  }
  const nlohmann::json j = {
      {"bitwise_equal", r.bitwise_equal},
      {"compared_outputs", r.compared_outputs},
      {"mismatched_outputs", r.mismatched_outputs},
      {"mismatched_host_entries", r.mismatched_host_entries},
      {"first_mismatch", r.first_mismatch},
      {"steps", r.steps},
      {"hits", r.hits},
      {"misses", r.misses},
      {"warmup_fills", r.warmup_fills},
      {"split_steps", r.split_steps},
      {"host_bytes", r.host_bytes},
      {"host_bytes_unshared", r.host_bytes_unshared},
      {"group_calls", r.group_calls},
      {"residency",
       {{"mode", to_string(c.residency)},
        {"pool_rows", r.pool_rows},
        {"whole_steps", r.whole_steps},
        {"sparse_steps", r.sparse_steps},
        {"swap_launches", r.swap_launches},
        {"demotions", r.demotions},
        {"promotions", r.promotions}}},
      {"index_sharing",
       {{"shared_layers", r.shared_layers},
        {"prefetch", c.shared_index_prefetch},
        {"prefetched_steps", r.prefetched_steps}}},
      {"tokens_per_entry", r.tokens_per_entry},
      {"per_layer_misses", per_layer_misses},
      {"per_layer", per_layer},
      {"misses_per_step", r.misses_per_step},
      {"config",
       {{"model", model.name},
        {"requests", c.requests},
        {"layers", c.layers},
        {"context", c.context},
        {"mtp", c.mtp},
        {"topk", c.topk},
        {"slots", r.slots},
        {"ratio", c.slots > 0 ? nlohmann::json(nullptr) : nlohmann::json(c.ratio)},
        {"warmup_windows", c.warmup_windows},
        {"reserve_newest", c.reserve_newest},
        {"prefix_share", c.prefix_share},
        {"seed", c.seed}}},
      {"host_memory", r.host_memory},
      {"backend", r.backend},
      {"seconds", r.seconds}};
  return j;
}

std::string to_csv(const VerifyReport& r) {
  std::string out;
  auto add = [&out]<typename... A>(fmt::format_string<A...> f, A&&... a) {
    fmt::format_to(std::back_inserter(out), f, std::forward<A>(a)...);
  };
  add("layer,hits,misses,bitwise_equal\n");
  for (const auto& l : r.per_layer) {
    add("{},{},{},{}\n", l.layer, l.hits, l.misses, r.bitwise_equal);
  }
  return out;
}

}  // namespace ess::harness
