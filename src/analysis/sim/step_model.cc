#include "ess/sim/step_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "analysis/sim/layer_builder.h"
#include "analysis/sim/step_scheduler.h"
#include "ess/cache/sparse_pool.h"
#include "ess/core/error.h"

namespace ess::sim {
namespace {

// Residency kAdaptive: the requests whole at this batch. The cache memory left beside the batch's
// resident caches holds P pool rows of `slots` entries per layer; a whole request takes
// ceil(context / slots) of them (context in entries), a sparse one one, so w are whole where
// w (u - 1) + batch <= P.
int whole_requests(const MemoryModel& mem, int batch, std::int32_t slots, std::int64_t context) {
  if (slots >= context) return batch;
  const double tokens = (mem.cache_budget() - batch * mem.resident_bytes_per_request()) / mem.latent_bytes_per_request(1);
  const double rows = std::floor(tokens / slots);
  const double per_whole = std::ceil(double(context) / slots);
  return static_cast<int>(std::clamp(std::floor((rows - batch) / (per_whole - 1)), 0.0, double(batch)));
}

// The batch and the pool: the batch given or the largest that fits, the slots given, from the
// ratio or the most that fit the batch; the cache and host pool they take. The rig holds an
// explicit batch and pool and no memory model (it holds rig_layers layers).
StepResult size_step(const ModelSpec& model, const Deployment& dep, const Workload& wl, const MemoryModel& mem) {
  StepResult r;
  r.offload = wl.offload;
  r.overlap = wl.offload ? wl.overlap : OverlapMode::kNone;
  std::int32_t slots = 0;
  const std::int64_t entries = mem.context_entries();  // slots, top-k and misses count entries
  const auto ctx32 = static_cast<std::int32_t>(std::min<std::int64_t>(entries, std::numeric_limits<std::int32_t>::max()));
  if (!wl.offload) {
    ESS_CHECK(wl.slots == 0 && (wl.ratio == 0 || wl.ratio == 1),
              "the all-on-GPU baseline keeps the whole context on the GPU: ratio {} / slots {} do not apply",
              wl.ratio, wl.slots);
    slots = ctx32;
  } else if (wl.slots > 0) {
    ESS_CHECK(wl.slots <= entries, "slots = {} exceed the context length {}{}", wl.slots, entries,
              entries == wl.context ? std::string() : fmt::format(" (C4 entries of {} tokens)", wl.context));
    slots = wl.slots;
  } else if (wl.ratio > 0) {
    slots = slots_for_ratio(wl.ratio, entries);
  }
  const bool rig = dep.rig_layers > 0;
  int batch = wl.batch;
  if (rig) {
    ESS_CHECK(batch > 0, "deployment {}: the executor rig (rig_layers = {}) needs an explicit batch", dep.name,
              dep.rig_layers);
    if (slots == 0) slots = ctx32;
    const std::int64_t whole = std::min<std::int64_t>(std::int64_t{dep.mtp_tokens} * model.selected_entries(), wl.context);
    ESS_CHECK(!wl.offload || slots >= whole,
              "the executor rig runs steps whole (no query groups): {} slots cannot hold a step's working set of up to "
              "min(T x top-k, context) = {}", slots, whole);
    // The rig holds its layers' whole indexer cache and a latent pool (the context when resident)
    // for every request on its one GPU.
    const double rig_bytes = double(batch) * dep.rig_layers *
                             (double(wl.context) * double(model.indexer_entry_bytes()) + double(slots) * double(model.latent_entry_bytes()));
    ESS_CHECK(rig_bytes <= mem.hbm_bytes(),
              "the executor rig cannot hold batch {}: {} layers x {} requests of cache take {:.1f} GB, more than the "
              "GPU's {:.1f} GB of HBM", batch, dep.rig_layers, batch, rig_bytes / 1e9, mem.hbm_bytes() / 1e9);
  } else if (batch == 0) {
    // The largest batch: at the given pool, else (offload) at the pool floor, the smallest pool a
    // request-layer may get; the all-on-GPU baseline holds the whole context.
    if (slots == 0) {
      slots = wl.offload ? std::min(mem.min_slots(), ctx32) : ctx32;  // the floor the memory model was built with
    }
    batch = mem.max_batch(slots);
    ESS_CHECK(batch >= 1, "no request fits: one request with {} slots per request-layer needs {:.2f} GB of "
                          "cache per GPU but only {:.2f} GB is left after the weights",
              slots, (mem.resident_bytes_per_request() + mem.latent_bytes_per_request(slots)) / 1e9,
              mem.cache_budget() / 1e9);
  } else if (slots == 0) {
    slots = mem.slots_for_batch(batch);
  }
  if (!rig) mem.check_fits(batch, slots);
  r.batch = batch;
  r.slots = slots;
  r.ratio = double(slots) / double(entries);
  r.cache_gb = batch * (mem.resident_bytes_per_request() + mem.latent_bytes_per_request(slots)) / 1e9;
  r.host_pool_gb_per_node = wl.offload ? mem.host_pool_bytes_per_node(batch, wl.prefix_share) / 1e9 : 0.0;
  r.host_pool_gb_per_node_unshared = wl.offload ? mem.host_pool_bytes_per_node(batch) / 1e9 : 0.0;
  if (wl.offload && wl.residency == Residency::kAdaptive && !rig) r.whole_requests = whole_requests(mem, batch, slots, entries);
  return r;
}

// One step on a sized batch: the layers (dense, then MoE whole or in Two-Batch Overlap), the LM
// head, sampling and the MTP drafts, and the host's time between steps.
class StepRun {
 public:
  StepRun(const ModelSpec& model, const HardwareProfile& hw, const Deployment& dep, const OpCostModel& cost,
          const Workload& wl, StepResult sized, Timeline* timeline)
      : model_(model),
        hw_(hw),
        dep_(dep),
        wl_(wl),
        r_(std::move(sized)),
        T_(dep.mtp_tokens),
        entries_(context_in_entries(model, wl.context)),
        offload_(wl.offload && r_.slots < entries_ && r_.whole_requests < r_.batch),
        rig_(dep.rig_layers > 0),
        lb_(model, dep, wl.context, wl.offload, double(r_.slots), sparse_share()),
        s_(cost, r_, timeline),
        topk_eff_(static_cast<double>(std::min<std::int64_t>(model.selected_entries(), entries_))),
        n_layers_(rig_ ? dep.rig_layers : model.num_hidden_layers),
        first_moe_(rig_ ? 0 : std::min(model.first_k_dense_replace, n_layers_)) {}
  StepRun(const StepRun&) = delete;  // the scheduler points at r_
  StepRun& operator=(const StepRun&) = delete;

