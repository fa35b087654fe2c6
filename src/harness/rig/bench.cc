#include "harness/rig/bench.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "ess/core/error.h"
#include "ess/ops/sparse_mla.h"
#include "ess/sim/hardware.h"
#include "ess/sim/memory_model.h"
#include "ess/sim/op_cost.h"
#include "ess/sim/step_model.h"
#include "harness/rig/gemm.h"
#include "harness/rig/predict.h"
#include "runtime/ops/flashtrans/flashtrans_bench.h"
#include "runtime/ops/gpu_swap/swap_engine_bench.h"
#include "testing/device.h"

namespace ess::rig {
namespace {

struct Line {
  double intercept = 0, slope = 0;
};
// Least-squares line through (x, y).
Line fit(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = static_cast<double>(x.size());
  const double mx = std::accumulate(x.begin(), x.end(), 0.0) / n;
  const double my = std::accumulate(y.begin(), y.end(), 0.0) / n;
  double sxy = 0, sxx = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
  }
  Line l;
  l.slope = sxx > 0 ? sxy / sxx : 0.0;
  l.intercept = my - l.slope * mx;
  return l;
}

nlohmann::json summary_json(const test::Summary& s) { return {{"median", s.median}, {"min", s.min}, {"max", s.max}}; }

}  // namespace

// ---- bench profile ----------------------------------------------------------------------

