#include "ess/sim/deployment.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

#include "analysis/sim/shipped_configs.h"
#include "ess/core/error.h"
#include "ess/core/json.h"
#include "ess/trace/generator.h"

namespace ess::sim {

using nlohmann::json;

// ---- Deployment ------------------------------------------------------------------------

Deployment Deployment::from_json(const json& j, const std::string& source) {
  ESS_CHECK(j.is_object(), "{}: a deployment must be a JSON object", source);
  static constexpr const char* kKnown[] = {"name", "nodes", "gpus_per_node", "expert_parallel",
                                           "attention_data_parallel", "attention_tensor_parallel", "mtp_tokens", "accept_ratio",
                                           "two_batch_overlap", "preattn_in_copy_window", "shared_index_prefetch",
                                           "mem_fraction_static",
                                           "rig_layers", "sources"};
  for (const auto& [k, v] : j.items()) {
    (void)v;
    bool known = false;
    for (const char* n : kKnown) known = known || k == n;
    ESS_CHECK(known, "{}: unknown deployment field '{}'", source, k);
  }
  Deployment d;
  d.name = json_string(j, "name", source, false);
  if (d.name.empty()) d.name = source;
  auto get_int = [&](const char* field, int fallback) {
    const std::int64_t v = json_int_or(j, field, source, fallback);
    ESS_CHECK(v >= 0 && v <= 1 << 20, "{}: field '{}' = {} is out of range", source, field, v);
    return static_cast<int>(v);
  };
  d.nodes = get_int("nodes", d.nodes);
  d.gpus_per_node = get_int("gpus_per_node", d.gpus_per_node);
  d.expert_parallel = get_int("expert_parallel", d.expert_parallel);
  d.attention_data_parallel = get_int("attention_data_parallel", d.attention_data_parallel);
  d.attention_tensor_parallel = get_int("attention_tensor_parallel", d.attention_tensor_parallel);
  d.mtp_tokens = get_int("mtp_tokens", d.mtp_tokens);
  d.accept_ratio = json_number_or(j, "accept_ratio", source, d.accept_ratio);
  d.two_batch_overlap = json_bool_or(j, "two_batch_overlap", source, d.two_batch_overlap);
  d.preattn_in_copy_window = json_bool_or(j, "preattn_in_copy_window", source, d.preattn_in_copy_window);
  d.shared_index_prefetch = json_bool_or(j, "shared_index_prefetch", source, d.shared_index_prefetch);
  d.mem_fraction_static = json_number_or(j, "mem_fraction_static", source, d.mem_fraction_static);
  d.rig_layers = get_int("rig_layers", d.rig_layers);
  if (auto it = j.find("sources"); it != j.end()) d.sources = it->dump();
  d.validate(source);
  return d;
}

void Deployment::check_counts(const std::string& source) const {
  ESS_CHECK(nodes >= 1 && nodes <= kMaxNodes, "{}: nodes = {} must be in [1, {}]", source, nodes, kMaxNodes);
  ESS_CHECK(gpus_per_node >= 1 && gpus_per_node <= kMaxGpusPerNode, "{}: gpus_per_node = {} must be in [1, {}]", source,
            gpus_per_node, kMaxGpusPerNode);
}

void Deployment::validate(const std::string& source) const {
  check_counts(source);
  ESS_CHECK(rig_layers >= 0 && rig_layers <= 1024, "{}: rig_layers = {} must be in [0, 1024]", source, rig_layers);
  ESS_CHECK(expert_parallel >= 1 && (rig_layers > 0 || expert_parallel <= gpus()),
            "{}: expert_parallel = {} must be in [1, nodes x gpus_per_node = {}]", source,
            expert_parallel, gpus());
  ESS_CHECK(rig_layers > 0 || gpus() % expert_parallel == 0,
            "{}: expert_parallel = {} does not divide the {} GPUs (each EP group spans whole GPUs)", source,
            expert_parallel, gpus());
  // Attention data parallel on every GPU (TP 1), or tensor parallel over every GPU (DP 1): a mix
  // (SGLang's DP attention with attention TP > 1 gathers tokens across groups) is not modelled.
  ESS_CHECK(attention_tensor_parallel == 1 || attention_tensor_parallel == gpus(),
            "{}: attention_tensor_parallel = {}: attention tensor parallel over every GPU ({}) or none (1) is modelled",
            source, attention_tensor_parallel, gpus());
  ESS_CHECK(attention_data_parallel * attention_tensor_parallel == gpus(),
            "{}: attention_data_parallel = {} x attention_tensor_parallel = {} must be the {} GPUs (every GPU in one "
            "attention group)",
            source, attention_data_parallel, attention_tensor_parallel, gpus());
  if (attention_tensor_parallel > 1) {
    // SGLang with --tp N and --ep N: every rank holds the batch's tokens, its experts run on the tokens
    // routed to them, an all-reduce sums the ranks' outputs; no two-batch overlap (it splits DP ranks'
    // batches for DeepEP's all-to-all).
    ESS_CHECK(expert_parallel == attention_tensor_parallel,
              "{}: expert_parallel = {} under attention_tensor_parallel = {}: the MoE is modelled with expert "
              "parallelism over the same GPUs (--tp N --ep N); tensor-parallel experts are not modelled",
              source, expert_parallel, attention_tensor_parallel);
    ESS_CHECK(!two_batch_overlap,
              "{}: two_batch_overlap under attention_tensor_parallel = {} is not modelled (its micro-batches split "
              "data-parallel ranks' batches around DeepEP's all-to-all)",
              source, attention_tensor_parallel);
    ESS_CHECK(rig_layers == 0, "{}: the executor rig (rig_layers = {}) runs data-parallel attention on one GPU", source,
              rig_layers);
  }
  ESS_CHECK(mtp_tokens >= 1 && mtp_tokens <= 16, "{}: mtp_tokens = {} must be in [1, 16]", source,
            mtp_tokens);
  ESS_CHECK(std::isfinite(accept_ratio) && accept_ratio >= 1.0 && accept_ratio <= mtp_tokens,
            "{}: accept_ratio = {} must be in [1, mtp_tokens = {}]", source, accept_ratio, mtp_tokens);
  ESS_CHECK(std::isfinite(mem_fraction_static) && mem_fraction_static > 0 && mem_fraction_static <= 1,
            "{}: mem_fraction_static = {} must be in (0, 1]", source, mem_fraction_static);
}

json Deployment::to_json() const {
  json j = {{"name", name},
          {"nodes", nodes},
          {"gpus_per_node", gpus_per_node},
          {"expert_parallel", expert_parallel},
          {"attention_data_parallel", attention_data_parallel},
          {"mtp_tokens", mtp_tokens},
          {"accept_ratio", accept_ratio},
          {"two_batch_overlap", two_batch_overlap},
          {"preattn_in_copy_window", preattn_in_copy_window},
          {"shared_index_prefetch", shared_index_prefetch},
          {"mem_fraction_static", mem_fraction_static},
          {"rig_layers", rig_layers}};
  if (attention_tensor_parallel != 1) j["attention_tensor_parallel"] = attention_tensor_parallel;
  return j;
}

Deployment Deployment::shipped(const std::string& name) {
  std::string names;
  for (const auto& c : shipped::kDeployments) {
    if (name == c.name) {
      return from_json(json::parse(c.json), fmt::format("configs/deployments/{}.json", c.name));
    }
    names += names.empty() ? c.name : fmt::format(", {}", c.name);
  }
  ESS_THROW("unknown deployment '{}': shipped deployments are {} (or give a path to a JSON file)",
            name, names);
}

Deployment Deployment::load(const std::string& name_or_path) {
  for (const auto& c : shipped::kDeployments) {
    if (name_or_path == c.name) return shipped(name_or_path);
  }
  if (name_or_path.ends_with(".json") || std::filesystem::exists(name_or_path)) {
    return from_json(read_json_file(name_or_path, "deployment"), name_or_path);
  }
  return shipped(name_or_path);
}

// ---- MissModel ---------------------------------------------------------------------------

double MissModel::misses(int layer, double slots, double context, int tokens) const {
  if (slots >= context) return 0.0;
  const double free_ref = 1.0 - reference_slots / reference_context;
  double m = reference_misses * std::pow(reference_slots / slots, exponent) *
             (1.0 - slots / context) / free_ref * static_cast<double>(tokens) /
             static_cast<double>(reference_tokens);
  if (!layer_shape.empty()) m *= layer_shape[static_cast<std::size_t>(layer) % layer_shape.size()];
  return m;
}

double MissModel::working_set(double measured, int tokens, int topk) const {
  if (tokens <= 1) return topk;
  if (measured <= 0 || reference_tokens < 2) return 0;
  if (tokens == reference_tokens) return measured;
  const double per_token = std::max(0.0, measured - topk) / (reference_tokens - 1);
  return topk + (tokens - 1) * per_token;
}

double MissModel::min_slots(int tokens, int topk, double context) const {
  const double whole = std::min(double(tokens) * topk, context);
  const double floor = std::min(double(topk), context);
  if (pool_floor == "tk") return whole;
  const double ws = working_set(pool_floor == "p99" ? working_set_p99 : working_set_max, tokens, topk);
  if (ws <= 0) return whole;
  return std::clamp(std::ceil(ws * (1 + floor_margin)), floor, whole);
}

std::string MissModel::floor_rule(int tokens, int topk, double context) const {
  if (tokens <= 1) {  // one query token: its top-k is the whole working set
    return fmt::format("T = 1: one query token's top-{}{}", topk, context < topk ? ", capped at the context" : "");
  }
  const double whole = std::min(double(tokens) * topk, context);
  const double ws = working_set(pool_floor == "p99" ? working_set_p99 : working_set_max, tokens, topk);
  if (pool_floor == "tk" || ws <= 0) {
    return fmt::format("T x top-k = {} x {}, capped at the context{}", tokens, topk,
                       pool_floor == "tk" ? "" : " (no MTP working set measured at this T: give a miss profile)");
  }
  const double got = min_slots(tokens, topk, context);
  return fmt::format("the MTP working set's {} {:.0f} x {} from {} at T = {}{}{}", pool_floor, ws,
                     1 + floor_margin, working_set_from, reference_tokens,
                     tokens != reference_tokens ? fmt::format(", carried to T = {}", tokens) : std::string(),
                     got >= whole ? ", capped at T x top-k" : "");
}

double MissModel::split_bound(double slots, int tokens, int topk, double context) const {
  if (slots >= std::min(double(tokens) * topk, context)) return 0;
  const double max = working_set(working_set_max, tokens, topk);
  const double p99 = working_set(working_set_p99, tokens, topk);
  if (max > 0 && slots >= max) return 0;
  if (p99 > 0 && slots >= p99) return 0.01;
  return 1;
}

void MissModel::validate(const std::string& source) const {
  ESS_CHECK(std::isfinite(reference_misses) && reference_misses >= 0,
            "{}: reference misses = {} must be >= 0", source, reference_misses);
  ESS_CHECK(reference_slots > 0 && reference_context > reference_slots,
            "{}: reference slots = {} must be positive and below the reference context {}", source,
            reference_slots, reference_context);
  ESS_CHECK(reference_tokens >= 1, "{}: reference tokens = {} must be >= 1", source, reference_tokens);
  ESS_CHECK(std::isfinite(exponent) && exponent >= 0 && exponent <= 4,
            "{}: miss exponent = {} must be in [0, 4]", source, exponent);
  for (std::size_t i = 0; i < layer_shape.size(); ++i) {
    ESS_CHECK(std::isfinite(layer_shape[i]) && layer_shape[i] >= 0,
              "{}: layer {} miss weight = {} must be >= 0", source, i, layer_shape[i]);
  }
  ESS_CHECK(pool_floor == "max" || pool_floor == "p99" || pool_floor == "tk",
            "{}: pool floor '{}' must be max, p99 or tk", source, pool_floor);
  ESS_CHECK(std::isfinite(floor_margin) && floor_margin >= 0 && floor_margin <= 1,
            "{}: pool floor margin = {} must be in [0, 1]", source, floor_margin);
  ESS_CHECK(std::isfinite(working_set_p99) && std::isfinite(working_set_max) && working_set_p99 >= 0 &&
                working_set_max >= working_set_p99,
            "{}: working set p99 {} and max {} must be >= 0 with p99 <= max", source, working_set_p99, working_set_max);
}

std::vector<double> MissModel::load_layer_shape(const std::string& path) {
  const json j = read_json_file(path, "miss profile");
  const json* arr = &j;
  if (j.is_object()) {
    const auto it = j.find("per_layer_misses");
    ESS_CHECK(it != j.end(), "{}: a miss profile needs a 'per_layer_misses' array", path);
    arr = &*it;
  }
  ESS_CHECK(arr->is_array() && !arr->empty(), "{}: per_layer_misses must be a non-empty array", path);
  std::vector<double> v;
  double sum = 0;
  for (std::size_t i = 0; i < arr->size(); ++i) {
    const json& e = (*arr)[i];
    ESS_CHECK(e.is_number() && e.get<double>() >= 0,
              "{}: per_layer_misses[{}] = {} must be a number >= 0", path, i, e.dump());
    v.push_back(e.get<double>());
    sum += v.back();
  }
  ESS_CHECK(sum > 0, "{}: per_layer_misses are all zero: no shape to apply", path);
  const double mean = sum / static_cast<double>(v.size());
  for (double& x : v) x /= mean;
  return v;
}

MissModel MissModel::with_builtin_working_set(std::int64_t context, MissModel base) {
  const trace::GeneratorProfile p = trace::GeneratorProfile::shipped_default();
  const trace::GeneratorProfile::WorkingSet* best = nullptr;
  for (const auto& w : p.mtp_working_set) {
    if (w.mtp != base.reference_tokens) continue;
    if (best == nullptr || std::llabs(w.context - context) < std::llabs(best->context - context)) best = &w;
  }
  if (best == nullptr) return base;
  base.working_set_p99 = best->p99;
  base.working_set_max = best->max;
  base.working_set_from = fmt::format("the built-in locality model (configs/trace-profiles/default.json, measured "
                                      "once at {}K)", best->context / 1024);
  return base;
}

MissModel MissModel::load_profile(const std::string& path, std::int64_t context, MissModel base) {
  const json j = read_json_file(path, "miss profile");
  if (!j.is_object() || j.value("format", std::string()) != "ess-miss-profile") {
    base.layer_shape = load_layer_shape(path);
    base.validate(path);
    return base;
  }
  const auto contexts = j.find("contexts");
  ESS_CHECK(contexts != j.end() && contexts->is_array() && !contexts->empty(),
            "{}: an ess-miss-profile needs a non-empty 'contexts' array", path);
  const json* best = nullptr;
  for (const json& c : *contexts) {
    ESS_CHECK(c.is_object() && c.contains("context") && c["context"].is_number(),
              "{}: every contexts[] entry needs a numeric 'context'", path);
    if (best == nullptr || std::abs(c["context"].get<double>() - double(context)) <
                               std::abs((*best)["context"].get<double>() - double(context))) {
      best = &c;
    }
  }
  const json& c = *best;
  const double tokens = c["context"].get<double>();
  // A profile of units (a trace's ess.unit_tokens): its slots and misses count ids, ceil(tokens / unit) a context.
  const std::int64_t unit = json_int_or(j, "unit_tokens", path, 1);
  ESS_CHECK(unit >= 1 && unit <= (1 << 16), "{}: unit_tokens = {} is outside [1, 65536]", path, unit);
  const double ctx = std::ceil(tokens / double(unit));
  double slots = 0;
  if (c.contains("slots") && c["slots"].is_number()) {
    slots = c["slots"].get<double>();
  } else if (c.contains("ratio") && c["ratio"].is_number()) {
    slots = std::ceil(c["ratio"].get<double>() * ctx);
  }
  ESS_CHECK(slots > 0 && slots < ctx, "{}: context {} entry needs a pool ('slots' or 'ratio') smaller than the context{}",
            path, tokens, unit > 1 ? fmt::format(" ({} ids of {} tokens)", ctx, unit) : std::string());
  const auto layers = c.find("layers");
  ESS_CHECK(layers != c.end() && layers->is_array() && !layers->empty(), "{}: context {} entry has no 'layers'",
            path, tokens);
  std::vector<double> means;
  for (const json& l : *layers) {
    ESS_CHECK(l.is_object() && l.contains("mean") && l["mean"].is_number() && l["mean"].get<double>() >= 0,
              "{}: every layers[] entry needs a 'mean' >= 0", path);
    // Layers are listed in order, one entry each: an id elsewhere means another layout.
    const std::int64_t id = json_int_or(l, "layer", path, static_cast<std::int64_t>(means.size()));
    ESS_CHECK(id == static_cast<std::int64_t>(means.size()),
              "{}: context {} layers[{}] has layer = {}; entries must list layers 0, 1, ... in order", path, tokens,
              means.size(), id);
    means.push_back(l["mean"].get<double>());
  }
  double sum = 0;
  for (double m : means) sum += m;
  const double mean = sum / double(means.size());
  MissModel m = base;
  m.builtin = false;
  m.reference_misses = mean;
  m.reference_slots = slots;
  m.reference_context = ctx;
  const std::int64_t mtp = json_int_or(j, "mtp", path, base.reference_tokens);
  ESS_CHECK(mtp >= 1 && mtp <= 16, "{}: mtp = {} must be in [1, 16]", path, mtp);
  m.reference_tokens = static_cast<int>(mtp);
  const std::int64_t topk = json_int_or(j, "topk", path, 0);
  ESS_CHECK(topk >= 0 && topk <= 65536, "{}: topk = {} is out of range", path, topk);
  m.profile_topk = static_cast<int>(topk);
  m.unit_tokens = static_cast<int>(unit);
  m.working_set_p99 = m.working_set_max = 0;
  if (const auto ws = c.find("working_set"); ws != c.end()) {
    const std::string where = fmt::format("{}: context {} working_set", path, tokens);
    ESS_CHECK(ws->is_object(), "{} must be an object", where);
    m.working_set_p99 = json_number_or(*ws, "p99", where, 0.0);
    m.working_set_max = json_number_or(*ws, "max", where, 0.0);
  }
  m.layer_shape.clear();
  if (mean > 0) {
    for (double x : means) m.layer_shape.push_back(x / mean);
  }
  m.validate(path);
  return m;
}

// ---- Workload ----------------------------------------------------------------------------

void Workload::validate() const {
  ESS_CHECK(context >= 1 && context <= (std::int64_t{1} << 24),
            "workload: context = {} must be in [1, 16M] tokens", context);
  ESS_CHECK(batch >= 0, "workload: batch = {} must be >= 0 (0 = the largest that fits)", batch);
  ESS_CHECK(std::isfinite(ratio) && ratio >= 0 && ratio <= 1,
            "workload: sparse memory ratio = {} must be in (0, 1] (0 = derive from the batch)", ratio);
  ESS_CHECK(slots >= 0, "workload: slots = {} must be >= 0", slots);
  ESS_CHECK(layerwise_threshold == -1 || (std::isfinite(layerwise_threshold) && layerwise_threshold >= 0),
            "workload: layer-wise threshold = {} must be a number of misses >= 0 (or -1: pick the faster mode per "
            "layer)", layerwise_threshold);
  ESS_CHECK(std::isfinite(prefix_share) && prefix_share >= 0 && prefix_share <= 1,
            "workload: prefix share = {} must be in [0, 1]", prefix_share);
  ESS_CHECK(residency == Residency::kSparse || residency == Residency::kAdaptive,
            "workload: residency {} is not modelled (sparse or adaptive; every request whole is the all-on-GPU "
            "baseline)", to_string(residency));
  misses.validate("workload miss model");
}

Residency parse_residency(std::string_view name) {
  if (name == "sparse") return Residency::kSparse;
  if (name == "adaptive") return Residency::kAdaptive;
  ESS_CHECK(false, "residency '{}' is not sparse or adaptive", name);
  return Residency::kSparse;
}

}  // namespace ess::sim

