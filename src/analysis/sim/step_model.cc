#include "ess/sim/step_model.h"

#include "ess/core/op_names.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ess/cache/sparse_pool.h"
#include "ess/core/error.h"

namespace ess::sim {
namespace {

enum class Wait { kNone, kComm, kTransfer };
enum class Category { kAttention, kMoe, kOther, kMtpDraft };

// Four in-order streams; each op starts when its stream is free and its inputs are ready.
// Idle time of the compute stream is charged to what it waited for.
class Scheduler {
 public:
  Scheduler(const OpCostModel& cost, StepResult& result, Timeline* timeline)
      : cost_(&cost), r_(&result), timeline_(timeline) {}

  void set_label(int layer, char micro_batch) {
    layer_ = layer;
    mb_ = micro_batch;
  }
  void set_category(Category c) { category_ = c; }

  double issue(Stream s, const Op& op, double ready, Wait wait = Wait::kNone) {
    const OpTime t = cost_->time(op);
    double& lane = lanes_[static_cast<int>(s)];
    const double start = std::max(lane, ready);
    if (s == Stream::kCompute) {
      const double gap = start - lane;
      if (gap > 0) {
        if (wait == Wait::kComm) r_->exposed_comm_us += gap;
        if (wait == Wait::kTransfer) r_->exposed_transfer_us += gap;
      }
      r_->compute_us += t.us;
      switch (category_) {
        case Category::kAttention: r_->attention_us += t.us; break;
        case Category::kMoe: r_->moe_us += t.us; break;
        case Category::kOther: r_->other_us += t.us; break;
        case Category::kMtpDraft: r_->mtp_draft_us += t.us; break;
      }
    } else if (s == Stream::kComm) {
      r_->comm_us += t.us;
    } else if (s == Stream::kH2D) {
      r_->h2d_us += t.us;
    }
    switch (t.source) {
      case CostSource::kMeasured: ++r_->ops_measured; break;
      case CostSource::kAnalytical: ++r_->ops_analytical; break;
      case CostSource::kAnalyticalOutsideGrid: ++r_->ops_outside_grid; break;
    }
    lane = start + t.us;
    if (timeline_ != nullptr && t.us > 0) {
      timeline_->events.push_back(
          {s, layer_ < 0 ? std::string(op.name) : fmt::format("L{}{} {}", layer_, mb_, op.name), start, t.us, t.source});
    }
    return lane;
  }
  double end() const { return *std::max_element(lanes_, lanes_ + 4); }
  double compute_end() const { return lanes_[0]; }
  // A copy that records nothing visible: for trying a schedule.
  Scheduler trial(StepResult& scratch) const {
    Scheduler s = *this;
    s.r_ = &scratch;
    s.timeline_ = nullptr;
    return s;
  }

 private:
  const OpCostModel* cost_;
  StepResult* r_;
  Timeline* timeline_;
  double lanes_[4] = {0, 0, 0, 0};
  int layer_ = -1;
  char mb_ = ' ';
  Category category_ = Category::kOther;
};

struct MicroBatch {
  double requests = 0;   // b
  double tokens = 0;     // n = b x query tokens
  double misses = 0;     // entries to fetch in this layer, whole micro-batch
  // Expected step calls past the first in this layer: query groups of steps whose working
  // set exceeds the pool (the batch shares one grouping, so one split position splits all).
  double split_calls = 0;
  double ready = 0;      // when its previous layer finished (combine done)
  char label = 'A';
};

class LayerBuilder {
 public:
  LayerBuilder(const ModelSpec& m, const Deployment& d, std::int64_t context, bool offload, double slots)
      : m_(m), d_(d), ctx_(static_cast<double>(context)), slots_(slots), offload_(offload) {
    topk_ = std::min(static_cast<double>(m.index_topk), ctx_);
    ctx64_ = context;
  }

