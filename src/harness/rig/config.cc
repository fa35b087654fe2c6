#include "harness/rig/config.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <unistd.h>

#include "ess/cache/policy.h"
#include "ess/cache/sparse_pool.h"
#include "ess/core/error.h"
#include "ess/core/files.h"
#include "ess/trace/analyzer.h"
#include "ess/trace/format.h"
#include "ess/trace/generator.h"

namespace ess::rig {

std::int32_t ExecutorConfig::resolved_slots() const {
  return slots > 0 ? slots : slots_for_ratio(ratio, context);
}

namespace {

// The Sparse Memory Pool's own checks, and the rig's: it runs every step whole (no query
// groups), so the pool must hold a step's largest working set, min(T x top-k, context) ids.
void check_pool(const ExecutorConfig& c, int topk, int query_tokens) {
  SparsePoolConfig pc;
  pc.num_layers = c.layers;
  pc.max_requests = c.batch;
  pc.slots = c.resolved_slots();
  pc.query_tokens = query_tokens;
  pc.topk = topk;
  pc.max_context = c.context;
  pc.validate();
  const std::int64_t whole = std::min<std::int64_t>(std::int64_t{query_tokens} * topk, c.context);
  ESS_CHECK(pc.slots >= whole,
            "executor: {} slots per request-layer cannot hold a whole step's working set of up to {} ids "
            "(T {} x top-k {}, capped by the context); the rig runs steps whole, without query groups",
            pc.slots, whole, query_tokens, topk);
}

}  // namespace

void ExecutorConfig::validate(const ModelSpec& model) const {
  ESS_CHECK(layers >= 1 && layers <= 256, "executor: layers = {} must be in [1, 256]", layers);
  ESS_CHECK(batch >= 1 && batch <= 4096, "executor: batch = {} must be in [1, 4096]", batch);
  ESS_CHECK(context >= 64 && context <= (std::int64_t{1} << 30), "executor: context = {} must be in [64, 2^30]",
            context);
  ESS_CHECK(steps >= 1 && steps <= 4096, "executor: steps = {} must be in [1, 4096]", steps);
  ESS_CHECK(warm_steps >= 0 && warm_steps < steps, "executor: warm_steps = {} must be in [0, steps = {})",
            warm_steps, steps);
  ESS_CHECK(expert_parallel >= 1 && expert_parallel <= model.n_routed_experts,
            "executor: expert_parallel = {} must be in [1, {}] (the model's routed experts)", expert_parallel,
            model.n_routed_experts);
  ESS_CHECK(std::isfinite(layerwise_threshold) && layerwise_threshold >= 0,
            "executor: layerwise_threshold = {} must be a non-negative number of misses", layerwise_threshold);
  ESS_CHECK(device >= 0, "executor: device = {} must be >= 0", device);
  if (!trace.empty()) check_input_file(trace, "--trace");
  ESS_CHECK(copy_blocks >= 0 && copy_blocks <= 65535, "executor: copy_blocks = {} must be in [0, 65535] (0 = default)",
            copy_blocks);
  if (offload) {
    ESS_CHECK(slots >= 0, "executor: slots = {} must be >= 0 (0 = from the ratio)", slots);
    if (slots == 0) {
      ESS_CHECK(std::isfinite(ratio) && ratio > 0 && ratio <= 1, "executor: ratio = {} must be in (0, 1]", ratio);
    }
  } else {
    ESS_CHECK(!skip_transfers, "executor: skip_transfers applies to the offloaded mode only");
    ESS_CHECK(!reserve_newest, "executor: reserve_newest applies to the offloaded mode only");
  }
  // T is the trace's: at least 1 here, checked again with the trace's T in load_inputs.
  if (offload) check_pool(*this, model.index_topk, 1);
}

std::int64_t StepInputs::max_length() const {
  std::int64_t m = prompt;
  for (const std::int64_t l : lengths) m = std::max(m, l);
  return m;
}

namespace {

// A temporary file name for a synthetic trace (removed once it is mapped).
std::string temp_trace_path() {
  const auto dir = std::filesystem::temp_directory_path();
  static std::atomic<int> counter{0};
  const auto t = std::chrono::steady_clock::now().time_since_epoch().count();
  return (dir / fmt::format("ess-executor-{}-{}-{}.safetensors", ::getpid(), t, counter++)).string();
}

trace::TraceReader open_inputs_trace(const ExecutorConfig& c, std::string& source) {
  if (!c.trace.empty()) {
    source = c.trace;
    return trace::TraceReader(c.trace);
  }
  trace::GeneratorProfile profile = trace::GeneratorProfile::shipped_default();
  profile.layers = c.layers;
  trace::GenerateConfig g;
  g.contexts = {c.context};
  g.requests = c.batch;
  g.steps = c.steps;
  g.seed = c.seed;
  const std::string path = temp_trace_path();
  trace::generate_trace(profile, g, path);
  try {
    trace::TraceReader reader(path);
    std::filesystem::remove(path);
    source = fmt::format("synthetic: shipped generator profile '{}', {} layers, {} requests, context {}, {} steps, seed {}",
                         profile.name, c.layers, c.batch, c.context, c.steps, c.seed);
    return reader;
  } catch (...) {
    std::filesystem::remove(path);
    throw;
  }
}

}  // namespace

StepInputs load_inputs(const ExecutorConfig& c, const ModelSpec& model) {
  c.validate(model);
  StepInputs in;
  const trace::TraceReader reader = open_inputs_trace(c, in.source);
  const trace::TraceMeta& meta = reader.meta();
  ESS_CHECK(reader.requests() >= 1, "executor: trace {} holds no request", in.source);
  ESS_CHECK(meta.topk == model.index_topk, "executor: trace {} has top-k {}, the model selects {}", in.source, meta.topk,
            model.index_topk);
  ESS_CHECK(meta.layers >= 1, "executor: trace {} has no layer", in.source);
  in.layers = c.layers;
  in.batch = c.batch;
  in.mtp = meta.mtp;
  in.topk = meta.topk;
  in.steps = c.steps;
  ESS_CHECK(static_cast<std::int64_t>(in.mtp) * in.topk <= 4096,
            "executor: trace {} has T x top-k = {} x {} > 4096 ids per request (the GPU swap engine's limit)",
            in.source, in.mtp, in.topk);
  if (c.offload) check_pool(c, in.topk, in.mtp);
  for (int l = 0; l < c.layers; ++l) {
    const int tl = c.layers == 1 ? 0
                                 : static_cast<int>(std::lround(static_cast<double>(l) * (meta.layers - 1) /
                                                                (c.layers - 1)));
    in.trace_layers.push_back(std::min(tl, meta.layers - 1));
  }
  const std::size_t row = static_cast<std::size_t>(in.mtp) * static_cast<std::size_t>(in.topk);
  in.ids.assign(static_cast<std::size_t>(c.steps) * c.layers * c.batch * row, -1);
  in.lengths.assign(static_cast<std::size_t>(c.steps) * c.batch, 0);
  in.prefill_windows = c.warmup ? reader.request(0).prefill_windows : 0;
  for (std::size_t r = 0; r < reader.requests(); ++r) {
    if (reader.request(r).prefill_windows != in.prefill_windows && c.warmup) in.prefill_windows = 0;
  }
  in.prefill.assign(static_cast<std::size_t>(c.layers) * c.batch * in.prefill_windows * in.topk, -1);
  const std::int32_t slots = c.offload ? c.resolved_slots() : 0;
  std::vector<double> miss_sum(static_cast<std::size_t>(c.layers), 0.0);
  std::int64_t prompt = -1;
  for (int b = 0; b < c.batch; ++b) {
    const std::size_t ri = static_cast<std::size_t>(b) % reader.requests();
    const trace::RequestView& rv = reader.request(ri);
    if (b < static_cast<int>(reader.requests())) reader.validate_request(ri);
    ESS_CHECK(rv.steps >= c.steps, "executor: trace {} request {} has {} steps, {} requested", in.source, ri, rv.steps,
              c.steps);
    const std::int64_t p = rv.lengths[0] - in.mtp;
    ESS_CHECK(p >= 1, "executor: trace {} request {} starts with length {} for T = {}", in.source, ri, rv.lengths[0], in.mtp);
    prompt = prompt < 0 ? p : std::min(prompt, p);
    for (int s = 0; s < c.steps; ++s) {
      in.lengths[static_cast<std::size_t>(s) * c.batch + static_cast<std::size_t>(b)] = rv.lengths[static_cast<std::size_t>(s)];
      for (int l = 0; l < c.layers; ++l) {
        const auto src = rv.step(s, in.trace_layers[static_cast<std::size_t>(l)]);
        std::copy(src.begin(), src.end(),
                  in.ids.begin() + static_cast<std::ptrdiff_t>(((static_cast<std::size_t>(s) * c.layers + l) * c.batch + b) * row));
      }
    }
    for (int l = 0; l < c.layers && in.prefill_windows > 0; ++l) {
      const auto src = rv.prefill(in.trace_layers[static_cast<std::size_t>(l)]);
      std::copy(src.begin(), src.end(),
                in.prefill.begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(l) * c.batch + b) *
                                                                  static_cast<std::size_t>(in.prefill_windows) * in.topk));
    }
    // Offline profile: the same LRU (+ warm-up) the GPU engine runs, replayed on the CPU.
    if (c.offload && b < static_cast<int>(reader.requests())) {
      for (int l = 0; l < c.layers; ++l) {
        const trace::LayerReplay rep = trace::replay_layer(rv, in.trace_layers[static_cast<std::size_t>(l)], slots,
                                                           std::make_unique<LruPolicy>(slots), in.prefill_windows > 0);
        double sum = 0;
        for (int s = 0; s < c.steps; ++s) sum += rep.misses[static_cast<std::size_t>(s)];
        miss_sum[static_cast<std::size_t>(l)] += sum / c.steps;
      }
    }
  }
  in.prompt = prompt;
  in.profile_misses.resize(static_cast<std::size_t>(c.layers), 0.0);
  const int replayed = std::min<int>(c.batch, static_cast<int>(reader.requests()));
  for (int l = 0; l < c.layers; ++l) in.profile_misses[static_cast<std::size_t>(l)] = miss_sum[static_cast<std::size_t>(l)] / replayed;
  return in;
}

std::vector<OverlapMode> layer_modes(const ExecutorConfig& c, const StepInputs& in) {
  std::vector<OverlapMode> modes(static_cast<std::size_t>(in.layers), c.overlap);
  if (!c.offload) {
    std::fill(modes.begin(), modes.end(), OverlapMode::kNone);
  } else if (c.overlap == OverlapMode::kLayerWise) {
    ESS_CHECK(in.profile_misses.size() == modes.size(), "executor: layer-wise needs a miss profile of {} layers, got {}",
              modes.size(), in.profile_misses.size());
    for (std::size_t l = 0; l < modes.size(); ++l) {
      modes[l] = in.profile_misses[l] >= c.layerwise_threshold ? OverlapMode::kDualBatchAttention
                                                               : OverlapMode::kDualAttention;
    }
  }
  return modes;
}

}  // namespace ess::rig