  StepResult run() {
    if (r_.overlap == OverlapMode::kLayerWise) {
      r_.layer_modes.reserve(static_cast<std::size_t>(3 * (model_.num_hidden_layers + 1)));
    }
    plan_misses();
    const double ready = layers();
    if (rig_) {  // the rig's step ends with its last layer
      r_.step_us = s_.end();
      const double step_s = r_.step_us * 1e-6;
      r_.otps = dep_.accept_ratio / step_s;
      r_.throughput_tokens_per_s = r_.otps * r_.batch;
      r_.h2d_gbps_per_node = r_.h2d_bytes / step_s / 1e9;
      return r_;
    }
    head_and_drafts(ready);
    // Host time between steps: a fixed part (scheduling, the ranks' synchronisation) and a part
    // per request (its bookkeeping: acceptance, outputs, the next batch's inputs).
    r_.step_overhead_us = hw_.step_overhead_us + hw_.step_overhead_per_request_us * r_.batch;
    s_.host_gap(r_.step_overhead_us);
    r_.step_us = s_.end();
    const double step_s = r_.step_us * 1e-6;
    r_.otps = dep_.accept_ratio / step_s;
    // Per node: a batch per GPU, or (attention TP) one batch over gpus_per_request GPUs.
    r_.throughput_tokens_per_s = r_.otps * r_.batch * dep_.gpus_per_node / dep_.gpus_per_request();
    r_.h2d_gbps_per_node = r_.h2d_bytes * dep_.gpus_per_node / step_s / 1e9;
    return r_;
  }

 private:
  // A request cannot miss more entries than its query tokens select: the model's value is
  // capped there, for the reported misses as for the step time, and the cap is reported.
  double capped(double m, int tokens) {
    const double cap = tokens * topk_eff_;
    if (m <= cap) return m;
    ++r_.miss_capped_layers;
    return cap;
  }

