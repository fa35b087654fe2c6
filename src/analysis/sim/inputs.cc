#include "ess/sim/inputs.h"

#include <algorithm>
#include <cmath>

#include "ess/core/error.h"
#include "ess/core/json.h"
#include "ess/sim/launch.h"
#include "ess/sim/overlap.h"
#include "ess/sim/planner.h"

namespace ess::sim {

ModelSpec Inputs::load_model() const { return model.empty() ? ModelSpec::deepseek_v32_exp() : ModelSpec::from_file(model); }

HardwareProfile Inputs::load_hardware() const {
  HardwareProfile hw = HardwareProfile::load(hardware);
  if (host_reserve) {
    hw.host_dram_reserve = *host_reserve;
    hw.sources["host_dram_reserve"] = "--host-reserve";
    hw.validate("hardware (after --host-reserve)");
  }
  return hw;
}

Deployment Inputs::load_deployment() const {
  const bool default_deployment = deployment.empty();
  const bool m3 = default_deployment && !model.empty() && load_model().is_minimax_m3();
  // No deployment given: the paper's; for MiniMax-M3 the shipped one its HiSparse runs (attention TP over one
  // node, one KV head per rank).
  Deployment d = Deployment::load(!default_deployment ? deployment
                                  : m3                ? std::string(kMiniMaxM3Deployment)
                                                      : std::string("paper-table1"));
  if (!mtp && (default_deployment || deployment == "paper-table1") && !model.empty() && load_model().is_deepseek_v4()) {
    // The shipped deployment's MTP 2 for DeepSeek-V4, which SGLang's HiSparse serves without speculative
    // decoding: one query token per step (a deployment of the user's keeps its own, and is refused if it
    // asks for more).
    d.mtp_tokens = 1;
    d.accept_ratio = 1;
  }
  if (mtp) d.mtp_tokens = *mtp;
  if (accept) d.accept_ratio = *accept;
  if (mtp && !accept) d.accept_ratio = std::min(d.accept_ratio, static_cast<double>(*mtp));
  if (nodes) d.nodes = *nodes;
  if (gpus_per_node) d.gpus_per_node = *gpus_per_node;
  d.check_counts("deployment (after command-line overrides)");
  if (ep) d.expert_parallel = *ep;
  if ((nodes || gpus_per_node) && !ep) d.expert_parallel = d.gpus();
  if ((nodes || gpus_per_node) && d.attention_tensor_parallel > 1) {
    d.attention_tensor_parallel = d.gpus();  // attention tensor parallel over every GPU, as given
    d.attention_data_parallel = 1;
  } else if (nodes || gpus_per_node) {
    d.attention_data_parallel = d.gpus();
  }
  if (mem_fraction) d.mem_fraction_static = *mem_fraction;
  if (no_tbo) d.two_batch_overlap = false;
  if (no_prefetch) d.shared_index_prefetch = false;
  if (rig_layers) d.rig_layers = *rig_layers;
  d.validate("deployment (after command-line overrides)");
  return d;
}

MissModel Inputs::load_misses(std::int64_t context) const {
  MissModel m;
  if (reference_misses) m.reference_misses = *reference_misses;
  if (miss_exponent) m.exponent = *miss_exponent;
  if (reference_misses || miss_exponent) m.builtin = false;
  if (miss_profile.empty()) {
    // No trace: the pool floor from the MTP working set of the built-in locality model.
    m = MissModel::with_builtin_working_set(context, m);
  } else {
    m = MissModel::load_profile(miss_profile, context, m);
    // A trace's profile sets its own reference point: a --misses beside it would be dropped.
    ESS_CHECK(!reference_misses || m.reference_misses == *reference_misses,
              "--misses {} and --miss-profile {} both set the mean misses; pass one", *reference_misses, miss_profile);
  }
  apply_pool_floor(m);
  m.validate("--misses / --miss-exponent / --miss-profile");
  return m;
}

void Inputs::apply_pool_floor(MissModel& m) const {
  if (pool_floor) m.pool_floor = *pool_floor;
  if (pool_floor_margin) m.floor_margin = *pool_floor_margin;
  m.validate("--pool-floor / --pool-floor-margin");
}

std::unique_ptr<MeasuredTables> Inputs::load_tables() const {
  if (op_table.empty()) return nullptr;
  return std::make_unique<MeasuredTables>(MeasuredTables::from_csv(op_table));
}

Plans plan_contexts(const Inputs& inputs, const PlanOptions& options) {
  const ModelSpec model = inputs.load_model();
  const HardwareProfile hw = inputs.load_hardware();
  Deployment dep = inputs.load_deployment();
  ESS_CHECK(!options.modes.empty(), "plan: no overlap mode to try");
  for (const auto& m : options.modes) (void)parse_overlap_mode(m);  // each named mode checked first
  const EngineLimits limits =
      engine_limits(options.engine, inputs.pool_floor.value_or(""), inputs.pool_floor.has_value(), dep.mtp_tokens);
  dep.preattn_in_copy_window = dep.preattn_in_copy_window && limits.preattn_in_copy_window;
  dep.shared_index_prefetch = dep.shared_index_prefetch && limits.shared_index_prefetch;
  std::vector<std::string> notes = limits.notes;
  std::vector<std::string> modes = options.modes;
  const bool dsa = !model.is_deepseek_v4() && !model.is_minimax_m3();
  if (!dsa) {
    const std::string family = model.is_deepseek_v4() ? "DeepSeek-V4" : "MiniMax-M3";
    ESS_CHECK(options.engine != kVllmEngine,
              "plan --engine vllm: {}: ESS's vLLM connector is checked with DSA models' sparse MLA (vLLM 0.33.0's "
              "index groups); {} is planned for SGLang or without an engine",
              model.name, family);
    notes.push_back(model.is_deepseek_v4()
                        ? "DeepSeek-V4: T = 1 (SGLang 0.5.23's HiSparse refuses speculative decoding with it); slots, "
                          "top-k and misses count C4 entries of 4 tokens"
                        : fmt::format("MiniMax-M3: attention tensor parallel over {} GPUs, one KV head per rank (SGLang "
                                      "0.5.23's HiSparse); T = 1; a batch is the instance's, slots and misses count "
                                      "tokens, its top-k {} blocks of {}",
                                      dep.attention_tensor_parallel, model.selected_ids(), model.sparse_block_size));
    if (std::erase_if(modes, [](const std::string& m) { return m != "none"; }) > 0) {
      notes.push_back(family + ": overlap none only (the overlap schedules split DSA's FlashMLA decode; the SGLang "
                      "adapter refuses ESS_OVERLAP with its pool)");
    }
    ESS_CHECK(!modes.empty(), "plan: {} runs overlap none only, and --modes leaves it out", family);
    if (!options.engine.empty()) {
      // DeepSeek-V4's host_to_device_ratio sizes its C4 pool otherwise (pool_configurator.py: full tokens // (4 x
      // ratio)); stock HiSparse's sizing is modelled on DSA's pools.
      notes.push_back(model.is_deepseek_v4()
                          ? family + ": no launch command and no stock-HiSparse comparison yet (both are modelled on "
                                     "DSA's pools and flags)"
                          : family + ": no stock-HiSparse comparison yet (its sizing is modelled on DSA's pools)");
    }
  }
  if (!limits.shared_index_prefetch && !model.shared_index.empty()) {
    notes.push_back("a shared-index layer swaps at its own turn (the adapter issues no prefetch)");
  }
  if (options.engine == kSglangEngine && model.declares_index_sharing && dep.two_batch_overlap) {
    // SGLang refuses it at launch (arg_groups/model_hook.py, _validate_dsa_tbo_index_sharing).
    dep.two_batch_overlap = false;
    notes.push_back("TBO off (SGLang 0.5.23 refuses two-batch overlap with index sharing: its TBO path does not carry "
                    "the top-k to the shared layers)");
  }
  const auto tables = inputs.load_tables();
  const StepModel sm(model, hw, dep, tables.get());
  // With Two-Batch Overlap on, the search covers it off as well (a small batch may do better without it).
  Deployment no_tbo = dep;
  no_tbo.two_batch_overlap = false;
  const StepModel sm_no_tbo(model, hw, no_tbo, tables.get());
  // With index sharing and the prefetch on, the search covers it off as well (its copies queue on
  // the one host-to-device link and take SMs from the compute they run beside).
  Deployment no_prefetch = dep, no_tbo_no_prefetch = no_tbo;
  no_prefetch.shared_index_prefetch = no_tbo_no_prefetch.shared_index_prefetch = false;
  const StepModel sm_no_prefetch(model, hw, no_prefetch, tables.get());
  const StepModel sm_no_tbo_no_prefetch(model, hw, no_tbo_no_prefetch, tables.get());
  const bool both_prefetch = dep.shared_index_prefetch && !model.shared_index.empty();
  std::vector<const StepModel*> models = {&sm};
  std::vector<std::string> suffixes = {""};
  if (dep.two_batch_overlap && !inputs.rig_layers) {
    models.push_back(&sm_no_tbo);
    suffixes.push_back(", TBO off");
  }
  PlanRequest base;
  base.min_otps = options.min_otps;
  base.batch_step = options.batch_step;
  ESS_CHECK(options.batch_step >= 1, "plan: batch_step = {} must be >= 1", options.batch_step);
  ESS_CHECK(std::isfinite(options.min_otps) && options.min_otps >= 0, "plan: min_otps = {} must be a finite number >= 0",
            options.min_otps);
  ESS_CHECK(!inputs.rig_layers, "plan: --rig-layers models the single-GPU rig of `ess bench step`; plan a deployment");
  if (!limits.two_batch_overlap) {  // the engine runs none: the search without it
    models = {&sm_no_tbo};
    suffixes = {""};
  }
  if (both_prefetch) {
    const std::size_t n = models.size();
    for (std::size_t k = 0; k < n; ++k) {
      models.push_back(models[k] == &sm ? &sm_no_prefetch : &sm_no_tbo_no_prefetch);
      suffixes.push_back(suffixes[k] + ", no prefetch");
    }
  }
  base.modes.clear();
  for (const auto& m : modes) base.modes.push_back(parse_overlap_mode(m));
  Inputs engine_inputs = inputs;
  if (!limits.pool_floor.empty()) engine_inputs.pool_floor = limits.pool_floor;
  ESS_CHECK(!options.contexts.empty(), "plan: no context length given");
  Plans plans{model, hw, limits.two_batch_overlap ? dep : no_tbo, options.min_otps, {}, options.engine, notes, {}, {}};
  for (std::int64_t ctx : options.contexts) {
    ESS_CHECK(ctx >= 1 && ctx <= (std::int64_t{1} << 24), "plan: context {} must be in [1, 2^24]", ctx);
    PlanRequest r = base;
    r.context = ctx;
    r.misses = engine_inputs.load_misses(ctx);
    r.prefix_share = inputs.prefix_share.value_or(0.0);
    plans.results.push_back(plan(models, suffixes, r));
    if (!limits.whole_residency) plans.results.back().low_load = {};
    const PlanResult& got = plans.results.back();
    // DeepSeek-V4: no launch command; V4, MiniMax-M3: no stock-HiSparse comparison (modelled on DSA's pools).
    plans.launches.push_back(options.engine.empty() || !got.found || model.is_deepseek_v4()
                                 ? nlohmann::json()
                                 : launch_for(options.engine, model, hw, plans.deployment, got).to_json());
    plans.stock.push_back(got.found && dsa ? stock_hisparse(options.engine, *models.front(), r).to_json() : nlohmann::json());
    if (options.progress) options.progress(plans.results.size(), options.contexts.size());
  }
  return plans;
}

namespace {

template <typename T>
void read_optional(const nlohmann::json& j, const char* field, std::optional<T>& out, const std::string& source) {
  if (!j.contains(field)) return;
  T value{};
  json_read(j, field, value, source);
  out = value;
}

}  // namespace

void read_plan_request(const nlohmann::json& j, Inputs& in, PlanOptions& opt) {
  const std::string source = "plan request";
  ESS_CHECK(j.is_object(), "{}: must be a JSON object, not {}", source, j.type_name());
  json_check_keys(j,
                  {"contexts", "min_otps", "modes", "batch_step", "model", "hardware", "deployment", "mtp", "accept",
                   "nodes", "gpus_per_node", "ep", "mem_fraction", "no_tbo", "no_prefetch", "misses", "miss_exponent", "miss_profile",
                   "pool_floor", "pool_floor_margin", "prefix_share", "host_reserve",
                   "op_table", "engine"},
                  source, "request");
  json_read(j, "contexts", opt.contexts, source);
  json_read(j, "min_otps", opt.min_otps, source);
  json_read(j, "modes", opt.modes, source);
  json_read(j, "engine", opt.engine, source);
  json_read(j, "batch_step", opt.batch_step, source);
  json_read(j, "model", in.model, source);
  json_read(j, "hardware", in.hardware, source);
  json_read(j, "deployment", in.deployment, source);
  read_optional(j, "mtp", in.mtp, source);
  read_optional(j, "accept", in.accept, source);
  read_optional(j, "nodes", in.nodes, source);
  read_optional(j, "gpus_per_node", in.gpus_per_node, source);
  read_optional(j, "ep", in.ep, source);
  read_optional(j, "mem_fraction", in.mem_fraction, source);
  json_read(j, "no_tbo", in.no_tbo, source);
  json_read(j, "no_prefetch", in.no_prefetch, source);
  read_optional(j, "misses", in.reference_misses, source);
  read_optional(j, "miss_exponent", in.miss_exponent, source);
  read_optional(j, "pool_floor", in.pool_floor, source);
  read_optional(j, "pool_floor_margin", in.pool_floor_margin, source);
  read_optional(j, "prefix_share", in.prefix_share, source);
  read_optional(j, "host_reserve", in.host_reserve, source);
  json_read(j, "miss_profile", in.miss_profile, source);
  json_read(j, "op_table", in.op_table, source);
}

}  // namespace ess::sim
