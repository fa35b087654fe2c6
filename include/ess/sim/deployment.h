// What is deployed (Deployment), what it serves (Workload) and how the offload traffic is
// scheduled (OverlapMode), as the simulator's inputs.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ess/runtime/residency.h"
#include "ess/sim/overlap.h"

namespace ess::sim {

struct Deployment {
  static constexpr int kMaxNodes = 4096;
  static constexpr int kMaxGpusPerNode = 64;
  std::string name = "custom";
  int nodes = 4;
  int gpus_per_node = 8;
  int expert_parallel = 32;          // EP degree (GPUs the routed experts are spread over)
  // Attention: data parallel on every GPU (attention_tensor_parallel 1: each GPU its own batch, its
  // requests' caches whole), or tensor parallel over every GPU (attention_data_parallel 1: each GPU
  // a share of the heads of one batch, an all-reduce after the attention's and the MoE's output;
  // modelled for MiniMax-M3, whose HiSparse pool holds one KV head per rank).
  int attention_data_parallel = 32;
  int attention_tensor_parallel = 1;
  int mtp_tokens = 2;                // T: query tokens per request per step (1 = no MTP)
  double accept_ratio = 1.7;         // tokens kept per request per step, in [1, T]
  bool two_batch_overlap = true;     // TBO: two micro-batches, compute of one over comm of other
  // Where PreAttn (q_b_proj, absorb bmm) runs under DA / DBA: after the indexer, inside the copy
  // window (the paper, the rig), or before the indexer (false), where SGLang 0.5.23's model
  // computes q (forward_prepare) and ESS's adapter leaves it.
  bool preattn_in_copy_window = true;
  // A model whose layers share an indexer's top-k (ModelSpec::shared_index): a follower layer's
  // swap decision and copy issued at its leader's layer, the copy running under the layers
  // between (the SGLang adapter's prefetch); false: each follower swaps at its own turn.
  bool shared_index_prefetch = true;
  // Fraction of HBM for weights + caches (SGLang's mem_fraction_static); the rest holds
  // activations, CUDA graphs and workspace.
  double mem_fraction_static = 0.9;
  // 0: the whole model. > 0: the single-GPU rig of `ess bench step` (src/harness/rig): a step
  // is this many MoE decoder layers running the experts one GPU of expert_parallel owns, with
  // no all-to-all, no Two-Batch Overlap, no LM head and no MTP draft pass; expert_parallel may
  // then exceed the GPUs (it is emulated) and the memory model is not applied (the rig holds
  // only rig_layers layers).
  int rig_layers = 0;
  std::string sources;  // where the numbers come from

  int gpus() const { return nodes * gpus_per_node; }  // after check_counts: at most 4096 x 64
  // GPUs holding each request (its attention's tensor-parallel group): 1 under data-parallel attention.
  int gpus_per_request() const { return attention_tensor_parallel; }
  // Throws ess::Error unless nodes and gpus_per_node are in range (gpus() cannot overflow).
  void check_counts(const std::string& source) const;
  static Deployment from_json(const nlohmann::json& j, const std::string& source);
  static Deployment shipped(const std::string& name);  // configs/deployments/<name>.json
  static Deployment load(const std::string& name_or_path);
  nlohmann::json to_json() const;
  void validate(const std::string& source) const;
};

// Misses per request, layer and step (all T query tokens of the request together).
//
// Parametric model: `reference_misses` at `reference_slots` slots for `reference_tokens` query
// tokens, scaled by (reference_slots / slots)^exponent x (1 - slots/context) / (1 -
// reference_slots/reference_context) and linearly in T; zero when the pool holds the whole
// context. An optional per-layer shape (e.g. `ess verify`'s per_layer_misses) redistributes
// the mean over layers (normalised to mean 1).
struct MissModel {
  double reference_misses = 200;      // brief §2.1: >= 6.4K slots keep the mean below ~200
  double reference_slots = 6554;      // 0.2 x 32768
  double reference_context = 32768;
  int reference_tokens = 2;
  double exponent = 1.0;
  std::vector<double> layer_shape;    // empty: uniform
  int profile_topk = 0;               // top-k the profile was measured at (0: not said)
  // The tokens a profile's ids name (a trace's ess.unit_tokens): its slots, misses and working sets
  // count them. The built-in model's are tokens of a DSA model at top-2048.
  int unit_tokens = 1;
  // The built-in reference point, untouched (no --misses / --miss-exponent, no workload 'misses'
  // reference, no profile): what StepModel::misses_in_entries may carry to another model's entries.
  bool builtin = true;
  // The MTP working set a trace's profile measured at reference_tokens (the union of the
  // query tokens' top-k per request-layer-step; `ess trace analyze`): p99 and max, 0 = not
  // measured.
  double working_set_p99 = 0;
  double working_set_max = 0;
  std::string working_set_from = "the miss profile";  // where the two came from, for floor_rule()
  // The pool's floor (the fewest slots a plan may give a request-layer): "max" (the default:
  // the measured max working set x (1 + floor_margin); no step is expected to split), "p99"
  // (the p99 x (1 + floor_margin): the rarer larger steps run in query groups) or "tk"
  // (T x K: no step can split; also what "max" and "p99" become without a measurement).
  std::string pool_floor = "max";
  double floor_margin = 0.1;