namespace ess::sim {

Workload Workload::from_json(const json& j, const std::string& source) {
  ESS_CHECK(j.is_object(), "{}: a workload must be a JSON object", source);
  static constexpr const char* kKnown[] = {"context", "batch", "ratio", "slots", "offload", "overlap",
                                           "layerwise_threshold", "prefix_share", "residency", "misses", "description"};
  for (const auto& [k, v] : j.items()) {
    (void)v;
    bool known = false;
    for (const char* n : kKnown) known = known || k == n;
    ESS_CHECK(known, "{}: unknown workload field '{}'", source, k);
  }
  Workload w;
  w.context = json_int_or(j, "context", source, w.context);
  if (auto it = j.find("batch"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      ESS_CHECK(it->get<std::string>() == "max", "{}: field 'batch' must be a number or \"max\", got {}", source,
                it->dump());
      w.batch = 0;
    } else {
      const std::int64_t b = json_int_or(j, "batch", source, 0);
      ESS_CHECK(b >= 1 && b <= 1'000'000, "{}: field 'batch' = {} must be in [1, 1000000] (or \"max\")", source, b);
      w.batch = static_cast<int>(b);
    }
  }
  w.ratio = json_number_or(j, "ratio", source, w.ratio);
  const std::int64_t slots = json_int_or(j, "slots", source, 0);
  ESS_CHECK(slots >= 0 && slots <= std::numeric_limits<std::int32_t>::max(), "{}: field 'slots' = {} is out of range",
            source, slots);
  w.slots = static_cast<std::int32_t>(slots);
  ESS_CHECK(!(w.slots > 0 && w.ratio > 0), "{}: give 'ratio' or 'slots', not both", source);
  w.offload = json_bool_or(j, "offload", source, w.offload);
  const std::string overlap = json_string(j, "overlap", source, false);
  if (!overlap.empty()) w.overlap = parse_overlap_mode(overlap);
  w.layerwise_threshold = json_number_or(j, "layerwise_threshold", source, w.layerwise_threshold);
  w.prefix_share = json_number_or(j, "prefix_share", source, w.prefix_share);
  if (const std::string residency = json_string(j, "residency", source, false); !residency.empty()) {
    w.residency = parse_residency(residency);
  }
  if (auto it = j.find("misses"); it != j.end() && !it->is_null()) {
    ESS_CHECK(it->is_object(), "{}: field 'misses' must be an object", source);
    const std::string where = source + " misses";
    static constexpr const char* kMissKnown[] = {"reference_misses", "reference_slots", "reference_context",
                                                 "reference_tokens", "exponent", "profile", "pool_floor",
                                                 "pool_floor_margin"};
    for (const auto& [k, v] : it->items()) {
      (void)v;
      bool known = false;
      for (const char* n : kMissKnown) known = known || k == n;
      ESS_CHECK(known, "{}: unknown field '{}'", where, k);
    }
    MissModel& m = w.misses;
    for (const char* k : {"reference_misses", "reference_slots", "reference_context", "reference_tokens", "exponent"}) {
      if (it->contains(k)) m.builtin = false;
    }
    m.reference_misses = json_number_or(*it, "reference_misses", where, m.reference_misses);
    m.reference_slots = json_number_or(*it, "reference_slots", where, m.reference_slots);
    m.reference_context = json_number_or(*it, "reference_context", where, m.reference_context);
    const std::int64_t tokens = json_int_or(*it, "reference_tokens", where, m.reference_tokens);
    ESS_CHECK(tokens >= 1 && tokens <= 16, "{}: field 'reference_tokens' = {} must be in [1, 16]", where, tokens);
    m.reference_tokens = static_cast<int>(tokens);
    m.exponent = json_number_or(*it, "exponent", where, m.exponent);
    const std::string profile = json_string(*it, "profile", where, false);
    if (!profile.empty()) m = MissModel::load_profile(profile, w.context, m);
    const std::string floor = json_string(*it, "pool_floor", where, false);
    if (!floor.empty()) m.pool_floor = floor;
    m.floor_margin = json_number_or(*it, "pool_floor_margin", where, m.floor_margin);
  }
  w.validate();
  return w;
}

Workload Workload::from_file(const std::string& path) {
  return from_json(read_json_file(path, "workload"), path);
}

}  // namespace ess::sim