ProfileResult run_profile(const ProfileConfig& pc) {
  ESS_CHECK(!pc.requests.empty() && pc.repeats >= 1, "bench profile: needs a request grid and repeats >= 1");
  ProfileResult res;
  const ModelSpec model = ModelSpec::deepseek_v32_exp();
  const int max_req = *std::max_element(pc.requests.begin(), pc.requests.end());
  ESS_CHECK(*std::min_element(pc.requests.begin(), pc.requests.end()) >= 1, "bench profile: request counts must be >= 1");
  pc.base.validate(model);  // the flags as given, although each op is then timed on one layer
  nlohmann::json ops = nlohmann::json::array();
  std::string csv = "op,context,tokens,time_us\n";
  const std::int64_t ctx = pc.base.context;
  auto add = [&](std::string_view op, std::int64_t context, int tokens, const test::Summary& s) {
    csv += fmt::format("{},{},{},{:.3f}\n", op, context, tokens, s.median);  // op names hold no comma
    ops.push_back({{"op", op}, {"context", context}, {"tokens", tokens}, {"us", summary_json(s)}});
  };

  ExecutorConfig rc = pc.base;
  rc.layers = 1;
  rc.batch = max_req;
  rc.steps = 2;
  rc.warm_steps = 0;
  rc.offload = false;
  rc.reserve_newest = false;
  rc.stand_in_gemms = true;
  rc.validate(model);  // checked without a device first: a bad flag costs no device time
  (void)sim::HardwareProfile::load(pc.base_hardware);
  res.device = test::use_device(pc.base.device, "bench profile");
  const StepInputs rin = load_inputs(rc, model);
  const int T = rin.mtp;
  Line attn_line;
  double attn_tokens = 0;
  {
    StepExecutor ex(rc, model, rin);
    for (const int b : pc.requests) {
      const int n = b * T;
      for (const GemmOp g : kAllGemmOps) add(op_name(g), 0, n, ex.time_op(op_name(g), b, pc.repeats));
      add(op::kIndexerLogits, ctx, n, ex.time_op(op::kIndexerLogits, b, pc.repeats));
      add(op::kIndexerTopk, ctx, n, ex.time_op(op::kIndexerTopk, b, pc.repeats));
      add(op::kSparseMla, ctx, n, ex.time_op(op::kSparseMla, b, pc.repeats));
    }
    // Attention time against the entries each query token reads (the DA halves read fewer):
    // a line whose slope gives the achieved TFLOP/s and whose intercept the fixed cost.
    std::vector<double> xs, ys;
    nlohmann::json pts = nlohmann::json::array();
    for (const int e : {256, 512, 1024, 1536, 2048}) {
      if (e > rin.topk) continue;
      const test::Summary s = ex.time_op(op::kSparseMla, max_req, pc.repeats, e);
      xs.push_back(e);
      ys.push_back(s.median);
      pts.push_back({{"entries", e}, {"us", summary_json(s)}});
    }
    attn_line = fit(xs, ys);
    attn_tokens = static_cast<double>(max_req) * T;
    res.report["attention_vs_entries"] = {{"tokens", attn_tokens}, {"points", pts},
                                          {"intercept_us", attn_line.intercept}, {"us_per_entry", attn_line.slope}};
  }
  {
    ExecutorConfig oc = rc;
    oc.offload = true;
    oc.steps = 8;
    oc.overlap = OverlapMode::kDualAttention;
    oc.stand_in_gemms = false;
    const StepInputs oin = load_inputs(oc, model);
    StepExecutor ex(oc, model, oin);
    ex.run();  // fills the partial states the merge reads
    for (const int b : pc.requests) {
      add(op::kSwap, 0, b * T, ex.time_op(op::kSwap, b, pc.repeats));
      add(op::kMerge, 0, b * T, ex.time_op(op::kMerge, b, pc.repeats));
    }
  }
  // FlashTrans in both directions at a few miss counts: bandwidth and fixed cost.
  Line h2d, d2h;
  {
    std::vector<double> bytes, th, td;
    nlohmann::json pts = nlohmann::json::array();
    for (const int misses : {32, 128, 512}) {
      cuda::FlashTransBenchConfig tc;
      tc.requests = 64;
      tc.misses_per_request = misses;
      tc.context = ctx;
      tc.repeats = std::max(5, pc.repeats / 2);
      tc.device = rc.device;
      const cuda::FlashTransBenchResult tr = cuda::run_flashtrans_bench(tc);
      ESS_CHECK(tr.verified, "bench profile: FlashTrans copies did not verify");
      for (const cuda::TransferStat& st : tr.stats) {
        if (st.method != "flashtrans") continue;
        (st.direction == "h2d" ? th : td).push_back(st.median_us);
      }
      bytes.push_back(static_cast<double>(tr.bytes_per_run));
      pts.push_back({{"misses_per_request", misses}, {"bytes", tr.bytes_per_run}, {"h2d_us", th.back()}, {"d2h_us", td.back()}});
    }
    h2d = fit(bytes, th);
    d2h = fit(bytes, td);
    res.report["flashtrans"] = {{"points", pts}};
  }
  res.date = test::utc_now();
  res.csv = csv;
  res.report["ops"] = ops;

  // The hardware profile: the base profile with the fields measured here replaced.
  sim::HardwareProfile hw = sim::HardwareProfile::load(pc.base_hardware);
  const double flop_per_entry = 2.0 * model.num_attention_heads * (model.mla_head_dim() + model.kv_lora_rank);
  const std::string tag = fmt::format("MEASURED by ess bench profile on {} ({})", res.device, res.date);
  hw.name = fmt::format("measured-{}", res.device);
  std::replace(hw.name.begin(), hw.name.end(), ' ', '-');
  hw.description = fmt::format("{}: op tables for the executor rig; unmeasured fields from '{}'", tag, pc.base_hardware);
  if (attn_line.slope > 0) {
    const double tflops = attn_tokens * flop_per_entry / attn_line.slope / 1e6;  // flop per us -> TFLOP/s
    hw.attention_efficiency = std::min(1.0, tflops / hw.bf16_tflops);
    hw.sources["attention_efficiency"] = fmt::format("{}: sparse MLA slope {:.4f} us per entry at {} tokens = {:.0f} TFLOP/s",
                                                     tag, attn_line.slope, attn_tokens, tflops);
  }
  hw.kernel_launch_us = std::max(0.0, attn_line.intercept);
  hw.sources["kernel_launch_us"] = fmt::format("{}: intercept of the sparse MLA time against entries (ops without a "
                                               "table: the DA halves, the copies' kernels)", tag);
  if (h2d.slope > 0) {
    hw.h2d_scattered_gbps = 1e-3 / h2d.slope;  // us per byte -> GB/s
    hw.sources["h2d_scattered_gbps"] = fmt::format("{}: FlashTrans H2D, 656-byte entries, slope of time against bytes", tag);
  }
  if (d2h.slope > 0) {
    hw.d2h_scattered_gbps = 1e-3 / d2h.slope;
    hw.sources["d2h_scattered_gbps"] = fmt::format("{}: FlashTrans D2H, slope of time against bytes", tag);
  }
  hw.transfer_launch_us = std::max(0.0, 0.5 * (h2d.intercept + d2h.intercept));
  hw.sources["transfer_launch_us"] = fmt::format("{}: mean intercept of the FlashTrans H2D / D2H lines", tag);
  hw.validate("bench profile");
  res.hardware = hw.to_json();
  res.report["device"] = res.device;
  res.report["date"] = res.date;
  res.report["statistic"] = fmt::format("median (min, max) of {} launches after 3 untimed ones, CUDA events", pc.repeats);
  res.report["params"] = {{"context", ctx}, {"requests", pc.requests}, {"mtp", T}, {"base_hardware", pc.base_hardware},
                          {"expert_parallel", pc.base.expert_parallel}, {"stand_in_gemm_dtype", "bf16"}};
  return res;
}

// ---- bench step -------------------------------------------------------------------------