  // Whether the MoE layers run as Two-Batch Overlap's two micro-batches.
  bool runs_tbo() const { return dep_.two_batch_overlap && r_.batch >= 2 && !rig_; }

  // The share of the batch's requests that are sparse (Workload::residency).
  double sparse_share() const { return r_.batch > 0 ? double(r_.batch - r_.whole_requests) / r_.batch : 1.0; }

  // Each layer's misses per request (capped) and their mean over the offloaded layers (DeepSeek-V4's
  // C4 layers, MiniMax-M3's sparse ones, a miss profile's layers in their order; every layer of a DSA
  // model).
  void plan_misses() {
    layer_misses_.assign(static_cast<std::size_t>(n_layers_), 0.0);
    double miss_sum = 0;
    int offloaded = 0;
    for (int layer = 0; layer < n_layers_; ++layer) {
      if (!rig_ && !model_.offloads(layer)) continue;
      // Whole requests miss nothing: the mean over the batch is the sparse ones' share. A layer
      // sharing its leader's top-k misses what its leader misses (its pool sees the same ids).
      const double m = !offload_                    ? 0.0
                       : model_.index_shared(layer) ? layer_misses_[static_cast<std::size_t>(model_.index_leader(layer))]
                                                    : capped(wl_.misses.misses(offloaded, r_.slots, double(entries_), T_), T_) *
                                                          sparse_share();
      layer_misses_[static_cast<std::size_t>(layer)] = m;
      miss_sum += m;
      ++offloaded;
    }
    r_.misses_per_request_layer = offloaded > 0 ? miss_sum / offloaded : 0.0;
  }

  // Sets a micro-batch's tokens, misses, split calls and overlap mode for a layer. Layer-wise
  // without a threshold: the faster of DA and DBA for a layer's miss count, tried once per
  // distinct (misses, tokens) of each micro-batch slot.
  void enter_layer(MicroBatch& mb, int layer, int slot, int tokens_per_request, double misses_per_request, bool moe,
                   bool first_of_layer) {
    misses_per_request = std::min(misses_per_request, tokens_per_request * topk_eff_);
    // Index sharing: a follower was prefetched when its leader's prepare issued its copy; a leader
    // with the prefetch issues its followers' (while the layers after it share its top-k).
    const bool prefetch = offload_ && dep_.shared_index_prefetch && !model_.shared_index.empty();
    mb.layer = layer;
    mb.index_shared = model_.index_shared(layer);
    mb.prefetched = prefetch && mb.index_shared && mb.prefetch_end.size() > static_cast<std::size_t>(layer) &&
                    mb.prefetch_end[static_cast<std::size_t>(layer)] >= 0;
    mb.followers.clear();
    if (prefetch && !mb.index_shared) {
      mb.prefetch_end.assign(static_cast<std::size_t>(n_layers_), -1.0);
      // A dense layer runs the whole batch; under Two-Batch Overlap the MoE layers after it run
      // micro-batches, whose swaps a copy for the whole batch does not serve.
      const int last = runs_tbo() && layer < first_moe_ ? first_moe_ : n_layers_;
      for (int f = layer + 1; f < last && model_.index_shared(f); ++f) {
        const double m = std::min(layer_misses_[static_cast<std::size_t>(f)], tokens_per_request * topk_eff_);
        mb.followers.emplace_back(f, mb.requests * m);
      }
    }
    // Steps larger than the pool: any floor(slots / K) query tokens fit together, so greedy
    // grouping makes at most ceil(T / floor(slots / K)) groups; the share of request-layer-
    // steps that split is bounded by the measured working set.
    const double slots = double(r_.slots);
    const double split = offload_ && tokens_per_request > 1
                             ? wl_.misses.split_bound(slots, tokens_per_request, model_.selected_entries(), double(entries_))
                             : 0.0;
    const double per_group = std::max(1.0, std::floor(slots / topk_eff_));
    const double max_groups = std::ceil(double(tokens_per_request) / per_group);
    mb.tokens = mb.requests * tokens_per_request;
    mb.misses = offload_ ? mb.requests * misses_per_request : 0.0;
    mb.split_calls = split > 0 ? (1 - std::pow(1 - split, mb.requests)) * (max_groups - 1) : 0.0;
    r_.split_calls_per_layer = std::max(r_.split_calls_per_layer, mb.split_calls);
    OverlapMode mode = mb.prefetched ? OverlapMode::kNone : r_.overlap;  // a prefetched follower's copy is done
    // A follower runs no indexer, so it has no first half to swap: DBA runs as DA there (as the adapter runs it).
    if (mb.index_shared && mode == OverlapMode::kDualBatchAttention) mode = OverlapMode::kDualAttention;
    if (mb.prefetched && r_.overlap == OverlapMode::kLayerWise) {
      if (first_of_layer && modes_in_layer_++ > 0) r_.layer_modes += ' ';
      r_.layer_modes += '-';
    } else if (mode == OverlapMode::kLayerWise && mb.index_shared) {
      mode = OverlapMode::kDualAttention;
      r_.layers_da += 1;
      if (first_of_layer && modes_in_layer_++ > 0) r_.layer_modes += ' ';
      r_.layer_modes += mb.misses <= 0 ? '-' : 'a';
    } else if (mode == OverlapMode::kLayerWise) {
      Choice& c = choice_[slot];
      if (wl_.layerwise_threshold >= 0) {
        mode = mb.misses < wl_.layerwise_threshold ? OverlapMode::kDualAttention : OverlapMode::kDualBatchAttention;
      } else if (c.misses == mb.misses && c.tokens == mb.tokens && c.moe == moe) {
        mode = c.mode;  // same layer inputs as the last trial: same choice
      } else {
        StepResult scratch;
        MicroBatch a = mb, b = mb;
        a.mode = OverlapMode::kDualAttention;
        b.mode = OverlapMode::kDualBatchAttention;
        Scheduler da = s_.trial(scratch), dba = s_.trial(scratch);
        lb_.prepare(da, a);
        lb_.core(da, a, moe);
        lb_.prepare(dba, b);
        lb_.core(dba, b, moe);
        mode = dba.compute_end() < da.compute_end() ? OverlapMode::kDualBatchAttention : OverlapMode::kDualAttention;
        c = {mb.misses, mb.tokens, moe, mode};
      }
      (mode == OverlapMode::kDualAttention ? r_.layers_da : r_.layers_dba) += 1;
      if (first_of_layer && modes_in_layer_++ > 0) r_.layer_modes += ' ';
      r_.layer_modes += mb.misses <= 0 ? '-' : (mode == OverlapMode::kDualAttention ? 'a' : 'b');
    }
    mb.mode = mode;
  }