  // The attention block of one micro-batch under `mode`; returns when o_proj finished.
  double attention(Scheduler& s, const MicroBatch& mb, OverlapMode mode) const {
    const double n = mb.tokens, b = mb.requests, h = m_.hidden_size, heads = m_.num_attention_heads;
    const double ih = m_.index_n_heads, id = m_.index_head_dim;
    const double proj0_out = m_.q_lora_rank + m_.kv_lora_rank + m_.qk_rope_head_dim + id + ih;
    const Op proj0{op::kProj0, OpKind::kGemmFp8, 2 * n * h * proj0_out,
                   h * proj0_out + n * h * 2 * 3, n, 0, 0, 0, 3};
    double e = s.issue(Stream::kCompute, proj0, mb.ready, Wait::kComm);
    if (offload_) {
      const Op d2h{op::kD2HNewEntries, OpKind::kD2H, 0, n * double(m_.latent_entry_bytes()), n, 0, 0, 0, 1};
      s.issue(Stream::kD2H, d2h, e);
    }
    const double qb_out = heads * (m_.qk_nope_head_dim + m_.qk_rope_head_dim);
    const Op pre_q{op::kQbProj, OpKind::kGemmFp8, 2 * n * m_.q_lora_rank * qb_out,
                   m_.q_lora_rank * qb_out + n * qb_out * 2, n, 0, 0, 0, 1};
    const Op pre_bmm{op::kAbsorbBmm, OpKind::kGemmBf16, 2 * n * heads * m_.qk_nope_head_dim * m_.kv_lora_rank,
                     heads * m_.qk_nope_head_dim * m_.kv_lora_rank * 2.0 + n * heads * m_.mla_head_dim() * 2.0, n, 0, 0, 0, 2};
    auto indexer = [&](double e0, double frac) {
      const double nn = n * frac, bb = b * frac;
      const Op q{op::kIndexerWqB, OpKind::kGemmFp8, 2 * nn * m_.q_lora_rank * ih * id,
                 m_.q_lora_rank * ih * id + nn * ih * id, nn, 0, 0, 0, 1};
      const Op logits{op::kIndexerLogits, OpKind::kIndexer, 2 * nn * ctx_ * ih * id,
                      bb * ctx_ * double(m_.indexer_entry_bytes()) + nn * ctx_ * 4, nn, ctx64_, 0, 0, 1};
      const Op topk{op::kIndexerTopk, OpKind::kMemory, 0, 2 * nn * ctx_ * 4, nn, ctx64_, 0, 0, 1};
      double t = s.issue(Stream::kCompute, q, e0);
      t = s.issue(Stream::kCompute, logits, t);
      t = s.issue(Stream::kCompute, topk, t);
      if (offload_) {
        // The swap engine's LRU decision and the FlashTrans list for this batch (GPU swap
        // engine + split kernel). The paper's simulator does not charge it; analytically it is
        // its memory traffic only (ids in and out, 12 bytes of state per slot), with no
        // per-kernel overhead (kernels = 0), so the paper calibration is unchanged; a measured
        // table (`ess bench profile`) gives its real time.
        const Op swap{op::kSwap, OpKind::kMemory, 0, nn * topk_ * 4.0 * 4 + bb * slots_ * 12.0, nn, 0, 0, 0, 0};
        t = s.issue(Stream::kCompute, swap, t);
        if (mb.split_calls > 0) {
          // Each further query group: the decision again and one more attention launch.
          const Op groups{op::kQueryGroups, OpKind::kMemory, 0, mb.split_calls * swap.bytes, nn, 0, 0, 0,
                          2 * mb.split_calls};
          t = s.issue(Stream::kCompute, groups, t);
        }
      }
      return t;
    };
    const double flop_per_entry = 2 * heads * (m_.mla_head_dim() + m_.kv_lora_rank);
    auto attn = [&](std::string_view name, double entries_per_token) {
      return Op{name, OpKind::kAttention, n * entries_per_token * flop_per_entry,
                n * entries_per_token * double(m_.latent_entry_bytes()) + n * heads * (m_.mla_head_dim() + m_.kv_lora_rank) * 2.0,
                n, ctx64_, 0, 0, 1};
    };
    const double entry = double(m_.latent_entry_bytes());
    const double misses = offload_ ? mb.misses : 0;
    const double miss_per_token = std::min(topk_, misses / std::max(n, 1.0));
    const Op h2d_all{op::kH2DMisses, OpKind::kH2D, 0, misses * entry, 0, 0, 0, 0, 1};
    const Op merge{op::kMerge, OpKind::kMemory, 0, 3 * n * heads * m_.kv_lora_rank * 2.0, n, 0, 0, 0, 1};
    if (misses <= 0 || mode == OverlapMode::kNone) {
      e = s.issue(Stream::kCompute, pre_q, e);
      e = s.issue(Stream::kCompute, pre_bmm, e);
      e = indexer(e, 1.0);
      double x = e;
      if (misses > 0) x = s.issue(Stream::kH2D, h2d_all, e);
      e = s.issue(Stream::kCompute, attn(op::kSparseMla, topk_), x, Wait::kTransfer);
    } else {
      double x = 0;
      if (mode == OverlapMode::kDualAttention) {
        e = indexer(e, 1.0);
        x = s.issue(Stream::kH2D, h2d_all, e);
      } else {  // DBA: two halves of the batch; the first half's copy runs under the second's indexer
        e = indexer(e, 0.5);
        s.issue(Stream::kH2D, Op{op::kH2DMissesHalf0, OpKind::kH2D, 0, 0.5 * misses * entry, 0, 0, 0, 0, 1}, e);
        e = indexer(e, 0.5);
        x = s.issue(Stream::kH2D, Op{op::kH2DMissesHalf1, OpKind::kH2D, 0, 0.5 * misses * entry, 0, 0, 0, 0, 1}, e);
      }
      e = s.issue(Stream::kCompute, pre_q, e);
      e = s.issue(Stream::kCompute, pre_bmm, e);
      e = s.issue(Stream::kCompute, attn(op::kAttn0, topk_ - miss_per_token), e);
      e = s.issue(Stream::kCompute, attn(op::kAttn1, miss_per_token), x, Wait::kTransfer);
      e = s.issue(Stream::kCompute, merge, e);
    }
    const Op out_bmm{op::kOutBmm, OpKind::kGemmBf16, 2 * n * heads * m_.kv_lora_rank * m_.v_head_dim,
                     heads * m_.kv_lora_rank * m_.v_head_dim * 2.0, n, 0, 0, 0, 1};
    const Op o_proj{op::kOProj, OpKind::kGemmFp8, 2 * n * heads * m_.v_head_dim * h,
                    heads * m_.v_head_dim * h + n * h * 2, n, 0, 0, 0, 1};
    e = s.issue(Stream::kCompute, out_bmm, e);
    return s.issue(Stream::kCompute, o_proj, e);
  }

