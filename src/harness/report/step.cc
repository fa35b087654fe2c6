// `ess bench step`'s report (report.h): its points and result as JSON, its table.
#include <fmt/format.h>

#include <iterator>

#include "ess/ops/flashtrans.h"
#include "harness/report/report.h"

namespace ess::rig {
namespace {

nlohmann::json summary_json(const test::Summary& s) { return {{"median", s.median}, {"min", s.min}, {"max", s.max}}; }

}  // namespace

nlohmann::json StepPoint::to_json() const {
  nlohmann::json j = {{"batch", batch},
                      {"mode", mode},
                      {"device", report.device},
                      {"date", report.date},
                      {"step_us", summary_json(report.step)},
                      {"steps_timed", report.step_us.size()},
                      {"slots", report.slots},
                      {"graph", report.graph}};
  if (report.offload) {
    j["misses_per_request_layer"] = report.misses;
    j["profile_misses_per_request_layer"] = report.profile_misses;
    j["h2d_mb_per_step"] = report.h2d_bytes_per_step / 1e6;
    j["d2h_mb_per_step"] = report.d2h_bytes_per_step / 1e6;
    std::string modes;
    for (const OverlapMode m : report.modes) {
      modes += m == OverlapMode::kDualBatchAttention ? 'b' : (m == OverlapMode::kDualAttention ? 'a' : 'n');
    }
    j["layer_modes"] = modes;
  }
  if (vs_resident > 0) j["vs_resident"] = vs_resident;
  if (exposed_us >= 0) j["exposed_transfer_us"] = exposed_us;
  if (predicted_us >= 0) {
    j["predicted_us"] = predicted_us;
    j["prediction_error"] = predicted_us / report.step.median - 1.0;
  }
  return j;
}

nlohmann::json StepBenchResult::to_json(const StepBenchConfig& sc) const {
  nlohmann::json pts = nlohmann::json::array();
  for (const StepPoint& p : points) pts.push_back(p.to_json());
  nlohmann::json gain = nullptr;
  if (gain_points.size() == 2) {
    gain = {{"resident", gain_points[0].to_json()}, {"ess", gain_points[1].to_json()}, {"throughput_gain", throughput_gain}};
  }
  const ExecutorConfig& b = sc.base;
  return {{"benchmark", "step"},
          {"device", device},
          {"date", date},
          {"statistic", fmt::format("median (min, max) over {} graph-replayed steps after {} warm steps, CUDA events",
                                    b.steps - b.warm_steps, b.warm_steps)},
          {"params",
           {{"layers", b.layers},
            {"context", b.context},
            {"ratio", b.ratio},
            {"slots", sc.base.resolved_slots()},
            {"layerwise_threshold", b.layerwise_threshold},
            {"expert_parallel", b.expert_parallel},
            {"stand_in_gemms", b.stand_in_gemms ? "bf16 cuBLAS" : "off"},
            {"graph", b.graph},
            {"copy_blocks", b.copy_blocks > 0 ? b.copy_blocks : cuda::kFlashTransDefaultBlocks},
            {"reserve_newest", b.reserve_newest},
            {"preattn_in_copy_window", b.preattn_in_copy_window},
            {"inputs", points.empty() ? std::string() : points.front().report.inputs}}},
          {"points", pts},
          {"max_batch",
           {{"hardware", sc.hardware},
            {"deployment", sc.deployment},
            {"resident", max_batch_resident},
            {"ess", max_batch_ess},
            {"ess_slots", ess_slots}}},
          {"gain", gain},
          {"target_vs_resident", 1.10}};
}

}  // namespace ess::rig

namespace ess::harness {

std::string to_table(const rig::StepBenchConfig& sc, const rig::StepBenchResult& r) {
  std::string out;
  auto add = [&out]<typename... A>(fmt::format_string<A...> f, A&&... a) {
    fmt::format_to(std::back_inserter(out), f, std::forward<A>(a)...);
  };
  const auto& b = sc.base;
  add("ess bench step on {} ({}): {} layers, context {}, ratio {} ({} slots), median of {} graph steps\n", r.device,
             r.date, b.layers, b.context, b.ratio, b.resolved_slots(), b.steps - b.warm_steps);
  add("{:>6} {:<10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>11} {:>11}\n", "batch", "mode", "step us", "min", "max",
             "vs res", "misses", "exposed us", "predicted");
  for (const auto& p : r.points) {
    double misses = 0;
    for (const double m : p.report.misses) misses += m / static_cast<double>(p.report.misses.size());
    add("{:>6} {:<10} {:>10.1f} {:>10.1f} {:>10.1f} {:>9} {:>9.1f} {:>11} {:>11}\n", p.batch, p.mode,
               p.report.step.median, p.report.step.min, p.report.step.max,
               p.vs_resident > 0 ? fmt::format("{:.3f}", p.vs_resident) : "",
               misses, p.exposed_us >= 0 ? fmt::format("{:.1f}", p.exposed_us) : "",
               p.predicted_us >= 0 ? fmt::format("{:.1f}", p.predicted_us) : "");
  }
  add("\nmax batch of the whole model ({}, {}): all-resident {}, ESS {} ({} slots)\n", sc.hardware, sc.deployment,
             r.max_batch_resident, r.max_batch_ess, r.ess_slots);
  if (r.gain_points.size() == 2) {
    add("throughput gain on the rig at those batches: {:.2f}x (resident {:.1f} us, ESS {:.1f} us per step)\n",
               r.throughput_gain, r.gain_points[0].report.step.median, r.gain_points[1].report.step.median);
  }
  return out;
}

}  // namespace ess::harness
