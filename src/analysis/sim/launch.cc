#include "ess/sim/launch.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "ess/core/error.h"
#include "ess/sim/overlap.h"

namespace ess::sim {
namespace {

// The overlap modes SGLang 0.5.23 runs with ESS (python/ess/integrations/sglang/overlap.py).
const std::vector<std::string> kSglangModes = {"none", "da"};

std::string shell_quote(const std::string& s) {
  if (!s.empty() &&
      s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:=,@") == std::string::npos) {
    return s;
  }
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

EngineLimits engine_limits(const std::string& engine, const std::vector<std::string>& modes, bool modes_given,
                           const std::string& pool_floor, bool pool_floor_given, int mtp_tokens) {
  EngineLimits out;
  out.modes = modes;
  out.pool_floor = pool_floor_given ? pool_floor : "";
  if (engine.empty()) return out;
  ESS_CHECK(engine == kSglangEngine,
            "plan: --engine {}: this build plans for sglang (0.5.23) only; vLLM 0.33.0's connector serves no overlap "
            "mode and no micro-batching yet, so plan it with --modes none --no-tbo", engine);
  out.modes.clear();
  for (const std::string& m : modes) {
    if (std::find(kSglangModes.begin(), kSglangModes.end(), m) != kSglangModes.end()) {
      out.modes.push_back(m);
    } else {
      ESS_CHECK(!modes_given, "plan: --engine sglang: overlap mode {} is not served inside SGLang (it runs {}); "
                "leave it out of --modes", m, fmt::join(kSglangModes, ", "));
    }
  }
  if (!modes_given) out.notes.push_back(fmt::format("modes: {} (what ESS runs inside SGLang)", fmt::join(out.modes, ", ")));
  if (mtp_tokens > 1) {
    // One swap serves a verify step's T query tokens (FlashMLA runs once after it): the pool holds their union.
    ESS_CHECK(!pool_floor_given || pool_floor == "tk",
              "plan: --engine sglang with MTP {}: --pool-floor {} may give a pool below what SGLang's verify step "
              "needs (one swap of T x top-k ids: the adapter refuses device_buffer_size < T x top_k); use --pool-floor "
              "tk",
              mtp_tokens, pool_floor);
    out.pool_floor = "tk";
    if (!pool_floor_given) out.notes.push_back("pool floor: tk (SGLang's verify step swaps T x top-k ids at once)");
  }
  return out;
}

std::string Launch::command_line() const {
  std::string out;
  for (const std::string& e : env) out += shell_quote(e) + " ";
  for (std::size_t i = 0; i < argv.size(); ++i) {
    if (i > 0) out += argv[i].rfind("--", 0) == 0 ? " \\\n    " : " ";
    out += shell_quote(argv[i]);
  }
  return out;
}

nlohmann::json Launch::to_json() const {
  return {{"engine", engine}, {"release", release}, {"env", env}, {"argv", argv}, {"notes", notes},
          {"command_line", command_line()}};
}

Launch launch_for(const std::string& engine, const ModelSpec& model, const Deployment& d, const PlanResult& result) {
  ESS_CHECK(engine == kSglangEngine, "plan: no launch line for engine '{}'", engine);
  ESS_CHECK(result.found, "plan: context {}: no configuration was found, so there is no launch line", result.context);
  const StepResult& c = result.chosen.best;
  Launch l;
  l.engine = engine;
  l.release = "0.5.23";
  const int gpus = d.gpus();
  const int dp = d.attention_data_parallel;
  const int per_gpu = c.batch;
  if (c.offload && c.overlap != OverlapMode::kNone) l.env.push_back(fmt::format("ESS_OVERLAP={}", to_string(c.overlap)));
  if (c.offload) {
    // Requests stay whole among ESS's rows while they are free: a light load pays no offload.
    l.env.push_back("ESS_RESIDENCY=adaptive");
    if (result.low_load.found) {
      l.notes.push_back(fmt::format("ESS_RESIDENCY=adaptive: up to {} requests per GPU stay whole (no swap, no misses); "
                                    "past them, requests are demoted to pools of {} slots as they arrive",
                                    result.low_load.all_whole_up_to, c.slots));
    }
  }
  l.argv = {"python", "-m", c.offload ? "ess.integrations.sglang_launch" : "sglang.launch_server", "--model-path",
            model.name};
  auto flag = [&l](const std::string& name, const std::string& value = "") {
    l.argv.push_back(name);
    if (!value.empty()) l.argv.push_back(value);
  };
  flag("--tp-size", std::to_string(gpus));
  if (d.nodes > 1) {
    flag("--nnodes", std::to_string(d.nodes));
    flag("--node-rank", "<rank>");
    flag("--dist-init-addr", "<host:port>");
    l.notes.push_back(fmt::format("run it on each of the {} nodes, --node-rank 0 .. {}, --dist-init-addr the first "
                                  "node's address",
                                  d.nodes, d.nodes - 1));
  }
  if (dp > 1) {
    flag("--dp-size", std::to_string(dp));
    flag("--enable-dp-attention");
  }
  if (d.expert_parallel > 1) {
    flag("--ep-size", std::to_string(d.expert_parallel));
    flag("--moe-a2a-backend", "deepep");
  }
  if (result.chosen.two_batch_overlap) flag("--enable-two-batch-overlap");
  if (d.mtp_tokens > 1) {
    // DeepSeek's MTP head as SGLang runs it: EAGLE with one draft per step and T draft tokens per verify.
    flag("--speculative-algorithm", "EAGLE");
    flag("--speculative-num-steps", std::to_string(d.mtp_tokens - 1));
    flag("--speculative-eagle-topk", "1");
    flag("--speculative-num-draft-tokens", std::to_string(d.mtp_tokens));
  }
  flag("--context-length", std::to_string(result.context));
  flag("--kv-cache-dtype", "fp8_e4m3");
  flag("--mem-fraction-static", fmt::format("{}", d.mem_fraction_static));
  flag("--max-running-requests", std::to_string(static_cast<long long>(per_gpu) * std::max(1, dp)));
  flag("--cuda-graph-max-bs-decode", std::to_string(per_gpu));
  if (c.offload) {
    flag("--disable-radix-cache");
    flag("--enable-hisparse");
    if (c.overlap == OverlapMode::kDualAttention) flag("--dsa-decode-backend", "flashmla_kv");
    // The host pool is SGLang's HiSparse device pool (at least ESS's rows: batch x (slots + T)) times the
    // ratio: the smallest ratio that holds every request's context whatever else the device pool keeps.
    const double rows = double(per_gpu) * double(c.slots + d.mtp_tokens);
    const auto ratio = static_cast<long long>(std::ceil(double(per_gpu) * double(result.context) / rows));
    flag("--hisparse-config", fmt::format(R"({{"top_k": {}, "device_buffer_size": {}, "host_to_device_ratio": {}}})",
                                          model.index_topk, c.slots, std::max<long long>(ratio, 1)));
    l.notes.push_back(fmt::format(
        "host_to_device_ratio {}: ESS's host pool is SGLang's HiSparse device pool (at least {} x ({} + {}) rows per "
        "GPU) times it; a device pool larger than ESS's rows makes the host pool larger too: ESS logs its size at "
        "start-up ('host pool ... GiB'), to hold within the node's DRAM",
        std::max<long long>(ratio, 1), per_gpu, c.slots, d.mtp_tokens));
  }
  l.notes.push_back(fmt::format("--model-path: the model's Hugging Face id or a local copy ({} is its config's name)",
                                model.name));
  return l;
}

}  // namespace ess::sim