  // One layer for one micro-batch, every stage in order (no overlap with another micro-batch).
  void whole_layer(MicroBatch& mb, int layer, bool moe, int tokens_per_request, double misses) {
    s_.set_label(layer, mb.label);
    enter_layer(mb, layer, 0, tokens_per_request, misses, moe, true);
    lb_.prepare(s_, mb);
    lb_.core(s_, mb, moe);
    if (!moe) return;
    for (int stage = 2; stage < 5; ++stage) lb_.moe_stage(s_, mb, stage, !rig_);
  }

  // Every layer of the model (or the rig); returns when the last one is done. The dense layers
  // run the whole batch (SGLang overlaps only MoE layers).
  double layers() {
    MicroBatch whole;
    whole.requests = r_.batch;
    whole.label = 'A';
    for (int layer = 0; layer < first_moe_; ++layer) {
      whole_layer(whole, layer, false, T_, layer_misses_[static_cast<std::size_t>(layer)]);
    }
    if (runs_tbo()) return two_batch_overlap(whole.ready);
    for (int layer = first_moe_; layer < n_layers_; ++layer) {
      whole_layer(whole, layer, true, T_, layer_misses_[static_cast<std::size_t>(layer)]);
    }
    return whole.ready;
  }

  // Two-Batch Overlap: the two halves run the five stages of each MoE layer with the second
  // two stages behind the first (SGLang's execute_overlapped_operations, delta 2): A0 A1 A2
  // B0 A3 B1 ..., so one half's dispatch and combine are in flight while the other runs its
  // attention and MoE.
  double two_batch_overlap(double ready) {
    MicroBatch mbs[2];
    mbs[0].requests = std::ceil(r_.batch / 2.0);
    mbs[1].requests = std::floor(r_.batch / 2.0);
    mbs[1].label = 'B';
    for (MicroBatch& mb : mbs) mb.ready = ready;
    const int stages = 5 * (n_layers_ - first_moe_);
    auto stage = [&](int i, int k) {
      MicroBatch& mb = mbs[i];
      const int layer = first_moe_ + k / 5;
      s_.set_label(layer, mb.label);
      switch (k % 5) {
        case 0:
          enter_layer(mb, layer, i, T_, layer_misses_[static_cast<std::size_t>(layer)], true, i == 0);
          lb_.prepare(s_, mb);
          break;
        case 1: lb_.core(s_, mb, true); break;
        default: lb_.moe_stage(s_, mb, k % 5, !rig_); break;
      }
    };
    constexpr int kDelta = 2;
    for (int k = 0; k < std::min(kDelta, stages); ++k) stage(0, k);
    for (int k = kDelta; k < stages; ++k) {
      stage(0, k);
      stage(1, k - kDelta);
    }
    for (int k = std::max(0, stages - kDelta); k < stages; ++k) stage(1, k);
    return std::max(mbs[0].ready, mbs[1].ready);
  }

