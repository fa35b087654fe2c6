// `ess trace gen`: a synthetic top-k trace generator with a parametric locality model
// (docs/trace-format.md, "Synthetic traces"). Its traces are SYNTHETIC: they reproduce the
// statistics the ESS paper publishes for DeepSeek-V3.2-Exp, not any real model's selections,
// and every file it writes says so in its metadata (ess.synthetic = "true").
//
// The model, per request and layer (K = top-k, T = MTP query tokens):
//   * sinks: the first `sink_tokens` tokens are always selected;
//   * recency window: each query token selects the last `recent_window` tokens it can see;
//   * heavy hitters: the other h = K - sinks - window selections form a set H, drawn from a
//     per-request-layer candidate set C of M(L) = candidate_base * (L / reference_context)^
//     candidate_exponent older tokens (attention mass concentrates: C grows slower than L);
//   * drift: at every step each member of H is replaced, with probability drift[layer], by a
//     random candidate outside H (the per-layer rate is what makes layers differ); with
//     probability return_probability the replacement is instead one of the heavy slot's last
//     return_depth occupants (temporal re-reference: what a bigger pool catches);
//   * layers share the random events (which heavy slot is replaced, which candidate comes in),
//     so layers with similar drift rates select similar sets (inter-layer similarity);
//   * topic shifts: with probability topic_shift_rate per step (one event for all layers of a
//     request) a fraction topic_shift_fraction of H is replaced by tokens new to C;
//   * candidate churn: per step a fraction candidate_churn of C is replaced by new tokens;
//   * MTP: query token t > 0 shares query 0's set except that each heavy hitter is swapped for
//     another candidate with probability mtp_divergence * drift[layer], and its window ends t
//     tokens later; each step `accept` tokens are kept (mean accept_ratio, within [1, T]);
//   * prefill: the last `prefill_windows` prompt positions run the same process one token at a
//     time before decode starts, so the prefill top-k (for LRU-Warmup) is consistent with it.
// Every query selects exactly min(K, visible tokens) distinct valid ids (-1 pads the rest).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ess/model/model_spec.h"
#include "ess/trace/format.h"

namespace ess::trace {

struct GeneratorProfile {
  std::string name = "custom";
  std::string description;
  std::string model = "deepseek-v3.2-exp";
  int layers = 61;
  int topk = 2048;
  int mtp = 2;
  double accept_ratio = 1.7;
  int prefill_windows = 32;
  int sink_tokens = 4;
  int recent_window = 64;
  double candidate_base = 16384;
  std::int64_t reference_context = 32768;
  double candidate_exponent = 0.5;
  double mtp_divergence = 1.0;
  double topic_shift_rate = 0.005;
  double topic_shift_fraction = 0.25;
  double candidate_churn = 0.0005;
  double return_probability = 0.0;  // a drift replacement brings back a previous occupant of the slot
  int return_depth = 3;             // ... uniformly among the slot's last this-many occupants
  std::vector<double> drift;  // per layer (resampled linearly when its size differs from layers)
  // Index sharing (ModelSpec::shared_index, `ess trace gen --model`): a shared layer selects
  // exactly its leader's top-k (the last layer before it that is not shared), prefill windows
  // included. Empty: every layer its own; else one flag per layer, layer 0 not shared.
  std::vector<bool> shared_index;
  // Tokens an id names (TraceMeta::unit_tokens): 1, a token; 4, DeepSeek-V4's C4 entries; a
  // block's size, MiniMax-M3's blocks. topk, sink_tokens, recent_window, candidate_base and
  // reference_context count ids; contexts and lengths stay tokens (a query at length L sees
  // ceil(L / unit_tokens) ids).
  int unit_tokens = 1;
  std::int64_t ids_of(std::int64_t tokens) const { return trace::ids_of(tokens, unit_tokens); }
  // The MTP working set this profile's traces have (distinct ids per request-layer-step: the
  // union of its `mtp` query tokens' top-k), measured once by `ess trace generate` + `ess
  // trace analyze` and stored with the profile so that the simulator need not regenerate it;
  // the generator itself does not read it. Empty: not measured.
  struct WorkingSet {
    std::int64_t context = 0;
    int mtp = 0;
    double p99 = 0;
    double max = 0;
  };
  std::vector<WorkingSet> mtp_working_set;
  std::string mtp_working_set_how;  // the commands that measured it

  // Unknown keys and out-of-range values are errors naming `source` and the key.
  static GeneratorProfile from_json(const nlohmann::json& j, const std::string& source);
  static GeneratorProfile from_file(const std::string& path);
  // The shipped default (configs/trace-profiles/default.json, compiled in).
  static GeneratorProfile shipped_default();
  nlohmann::json to_json() const;
  double drift_of(int layer) const;
  void validate(const std::string& source) const;
};

// A profile for `model`'s selections: its name, one traced layer per offloaded layer
// (ModelSpec::offloaded_layers), its index sharing, its ids (unit_tokens: a selected id's
// tokens) and top-k (ModelSpec::selected_ids). With ids of u > 1 tokens the profile's token
// spans become spans of ids (sinks, recent window rounded up; candidate_base, reference_context
// divided by u); MiniMax-M3's sinks and window are its forced init and local blocks. A model
// without a next-n layer, or one SGLang's HiSparse serves without speculative decoding
// (DeepSeek-V4, MiniMax-M3), decodes one token per step (mtp 1). Call validate() after.
void apply_model(GeneratorProfile& profile, const ModelSpec& model);

// The longest prompt the generator takes (its candidate process keeps a few bytes per token);
// a profile of a model ESS knows is held to that model's max_position_embeddings as well.
inline constexpr std::int64_t kMaxGeneratedContext = std::int64_t{1} << 24;

struct GenerateConfig {
  std::vector<std::int64_t> contexts{32768};  // prompt lengths; request i uses contexts[i % n]
  int requests = 1;
  std::int64_t steps = 64;  // decode steps per request
  std::uint64_t seed = 1;
};

// One request, in memory. Deterministic in (profile, context, steps, seed, index); layers are
// generated in parallel.
RequestData generate_request(const GeneratorProfile& profile, std::int64_t context, std::int64_t steps,
                             std::uint64_t seed, int index);

TraceMeta synthetic_meta(const GeneratorProfile& profile, const GenerateConfig& config);

// Generates and writes a whole trace, one request at a time (memory: one request). `size`, when
// set, is told the file's size in bytes once every check has passed, before anything is written;
// `progress` after each request.
void generate_trace(const GeneratorProfile& profile, const GenerateConfig& config, const std::string& path,
                    const std::function<void(double bytes)>& size = nullptr,
                    const std::function<void(std::size_t done, std::size_t total)>& progress = nullptr);

}  // namespace ess::trace