  double misses(int layer, double slots, double context, int tokens) const;
  // The working set statistic (the p99 or max) of `tokens` query tokens of top-`topk`: the
  // measured one at reference_tokens; at another T, the measured growth per query token past
  // the first carried over linearly (K + (T - 1) x (ws - K) / (T_ref - 1)). 0: unknown.
  double working_set(double measured, int tokens, int topk) const;
  // The smallest pool for a step of `tokens` x top-`topk` at `context`, per pool_floor: never
  // below min(K, context) (one query token's top-k), never above min(T x K, context).
  double min_slots(int tokens, int topk, double context) const;
  // What min_slots() took, in words (e.g. "the MTP working set's max 3686 x 1.1, from the
  // miss profile at T = 2").
  std::string floor_rule(int tokens, int topk, double context) const;
  // An upper bound on the share of request-layer-steps whose working set exceeds `slots`
  // (served in query groups): 0 at or above the max (or min(T x K, context)), 0.01 at or
  // above the p99, else 1 (and 1 below T x K when nothing was measured).
  double split_bound(double slots, int tokens, int topk, double context) const;
  // Reads {"per_layer_misses": [...]} (the key `ess verify --format json` writes) or a
  // plain array of numbers.
  static std::vector<double> load_layer_shape(const std::string& path);
  // Reads a miss profile: either `ess trace analyze --miss-profile` output ("format":
  // "ess-miss-profile": absolute per-layer means at a pool size, context and MTP; the entry
  // whose context is nearest `context` becomes the reference point and the per-layer shape)
  // or a plain per_layer_misses list (shape only, applied to `base`).
  static MissModel load_profile(const std::string& path, std::int64_t context, MissModel base);
  // `base` with the MTP working set of the shipped generator profile's locality model
  // (configs/trace-profiles/default.json, measured once and stored there) at the measured
  // context nearest `context`; unchanged when the profile holds none at base's reference T.
  static MissModel with_builtin_working_set(std::int64_t context, MissModel base);
  void validate(const std::string& source) const;
};

// "sparse" or "adaptive" (Workload::residency); throws naming any other.
Residency parse_residency(std::string_view name);

struct Workload {
  std::int64_t context = 32768;
  int batch = 0;          // requests per GPU; 0 = the largest that fits
  double ratio = 0;       // Sparse Memory Ratio; 0 = the smallest that fits the batch
  std::int32_t slots = 0; // overrides ratio when > 0
  bool offload = true;    // false: the all-on-GPU baseline (ratio 1, no transfers)
  OverlapMode overlap = OverlapMode::kLayerWise;
  double layerwise_threshold = -1;  // misses per layer per micro-batch; < 0: pick the faster
  // The fraction of the context every request of a GPU shares (a common prompt prefix): the
  // host pool holds its pages once (docs/architecture.md, "Shared prefixes").
  double prefix_share = 0;
  // kAdaptive: as many requests whole as the GPU's cache memory holds beside the others' pools
  // (Offload's residency: a whole request takes ceil(context / slots) pool rows, no misses, no
  // swap); the rest sparse. kSparse: every request sparse. (kWhole is the all-on-GPU baseline.)
  Residency residency = Residency::kSparse;
  MissModel misses;
  void validate() const;
  // {"context", "batch" (number or "max"), "ratio", "slots", "offload", "overlap",
  //  "layerwise_threshold", "prefix_share", "residency" ("sparse" | "adaptive"), "misses": {"reference_misses", "reference_slots",
  //  "reference_context", "reference_tokens", "exponent", "profile" (a miss-profile file)}};
  // every field optional, unknown fields refused.
  static Workload from_json(const nlohmann::json& j, const std::string& source);
  static Workload from_file(const std::string& path);
};

}  // namespace ess::sim