  // LM head over every verified position, then sampling and the verification of the drafts,
  // as SGLang 0.5.23 runs them for a greedy batch. MTP (eagle_utils.py:eagle_sample, greedy
  // branch): argmax over the B x T rows of logits (one pass), verify_tree_greedy_func, the
  // zeros / full of predict and accept_index, then prepare_verify_commit_outputs
  // (eagle_worker_common.py:run_eagle_verify): 5 kernels. No MTP (sampler.py:Sampler.forward,
  // is_all_greedy): argmax, one pass, 1 kernel.
  void head_and_drafts(double ready) {
    const int batch = r_.batch;
    s_.set_label(-1, ' ');
    s_.set_category(Category::kOther);
    double e = s_.issue(Stream::kCompute, lb_.lm_head(double(batch) * T_), ready, Wait::kComm);
    e = s_.issue(Stream::kCompute, lb_.sample("sample+verify", double(batch) * T_, 1, T_ > 1 ? 5 : 1), e);
    // MTP drafts as SGLang 0.5.23's EAGLE worker runs them (eagle_worker_v2.py, top-k 1, so
    // speculative_num_steps = T - 1 and speculative_num_draft_tokens = T, base_spec_worker.py):
    //  - after the verify, EagleDraftWorker._draft_extend_for_decode: one pass of the next-n
    //    layer over num_draft_tokens = T positions per request; its cuda graph selects each
    //    request's last accepted row before the LM head (B rows), then torch.argmax + ones_like
    //    (2 kernels);
    //  - EagleDraftWorker.draft_forward: speculative_num_steps - 1 = T - 2 passes over one
    //    position per request (the loop breaks at i = num_steps - 1), each with its LM head
    //    over B rows and draft_topk1_postprocess (1 kernel).
    // So T = 2: 1 pass (extend); T = 3: 2 (extend + 1 decode); T = 4: 3 (extend + 2 decode).
    // The draft layer runs its own indexer (DeepSeek-V3.2 has no index sharing; for a model with
    // index_share_for_mtp_iteration, GLM-5.2's, this overstates the drafts' indexer work) and no
    // Two-Batch Overlap.
    if (T_ <= 1 || model_.num_nextn_predict_layers <= 0) return;
    const int layer = model_.num_hidden_layers;
    s_.set_drafting(true);
    double decode_misses = -1;  // the decode passes' misses: one value, capped (and counted) once
    for (int pass = 0; pass < T_ - 1; ++pass) {
      const int tokens = pass == 0 ? T_ : 1;
      double m = 0;
      if (offload_ && pass == 0) m = capped(wl_.misses.misses(layer, r_.slots, double(entries_), tokens), tokens) * sparse_share();
      if (offload_ && pass > 0) {
        if (decode_misses < 0) decode_misses = capped(wl_.misses.misses(layer, r_.slots, double(entries_), 1), 1) * sparse_share();
        m = decode_misses;
      }
      s_.set_label(layer, pass == 0 ? 'X' : 'D');
      s_.set_category(Category::kOther);
      MicroBatch draft;
      draft.requests = batch;
      draft.label = pass == 0 ? 'X' : 'D';
      draft.ready = s_.issue(Stream::kCompute, lb_.eh_proj(double(batch) * tokens), e);
      whole_layer(draft, layer, true, tokens, m);
      s_.set_label(layer, draft.label);
      s_.set_category(Category::kOther);
      e = s_.issue(Stream::kCompute, lb_.lm_head(batch), draft.ready, Wait::kComm);
      e = s_.issue(Stream::kCompute, lb_.sample("draft sample", batch, 1, pass == 0 ? 2 : 1), e);
    }
    s_.set_drafting(false);
  }

