#include "ess/sim/launch.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "ess/core/error.h"
#include "ess/sim/memory_model.h"
#include "ess/sim/overlap.h"

namespace ess::sim {
namespace {

std::string shell_quote(const std::string& s) {
  if (!s.empty() &&
      s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:=,@") == std::string::npos) {
    return s;
  }
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// ESS_OVERLAP for an offloaded choice, and ESS_OVERLAP_LAYERS for a layer-wise one: the simulator's choice per layer
// (and micro-batch), in the adapters' codes (a DA, b DBA, - no misses).
void add_overlap_env(const StepResult& c, std::vector<std::string>& env) {
  if (!c.offload || c.overlap == OverlapMode::kNone) return;
  env.push_back(fmt::format("ESS_OVERLAP={}", to_string(c.overlap)));
  if (c.overlap == OverlapMode::kLayerWise) env.push_back(fmt::format("ESS_OVERLAP_LAYERS={}", c.layer_modes));
}

}  // namespace

EngineLimits engine_limits(const std::string& engine, const std::string& pool_floor, bool pool_floor_given,
                           int mtp_tokens) {
  EngineLimits out;
  out.pool_floor = pool_floor_given ? pool_floor : "";
  if (engine.empty()) return out;
  ESS_CHECK(engine == kSglangEngine || engine == kVllmEngine,
            "plan: --engine {}: this build plans for sglang (0.5.23) and vllm (0.33.0)", engine);
  // Every overlap mode runs inside both: SGLang 0.5.23 (python/ess/integrations/sglang/overlap.py and
  // indexer_split.py) and vLLM 0.33.0 (vllm_overlap.py: DA inside FlashMLA's FP8 sparse decode; vllm_indexer_split.py:
  // DBA's indexer split): the search tries the modes as asked.
  const bool vllm = engine == kVllmEngine;
  const char* name = vllm ? "vLLM" : "SGLang";
  out.preattn_in_copy_window = false;
  out.notes.push_back(vllm ? "PreAttn before the indexer (vLLM's DSA attention computes q before its indexer and "
                             "forward_mqa's swap): DA and DBA hide the copy under attention over the resident entries "
                             "and DBA's second indexer half only"
                           : "PreAttn before the indexer (SGLang's model computes q in forward_prepare): DA and DBA "
                             "hide the copy under attention over the resident entries and DBA's second indexer half "
                             "only");
  if (vllm) {
    out.two_batch_overlap = false;
    out.whole_residency = false;
    out.shared_index_prefetch = false;
    out.notes.push_back("TBO off (vLLM 0.33.0's HiSparse needs Model Runner V2, which runs no dual-batch overlap)");
    out.notes.push_back("every request priced sparse (vLLM reads a request in place until its own policy moves it to host "
                        "reads, which the plan does not model: an upper bound on the offload's cost at low load)");
  }
  if (mtp_tokens > 1) {
    // One swap serves a verify step's T query tokens (FlashMLA runs once after it): the pool holds their union.
    ESS_CHECK(!pool_floor_given || pool_floor == "tk",
              "plan: --engine {} with MTP {}: --pool-floor {} may give a pool below what {}'s verify step needs (one "
              "swap of T x top-k ids); use --pool-floor tk",
              engine, mtp_tokens, pool_floor, name);
    out.pool_floor = "tk";
    if (!pool_floor_given) {
      out.notes.push_back(fmt::format("pool floor: tk ({}'s verify step swaps T x top-k ids at once)", name));
    }
  }
  return out;
}

std::string Launch::command_line() const {
  std::string out;
  for (const std::string& e : env) {  // NAME=value, the value quoted (a quoted name is not an assignment)
    const std::size_t eq = e.find('=');
    out += eq == std::string::npos ? shell_quote(e) : e.substr(0, eq + 1) + shell_quote(e.substr(eq + 1));
    out += " ";
  }
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

namespace {

// vLLM 0.33.0's `vllm serve` with ESS's HiSparse connector (python/ess/integrations/vllm_connector.py).
Launch vllm_launch(const ModelSpec& model, const HardwareProfile& hw, const Deployment& d, const PlanResult& result) {
  const StepResult& c = result.chosen.best;
  Launch l;
  l.engine = kVllmEngine;
  l.release = "0.33.0";
  const int gpus = d.gpus();
  const int dp = std::max(1, d.attention_data_parallel);
  const int per_gpu = c.batch;
  l.argv = {"vllm", "serve", model.name};
  auto flag = [&l](const std::string& name, const std::string& value = "") {
    l.argv.push_back(name);
    if (!value.empty()) l.argv.push_back(value);
  };
  flag("--tensor-parallel-size", std::to_string(gpus / dp));
  if (dp > 1) flag("--data-parallel-size", std::to_string(dp));
  if (d.expert_parallel > 1) flag("--enable-expert-parallel");
  if (d.nodes > 1 && dp > 1) {  // data parallel over the nodes: the first node serves, the others run engines
    const int local = dp / d.nodes;
    flag("--data-parallel-size-local", std::to_string(local));
    flag("--data-parallel-address", "<host>");
    flag("--data-parallel-rpc-port", "<port>");
    l.notes.push_back(fmt::format("this is the first node's line (its API server balances over every DP rank); on node "
                                  "k = 1 .. {} add --headless --data-parallel-start-rank {} x k (a start rank without "
                                  "--headless would serve its own node's ranks only); --data-parallel-address: the "
                                  "first node's address",
                                  d.nodes - 1, local));
  } else if (d.nodes > 1) {  // one TP group over the nodes
    flag("--nnodes", std::to_string(d.nodes));
    flag("--node-rank", "<rank>");
    flag("--master-addr", "<host>");
    l.notes.push_back(fmt::format("run it on each of the {} nodes, --node-rank 0 .. {} (with --headless on every node "
                                  "but the first), --master-addr the first node's address",
                                  d.nodes, d.nodes - 1));
  }
  if (d.expert_parallel > 1 && d.expert_parallel != gpus) {
    l.notes.push_back(fmt::format("--enable-expert-parallel spans every GPU of the deployment ({}), not the plan's EP "
                                  "{}: vLLM's expert-parallel group is DP x TP",
                                  gpus, d.expert_parallel));
  }
  if (d.mtp_tokens > 1) {
    flag("--speculative-config",
         fmt::format(R"({{"method": "mtp", "num_speculative_tokens": {}}})", d.mtp_tokens - 1));
  }
  flag("--max-model-len", std::to_string(result.context));
  flag("--max-num-seqs", std::to_string(per_gpu));  // per engine: a DP rank, or the TP group
  flag("--kv-cache-dtype", "fp8_ds_mla");
  const double hbm = hw.hbm_capacity_gb * 1e9;
  double utilization = d.mem_fraction_static;
  if (c.offload) {
    // ESS's rows are in vLLM's hot regions, inside its budget: a request's region of cdiv(device_buffer_size, 64)
    // blocks per layer holds its slots and its T reserved rows (device_buffer_size = slots + T). Outside the budget
    // sits the engine's own state, about 1 GiB (the connector refuses at start-up, naming the utilization that fits,
    // when it does not fit).
    const int buffer = c.slots + d.mtp_tokens;
    const double engine_state = double(1ull << 30);
    utilization = std::floor((d.mem_fraction_static - engine_state / hbm) * 1000.0) / 1000.0;
    // vLLM's host pool per engine (HiSparseConnector's host_pool_gib: a DP rank's, or the TP group's, shared by its
    // ranks on a node): every request's context in 64-token blocks, and the pool's null and copy-on-write blocks.
    // The MTP draft layers' host caches are in the same pool (v1/hisparse/binding.py).
    const int host_layers = model.num_hidden_layers + (d.mtp_tokens > 1 ? model.num_nextn_predict_layers : 0);
    const double pages = std::ceil(double(result.context) / 64.0) + 2.0;
    const double host = double(per_gpu) * pages * 64.0 * double(host_layers) * double(model.latent_entry_bytes());
    const double host_gib = std::ceil(host / double(1ull << 30) * 10.0) / 10.0;
    // vLLM's LRU positions are int16 (v1/hisparse/runtime.py: device_buffer_size <= 32768).
    ESS_CHECK(buffer <= 32768,
              "plan: context {}: the chosen pool of {} slots and {} reserved rows is above vLLM's device_buffer_size "
              "limit of 32768; plan a shorter context or fewer slots (--pool-floor)",
              result.context, c.slots, d.mtp_tokens);
    flag("--gpu-memory-utilization", fmt::format("{}", utilization));
    flag("--kv-transfer-config",
         fmt::format(R"({{"kv_connector": "HiSparseConnector", "kv_connector_module_path": )"
                     R"("ess.integrations.vllm_connector", "kv_role": "kv_both", "kv_connector_extra_config": )"
                     R"({{"host_pool_gib": {}}}}})",
                     host_gib));
    flag("--attention-config", fmt::format(R"({{"hisparse_config": {{"device_buffer_size": {}}}}})", buffer));
    add_overlap_env(c, l.env);
    if (c.overlap != OverlapMode::kNone) {
      l.notes.push_back("ESS_OVERLAP: each DA layer's FlashMLA FP8 sparse decode runs over its resident entries while "
                        "its misses are copied, then over the copied ones (vLLM's FlashMLA sparse backend, which "
                        "--kv-cache-dtype fp8_ds_mla selects for DeepSeek-V3.2 on Hopper)");
      if (c.overlap == OverlapMode::kDualBatchAttention || c.overlap == OverlapMode::kLayerWise) {
        l.notes.push_back("a DBA layer's indexer runs per half of the batch, the first half's misses copied beside the "
                          "second half's indexer, where the batch is pure decode with one token count per request "
                          "(not under adaptive verification); other steps run the layer as DA, which the plan does "
                          "not model");
      }
    }
    l.notes.push_back(fmt::format(
        "--gpu-memory-utilization {}: the plan's {} less about 1 GiB of ESS's engine state (its LRU state, step "
        "scratch and page tables), which sits outside vLLM's budget; ESS's rows are vLLM's hot regions, inside it",
        utilization, d.mem_fraction_static));
    // vLLM 0.33.0 gives a request it moves to host reads a hot region of cdiv(device_buffer_size, 64) blocks per
    // layer in its own pool (v1/hisparse/layout.py hot_blocks_per_request): ESS's rows.
    const double region_rows = std::ceil(double(buffer) / 64.0) * 64.0;
    const double hot = double(host_layers) * double(per_gpu) * region_rows * double(model.latent_entry_bytes());
    l.notes.push_back(fmt::format(
        "device_buffer_size {}: ESS's {} slots and the {} reserved rows of a request's hot region, which vLLM gives it "
        "per layer, inside its budget, when it moves it to host reads (up to {:.1f} GiB for {} requests; a request "
        "is read in place at its resident pages until then); vLLM's budget also holds the activations and CUDA "
        "graphs that the plan's memory fraction leaves out: vLLM may run fewer than --max-num-seqs requests at once "
        "(its log's KV cache size says how many fit)",
        buffer, c.slots, d.mtp_tokens, hot / double(1ull << 30), per_gpu));
    const std::string per_node =
        dp > 1 ? fmt::format("{} of them", dp / d.nodes) : std::string("one, shared by the TP ranks,");
    l.notes.push_back(fmt::format("host_pool_gib {}: vLLM's host pool per engine ({} requests of {} tokens); {} per "
                                  "node",
                                  host_gib, per_gpu, result.context, per_node));
  } else {
    flag("--gpu-memory-utilization", fmt::format("{}", utilization));
  }
  l.notes.push_back(fmt::format("{}: the model's Hugging Face id or a local copy ({} is its config's name)", model.name,
                                model.name));
  return l;
}

}  // namespace

Launch launch_for(const std::string& engine, const ModelSpec& model, const HardwareProfile& hw, const Deployment& d,
                  const PlanResult& result) {
  ESS_CHECK(engine == kSglangEngine || engine == kVllmEngine, "plan: no launch line for engine '{}'", engine);
  ESS_CHECK(result.found, "plan: context {}: no configuration was found, so there is no launch line", result.context);
  if (engine == kVllmEngine) return vllm_launch(model, hw, d, result);
  const StepResult& c = result.chosen.best;
  Launch l;
  l.engine = engine;
  l.release = "0.5.23";
  const int gpus = d.gpus();
  const int dp = d.attention_data_parallel;
  const int per_gpu = c.batch;
  add_overlap_env(c, l.env);
  if (c.offload && !model.shared_index.empty() && !result.chosen.shared_index_prefetch) {
    // resolve_shared_index_layers then passes no pattern: the shared layers swap at their own turn.
    l.env.push_back("SGLANG_DISABLE_HISPARSE_PREFETCH=1");
  }
  if (c.offload) {
    // Requests stay whole among ESS's rows while they are free: a light load pays no offload.
    l.env.push_back("ESS_RESIDENCY=adaptive");
    if (result.low_load.found) {
      l.notes.push_back(fmt::format("ESS_RESIDENCY=adaptive: up to {} requests per {} stay whole (no swap, no misses); "
                                    "past them, requests are demoted to pools of {} slots as they arrive",
                                    result.low_load.all_whole_up_to,
                                    d.attention_tensor_parallel > 1 ? "instance" : "GPU", c.slots));
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
    // DP attention: DeepEP's all-to-all. Attention TP (MiniMax-M3): every rank holds the batch's tokens, SGLang's
    // default MoE runs each rank's experts on them and all-reduces, as the plan modelled.
    if (d.attention_tensor_parallel == 1) flag("--moe-a2a-backend", "deepep");
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
  // DSA: the FP8 latent ESS's 656-byte entries are. MiniMax-M3: its K / V in the dtype the plan sized (its config's
  // kv_cache_dtype, else the model's: SGLang's auto).
  if (!model.is_minimax_m3()) {
    flag("--kv-cache-dtype", "fp8_e4m3");
  } else if (!model.kv_cache_dtype.empty()) {
    flag("--kv-cache-dtype", model.kv_cache_dtype);
  }
  flag("--mem-fraction-static", fmt::format("{}", d.mem_fraction_static));
  flag("--max-running-requests", std::to_string(static_cast<long long>(per_gpu) * std::max(1, dp)));
  flag("--cuda-graph-max-bs-decode", std::to_string(per_gpu));
  if (c.offload) {
    flag("--disable-radix-cache");
    flag("--enable-hisparse");
    if (c.overlap != OverlapMode::kNone) flag("--dsa-decode-backend", "flashmla_kv");
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
  if (model.is_minimax_m3() && c.offload) {
    l.notes.push_back(fmt::format(
        "MiniMax-M3: attention TP {} ({} KV heads, one a rank as SGLang's HiSparse requires); device_buffer_size {} "
        "holds a step's {} blocks of {} tokens ({}); ESS's step runs device_buffer_size columns a query",
        d.attention_tensor_parallel, model.num_key_value_heads, c.slots, model.selected_ids(), model.sparse_block_size,
        model.selected_entries()));
  }
  l.notes.push_back(fmt::format("--model-path: the model's Hugging Face id or a local copy ({} is its config's name)",
                                model.name));
  return l;
}

StockHiSparse stock_hisparse(const std::string& engine, const StepModel& model, const PlanRequest& req) {
  StockHiSparse out;
  if (engine != kSglangEngine) return out;
  const ModelSpec& m = model.model();
  const Deployment& d = model.deployment();
  const MemoryModel mem(m, model.hardware(), d, req.context);
  constexpr double kRatio = 2, kPage = 64;  // host_to_device_ratio; the DSA page (padded_buffer_size)
  // The coordinator's top_k is the model's index_topk; device_buffer_size defaults to 2 x the config's
  // top_k, 2048 unless given, whatever the model's.
  const double topk = m.index_topk, buffer = 2 * 2048, T = std::max(1, d.mtp_tokens);
  out.top_k = m.index_topk;
  out.device_buffer_size = 2 * 2048;
  const double per_token = mem.cache_layers() * (double(m.latent_entry_bytes()) + kRatio * double(m.indexer_entry_bytes()));
  out.device_tokens = std::floor(mem.cache_budget() / per_token / kPage) * kPage;
  out.logical_tokens = kRatio * out.device_tokens;
  out.slots_per_request = buffer + kPage + (T > 1 ? std::min(T * topk, std::max(1024.0, T * topk - buffer)) : 0.0);
  const int by_logical = static_cast<int>(out.logical_tokens / double(req.context));
  const int by_device = static_cast<int>(out.device_tokens / out.slots_per_request);
  out.admitted = std::min(by_logical, by_device);
  out.limit = by_logical <= by_device
                  ? fmt::format("its logical pool, host_to_device_ratio 2 x a device pool of {:.0f} tokens, holds {} "
                                "contexts of {}",
                                out.device_tokens, by_logical, req.context)
                  : fmt::format("its device pool of {:.0f} tokens holds {} requests of {:.0f} slots", out.device_tokens,
                                by_device, out.slots_per_request);
  Workload w;
  w.context = req.context;
  w.offload = true;
  w.overlap = OverlapMode::kNone;
  w.slots = static_cast<std::int32_t>(std::min<double>(buffer, double(req.context)));
  w.misses = req.misses;
  w.prefix_share = req.prefix_share;
  for (int b = out.admitted; b >= 1; --b) {  // the step time rises with the batch: the first that meets the target
    w.batch = b;
    try {
      const StepResult r = model.run(w);
      if (r.otps + 1e-9 < req.min_otps) continue;
      out.found = true;
      out.batch = b;
      out.step = r;
      if (b < out.admitted) out.limit = fmt::format("OTPS {:.2f} at batch {} ({})", req.min_otps, b + 1, out.limit);
      break;
    } catch (const Error&) {
      continue;  // e.g. activations at this batch: a smaller one
    }
  }
  return out;
}

nlohmann::json StockHiSparse::to_json() const {
  if (!found) return nullptr;
  return {{"config", {{"top_k", top_k}, {"device_buffer_size", device_buffer_size}, {"host_to_device_ratio", 2}}},
          {"batch", batch},
          {"admitted", admitted},
          {"limit", limit},
          {"device_tokens", device_tokens},
          {"logical_tokens", logical_tokens},
          {"slots_per_request", slots_per_request},
          {"step_ms", step.step_us / 1e3},
          {"throughput_tokens_per_s_per_node", step.throughput_tokens_per_s},
          {"otps", step.otps},
          {"source", "simulated: SGLang 0.5.23's HiSparse sizing at its defaults, the serial swap"}};
}

}  // namespace ess::sim
