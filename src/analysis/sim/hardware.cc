#include "ess/sim/hardware.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "analysis/sim/shipped_configs.h"
#include "ess/core/error.h"
#include "ess/core/json.h"

namespace ess::sim {
namespace {

using nlohmann::json;

struct Field {
  const char* key;
  double HardwareProfile::*member;
  double min;  // inclusive
  double max;  // inclusive
  // Fields added after profiles were written: the value and source a profile without the field
  // gets (nullptr: the field is required).
  double fallback = 0;
  const char* fallback_source = nullptr;
};

constexpr const char* kDeepGemmFit =
    "DeepGEMM README (commit 327ec92), H800 FP8 GEMM table: 18 dense + 10 grouped shapes, least squares "
    "of the tile/wave model over all 28 (rms error 10 %; tests/sim/data/deepgemm_h800.csv)";

// Every numeric field of a profile, with the range a real machine can have.
constexpr Field kFields[] = {
    {"hbm_capacity_gb", &HardwareProfile::hbm_capacity_gb, 1, 1e4},
    {"hbm_bandwidth_gbps", &HardwareProfile::hbm_bandwidth_gbps, 1, 1e5},
    {"memory_efficiency", &HardwareProfile::memory_efficiency, 0.01, 1},
    {"bf16_tflops", &HardwareProfile::bf16_tflops, 1, 1e5},
    {"fp8_tflops", &HardwareProfile::fp8_tflops, 1, 1e5},
    {"sm_count", &HardwareProfile::sm_count, 1, 1024, 132,
     "default for profiles without it: H100 / H200 / H800 SXM have 132 SMs"},
    {"gemm_efficiency", &HardwareProfile::gemm_efficiency, 0.01, 1},
    {"gemm_tile_overhead_k", &HardwareProfile::gemm_tile_overhead_k, 0, 1e5, 512, kDeepGemmFit},
    {"gemm_memory_efficiency", &HardwareProfile::gemm_memory_efficiency, 0.01, 1, 0.7, kDeepGemmFit},
    {"attention_efficiency", &HardwareProfile::attention_efficiency, 0.01, 1},
    {"indexer_efficiency", &HardwareProfile::indexer_efficiency, 0.01, 1},
    {"kernel_launch_us", &HardwareProfile::kernel_launch_us, 0, 1e3},
    {"step_overhead_us", &HardwareProfile::step_overhead_us, 0, 1e6, 0,
     "default for profiles without it: no host time between steps is charged"},
    {"step_overhead_per_request_us", &HardwareProfile::step_overhead_per_request_us, 0, 1e4, 0,
     "default for profiles without it: the host's time between steps does not grow with the batch"},
    {"h2d_scattered_gbps", &HardwareProfile::h2d_scattered_gbps, 0.01, 1e4},
    {"d2h_scattered_gbps", &HardwareProfile::d2h_scattered_gbps, 0.01, 1e4},
    {"h2d_bulk_gbps", &HardwareProfile::h2d_bulk_gbps, 0.01, 1e4},
    {"d2h_bulk_gbps", &HardwareProfile::d2h_bulk_gbps, 0.01, 1e4},
    {"transfer_launch_us", &HardwareProfile::transfer_launch_us, 0, 1e3},
    {"transfer_sms", &HardwareProfile::transfer_sms, 0, 1024, 32,
     "default for profiles without it: FlashTrans's default grid of 32 blocks (include/ess/ops/flashtrans.h), "
     "one SM each"},
    {"nvlink_gbps", &HardwareProfile::nvlink_gbps, 0.01, 1e5},
    {"nvlink_latency_us", &HardwareProfile::nvlink_latency_us, 0, 1e4},
    {"rdma_gbps", &HardwareProfile::rdma_gbps, 0.01, 1e5},
    {"rdma_latency_us", &HardwareProfile::rdma_latency_us, 0, 1e4},
    {"host_dram_gb", &HardwareProfile::host_dram_gb, 1, 1e6},
    {"host_dram_bandwidth_gbps", &HardwareProfile::host_dram_bandwidth_gbps, 1, 1e5},
    {"host_dram_reserve", &HardwareProfile::host_dram_reserve, 0, 0.9, 0.1,
     "default for profiles without it: 10 % of host DRAM left to the OS, the serving engine's processes and their "
     "pinned buffers (--host-reserve changes it)"},
    {"cuda_context_gb", &HardwareProfile::cuda_context_gb, 0, 1e3},
};

}  // namespace

HardwareProfile HardwareProfile::from_json(const json& j, const std::string& source) {
  ESS_CHECK(j.is_object(), "{}: a hardware profile must be a JSON object, got {}", source,
            std::string(j.type_name()));
  HardwareProfile p;
  p.name = json_string(j, "name", source, true);
  p.description = json_string(j, "description", source, false);
  p.gpu = json_string(j, "gpu", source, false);
  for (const Field& f : kFields) {
    if (f.fallback_source != nullptr && !j.contains(f.key)) {
      p.*(f.member) = f.fallback;
      p.sources[f.key] = f.fallback_source;
      continue;
    }
    p.*(f.member) = json_number(j, f.key, source);
  }
  if (auto it = j.find("sources"); it != j.end()) {
    ESS_CHECK(it->is_object(), "{}: 'sources' must be an object of field -> text", source);
    for (const auto& [k, v] : it->items()) {
      ESS_CHECK(v.is_string(), "{}: sources.{} must be a string, got {}", source, k, v.dump());
      p.sources[k] = v.get<std::string>();
    }
  }
  for (const auto& [k, v] : j.items()) {
    (void)v;
    bool known = k == "name" || k == "description" || k == "gpu" || k == "sources";
    for (const Field& f : kFields) known = known || k == f.key;
    ESS_CHECK(known, "{}: unknown hardware field '{}'", source, k);
  }
  for (const auto& [k, v] : p.sources) {
    (void)v;
    bool known = false;
    for (const Field& f : kFields) known = known || k == f.key;
    ESS_CHECK(known, "{}: sources.{} names no hardware field", source, k);
    const bool sourced_in_file = j.contains("sources") && j.at("sources").contains(k);
    ESS_CHECK(j.contains(k) || !sourced_in_file,
              "{}: sources.{} is given but the profile sets no '{}' (a default would run under that source)", source,
              k, k);
  }
  p.validate(source);
  return p;
}

void HardwareProfile::validate(const std::string& source) const {
  ESS_CHECK(!name.empty(), "{}: hardware 'name' is empty", source);
  for (const Field& f : kFields) {
    const double v = this->*(f.member);
    ESS_CHECK(std::isfinite(v) && v >= f.min && v <= f.max,
              "{}: hardware field '{}' = {} is outside [{}, {}]", source, f.key, v, f.min, f.max);
    const auto it = sources.find(f.key);
    ESS_CHECK(it != sources.end() && !it->second.empty(),
              "{}: hardware field '{}' = {} has no source (add \"sources\": {{\"{}\": \"...\"}})",
              source, f.key, v, f.key);
  }
  ESS_CHECK(transfer_sms < sm_count, "{}: hardware field 'transfer_sms' = {} must be below sm_count = {} (a copy "
            "cannot hold every SM)", source, transfer_sms, sm_count);
}

json HardwareProfile::to_json() const {
  json j = {{"name", name}, {"description", description}};
  if (!gpu.empty()) j["gpu"] = gpu;
  for (const Field& f : kFields) j[f.key] = this->*(f.member);
  j["sources"] = sources;
  return j;
}

HardwareProfile HardwareProfile::from_file(const std::string& path) {
  return from_json(read_json_file(path, "hardware profile"), path);
}

std::vector<std::string> HardwareProfile::shipped_names() {
  std::vector<std::string> names;
  for (const auto& c : shipped::kHardware) names.emplace_back(c.name);
  return names;
}

namespace {

std::string lowercase(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// The shipped profile a name means, ignoring case; nullptr if none.
const shipped::Config* shipped_named(const std::string& name) {
  for (const auto& c : shipped::kHardware) {
    if (lowercase(name) == c.name) return &c;
  }
  return nullptr;
}

}  // namespace

HardwareProfile HardwareProfile::shipped(const std::string& name) {
  if (const shipped::Config* c = shipped_named(name)) {
    return from_json(json::parse(c->json), fmt::format("configs/hardware/{}.json", c->name));
  }
  std::vector<std::string> close;
  for (const auto& c : shipped::kHardware) {
    if (std::string(c.name).starts_with(lowercase(name))) close.emplace_back(c.name);
  }
  ESS_THROW("unknown hardware '{}'{}: shipped profiles are {}; for another GPU give a JSON file with a shipped "
            "profile's fields (configs/hardware/h200.json is one; docs/simulator.md says what each means)",
            name, close.empty() ? "" : fmt::format(" (did you mean {}?)", fmt::join(close, " or ")),
            fmt::join(shipped_names(), ", "));
}

HardwareProfile HardwareProfile::load(const std::string& name_or_path) {
  if (shipped_named(name_or_path) != nullptr) return shipped(name_or_path);
  if (name_or_path.find('/') != std::string::npos || name_or_path.ends_with(".json") ||
      std::filesystem::exists(name_or_path)) {
    return from_file(name_or_path);
  }
  return shipped(name_or_path);  // throws with the list of names
}

}  // namespace ess::sim
