#include "ess/sim/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "ess/cache/sparse_pool.h"
#include "ess/core/error.h"
#include "ess/sim/memory_model.h"
#include "ess/sim/timeline.h"

namespace ess::sim {
namespace {

double ms(double us) { return us / 1e3; }

// The profile's name and, when it names one, its GPU: "h200 (NVIDIA H200 SXM 141 GB)".
std::string on_gpu(const HardwareProfile& hw) { return hw.gpu.empty() ? hw.name : fmt::format("{} ({})", hw.name, hw.gpu); }

// The part of a step the table's other columns do not name: the compute stream idle for
// another reason (the other micro-batch, a D2H copy) and the step's tail on another stream.
double other_idle_us(const StepResult& r) {
  const double idle = r.step_us - r.compute_us - r.exposed_comm_us - r.exposed_transfer_us - r.step_overhead_us;
  return idle > 1e-6 * r.step_us ? idle : 0.0;
}

nlohmann::json row_json(const StepResult& r) {
  return {{"batch", r.batch},
          {"ratio", r.ratio},
          {"slots", r.slots},
          {"offload", r.offload},
          {"overlap", std::string(to_string(r.overlap))},
          {"step_ms", ms(r.step_us)},
          {"throughput_tokens_per_s", r.throughput_tokens_per_s},
          {"otps", r.otps},
          {"compute_ms", ms(r.compute_us)},
          {"exposed_comm_ms", ms(r.exposed_comm_us)},
          {"exposed_transfer_ms", ms(r.exposed_transfer_us)},
          {"host_ms", ms(r.step_overhead_us)},
          {"other_idle_ms", ms(other_idle_us(r))},
          {"breakdown_ms",
           {{"attention", ms(r.attention_us)},
            {"moe", ms(r.moe_us)},
            {"dense_norms_lm_head", ms(r.other_us)},
            {"mtp_draft", ms(r.mtp_draft_us)},
            {"comm_stream_busy", ms(r.comm_us)},
            {"h2d_stream_busy", ms(r.h2d_us)}}},
          // Fixed costs by cause: launch gaps of the compute stream's kernels (inside
          // compute_ms), all-to-all start-up per call (inside the comm stream), host time per
          // step (after the GPU work), and compute slowed by FlashTrans holding SMs.
          {"kernels_per_step", r.kernels},
          {"fixed_costs_ms",
           {{"launch_gaps", ms(r.launch_us)},
            {"comm_latency", ms(r.comm_latency_us)},
            {"step_overhead", ms(r.step_overhead_us)},
            {"transfer_sm_share", ms(r.transfer_sm_us)}}},
          {"misses_per_request_layer", r.misses_per_request_layer},
          {"whole_requests", r.whole_requests},
          {"miss_capped_layers", r.miss_capped_layers},
          {"split_calls_per_layer", r.split_calls_per_layer},
          {"h2d_mb_per_step", r.h2d_bytes / 1e6},
          {"d2h_mb_per_step", r.d2h_bytes / 1e6},
          {"layers_da", r.layers_da},
          {"layers_dba", r.layers_dba},
          {"layer_modes", r.layer_modes},
          {"cache_gb", r.cache_gb},
          {"host_pool_gb_per_node", r.host_pool_gb_per_node},
          {"host_pool_gb_per_node_unshared", r.host_pool_gb_per_node_unshared},
          {"h2d_gbps_per_node", r.h2d_gbps_per_node},
          {"op_sources", {{"analytical", r.ops_analytical}, {"measured", r.ops_measured}, {"outside_grid", r.ops_outside_grid}}}};
}

nlohmann::json option_json(const PlanOption& o) {
  nlohmann::json j = {{"label", o.label},
                      {"found", o.found},
                      {"why", o.why},
                      {"two_batch_overlap", o.two_batch_overlap},
                      {"shared_index_prefetch", o.shared_index_prefetch}};
  if (o.found) {
    const auto& r = o.best;
    j["limit"] = o.limit;
    j["memory_gb_per_gpu"] = {{"cache_budget", o.cache_budget_gb}, {"indexer", o.indexer_gb}, {"latent", o.latent_gb}};
    j["host_dram_usable_gb_per_node"] = o.host_dram_usable_gb;
    j["batch"] = r.batch;
    j["ratio"] = r.ratio;
    j["slots"] = r.slots;
    j["offload"] = r.offload;
    j["overlap"] = std::string(to_string(r.overlap));
    j["step_ms"] = ms(r.step_us);
    j["throughput_tokens_per_s"] = r.throughput_tokens_per_s;
    j["otps"] = r.otps;
    j["exposed_transfer_ms"] = ms(r.exposed_transfer_us);
    j["layers_da"] = r.layers_da;
    j["layers_dba"] = r.layers_dba;
    j["layer_modes"] = r.layer_modes;
    j["host_pool_gb_per_node"] = r.host_pool_gb_per_node;
    j["host_pool_gb_per_node_unshared"] = r.host_pool_gb_per_node_unshared;
    j["h2d_gbps_per_node"] = r.h2d_gbps_per_node;
  }
  return j;
}

// `ess plan --explain`: the figures behind an option's limit.
std::string explain_line(const PlanOption& o, const HardwareProfile& hw, std::string_view indent) {
  const StepResult& r = o.best;
  std::string out = fmt::format("{}per GPU: {:.1f} GB {} + {:.1f} GB latent of {:.1f} GB for the caches", indent,
                                o.indexer_gb, o.resident_what, o.latent_gb, o.cache_budget_gb);
  if (r.offload) {
    out += fmt::format("; per node: host pool {:.0f} of {:.0f} GB usable ({} GB, {:.0f} % reserved), H2D {:.0f} of {} GB/s",
                       r.host_pool_gb_per_node, o.host_dram_usable_gb, hw.host_dram_gb, 100 * hw.host_dram_reserve,
                       r.h2d_gbps_per_node, hw.host_dram_bandwidth_gbps);
  }
  out += fmt::format("; {:.2f} tokens/s per request\n", r.otps);
  return out;
}

std::string option_line(const PlanOption& o) {
  if (!o.found) return fmt::format("{:<22} -", o.label);
  const auto& r = o.best;
  return fmt::format("{:<22} batch {:>4}  ratio {:.3f}  step {:>7.2f} ms  {:>8.0f} tok/s/node  {:>6.2f} OTPS", o.label,
                     r.batch, r.ratio, ms(r.step_us), r.throughput_tokens_per_s, r.otps);
}


// ", attention TP t" under attention tensor parallel, else "".
std::string attention_tp(const Deployment& d) {
  return d.attention_tensor_parallel > 1 ? fmt::format(", attention TP {}", d.attention_tensor_parallel) : std::string();
}

// Under attention tensor parallel: what a batch and a GPU's caches are.
std::string attention_tp_line(const ModelSpec& m, const Deployment& d) {
  if (d.attention_tensor_parallel <= 1) return {};
  return fmt::format("attention TP {}: a batch is the {} GPUs' together, each GPU holding every request's K / V of {} KV "
                     "head{} (SGLang's HiSparse: one per rank) and its index cache; all-reduces after attention and "
                     "MoE\n",
                     d.attention_tensor_parallel, d.attention_tensor_parallel,
                     std::max(1, m.num_key_value_heads / d.attention_tensor_parallel),
                     m.num_key_value_heads / d.attention_tensor_parallel > 1 ? "s" : "");
}

// A model whose layers share an indexer's top-k: how many run one, and where the others swap.
// `searched`: a plan, whose search covers the prefetch on and off when the deployment allows it.
std::string index_sharing_line(const ModelSpec& m, const Deployment& d, bool searched = false) {
  if (m.shared_index.empty()) return {};
  return fmt::format("index sharing: {} of {} layers run an indexer (indexer keys and weights in those only); the others "
                     "reuse their leader's top-k and swap {}\n",
                     m.indexer_layers(m.num_hidden_layers), m.num_hidden_layers,
                     !d.shared_index_prefetch ? "at their own turn (no prefetch)"
                     : searched ? "with their copy issued at their leader's layer (prefetch) or at their own turn "
                                  "(\", no prefetch\"), whichever is faster"
                                : "with their copy issued at their leader's layer (prefetch)");
}

nlohmann::json index_sharing_json(const ModelSpec& m, const Deployment& d) {
  if (m.shared_index.empty()) return nullptr;
  return {{"indexer_layers", m.indexer_layers(m.num_hidden_layers)},
          {"layers", m.num_hidden_layers},
          {"prefetch", d.shared_index_prefetch}};
}

}  // namespace

double Simulation::gain(const StepResult& r) const {
  return wall_fits ? r.throughput_tokens_per_s / wall.throughput_tokens_per_s - 1.0 : 0.0;
}

double Simulation::same_batch(const SimulationRow& r) {
  return r.refused.empty() && r.baseline_fits && r.baseline.throughput_tokens_per_s > 0
             ? r.ess.throughput_tokens_per_s / r.baseline.throughput_tokens_per_s
             : 0.0;
}

int Simulation::offload_pays_from() const {
  if (!wall_fits) return 0;
  int best = 0;
  for (const SimulationRow& r : rows) {
    if (r.refused.empty() && r.ess.batch > wall.batch && gain(r.ess) > 0 && (best == 0 || r.ess.batch < best)) {
      best = r.ess.batch;
    }
  }
  return best;
}

std::vector<int> load_batches(const StepModel& sm, const Workload& base) {
  ESS_CHECK(base.slots > 0 || base.ratio > 0, "a load sweep needs the engine's pool: a ratio or slots");
  const MemoryModel mem(sm.model(), sm.hardware(), sm.deployment(), base.context);
  const std::int32_t slots = base.slots > 0 ? base.slots : slots_for_ratio(base.ratio, base.context);
  const int wall = mem.max_batch(static_cast<double>(base.context));
  const int top = std::max(mem.max_batch(static_cast<double>(slots)), 1);
  std::vector<int> out;
  for (int b = 1; b < std::min(wall, top); b *= 2) out.push_back(b);
  if (wall >= 1 && wall <= top) out.push_back(wall);
  int b = std::max(wall + 1, 1);
  for (; b < top; b *= 2) out.push_back(b);
  out.push_back(top);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

Simulation simulate(const StepModel& sm, const Workload& base_in, const std::vector<int>& batches,
                    const SimulateOptions& options) {
  ESS_CHECK(!batches.empty(), "sim: no batch size given");
  Workload base = base_in;
  base.batch = 0;
  base.validate();
  Simulation s;
  s.model = sm.model();
  s.hardware = sm.hardware();
  s.deployment = sm.deployment();
  s.base = base;
  const std::int64_t context = base.context;
  const MemoryModel mem(s.model, s.hardware, s.deployment, context);
  s.cache_budget_gb = mem.cache_budget() / 1e9;
  s.pool_floor = sm.pool_floor(base.misses, context);
  s.pool_floor_rule = sm.misses_in_entries(base.misses)
                          .floor_rule(s.deployment.mtp_tokens, s.model.selected_entries(), double(mem.context_entries()));
  s.weights_gb = mem.weights().total() / 1e9;

  // The memory wall: the all-on-GPU baseline at its largest batch. The executor rig has no
  // memory wall of its own: its all-resident step is reported at every batch instead.
  Workload wall = base;
  wall.offload = false;
  wall.ratio = 0;
  wall.slots = 0;
  wall.batch = 0;
  s.rig = s.deployment.rig_layers > 0;
  const int wall_batch = s.rig ? 0 : mem.max_batch(static_cast<double>(context));
  s.wall_fits = wall_batch >= 1;
  if (s.wall_fits) s.wall = sm.run(wall);

  // Paper columns only for the paper's own setup (its model, calibration profile, Table 1 deployment, 32K).
  const bool paper_setup = s.model.to_json() == ModelSpec::deepseek_v32_exp().to_json() && s.hardware.name == "paper-table1" &&
                           s.deployment.to_json() == Deployment::shipped("paper-table1").to_json() && context == 32768 &&
                           base.ratio == 0 && base.slots == 0;
  Timeline timeline;  // of the first row that runs, written once every row has run
  std::string timeline_title;
  bool recorded = false;
  std::string first_refusal;
  for (std::size_t i = 0; i < batches.size(); ++i) {
    SimulationRow row;
    Workload w = base;
    w.batch = batches[i];
    const bool record = !recorded && !options.timeline.empty();
    try {
      row.ess = sm.run(w, record ? &timeline : nullptr);
    } catch (const OutOfMemory&) {
      throw;
    } catch (const DeviceError&) {
      throw;
    } catch (const Error& e) {
      // A batch that cannot run (it does not fit, its pool is below the floor) is a row that says why; the
      // others still run.
      row.refused = e.what();
      row.ess.batch = batches[i];
      if (first_refusal.empty()) first_refusal = e.what();
      s.rows.push_back(row);
      if (options.progress) options.progress(i + 1, batches.size());
      continue;
    }
    if (record) {
      recorded = true;
      timeline_title = fmt::format("ess sim: {} on {}, batch {}, ratio {:.3f}, {}", s.model.name, s.hardware.name,
                                   row.ess.batch, row.ess.ratio, to_string(row.ess.overlap));
    }
    if (s.rig || (s.wall_fits && row.ess.batch <= wall_batch)) {
      Workload b = wall;
      b.batch = row.ess.batch;
      row.baseline_fits = true;
      row.baseline = sm.run(b);
    }
    if (paper_setup) {
      for (const auto& p : paper_table2_32k()) {
        if (p.batch == row.ess.batch) row.paper = &p;
      }
    }
    s.rows.push_back(row);
    if (options.progress) options.progress(i + 1, batches.size());
  }
  // No batch runs: the reason is the command's error, as it was for one batch.
  ESS_CHECK(std::any_of(s.rows.begin(), s.rows.end(), [](const SimulationRow& r) { return r.refused.empty(); }), "{}",
            first_refusal);
  if (recorded) timeline.write(options.timeline, timeline_title);

  return s;
}

std::vector<int> parse_batches(const std::vector<std::string>& items) {
  std::vector<int> out;
  auto to_int = [](const std::string& s) {
    std::size_t used = 0;
    long v = -1;
    try {
      v = std::stol(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    ESS_CHECK(used == s.size() && used > 0 && v >= 1 && v <= 1'000'000,
              "--batch: '{}' is not a batch size (a positive integer, a range A-B, or max)", s);
    return static_cast<int>(v);
  };
  for (const std::string& item : items) {
    if (item == "max") {
      out.push_back(0);
      continue;
    }
    const auto dash = item.find('-');
    if (dash != std::string::npos && dash > 0) {
      const int a = to_int(item.substr(0, dash)), b = to_int(item.substr(dash + 1));
      ESS_CHECK(a <= b, "--batch: range '{}' is empty", item);
      for (int x = a; x <= b; ++x) out.push_back(x);
    } else {
      out.push_back(to_int(item));
    }
  }
  ESS_CHECK(!out.empty(), "--batch: no batch size given");
  return out;
}

nlohmann::json to_json(const Simulation& s) {
  nlohmann::json j;
  j["model"] = s.model.name;
  j["hardware"] = s.hardware.name;
  j["gpu"] = s.hardware.gpu;
  j["deployment"] = s.deployment.to_json();
  j["context"] = s.base.context;
  j["residency"] = std::string(to_string(s.base.residency));
  j["cache_budget_gb"] = s.cache_budget_gb;
  j["weights_gb"] = s.weights_gb;
  j["pool_floor"] = {{"slots", s.pool_floor}, {"rule", s.pool_floor_rule}};
  j["index_sharing"] = index_sharing_json(s.model, s.deployment);
  j["baseline"] = s.wall_fits ? row_json(s.wall) : nlohmann::json(nullptr);
  nlohmann::json arr = nlohmann::json::array();
  for (const SimulationRow& r : s.rows) {
    if (!r.refused.empty()) {
      arr.push_back({{"batch", r.ess.batch}, {"refused", r.refused}});
      continue;
    }
    nlohmann::json e = row_json(r.ess);
    e["host_dram_fits"] = r.ess.host_pool_gb_per_node <= s.hardware.host_dram_usable_gb();
    e["host_bandwidth_fits"] = r.ess.h2d_gbps_per_node <= s.hardware.host_dram_bandwidth_gbps;
    e["gain_vs_baseline"] = s.wall_fits ? nlohmann::json(s.gain(r.ess)) : nlohmann::json(nullptr);
    e["all_on_gpu_at_batch"] = r.baseline_fits ? row_json(r.baseline) : nlohmann::json(nullptr);
    e["vs_all_on_gpu_at_batch"] = r.baseline_fits ? nlohmann::json(Simulation::same_batch(r)) : nlohmann::json(nullptr);
    if (r.paper != nullptr) {
      e["paper"] = {{"ratio", r.paper->ratio},
                    {"throughput_tokens_per_s", r.paper->throughput_tokens_per_s},
                    {"otps", r.paper->otps}};
    }
    arr.push_back(e);
  }
  j["rows"] = arr;
  const int pays = s.offload_pays_from();
  j["offload_pays_from_batch"] = pays > 0 ? nlohmann::json(pays) : nlohmann::json(nullptr);
  return j;
}

std::string to_csv(const Simulation& s) {
  std::string out =
      "batch,ratio,slots,overlap,step_ms,throughput_tokens_per_s,otps,compute_ms,exposed_comm_ms,"
      "exposed_transfer_ms,host_ms,other_idle_ms,misses_per_request_layer,gain_vs_baseline,"
      "all_on_gpu_throughput_tokens_per_s,refused\n";
  for (const SimulationRow& r : s.rows) {
    const StepResult& e = r.ess;
    if (!r.refused.empty()) {
      std::string why = r.refused;
      std::replace(why.begin(), why.end(), '"', '\'');
      fmt::format_to(std::back_inserter(out), "{},,,,,,,,,,,,,,,\"{}\"\n", e.batch, why);
      continue;
    }
    fmt::format_to(std::back_inserter(out),
                   "{},{:.4f},{},{},{:.3f},{:.1f},{:.3f},{:.3f},{:.3f},{:.3f},{:.3f},{:.3f},{:.1f},{},{}\n", e.batch,
                   e.ratio, e.slots, to_string(e.overlap), ms(e.step_us), e.throughput_tokens_per_s, e.otps,
                   ms(e.compute_us), ms(e.exposed_comm_us), ms(e.exposed_transfer_us), ms(e.step_overhead_us),
                   ms(other_idle_us(e)), e.misses_per_request_layer,
                   s.wall_fits ? fmt::format("{:.4f}", s.gain(e)) : "",
                   r.baseline_fits ? fmt::format("{:.1f}", r.baseline.throughput_tokens_per_s) : "");
    out.pop_back();
    out += ",\n";
  }
  return out;
}

namespace {

// Adaptive residency over a load: what ESS costs while the all-on-GPU step still fits, and from
// which batch offload pays.
std::string load_summary(const Simulation& s) {
  std::string out;
  // The lowest same-batch ratio among the rows whose requests are all whole, and among the others.
  const SimulationRow* worst[2] = {nullptr, nullptr};
  for (const SimulationRow& r : s.rows) {
    const double v = Simulation::same_batch(r);
    const SimulationRow*& w = worst[r.ess.whole_requests == r.ess.batch ? 0 : 1];
    if (v > 0 && (w == nullptr || v < Simulation::same_batch(*w))) w = &r;
  }
  if (const SimulationRow* r = worst[0]) {
    fmt::format_to(std::back_inserter(out),
                   "low load: with every request whole, ESS runs at >= {:.3f}x of all-on-GPU (batch {}): whole "
                   "requests still write their newest entries back ({:.2f} ms of SM time per step), so that the host "
                   "pool stays complete for a demotion\n",
                   Simulation::same_batch(*r), r->ess.batch, ms(r->ess.transfer_sm_us));
  }
  if (const SimulationRow* r = worst[1]) {
    fmt::format_to(std::back_inserter(out),
                   "near the memory wall: batch {} holds {} of its {} requests whole beside the others' pools and runs "
                   "at {:.3f}x of all-on-GPU (the sparse ones fetch their misses)\n",
                   r->ess.batch, r->ess.whole_requests, r->ess.batch, Simulation::same_batch(*r));
  }
  if (const int b = s.offload_pays_from(); b > 0) {
    fmt::format_to(std::back_inserter(out), "offload pays from batch {} (the all-on-GPU memory wall is batch {})\n", b,
                   s.wall.batch);
  } else if (s.wall_fits) {
    fmt::format_to(std::back_inserter(out),
                   "offload does not pay in these rows: none past the all-on-GPU memory wall (batch {}) beats it\n",
                   s.wall.batch);
  }
  return out;
}

}  // namespace

std::string to_table(const Simulation& s) {
  std::string out;
  auto add = [&out]<typename... A>(fmt::format_string<A...> f, A&&... a) {
    fmt::format_to(std::back_inserter(out), f, std::forward<A>(a)...);
  };
  const Deployment& dep = s.deployment;
  const HardwareProfile& hw = s.hardware;
  const std::int64_t context = s.base.context;
  if (s.rig) {
    add("ess sim: {} on {} | executor rig: {} MoE layers on one GPU, experts of EP {}, MTP {}, no all-to-all / "
        "TBO / LM head | context {} | overlap {}\n",
        s.model.name, on_gpu(hw), dep.rig_layers, dep.expert_parallel, dep.mtp_tokens, context, to_string(s.base.overlap));
    add("no memory model on the rig; all-on-GPU: the rig's all-resident step at the same batch\n\n");
  } else {
    add("ess sim: {} on {} | {} nodes x {} GPUs{}, EP {}, MTP {} (accept {}), TBO {} | context {} | overlap {}\n",
        s.model.name, on_gpu(hw), dep.nodes, dep.gpus_per_node, attention_tp(dep), dep.expert_parallel, dep.mtp_tokens,
        dep.accept_ratio, dep.two_batch_overlap ? "on" : "off", context, to_string(s.base.overlap));
    add("per GPU: {:.1f} GB HBM x {} static = {:.1f} GB weights + {:.1f} GB for the caches\n", hw.hbm_capacity_gb,
        dep.mem_fraction_static, s.weights_gb, s.cache_budget_gb);
    add("{}", attention_tp_line(s.model, dep));
    add("pool floor: {:.0f} slots per request-layer ({})\n", s.pool_floor, s.pool_floor_rule);
    add("{}", index_sharing_line(s.model, dep));
    if (s.wall_fits) {
      add("all-on-GPU baseline (memory wall): batch {}, step {:.2f} ms, {:.0f} tokens/s per node, {:.2f} tokens/s per "
          "request\n\n",
          s.wall.batch, ms(s.wall.step_us), s.wall.throughput_tokens_per_s, s.wall.otps);
    } else {
      add("all-on-GPU baseline: no request fits without offload at this context\n\n");
    }
  }
  const bool any_paper = std::any_of(s.rows.begin(), s.rows.end(), [](const SimulationRow& r) { return r.paper != nullptr; });
  // The step's columns add up: step = compute + x-comm + x-h2d + host (+ idle, shown when a row has any).
  const bool any_idle = std::any_of(s.rows.begin(), s.rows.end(),
                                    [](const SimulationRow& r) { return r.refused.empty() && other_idle_us(r.ess) > 0; });
  const bool any_whole = s.base.residency == Residency::kAdaptive;
  add("{:>5} {:>6} {:>6} {:>8} {:>8} {:>7} {:>7} {:>7}", "batch", "ratio", "slots", "step ms", "compute", "x-comm",
      "x-h2d", "host");
  if (any_idle) add(" {:>7}", "idle");
  add(" {:>7}", "misses");
  if (any_whole) add(" {:>5}", "whole");
  add(" {:>11} {:>7} {:>7} {:>11}", "tok/s/node", "OTPS", "gain", "all-on-GPU");
  if (any_whole) add(" {:>7}", "vs same");
  if (any_paper) add(" | {:>5} {:>10} {:>7} {:>6}", "paper", "tok/s", "err", "OTPS");
  add("\n");
  for (const SimulationRow& r : s.rows) {
    const StepResult& e = r.ess;
    if (!r.refused.empty()) {
      add("{:>5} does not run: {}\n", e.batch, r.refused);
      continue;
    }
    add("{:>5} {:>6.3f} {:>6} {:>8.2f} {:>8.2f} {:>7.2f} {:>7.2f} {:>7.2f}", e.batch, e.ratio, e.slots, ms(e.step_us),
        ms(e.compute_us), ms(e.exposed_comm_us), ms(e.exposed_transfer_us), ms(e.step_overhead_us));
    if (any_idle) add(" {:>7.2f}", ms(other_idle_us(e)));
    add(" {:>7.1f}", e.misses_per_request_layer);
    if (any_whole) add(" {:>5}", e.whole_requests);
    add(" {:>11.0f} {:>7.2f} {:>6.1f}% {:>11}", e.throughput_tokens_per_s, e.otps, 100 * s.gain(e),
        r.baseline_fits ? fmt::format("{:.0f}", r.baseline.throughput_tokens_per_s) : "OOM");
    if (any_whole) add(" {:>7}", r.baseline_fits ? fmt::format("{:.3f}x", Simulation::same_batch(r)) : "");
    if (r.paper != nullptr) {
      add(" | {:>5.2f} {:>10.0f} {:>+6.1f}% {:>6.2f}", r.paper->ratio, r.paper->throughput_tokens_per_s,
          100 * (e.throughput_tokens_per_s / r.paper->throughput_tokens_per_s - 1), r.paper->otps);
    }
    add("\n");
  }
  for (const SimulationRow& r : s.rows) {
    const StepResult& e = r.ess;
    if (!r.refused.empty()) continue;
    if (e.host_pool_gb_per_node > hw.host_dram_usable_gb()) {
      add("\nwarning: batch {}: the node's Total Memory Pool ({:.0f} GB) exceeds the host DRAM it may use ({:.0f} of {} GB, "
          "{:.0f} % reserved: --host-reserve)",
          e.batch, e.host_pool_gb_per_node, hw.host_dram_usable_gb(), hw.host_dram_gb, 100 * hw.host_dram_reserve);
    }
    if (e.miss_capped_layers > 0) {
      add("\nnote: batch {}: at {} slots the miss model exceeds T x top-k in {} layers; taken as T x top-k (every "
          "selected entry missing)", e.batch, e.slots, e.miss_capped_layers);
    }
    if (e.split_calls_per_layer > 0) {
      add("\nnote: batch {}: {} slots are below the MTP working set's max; steps that exceed them run in query groups, "
          "charged as up to {:.2f} extra step calls per layer and micro-batch", e.batch, e.slots, e.split_calls_per_layer);
    }
    if (e.h2d_gbps_per_node > hw.host_dram_bandwidth_gbps) {
      add("\nwarning: batch {}: H2D traffic ({:.0f} GB/s per node) exceeds host-memory bandwidth ({} GB/s)", e.batch,
          e.h2d_gbps_per_node, hw.host_dram_bandwidth_gbps);
    }
  }
  add("\nratio: Sparse Memory Ratio that fits the batch; x-comm / x-h2d: compute stream idle waiting for the "
      "{} / the misses' copy; host: the host's time between steps (scheduling, sampling bookkeeping), the "
      "step = compute + x-comm + x-h2d + host{}; misses: mean per request-layer-step (--miss-profile, else the "
      "parametric model){}; gain: throughput vs the all-on-GPU baseline at its largest batch; all-on-GPU: its "
      "throughput at the same batch (OOM: does not fit){}.\n",
      dep.attention_tensor_parallel > 1 ? "all-reduces" : "all-to-all", any_idle ? " + idle (compute stream idle for another reason: the other micro-batch, a D2H copy, or the step "
                 "ending on another stream)"
               : "",
      any_whole ? "; whole: requests whole on the GPU (--residency adaptive: no misses, no swap)" : "",
      any_whole ? "; vs same: ESS's throughput over all-on-GPU's at the same batch" : "");
  if (any_whole) add("{}", load_summary(s));
  return out;
}

bool Plans::all_found() const {
  return std::all_of(results.begin(), results.end(), [](const PlanResult& r) { return r.found; });
}

nlohmann::json to_json(const Plans& p) {
  nlohmann::json arr = nlohmann::json::array();
  for (const auto& r : p.results) {
    nlohmann::json alts = nlohmann::json::array();
    for (const auto& o : r.alternatives) alts.push_back(option_json(o));
    arr.push_back({{"context", r.context},
                   {"min_otps", r.min_otps},
                   {"found", r.found},
                   {"chosen", r.found ? option_json(r.chosen) : nlohmann::json(nullptr)},
                   {"alternatives", alts},
                   {"refusals", r.refusals},
                   {"notes", r.notes},
                   {"evaluated", r.evaluated}});
    if (r.low_load.found) {
      const LowLoad& l = r.low_load;
      arr.back()["low_load"] = {{"residency", "adaptive"},
                                {"all_whole_up_to_batch", l.all_whole_up_to},
                                {"batch1_vs_all_on_gpu", l.batch1_adaptive > 0 ? nlohmann::json(l.batch1_adaptive) : nlohmann::json(nullptr)},
                                {"batch1_sparse_vs_all_on_gpu", l.batch1_sparse > 0 ? nlohmann::json(l.batch1_sparse) : nlohmann::json(nullptr)}};
    }
    if (!p.engine.empty()) arr.back()["launch"] = p.launches.at(arr.size() - 1);
    if (arr.size() <= p.stock.size() && !p.stock[arr.size() - 1].is_null()) {
      arr.back()["stock_hisparse"] = p.stock[arr.size() - 1];
    }
  }
  nlohmann::json j = {{"model", p.model.name}, {"hardware", p.hardware.name}, {"gpu", p.hardware.gpu},
                      {"deployment", p.deployment.to_json()}, {"plans", arr}};
  j["index_sharing"] = index_sharing_json(p.model, p.deployment);
  if (!p.engine.empty()) {
    j["engine"] = p.engine;
    j["engine_notes"] = p.engine_notes;
  }
  return j;
}

std::string to_csv(const Plans& p) {
  std::string out = "context,min_otps,found,label,batch,ratio,overlap,step_ms,throughput_tokens_per_s,otps\n";
  for (const auto& r : p.results) {
    auto line = [&](const PlanOption& o) {
      if (!o.found) {
        fmt::format_to(std::back_inserter(out), "{},{},{},{},,,,,,\n", r.context, r.min_otps, false, o.label);
        return;
      }
      fmt::format_to(std::back_inserter(out), "{},{},{},{},{},{:.4f},{},{:.3f},{:.1f},{:.3f}\n", r.context, r.min_otps,
                     true, o.label, o.best.batch, o.best.ratio, to_string(o.best.overlap), ms(o.best.step_us),
                     o.best.throughput_tokens_per_s, o.best.otps);
    };
    if (r.found) line(r.chosen);
    for (const auto& o : r.alternatives) line(o);
  }
  return out;
}

std::string to_table(const Plans& p) {
  std::string out;
  auto add = [&out]<typename... A>(fmt::format_string<A...> f, A&&... a) {
    fmt::format_to(std::back_inserter(out), f, std::forward<A>(a)...);
  };
  const Deployment& dep = p.deployment;
  add("ess plan: {} on {} | {} nodes x {} GPUs{}, EP {}, MTP {} (accept {}), TBO {} | min OTPS {}\n", p.model.name,
      on_gpu(p.hardware), dep.nodes, dep.gpus_per_node, attention_tp(dep), dep.expert_parallel, dep.mtp_tokens,
      dep.accept_ratio, dep.two_batch_overlap ? "on" : "off", p.min_otps);
  add("{}", attention_tp_line(p.model, dep));
  add("{}", index_sharing_line(p.model, dep, true));
  if (!p.engine.empty()) add("engine: {} ({})\n", p.engine, p.engine_notes.empty() ? "as asked" : fmt::format("{}", fmt::join(p.engine_notes, "; ")));
  for (std::size_t i = 0; i < p.results.size(); ++i) {
    const PlanResult& r = p.results[i];
    add("\ncontext {} ({} configurations evaluated)\n", r.context, r.evaluated);
    if (r.found) {
      add("  chosen: {}\n", option_line(r.chosen));
      add("          limit: {}\n", r.chosen.limit);
      if (p.explain) add("{}", explain_line(r.chosen, p.hardware, "          "));
      if (r.chosen.best.offload && r.chosen.best.overlap == OverlapMode::kLayerWise) {
        add("          layer-wise: {} micro-batch layers DA, {} DBA; per layer (micro-batch A B; a = DA, b = DBA): {}\n",
            r.chosen.best.layers_da, r.chosen.best.layers_dba, r.chosen.best.layer_modes);
      }
      if (const LowLoad& l = r.low_load; l.found) {
        add("          low load (ESS_RESIDENCY=adaptive): every request whole up to batch {} per {}", l.all_whole_up_to,
            dep.attention_tensor_parallel > 1 ? "instance" : "GPU");
        if (l.batch1_adaptive > 0) {
          add("; batch 1 at {:.3f}x of all-on-GPU ({:.3f}x with every request sparse)", l.batch1_adaptive,
              l.batch1_sparse);
        }
        add("\n");
      }
      if (r.chosen.best.offload) {
        const StepResult& b = r.chosen.best;
        add("          host pool: {:.0f} GB per node{}\n", b.host_pool_gb_per_node,
            b.host_pool_gb_per_node < b.host_pool_gb_per_node_unshared
                ? fmt::format(" ({:.0f} GB without the shared prompt prefix)", b.host_pool_gb_per_node_unshared)
                : std::string());
      }
    } else {
      add("  no configuration meets {} tokens/s per request\n", r.min_otps);
    }
    for (const auto& o : r.alternatives) {
      add("  {}\n      {}\n", option_line(o), o.why);
      if (p.explain && o.found) {
        if (o.why.find(o.limit) == std::string::npos) add("      limit: {}\n", o.limit);
        add("{}", explain_line(o, p.hardware, "      "));
      }
    }
    for (const auto& s : r.refusals) add("  refused: {}\n", s);
    for (const auto& s : r.notes) add("  note: {}\n", s);
    if (!p.engine.empty() && r.found && !p.launches.at(i).is_null()) {  // null: none for this model (its notes say why)
      const nlohmann::json& l = p.launches.at(i);
      add("  launch ({} {}):\n    {}\n", l["engine"].get<std::string>(), l["release"].get<std::string>(),
          l["command_line"].get<std::string>());
      for (const auto& n : l["notes"]) add("    ({})\n", n.get<std::string>());
    }
    if (i < p.stock.size() && !p.stock[i].is_null() && r.found) {
      const nlohmann::json& s = p.stock[i];
      const double tput = s["throughput_tokens_per_s_per_node"].get<double>();
      add("  stock HiSparse (SGLang {}'s defaults: device_buffer_size {}, host_to_device_ratio 2; simulated, serial swap): "
          "batch {} per GPU, step {:.2f} ms, {:.0f} tok/s/node, {:.2f} OTPS; ESS's choice gives {:.2f}x its throughput\n"
          "      limit: {}\n",
          "0.5.23", s["config"]["device_buffer_size"].get<int>(), s["batch"].get<int>(), s["step_ms"].get<double>(), tput,
          s["otps"].get<double>(), tput > 0 ? r.chosen.best.throughput_tokens_per_s / tput : 0.0,
          s["limit"].get<std::string>());
    }
  }
  return out;
}

}  // namespace ess::sim
