// ess verify: the offloaded decode loop (the runtime's per-layer step on the CPU or CUDA
// backend), checked bit for bit against the full cache.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <string>

#include "commands.h"
#include "ess/core/error.h"
#include "harness/report/report.h"
#include "harness/verify/decode_loop.h"
#include "progress.h"

namespace ess::cli {
namespace {

struct VerifyArgs {
  VerifyConfig config;
  std::string model;
  std::string kv_cache_dtype;
  std::string backend = "cpu";
  std::string residency = "sparse";
  Format format = Format::kTable;
};

}  // namespace

void add_verify(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* cmd = app.add_subcommand(
      "verify",
      "Run a decode loop with the latent cache offloaded through the runtime's per-layer step (indexer -> "
      "top-k -> Offload::step: swap decision, misses fetched -> sparse attention over the rows it returns) "
      "beside attention over the full cache, and check every output is bit-identical. Exit status 1 if not.");
  VerifyConfig& c = args->config;
  cmd->add_option("--model", args->model, "Model config.json (default: the shipped DeepSeek-V3.2-Exp; configs/models/ has the others)");
  cmd->add_option("--kv-cache-dtype", args->kv_cache_dtype,
                  "The KV cache's dtype, as SGLang's flag: fp8_e4m3 (a DSA model's 656-byte FP8 latent, the default) or "
                  "bfloat16 (its 1,152-byte bf16 latent: SGLang's default for DSA on Hopper; MiniMax-M3's K / V)")
      ->check(CLI::IsMember({"fp8_e4m3", "bfloat16", "bf16", "auto"}));
  cmd->add_option("--requests,-b", c.requests, "Requests in the batch")->capture_default_str();
  cmd->add_option("--layers,-l", c.layers, "Layers (the model's first N whose cache is offloaded: DeepSeek-V4's with a C4 cache)")
      ->capture_default_str();
  cmd->add_option("--context,-c", c.context,
                  "Prompt length at the prefill -> decode hand-over, tokens (when not given for a model whose cache "
                  "holds an entry per R tokens: R times the default)")
      ->capture_default_str();
  cmd->add_option("--steps,-s", c.steps, "Decode steps")->capture_default_str();
  cmd->add_option("--mtp,-t", c.mtp,
                  "Query tokens per request per step (MTP T; 1 when not given for a model whose cache holds an entry per 4 "
                  "tokens, DeepSeek-V4's C4)")
      ->capture_default_str();
  cmd->add_option("--topk,-k", c.topk,
                  "Entries each query token selects (a block top-k's tokens, a multiple of the block: MiniMax-M3's "
                  "three blocks when not given)")
      ->capture_default_str();
  auto* slots = cmd->add_option(
      "--slots", c.slots,
      "Sparse Memory Pool slots per request-layer (at least top-k; below T x top-k, steps whose query tokens select "
      "more distinct ids run in query groups)");
  cmd->add_option("--ratio", c.ratio, "Sparse Memory Ratio: slots = ceil(ratio x context)")
      ->capture_default_str()
      ->check(above_at_most(0, 1))
      ->excludes(slots);
  cmd->add_option("--warmup", c.warmup_windows, "LRU-Warmup prefill windows (0 = cold start)")->capture_default_str();
  cmd->add_option("--drift", c.query_drift, "Indexer query drift per step in [0, 1]")
      ->capture_default_str()
      ->check(in_range(0.0, 1.0));
  cmd->add_option("--prefix-share", c.prefix_share,
                  "Fraction of the prompt requests 1.. share with request 0 (admitted on its prefix: host pages "
                  "shared, not copied)")
      ->capture_default_str();
  cmd->add_option("--seed", c.seed, "Random seed")->capture_default_str()->check(unsigned_integer());
  cmd->add_flag("--reserve-newest", c.reserve_newest,
               "Each step's new entries in reserved rows outside the LRU, written back to the host pool");
  cmd->add_flag("!--no-prefetch", c.shared_index_prefetch,
               "With a model whose layers share an indexer's top-k (GLM-5.2): run each shared layer's step at its "
               "own turn instead of right after its leader's");
  cmd->add_option("--residency", args->residency,
                  "Where requests live on the device: sparse (a Sparse Memory Pool each), whole (every entry in "
                  "rows of its own, no swap), adaptive (whole until the pool rows run out, then demoted; the last "
                  "request finishes halfway); whole and adaptive need --reserve-newest")
      ->check(CLI::IsMember({"sparse", "whole", "adaptive"}))
      ->capture_default_str();
  cmd->add_option("--pool-rows", c.pool_rows,
                  "Pool rows of slots each (0 = by residency: one per request for sparse, every request whole for "
                  "whole, request 0 whole and the others sparse for adaptive)")
      ->capture_default_str();
  cmd->add_option("--backend", args->backend,
                  "The Offload's backend: cpu, or cuda (GPU swap engine, device rows filled by FlashTrans; needs a GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  add_format_option(*cmd, args->format);
  cmd->callback([args, cmd, &exit_code] {
    // 0 stands for "derive from --ratio" inside; given on the command line it would be taken
    // silently for that.
    ESS_CHECK(cmd->count("--slots") == 0 || args->config.slots > 0, "--slots {} must be positive (or give --ratio)",
              args->config.slots);
    args->config.backend = args->backend == "cuda" ? Backend::kCuda : Backend::kCpu;
    args->config.residency = args->residency == "whole"      ? Residency::kWhole
                             : args->residency == "adaptive" ? Residency::kAdaptive
                                                             : Residency::kSparse;
    ModelSpec model = args->model.empty() ? ModelSpec::deepseek_v32_exp() : ModelSpec::from_file(args->model);
    if (!args->kv_cache_dtype.empty()) {  // as if the config carried SGLang's flag
      nlohmann::json j = model.to_json();
      j["kv_cache_dtype"] = args->kv_cache_dtype;
      model = ModelSpec::from_json(j, args->model.empty() ? "configs/models/deepseek-v3.2-exp.json" : args->model);
    }
    // A compressed cache (an entry per R tokens): unless given, MTP 1 and a context of as many entries
    // as the default has tokens.
    if (model.tokens_per_entry() > 1 && cmd->count("--mtp") == 0) args->config.mtp = 1;
    if (model.tokens_per_entry() > 1 && cmd->count("--context") == 0) args->config.context *= model.tokens_per_entry();
    // A block top-k (MiniMax-M3): unless given, three blocks (the newest and two chosen), which the
    // default ratio's slots hold.
    if (model.selection_block() > 1 && cmd->count("--topk") == 0) args->config.topk = 3 * model.selection_block();
    Progress progress("verify: requests warmed + steps");
    args->config.progress = [&](std::size_t done, std::size_t total) { progress(done, total); };
    const VerifyReport r = run_verify(model, args->config);
    args->config.progress = nullptr;
    if (args->format == Format::kJson) {
      fmt::print("{}\n", harness::to_json(model, args->config, r).dump(2));
    } else if (args->format == Format::kCsv) {
      fmt::print("{}", harness::to_csv(r));
    } else {
      fmt::print("{}", harness::to_table(model, args->config, r));
    }
    exit_code = r.bitwise_equal ? 0 : 1;
  });
}

}  // namespace ess::cli