  Op gate(double n) const {
    const double h = m_.hidden_size, e = m_.n_routed_experts;
    return {op::kGate, OpKind::kGemmBf16, 2 * n * h * e, h * e * 2 + n * h * 2 * 2, n, 0, 0, 0, 3};
  }
  Op shared(double n) const {
    const double w = 3.0 * m_.hidden_size * m_.moe_intermediate_size * m_.n_shared_experts;
    return {op::kSharedExpert, OpKind::kGemmFp8, 2 * n * w, w, n, 0, 0, 0, 2};
  }
  Op experts(double n) const {
    const double w = 3.0 * m_.hidden_size * m_.moe_intermediate_size;
    const double local = std::ceil(double(m_.n_routed_experts) / d_.expert_parallel);
    // Tokens routed to this GPU = n x top-k on average (every GPU holds n tokens).
    const double rows = n * m_.num_experts_per_tok;
    return {op::kRoutedExperts, OpKind::kGemmFp8, 2 * rows * w, local * w + rows * m_.hidden_size * 3.0, n, 0, 0, 0, 3};
  }
  Op all_to_all(std::string_view name, double n, double bytes_per_token) const {
    const double total = n * m_.num_experts_per_tok * bytes_per_token;
    const double ep = d_.expert_parallel;
    const double local_gpus = std::min<double>(d_.gpus_per_node, ep);
    const double rdma = total * (ep - local_gpus) / ep;
    const double nvl = total * (local_gpus - 1) / ep;
    return {name, OpKind::kComm, 0, 0, n, 0, rdma, nvl, 1};
  }
  Op dispatch(double n) const {  // FP8 hidden + one fp32 scale per 128
    return all_to_all(op::kDispatch, n, m_.hidden_size + m_.hidden_size / 128.0 * 4);
  }
  Op combine(double n) const { return all_to_all(op::kCombine, n, m_.hidden_size * 2.0); }
  Op dense_ffn(double n) const {
    const double w = 3.0 * m_.hidden_size * m_.intermediate_size;
    return {"dense.norm+ffn", OpKind::kGemmFp8, 2 * n * w, w + n * m_.hidden_size * 4.0, n, 0, 0, 0, 4};
  }
  Op lm_head(double n) const {
    const double h = m_.hidden_size, v = m_.vocab_size;
    return {"lm_head", OpKind::kGemmBf16, 2 * n * h * v, h * v * 2 + n * v * 4, n, 0, 0, 0, 2};
  }
  Op eh_proj(double n) const {
    const double h = m_.hidden_size;
    return {"mtp.eh_proj", OpKind::kGemmBf16, 2 * n * 2 * h * h, 2 * h * h * 2 + n * h * 6, n, 0, 0, 0, 2};
  }