  struct Choice {  // the last layer-wise trial of a micro-batch slot
    double misses = -1;
    double tokens = -1;
    bool moe = false;
    OverlapMode mode = OverlapMode::kDualAttention;
  };

  const ModelSpec& model_;
  const HardwareProfile& hw_;
  const Deployment& dep_;
  const Workload& wl_;
  StepResult r_;
  const int T_;
  const std::int64_t entries_;  // the context in the offloaded cache's entries
  const bool offload_;  // something is offloaded: the pool holds less than the context
  const bool rig_;
  const LayerBuilder lb_;
  Scheduler s_;
  const double topk_eff_;
  const int n_layers_;
  const int first_moe_;
  Choice choice_[2];
  int modes_in_layer_ = 0;
  std::vector<double> layer_misses_;
};

}  // namespace

StepModel::StepModel(const ModelSpec& model, const HardwareProfile& hw, const Deployment& dep,
                     const MeasuredTables* tables)
    : model_(model), hw_(hw), dep_(dep), cost_(hw_, tables) {
  dep_.validate(dep.name);
  require_modelled(model_, dep_);
  if (model_.is_deepseek_v4()) {
    ESS_CHECK(dep_.mtp_tokens == 1,
              "{}: mtp_tokens = {}: SGLang 0.5.23's HiSparse refuses speculative decoding with DeepSeek-V4, so its "
              "decode runs one query token per step (--mtp 1)",
              model_.name, dep_.mtp_tokens);
  }
  if (model_.is_minimax_m3()) {
    ESS_CHECK(dep_.mtp_tokens == 1,
              "{}: mtp_tokens = {}: SGLang 0.5.23's HiSparse serves MiniMax-M3 with no speculative decoding (its "
              "block swap has no verify path), so its decode runs one query token per step (--mtp 1)",
              model_.name, dep_.mtp_tokens);
  }
  if (model_.is_deepseek_v4() || model_.is_minimax_m3()) {
    const char* family = model_.is_deepseek_v4() ? "DeepSeek-V4" : "MiniMax-M3";
    ESS_CHECK(dep_.rig_layers == 0, "{}: the executor rig (rig_layers = {}) runs DSA layers; {}'s are modelled "
              "in a deployment only", model_.name, dep_.rig_layers, family);
    // A measured table names DSA's ops by name and context in tokens: its rows would time another model's shapes.
    ESS_CHECK(tables == nullptr || tables->empty(),
              "{}: --op-table: the measured ops are DSA's (`ess bench profile` times the rig's DSA layers); {}'s "
              "steps are timed analytically",
              model_.name, family);
  }
  // Experts spread unevenly are modelled (the busiest GPU holds the rounded-up share); more
  // GPUs in an EP group than experts are not.
  ESS_CHECK(dep_.expert_parallel <= model_.n_routed_experts,
            "{}: expert_parallel = {} exceeds the model's {} routed experts", dep.name, dep_.expert_parallel,
            model_.n_routed_experts);
}

MissModel StepModel::misses_in_entries(const MissModel& m) const {
  const int block = model_.selection_block();
  if (block > 1 && m.unit_tokens == block * model_.tokens_per_entry()) {
    // A profile of the model's own blocks (MiniMax-M3's): an id names `block` entries, selected, held
    // and missed together (the swap engine's LRU keeps a block's tokens together).
    MissModel e = m;
    e.reference_misses *= block;
    e.reference_slots *= block;
    e.reference_context *= block;
    e.working_set_p99 *= block;
    e.working_set_max *= block;
    e.profile_topk *= block;
    e.unit_tokens = model_.tokens_per_entry();
    return e;
  }
  if (m.unit_tokens != 1) return m;  // another model's units: check_misses names them
  // Tokens for a cache of tokens: as they are, but the built-in model's for a block selection.
  if (model_.tokens_per_entry() == 1 && (block == 1 || !m.builtin)) return m;
  ESS_CHECK(m.builtin,
            "{}: a miss model's reference point given in tokens (--misses / --miss-exponent, a workload's 'misses', a "
            "profile of tokens) does not describe its cache of entries of {} tokens; give a miss profile of its own "
            "(`ess trace gen --model` / a recording, then `ess trace analyze --miss-profile`)",
            model_.name, model_.tokens_per_entry());
  // The built-in model (tokens of a DSA model at top-2048) for a cache of entries of n tokens at
  // top-k entries (MiniMax-M3: tokens, its blocks' selected): the same share of the selection missed
  // at the same share of the context held.
  MissModel e = m;
  const double n = model_.tokens_per_entry(), share = double(model_.selected_entries()) / kBuiltinTopk;
  e.reference_misses *= share;
  e.reference_slots /= n;
  e.reference_context /= n;
  e.working_set_p99 *= share;
  e.working_set_max *= share;
  e.unit_tokens = model_.tokens_per_entry();
  return e;
}

double StepModel::pool_floor(const MissModel& misses, std::int64_t context) const {
  return misses_in_entries(misses).min_slots(dep_.mtp_tokens, model_.selected_entries(),
                                             double(context_in_entries(model_, context)));
}

void StepModel::check_misses(const MissModel& m) const {
  ESS_CHECK(m.unit_tokens == model_.tokens_per_entry(),
            "miss profile: its ids are {}; {} offloads {} (a trace of its own selections: `ess trace gen --model` or "
            "one recorded under it)",
            m.unit_tokens == 1 ? std::string("tokens") : fmt::format("units of {} tokens", m.unit_tokens), model_.name,
            model_.tokens_per_entry() == 1 ? std::string("tokens") : fmt::format("entries of {} tokens", model_.tokens_per_entry()));
  const double most = static_cast<double>(m.reference_tokens) * model_.selected_entries();
  ESS_CHECK(m.reference_misses <= most,
            "miss model: {} misses per request-layer-step at the reference pool exceed what {} query tokens x top-{} "
            "can select ({})",
            m.reference_misses, m.reference_tokens, model_.selected_entries(), most);
  const int offloaded = static_cast<int>(model_.offloaded_layers().size());
  const int layers = dep_.rig_layers > 0 ? dep_.rig_layers : offloaded;
  ESS_CHECK(m.layer_shape.empty() || static_cast<int>(m.layer_shape.size()) == offloaded ||
                (dep_.rig_layers > 0 && static_cast<int>(m.layer_shape.size()) >= layers),
            "miss profile: {} per-layer values for a model of {} {}layers{}", m.layer_shape.size(), offloaded,
            offloaded == model_.num_hidden_layers ? "" : "offloaded ",
            dep_.rig_layers > 0 ? fmt::format(" (the rig runs {})", layers) : "");
  ESS_CHECK(m.profile_topk == 0 || m.profile_topk == model_.selected_entries(),
            "miss profile: measured at top-{}, the model selects top-{}", m.profile_topk, model_.selected_entries());
}

StepResult StepModel::run(const Workload& given, Timeline* timeline) const {
  given.validate();
  ESS_CHECK(model_.max_position_embeddings <= 0 || given.context <= model_.max_position_embeddings,
            "context {} exceeds the model's max_position_embeddings ({})", given.context, model_.max_position_embeddings);
  ESS_CHECK((!model_.is_deepseek_v4() && !model_.is_minimax_m3()) || !given.offload || given.overlap == OverlapMode::kNone,
            "{}: overlap {}: the overlap schedules split FlashMLA's DSA decode; {}'s runs whole (the SGLang adapter "
            "refuses ESS_OVERLAP with it)",
            model_.name, to_string(given.overlap), model_.is_deepseek_v4() ? "DeepSeek-V4" : "MiniMax-M3");
  Workload wl = given;
  wl.misses = misses_in_entries(given.misses);
  check_misses(wl.misses);
  const MemoryModel mem(model_, hw_, dep_, wl.context, pool_floor(given.misses, wl.context));
  StepRun step(model_, hw_, dep_, cost_, wl, size_step(model_, dep_, wl, mem), timeline);
  return step.run();
}

}  // namespace ess::sim