StepBenchResult run_step_bench(const StepBenchConfig& sc, const std::function<void(const StepPoint&)>& on_point) {
  ESS_CHECK(!sc.batches.empty(), "bench step: no batch given");
  const ModelSpec model = ModelSpec::deepseek_v32_exp();
  // Everything that can be checked without a device first: a bad flag costs no device time.
  for (const int b : sc.batches) {
    ExecutorConfig c = sc.base;
    c.batch = b;
    for (const bool offload : {false, true}) {
      c.offload = offload;
      c.reserve_newest = offload && sc.base.reserve_newest;  // the resident baseline has no reserved rows
      c.validate(model);
    }
  }
  StepBenchResult res;
  const bool predict_on = !sc.profile_hardware.empty() || !sc.profile_table.empty();
  ESS_CHECK(sc.profile_hardware.empty() == sc.profile_table.empty(),
            "bench step: predictions need both the measured hardware profile and its op table");
  sim::HardwareProfile phw;
  sim::MeasuredTables tables;
  if (predict_on) {
    phw = sim::HardwareProfile::load(sc.profile_hardware);
    tables = sim::MeasuredTables::from_csv(sc.profile_table);
  }
  const sim::HardwareProfile hw = sim::HardwareProfile::load(sc.hardware);
  const sim::Deployment dep = sim::Deployment::load(sc.deployment);
  test::use_device(sc.base.device, "bench step");
  // One point: the run's report, the exposed transfer time (the same schedule again without
  // transfers, on the same executor), the prediction; handed on as soon as it is measured.
  auto measure = [&](StepExecutor& ex, const ExecutorConfig& c, int batch, const std::string& mode, double resident_us) {
    StepPoint p;
    p.batch = batch;
    p.mode = mode;
    p.report = ex.run();
    if (c.offload && sc.exposed) {
      ex.rearm(c.overlap, true);
      p.exposed_us = p.report.step.median - ex.run().step.median;
    }
    if (predict_on) p.predicted_us = predict_step(model, phw, tables, c, p.report).step_us;
    p.vs_resident = resident_us > 0 ? p.report.step.median / resident_us : -1;
    res.device = p.report.device;
    res.date = p.report.date;
    if (on_point) on_point(p);
    return p;
  };
  auto resident_point = [&](int batch, const StepInputs& in) {
    ExecutorConfig c = sc.base;
    c.batch = batch;
    c.offload = false;
    c.reserve_newest = false;
    c.overlap = OverlapMode::kNone;
    StepExecutor ex(c, model, in);
    return measure(ex, c, batch, "resident", -1);
  };
  for (const int b : sc.batches) {
    ExecutorConfig c = sc.base;
    c.batch = b;
    c.offload = true;
    const StepInputs in = load_inputs(c, model);
    double resident_us = -1;
    if (sc.resident) {
      res.points.push_back(resident_point(b, in));
      resident_us = res.points.back().report.step.median;
    }
    if (sc.modes.empty()) continue;
    // One offloaded executor for every schedule of this batch (rearmed between them).
    c.overlap = sc.modes.front();
    StepExecutor ex(c, model, in);
    bool fresh = true;
    for (const OverlapMode m : sc.modes) {
      c.overlap = m;
      if (!fresh) ex.rearm(m, false);
      fresh = false;
      res.points.push_back(measure(ex, c, b, std::string(to_string(m)), resident_us));
    }
  }
  // Max batch of the whole model on this GPU (the simulator's memory model) and the
  // throughput gain measured on the rig at those two batches.
  const sim::MemoryModel mem(model, hw, dep, sc.base.context);
  res.ess_slots = sc.base.resolved_slots();
  res.max_batch_resident = mem.max_batch(static_cast<double>(sc.base.context));
  res.max_batch_ess = mem.max_batch(static_cast<double>(res.ess_slots));
  if (sc.gain && res.max_batch_resident >= 1 && res.max_batch_ess >= 1) {
    const OverlapMode best = sc.modes.empty() ? OverlapMode::kLayerWise : sc.modes.back();
    ExecutorConfig c = sc.base;
    c.batch = res.max_batch_resident;
    const StepInputs in_r = load_inputs(c, model);
    res.gain_points.push_back(resident_point(res.max_batch_resident, in_r));
    c.batch = res.max_batch_ess;
    c.offload = true;
    c.overlap = best;
    const StepInputs in_e = load_inputs(c, model);
    StepExecutor ex(c, model, in_e);
    res.gain_points.push_back(measure(ex, c, res.max_batch_ess, std::string(to_string(best)), -1));
    const double tr = res.gain_points[0].report.step.median, te = res.gain_points[1].report.step.median;
    res.throughput_gain = (res.max_batch_ess / te) / (res.max_batch_resident / tr);
  }
  return res;
}

}  // namespace ess::rig