 private:
  const ModelSpec& m_;
  const Deployment& d_;
  double ctx_;
  double slots_;
  double topk_;
  std::int64_t ctx64_ = 0;
  bool offload_;
};

}  // namespace

StepModel::StepModel(const ModelSpec& model, const HardwareProfile& hw, const Deployment& dep,
                     const MeasuredTables* tables)
    : model_(model), hw_(hw), dep_(dep), cost_(hw_, tables) {
  dep_.validate(dep.name);
  // Experts spread unevenly are modelled (the busiest GPU holds the rounded-up share); more
  // GPUs in an EP group than experts are not.
  ESS_CHECK(dep_.expert_parallel <= model_.n_routed_experts,
            "{}: expert_parallel = {} exceeds the model's {} routed experts", dep.name, dep_.expert_parallel,
            model_.n_routed_experts);
}

void StepModel::check_misses(const MissModel& m) const {
  const double most = static_cast<double>(m.reference_tokens) * model_.index_topk;
  ESS_CHECK(m.reference_misses <= most,
            "miss model: {} misses per request-layer-step at the reference pool exceed what {} query tokens x top-{} "
            "can select ({})",
            m.reference_misses, m.reference_tokens, model_.index_topk, most);
  const int layers = dep_.rig_layers > 0 ? dep_.rig_layers : model_.num_hidden_layers;
  ESS_CHECK(m.layer_shape.empty() || static_cast<int>(m.layer_shape.size()) == model_.num_hidden_layers ||
                (dep_.rig_layers > 0 && static_cast<int>(m.layer_shape.size()) >= layers),
            "miss profile: {} per-layer values for a model of {} layers{}", m.layer_shape.size(),
            model_.num_hidden_layers, dep_.rig_layers > 0 ? fmt::format(" (the rig runs {})", layers) : "");
  ESS_CHECK(m.profile_topk == 0 || m.profile_topk == model_.index_topk,
            "miss profile: measured at top-{}, the model selects top-{}", m.profile_topk, model_.index_topk);
}

StepResult StepModel::run(const Workload& wl, Timeline* timeline) const {
  wl.validate();
  ESS_CHECK(model_.max_position_embeddings <= 0 || wl.context <= model_.max_position_embeddings,
            "context {} exceeds the model's max_position_embeddings ({})", wl.context, model_.max_position_embeddings);
  check_misses(wl.misses);
  const MemoryModel mem(model_, hw_, dep_, wl.context,
                        wl.misses.min_slots(dep_.mtp_tokens, model_.index_topk, double(wl.context)));
  StepResult r;
  r.offload = wl.offload;
  r.overlap = wl.offload ? wl.overlap : OverlapMode::kNone;
  // ---- batch and pool size --------------------------------------------------------------
  std::int32_t slots = 0;
  const auto ctx32 = static_cast<std::int32_t>(std::min<std::int64_t>(wl.context, std::numeric_limits<std::int32_t>::max()));
  if (!wl.offload) {
    ESS_CHECK(wl.slots == 0 && (wl.ratio == 0 || wl.ratio == 1),
              "the all-on-GPU baseline keeps the whole context on the GPU: ratio {} / slots {} do not apply",
              wl.ratio, wl.slots);
    slots = ctx32;
  } else if (wl.slots > 0) {
    ESS_CHECK(wl.slots <= wl.context, "slots = {} exceed the context length {}", wl.slots, wl.context);
    slots = wl.slots;
  } else if (wl.ratio > 0) {
    slots = slots_for_ratio(wl.ratio, wl.context);
  }
  const bool rig = dep_.rig_layers > 0;
  int batch = wl.batch;
  if (rig) {  // the executor rig: explicit batch and pool, no memory model (it holds rig_layers layers)
    ESS_CHECK(batch > 0, "deployment {}: the executor rig (rig_layers = {}) needs an explicit batch", dep_.name,
              dep_.rig_layers);
    if (slots == 0) slots = ctx32;
    const std::int64_t whole = std::min<std::int64_t>(std::int64_t{dep_.mtp_tokens} * model_.index_topk, wl.context);
    ESS_CHECK(!wl.offload || slots >= whole,
              "the executor rig runs steps whole (no query groups): {} slots cannot hold a step's working set of up to "
              "min(T x top-k, context) = {}", slots, whole);
    // The rig holds its layers' whole indexer cache and a latent pool (the context when resident)
    // for every request on its one GPU.
    const double rig_bytes = double(batch) * dep_.rig_layers *
                             (double(wl.context) * double(model_.indexer_entry_bytes()) + double(slots) * double(model_.latent_entry_bytes()));
    ESS_CHECK(rig_bytes <= mem.hbm_bytes(),
              "the executor rig cannot hold batch {}: {} layers x {} requests of cache take {:.1f} GB, more than the "
              "GPU's {:.1f} GB of HBM", batch, dep_.rig_layers, batch, rig_bytes / 1e9, mem.hbm_bytes() / 1e9);
  } else if (batch == 0) {
    if (slots == 0) slots = ctx32;
    batch = mem.max_batch(slots);
    ESS_CHECK(batch >= 1, "no request fits: one request with {} slots per request-layer needs {:.2f} GB of "
                          "cache per GPU but only {:.2f} GB is left after the weights",
              slots, (mem.indexer_bytes_per_request() + mem.latent_bytes_per_request(slots)) / 1e9,
              mem.cache_budget() / 1e9);
  } else if (slots == 0) {
    slots = mem.slots_for_batch(batch);
  }
  if (!rig) mem.check_fits(batch, slots);
  r.batch = batch;
  r.slots = slots;
  r.ratio = double(slots) / double(wl.context);
  r.cache_gb = batch * (mem.indexer_bytes_per_request() + mem.latent_bytes_per_request(slots)) / 1e9;
  r.host_pool_gb_per_node = wl.offload ? mem.host_pool_bytes_per_node(batch, wl.prefix_share) / 1e9 : 0.0;
  r.host_pool_gb_per_node_unshared = wl.offload ? mem.host_pool_bytes_per_node(batch) / 1e9 : 0.0;

  // ---- one step ----------------------------------------------------------------------------
  const int T = dep_.mtp_tokens;
  const bool offload = wl.offload && slots < wl.context;
  const LayerBuilder lb(model_, dep_, wl.context, wl.offload, double(slots));
  Scheduler s(cost_, r, timeline);
  const int n_mb = dep_.two_batch_overlap && batch >= 2 && !rig ? 2 : 1;
  MicroBatch mbs[2];
  for (int i = 0; i < n_mb; ++i) {
    mbs[i].requests = n_mb == 1 ? batch : (i == 0 ? std::ceil(batch / 2.0) : std::floor(batch / 2.0));
    mbs[i].label = static_cast<char>('A' + i);
  }
  double miss_sum = 0;
  int miss_layers = 0;
  const double topk_eff = static_cast<double>(std::min<std::int64_t>(model_.index_topk, wl.context));
  // Layer-wise without a threshold: the faster of DA and DBA for a layer's miss count, tried
  // once per distinct (misses, tokens) of each micro-batch.
  struct Choice {
    double misses = -1;
    double tokens = -1;
    OverlapMode mode = OverlapMode::kDualAttention;
  } choice[2];
  if (r.overlap == OverlapMode::kLayerWise) r.layer_modes.reserve(static_cast<std::size_t>(3 * (model_.num_hidden_layers + 1)));
  auto run_layer = [&](int layer, bool moe, int tokens_per_request, double misses_per_request) {
    if (r.overlap == OverlapMode::kLayerWise && !r.layer_modes.empty()) r.layer_modes += ' ';
    // A request cannot miss more entries than its T query tokens select.
    misses_per_request = std::min(misses_per_request, tokens_per_request * topk_eff);
    // Steps larger than the pool: any floor(slots / K) query tokens fit together, so greedy
    // grouping makes at most ceil(T / floor(slots / K)) groups; the share of request-layer-
    // steps that split is bounded by the measured working set.
    const double split = offload && tokens_per_request > 1
                             ? wl.misses.split_bound(double(slots), tokens_per_request, model_.index_topk, double(wl.context))
                             : 0.0;
    const double per_group = std::max(1.0, std::floor(double(slots) / topk_eff));
    const double max_groups = std::ceil(double(tokens_per_request) / per_group);
    for (int i = 0; i < n_mb; ++i) {
      mbs[i].tokens = mbs[i].requests * tokens_per_request;
      mbs[i].misses = offload ? mbs[i].requests * misses_per_request : 0.0;
      mbs[i].split_calls = split > 0 ? (1 - std::pow(1 - split, mbs[i].requests)) * (max_groups - 1) : 0.0;
      r.split_calls_per_layer = std::max(r.split_calls_per_layer, mbs[i].split_calls);
    }
    double attn_end[2] = {0, 0};
    double disp_end[2] = {0, 0};
    for (int i = 0; i < n_mb; ++i) {
      MicroBatch& mb = mbs[i];
      s.set_label(layer, mb.label);
      s.set_category(Category::kAttention);  // the previous micro-batch left it at MoE / other
      OverlapMode mode = r.overlap;
      if (mode == OverlapMode::kLayerWise) {
        if (wl.layerwise_threshold >= 0) {
          mode = mb.misses < wl.layerwise_threshold ? OverlapMode::kDualAttention : OverlapMode::kDualBatchAttention;
        } else if (choice[i].misses == mb.misses && choice[i].tokens == mb.tokens) {
          mode = choice[i].mode;  // same layer inputs as the last trial: same choice (decided by misses)
        } else {
          StepResult scratch;
          Scheduler da = s.trial(scratch), dba = s.trial(scratch);
          const double t_da = lb.attention(da, mb, OverlapMode::kDualAttention);
          const double t_dba = lb.attention(dba, mb, OverlapMode::kDualBatchAttention);
          mode = t_dba < t_da ? OverlapMode::kDualBatchAttention : OverlapMode::kDualAttention;
          choice[i] = {mb.misses, mb.tokens, mode};
        }
        (mode == OverlapMode::kDualAttention ? r.layers_da : r.layers_dba) += 1;
        r.layer_modes += mb.misses <= 0 ? '-' : (mode == OverlapMode::kDualAttention ? 'a' : 'b');
      }
      attn_end[i] = lb.attention(s, mb, mode);
      if (moe) {
        s.set_category(Category::kMoe);
        const double g = s.issue(Stream::kCompute, lb.gate(mb.tokens), attn_end[i]);
        if (rig) {  // no all-to-all: the local experts follow the shared expert
          s.issue(Stream::kCompute, lb.shared(mb.tokens), g);
          mb.ready = s.issue(Stream::kCompute, lb.experts(mb.tokens), g);
          continue;
        }
        disp_end[i] = s.issue(Stream::kComm, lb.dispatch(mb.tokens), g);
        s.issue(Stream::kCompute, lb.shared(mb.tokens), g);
        if (n_mb == 1) {
          const double x = s.issue(Stream::kCompute, lb.experts(mb.tokens), disp_end[i], Wait::kComm);
          mb.ready = s.issue(Stream::kComm, lb.combine(mb.tokens), x);
        }
      } else {
        s.set_category(Category::kOther);
        mb.ready = s.issue(Stream::kCompute, lb.dense_ffn(mb.tokens), attn_end[i]);
      }
    }
    if (moe && n_mb == 2) {  // TBO: A's experts run while B dispatches, B's while A combines
      for (int i = 0; i < 2; ++i) {
        s.set_label(layer, mbs[i].label);
        const double x = s.issue(Stream::kCompute, lb.experts(mbs[i].tokens), disp_end[i], Wait::kComm);
        mbs[i].ready = s.issue(Stream::kComm, lb.combine(mbs[i].tokens), x);
      }
    }
  };

  const int n_layers = rig ? dep_.rig_layers : model_.num_hidden_layers;
  // A request cannot miss more entries than its query tokens select: the model's value is
  // capped there, for the reported misses as for the step time, and the cap is reported.
  const auto capped = [&](double m, int tokens) {
    const double cap = tokens * topk_eff;
    if (m <= cap) return m;
    ++r.miss_capped_layers;
    return cap;
  };
  for (int layer = 0; layer < n_layers; ++layer) {
    const double m = offload ? capped(wl.misses.misses(layer, slots, double(wl.context), T), T) : 0.0;
    miss_sum += m;
    ++miss_layers;
    s.set_category(Category::kAttention);
    run_layer(layer, rig || layer >= model_.first_k_dense_replace, T, m);
  }
  if (rig) {  // the rig's step ends with its last layer
    r.step_us = s.end();
    r.misses_per_request_layer = miss_layers > 0 ? miss_sum / miss_layers : 0.0;
    if (offload) r.h2d_bytes = batch * miss_sum * double(model_.latent_entry_bytes());
    if (wl.offload) r.d2h_bytes = double(batch) * T * n_layers * double(model_.latent_entry_bytes());
    const double step_s = r.step_us * 1e-6;
    r.otps = dep_.accept_ratio / step_s;
    r.throughput_tokens_per_s = r.otps * batch;
    r.h2d_gbps_per_node = r.h2d_bytes / step_s / 1e9;
    return r;
  }
  // LM head over every verified token.
  s.set_label(-1, ' ');
  s.set_category(Category::kOther);
  double ready = 0;
  for (int i = 0; i < n_mb; ++i) ready = std::max(ready, mbs[i].ready);
  double e = s.issue(Stream::kCompute, lb.lm_head(double(batch) * T), ready, Wait::kComm);
  // MTP drafts: (T - 1) passes of the next-n layer over one token per request, each with its
  // own projection and LM head.
  if (T > 1 && model_.num_nextn_predict_layers > 0) {
    const int layer = model_.num_hidden_layers;
    const double m = offload ? capped(wl.misses.misses(layer, slots, double(wl.context), 1), 1) : 0.0;
    for (int d = 0; d < T - 1; ++d) {
      s.set_label(layer, 'D');
      s.set_category(Category::kMtpDraft);
      e = s.issue(Stream::kCompute, lb.eh_proj(batch), e);
      for (int i = 0; i < n_mb; ++i) mbs[i].ready = e;
      // The draft layer's compute is charged to the MTP budget whatever its op.
      StepResult before = r;
      run_layer(layer, true, 1, m);
      const double added = (r.attention_us - before.attention_us) + (r.moe_us - before.moe_us) +
                           (r.other_us - before.other_us);
      r.attention_us = before.attention_us;
      r.moe_us = before.moe_us;
      r.other_us = before.other_us;
      r.mtp_draft_us += added;
      s.set_label(layer, 'D');
      s.set_category(Category::kMtpDraft);
      ready = 0;
      for (int i = 0; i < n_mb; ++i) ready = std::max(ready, mbs[i].ready);
      e = s.issue(Stream::kCompute, lb.lm_head(batch), ready, Wait::kComm);
    }
  }
  r.step_us = s.end();
  r.misses_per_request_layer = miss_layers > 0 ? miss_sum / miss_layers : 0.0;
  const double layers_with_cache = model_.num_hidden_layers + (T > 1 ? model_.num_nextn_predict_layers : 0);
  if (offload) {
    r.h2d_bytes = batch * miss_sum * double(model_.latent_entry_bytes()) +
                  (T > 1 ? (T - 1) * batch * std::min(wl.misses.misses(model_.num_hidden_layers, slots, double(wl.context), 1), topk_eff) *
                               model_.num_nextn_predict_layers * double(model_.latent_entry_bytes())
                         : 0.0);
  }
  if (wl.offload) r.d2h_bytes = double(batch) * T * layers_with_cache * double(model_.latent_entry_bytes());
  const double step_s = r.step_us * 1e-6;
  r.otps = dep_.accept_ratio / step_s;
  r.throughput_tokens_per_s = r.otps * batch * dep_.gpus_per_node;
  r.h2d_gbps_per_node = r.h2d_bytes * dep_.gpus_per_node / step_s / 1e9;
  return r;
}

}  // namespace ess::sim
