// The GPU benchmarks' reports (report.h): `ess bench transfer | swap | attention | indexer`.
#include <fmt/format.h>

#include <iterator>

#include "ess/ops/sparse_mla.h"
#include "harness/report/report.h"

namespace ess::harness {
namespace {

// The headline point: the one at c.batch when it was timed, else the last one.
const cuda::SparseMlaBenchPoint& headline(const cuda::SparseMlaBenchConfig& c, const cuda::SparseMlaBenchResult& r) {
  const cuda::SparseMlaBenchPoint* head = &r.points.back();
  for (const auto& pt : r.points) head = pt.batch == c.batch ? &pt : head;
  return *head;
}
constexpr double kFlashMlaH800 = 410, kTarget = 150;

}  // namespace

nlohmann::json to_json(const cuda::FlashTransBenchConfig& c, const cuda::FlashTransBenchResult& r) {
  nlohmann::json methods = nlohmann::json::object();
  for (const auto& s : r.stats) {
    nlohmann::json d = {{"available", s.available}};
    if (s.available) {
      d["gbps"] = s.median_gbps;
      d["gbps_min"] = s.min_gbps;
      d["gbps_max"] = s.max_gbps;
      d["median_us"] = s.median_us;
    } else {
      d["note"] = s.note;
    }
    methods[s.method][s.direction] = d;
  }
  const nlohmann::json j = {{"benchmark", "transfer"},
                            {"device", r.device},
                            {"date", r.date},
                            {"statistic", fmt::format("median (min, max) of {} runs after {} warm-up runs, CUDA events", c.repeats, c.warmup)},
                            {"params",
                             {{"requests", c.requests},
                              {"misses_per_request", c.misses_per_request},
                              {"entry_bytes", c.entry_bytes},
                              {"context", c.context},
                              {"slots", c.slots}}},
                            {"bytes_per_run", r.bytes_per_run},
                            {"entries_per_run", r.entries_per_run},
                            {"flashtrans_verified", r.verified},
                            {"flashtrans_default_blocks", r.default_blocks},
                            {"methods", methods}};
  nlohmann::json out = j;
  if (!r.sweep.empty()) {
    nlohmann::json pts = nlohmann::json::array();
    for (const auto& p : r.sweep) {
      nlohmann::json q = {{"blocks", p.blocks}, {"direction", p.direction}, {"gbps", p.gbps},
                          {"gbps_min", p.gbps_min}, {"gbps_max", p.gbps_max}};
      if (p.concurrent_gbps >= 0) {
        q["concurrent_gbps"] = p.concurrent_gbps;
        q["attention_us"] = p.attention_us;
        q["attention_slowdown"] = p.attention_slowdown;
      }
      pts.push_back(q);
    }
    out["grid_sweep"] = {{"points", pts},
                         {"attention_alone_us", r.attention_alone_us},
                         {"attention", c.concurrent ? fmt::format("sparse MLA decode, batch {}, T 2, 128 heads, "
                                                                  "top-k 2048, {} slots", c.attention_batch, c.slots)
                                                    : std::string("not run")},
                         {"recommended_blocks", {{"h2d", r.recommended_blocks_h2d}, {"d2h", r.recommended_blocks_d2h}}},
                         {"rule", "smallest block count within 5 % of the best bandwidth alone"}};
  }
  return out;
}

std::string to_table(const cuda::FlashTransBenchConfig& c, const cuda::FlashTransBenchResult& r) {
  std::string out;
  auto add = [&out]<typename... A>(fmt::format_string<A...> f, A&&... a) {
    fmt::format_to(std::back_inserter(out), f, std::forward<A>(a)...);
  };
  add("ess bench transfer on {} ({}): {} requests x {} misses x {} B = {:.1f} MB per run; median of {} runs\n",
             r.device, r.date, c.requests, c.misses_per_request, c.entry_bytes, static_cast<double>(r.bytes_per_run) / 1e6,
             c.repeats);
  add("FlashTrans copies verified byte for byte: {}\n\n", r.verified ? "yes" : "NO");
  add("{:<18} {:>4} {:>10} {:>10} {:>10} {:>12}\n", "method", "dir", "GB/s", "min", "max", "median us");
  for (const auto& s : r.stats) {
    if (s.available) {
      add("{:<18} {:>4} {:>10.2f} {:>10.2f} {:>10.2f} {:>12.1f}\n", s.method, s.direction, s.median_gbps, s.min_gbps,
                 s.max_gbps, s.median_us);
    } else {
      add("{:<18} {:>4} {:>10}  ({})\n", s.method, s.direction, "n/a", s.note);
    }
  }
  add("(FlashTrans with its default grid: {} blocks)\n", r.default_blocks);
  if (r.sweep.empty()) return out;
  add("\nFlashTrans grid sweep{}\n", c.concurrent ? fmt::format(" (beside: sparse MLA batch {} alone {:.1f} us)",
                                                                      c.attention_batch, r.attention_alone_us)
                                                        : std::string());
  add("{:>7} {:>4} {:>10} {:>10} {:>10} {:>12} {:>10}\n", "blocks", "dir", "GB/s", "min", "max", "GB/s beside",
             "attn x");
  for (const auto& p : r.sweep) {
    add("{:>7} {:>4} {:>10.2f} {:>10.2f} {:>10.2f} {:>12} {:>10}\n", p.blocks, p.direction, p.gbps, p.gbps_min,
               p.gbps_max, p.concurrent_gbps >= 0 ? fmt::format("{:.2f}", p.concurrent_gbps) : "",
               p.attention_slowdown >= 0 ? fmt::format("{:.3f}", p.attention_slowdown) : "");
  }
  add("recommended blocks (smallest within 5 % of the best alone): h2d {}, d2h {}\n", r.recommended_blocks_h2d,
             r.recommended_blocks_d2h);
  return out;
}

nlohmann::json to_json(const cuda::SwapEngineBenchConfig& c, const cuda::SwapEngineBenchResult& r) {
  const nlohmann::json j = {
      {"benchmark", "swap"},
      {"device", r.device},
      {"date", r.date},
      {"statistic", fmt::format("median (min, max) over {} steps (after {} warm-up steps) of one CUDA-event span over {} "
                                "back-to-back layer launches, divided by the layers",
                                c.repeats, c.steps, c.layers)},
      {"params",
       {{"requests", c.requests},
        {"query_tokens", c.query_tokens},
        {"topk", c.topk},
        {"slots", c.slots},
        {"context", c.context},
        {"fresh_per_query", c.fresh_per_query},
        {"layers", c.layers},
        {"cluster", c.cluster}}},
      {"blocks_per_request", r.blocks_per_request},
      {"us_per_layer", {{"median", r.us_per_layer.median}, {"min", r.us_per_layer.min}, {"max", r.us_per_layer.max}}},
      {"target_us_per_layer", 20},
      {"hits_per_request_step", r.hits_per_request_step},
      {"misses_per_request_step", r.misses_per_request_step},
      {"checked_requests", r.checked_requests}};
  return j;
}

std::string to_table(const cuda::SwapEngineBenchConfig& c, const cuda::SwapEngineBenchResult& r) {
  std::string out;
  auto add = [&out]<typename... A>(fmt::format_string<A...> f, A&&... a) {
    fmt::format_to(std::back_inserter(out), f, std::forward<A>(a)...);
  };
  add("ess bench swap on {} ({}): batch {} x T {} x top-k {}, {} slots, {:.1f} misses per request-step, {} block{} per "
      "request{}\n",
      r.device, r.date, c.requests, c.query_tokens, c.topk, c.slots, r.misses_per_request_step, r.blocks_per_request,
      r.blocks_per_request == 1 ? "" : "s (a thread-block cluster)", c.cluster == 0 ? " (the engine's choice)" : " (--cluster)");
  add("us per layer (one launch for the batch; {} layers back to back per timed step): median {:.2f}, min {:.2f}, "
      "max {:.2f} over {} steps (target <= 20); outputs of {} requests checked against the LRU model\n",
      c.layers, r.us_per_layer.median, r.us_per_layer.min, r.us_per_layer.max, c.repeats, r.checked_requests);
  return out;
}

nlohmann::json to_json(const cuda::SparseMlaBenchConfig& c, const cuda::SparseMlaBenchResult& r) {
  const cuda::SparseMlaBenchPoint* head = &headline(c, r);
  const auto summary = [](const test::Summary& s) {
    return nlohmann::json{{"median", s.median}, {"min", s.min}, {"max", s.max}};
  };
  nlohmann::json points = nlohmann::json::array();
  for (const auto& pt : r.points) {
    points.push_back({{"batch", pt.batch},
                      {"us", summary(pt.us)},
                      {"tflops", pt.tflops},
                      {"tflops_best", pt.tflops_best},
                      {"bytes_per_call", pt.bytes_per_call},
                      {"gbps", pt.gbps}});
  }
  const nlohmann::json j = {
      {"benchmark", "attention"},
      {"device", r.device},
      {"date", r.date},
      {"statistic", fmt::format("median (min, max) of {} launches after {} warm-up launches, CUDA events, per "
                                "batch size",
                                c.repeats, c.warmup)},
      {"params",
       {{"batch", c.batch},
        {"query_tokens", c.query_tokens},
        {"heads", c.heads},
        {"topk", c.topk},
        {"slots", c.slots},
        {"softmax_scale", r.softmax_scale},
        {"seed", c.seed}}},
      {"verified", r.verified},
      {"verified_tokens", r.verified_tokens},
      {"worst_error_over_bound", r.verify_worst},
      {"headline_batch", head->batch},
      {"us", summary(head->us)},
      {"tflops", head->tflops},
      {"tflops_best", head->tflops_best},
      {"flops_per_call", cuda::sparse_mla_flops(head->batch, c.query_tokens, c.heads, c.topk)},
      {"bytes_per_call", head->bytes_per_call},
      {"gbps", head->gbps},
      {"flashmla_h800_tflops", kFlashMlaH800},
      {"target_tflops", kTarget},
      {"batches", points}};
  return j;
}

std::string to_table(const cuda::SparseMlaBenchConfig& c, const cuda::SparseMlaBenchResult& r) {
  std::string out;
  auto add = [&out]<typename... A>(fmt::format_string<A...> f, A&&... a) {
    fmt::format_to(std::back_inserter(out), f, std::forward<A>(a)...);
  };
  add("ess bench attention on {} ({}): T {} x {} heads x top-k {}, {} slots per request; median (min, max) "
             "of {} launches\n",
             r.device, r.date, c.query_tokens, c.heads, c.topk, c.slots, c.repeats);
  add("checked against the CPU reference at batch {} ({} query tokens, worst error / bound {:.3f}): {}\n\n",
             c.batch, r.verified_tokens, r.verify_worst, r.verified ? "yes" : "NO");
  add("{:>6} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}\n", "batch", "median us", "min", "max", "TFLOP/s",
             "best", "GB/s");
  for (const auto& pt : r.points) {
    add("{:>6} {:>10.1f} {:>10.1f} {:>10.1f} {:>9.1f} {:>9.1f} {:>9.0f}\n", pt.batch, pt.us.median, pt.us.min,
               pt.us.max, pt.tflops, pt.tflops_best, pt.gbps);
  }
  add("\ntarget >= {:.0f} TFLOP/s at batch 128, T 2, 128 heads, top-k 2048 (FlashMLA's FP8 sparse decode on "
             "H800: {:.0f}); GB/s counts each selected entry once per query token\n",
             kTarget, kFlashMlaH800);
  return out;
}

nlohmann::json to_json(const cuda::IndexerBenchConfig& c, const cuda::IndexerBenchResult& r) {
  const double hbm_fraction = r.hbm_peak_gbps > 0 ? r.logits_gbps / r.hbm_peak_gbps : 0.0;
  const auto summary = [](const test::Summary& s) { return nlohmann::json{{"median", s.median}, {"min", s.min}, {"max", s.max}}; };
  nlohmann::json j = {
      {"benchmark", "indexer"},
      {"device", r.device},
      {"date", r.date},
      {"statistic", fmt::format("median (min, max) of {} steps after {} warm-up steps, CUDA events, per layer",
                                c.repeats, c.warmup)},
      {"params",
       {{"requests", c.batch},
        {"query_tokens", c.query_tokens},
        {"context", c.context},
        {"heads", c.heads},
        {"head_dim", 128},
        {"page_tokens", 64},
        {"topk", c.topk},
        {"seed", c.seed}}},
      {"verified", r.verified},
      {"results",
       {{"logits_us", summary(r.logits_us)},
        {"topk_us", summary(r.topk_us)},
        {"indexer_us", summary(r.indexer_us)},
        {"logits_gbps", r.logits_gbps},
        {"hbm_peak_gbps", r.hbm_peak_gbps},
        {"logits_fraction_of_hbm_peak", hbm_fraction},
        {"logits_tflops", r.logits_tflops},
        {"bytes_read_per_layer", r.bytes_read},
        {"page_bytes_per_layer", r.page_bytes},
        {"bytes_written_per_layer", r.bytes_written},
        {"keys_per_layer", r.keys},
        {"flops_per_layer", r.flops},
        {"worst_logit_error_over_bound", r.worst_error_over_bound}}}};
  if (!r.verified) j["verify_note"] = r.verify_note;
  return j;
}

std::string to_table(const cuda::IndexerBenchConfig& c, const cuda::IndexerBenchResult& r) {
  const double hbm_fraction = r.hbm_peak_gbps > 0 ? r.logits_gbps / r.hbm_peak_gbps : 0.0;
  std::string out;
  auto add = [&out]<typename... A>(fmt::format_string<A...> f, A&&... a) {
    fmt::format_to(std::back_inserter(out), f, std::forward<A>(a)...);
  };
  add("ess bench indexer on {} ({}): batch {} x T {}, context {}, {} heads, top-k {}; per layer, median "
             "(min, max) of {} steps\n",
             r.device, r.date, c.batch, c.query_tokens, c.context, c.heads, c.topk, c.repeats);
  add("verified against the CPU reference (logits within bound, top-k bit for bit): {}{}\n\n",
             r.verified ? "yes" : "NO", r.verified ? std::string() : fmt::format(" ({})", r.verify_note));
  add("{:<16} {:>10} {:>10} {:>10}\n", "", "median us", "min", "max");
  const auto line = [&add](const char* what, const test::Summary& s) {
    add("{:<16} {:>10.1f} {:>10.1f} {:>10.1f}\n", what, s.median, s.min, s.max);
  };
  line("logits", r.logits_us);
  line("top-k", r.topk_us);
  line("logits + top-k", r.indexer_us);
  add("\nlogits: {:.1f} MB read per layer, {:.0f} GB/s ({:.0f} % of the {:.0f} GB/s HBM peak), {:.1f} TFLOP/s\n",
             r.bytes_read / 1e6, r.logits_gbps, 100.0 * hbm_fraction, r.hbm_peak_gbps, r.logits_tflops);
  return out;
}

}  // namespace ess::harness
