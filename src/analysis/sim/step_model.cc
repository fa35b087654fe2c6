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
// Idle time of the compute stream is charged to what it waited for. While a FlashTrans copy
// runs (H2D or D2H stream) it holds `transfer_sms` of the SMs, so compute issued beside it
// runs on the rest.
class Scheduler {
 public:
  Scheduler(const OpCostModel& cost, StepResult& result, Timeline* timeline)
      : cost_(&cost), r_(&result), timeline_(timeline) {
    const HardwareProfile& hw = cost.hardware();
    share_ = hw.sm_count > 0 ? std::clamp(hw.transfer_sms / hw.sm_count, 0.0, 0.95) : 0.0;
  }

  void set_label(int layer, char micro_batch) {
    layer_ = layer;
    mb_ = micro_batch;
  }
  void set_category(Category c) { category_ = c; }
  // Everything issued while drafting is charged to the MTP draft.
  void set_drafting(bool on) { drafting_ = on; }

  double issue(Stream s, const Op& op, double ready, Wait wait = Wait::kNone) {
    const OpTime t = cost_->time(op);
    double& lane = lanes_[static_cast<int>(s)];
    const double start = std::max(lane, ready);
    double dur = t.us;
    if (s == Stream::kCompute) {
      const double gap = start - lane;
      if (gap > 0) charge_wait(gap, wait);
      dur = beside_transfers(start, t.us);
      r_->compute_us += dur;
      r_->transfer_sm_us += dur - t.us;
      r_->kernels += op.kernels;
      // A measured time holds its own launch; the analytical one adds it.
      if (t.source != CostSource::kMeasured) r_->launch_us += op.kernels * cost_->hardware().kernel_launch_us;
      switch (drafting_ ? Category::kMtpDraft : category_) {
        case Category::kAttention: r_->attention_us += dur; break;
        case Category::kMoe: r_->moe_us += dur; break;
        case Category::kOther: r_->other_us += dur; break;
        case Category::kMtpDraft: r_->mtp_draft_us += dur; break;
      }
    } else if (s == Stream::kComm) {
      r_->comm_us += dur;
      if (dur > 0) r_->comm_latency_us += op.rdma_bytes > 0 ? cost_->hardware().rdma_latency_us : cost_->hardware().nvlink_latency_us;
    } else {
      if (s == Stream::kH2D) {
        r_->h2d_us += dur;
        r_->h2d_bytes += op.bytes;
      } else {
        r_->d2h_bytes += op.bytes;
      }
      if (dur > 0 && share_ > 0) transfers_.push_back({start, start + dur});
    }
    switch (t.source) {
      case CostSource::kMeasured: ++r_->ops_measured; break;
      case CostSource::kAnalytical: ++r_->ops_analytical; break;
      case CostSource::kAnalyticalOutsideGrid: ++r_->ops_outside_grid; break;
    }
    lane = start + dur;
    if (timeline_ != nullptr && dur > 0) {
      timeline_->events.push_back(
          {s, layer_ < 0 ? std::string(op.name) : fmt::format("L{}{} {}", layer_, mb_, op.name), start, dur, t.source});
    }
    return lane;
  }
  // The compute stream blocks until `t` (a receive kernel spinning on the all-to-all).
  void block_compute_until(double t, Wait wait) {
    double& lane = lanes_[0];
    if (t > lane) {
      charge_wait(t - lane, wait);
      lane = t;
    }
  }
  // Host time between steps: nothing runs on the GPU.
  void host_gap(double us) {
    const double t = end();
    for (double& l : lanes_) l = t + us;
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
  void charge_wait(double gap, Wait wait) {
    if (wait == Wait::kComm) r_->exposed_comm_us += gap;
    if (wait == Wait::kTransfer) r_->exposed_transfer_us += gap;
  }
  // When a compute op of `work` us (on every SM) that starts at `start` ends, running on
  // 1 - share of the SMs wherever copies are in flight (two copies hold two grids).
  double beside_transfers(double start, double work) {
    std::erase_if(transfers_, [&](const std::pair<double, double>& iv) { return iv.second <= start; });
    if (transfers_.empty() || work <= 0) return work;
    double t = start, left = work;
    for (int guard = 0; guard < 64; ++guard) {
      int depth = 0;
      double next = std::numeric_limits<double>::infinity();
      for (const auto& [b, e] : transfers_) {
        if (b <= t && t < e) ++depth;
        if (b > t) next = std::min(next, b);
        if (e > t) next = std::min(next, e);
      }
      const double rate = std::max(0.05, 1 - depth * share_);
      if (!std::isfinite(next) || (next - t) * rate >= left) return t + left / rate - start;
      left -= (next - t) * rate;
      t = next;
    }
    return t + left - start;
  }

  const OpCostModel* cost_;
  StepResult* r_;
  Timeline* timeline_;
  double lanes_[4] = {0, 0, 0, 0};
  double share_ = 0;
  std::vector<std::pair<double, double>> transfers_;  // FlashTrans copies in flight [start, end)
  int layer_ = -1;
  char mb_ = ' ';
  Category category_ = Category::kOther;
  bool drafting_ = false;
};

struct MicroBatch {
  double requests = 0;   // b
  double tokens = 0;     // n = b x query tokens
  double misses = 0;     // entries to fetch in this layer, whole micro-batch
  // Expected step calls past the first in this layer: query groups of steps whose working
  // set exceeds the pool (the batch shares one grouping, so one split position splits all).
  double split_calls = 0;
  OverlapMode mode = OverlapMode::kNone;  // this layer's placement of the copy
  double ready = 0;          // when its previous layer finished
  double fetched = 0;        // when this layer's misses are on the GPU
  double dispatched = 0;     // when the dispatch all-to-all delivered its tokens
  double combined = 0;       // when the combine all-to-all returned them
  char label = 'A';
};

// The ops of one layer for one micro-batch, in the stages SGLang's decode runs them
// (operations_strategy.py, "deepseek blog decode"): prepare | core attention + gate | dispatch
// send + shared expert | dispatch receive + routed experts + combine send | combine receive.
class LayerBuilder {
 public:
  LayerBuilder(const ModelSpec& m, const Deployment& d, std::int64_t context, bool offload, double slots)
      : m_(m), d_(d), ctx_(static_cast<double>(context)), slots_(slots), offload_(offload) {
    topk_ = std::min(static_cast<double>(m.index_topk), ctx_);
    ctx64_ = context;
    random_rows_ = d.rig_layers == 0;  // the rig routes tokens evenly; a deployment at random
  }

  // Stage 1: projections, the indexer, the swap decision and the misses' copy (placed by the
  // micro-batch's mode), PreAttn.
  void prepare(Scheduler& s, MicroBatch& mb) const {
    s.set_category(Category::kAttention);
    const double n = mb.tokens, h = m_.hidden_size, heads = m_.num_attention_heads;
    const double ih = m_.index_n_heads, id = m_.index_head_dim;
    const double proj0_out = m_.q_lora_rank + m_.kv_lora_rank + m_.qk_rope_head_dim + id + ih;
    // Kernels: input norm, the GEMM, q_a / kv_a norms, rope + latent store, indexer key quantise + store.
    const Op proj0 = gemm_op(op::kProj0, OpKind::kGemmFp8, n, proj0_out, h, h * proj0_out + n * h * 2 * 3, 6);
    double e = s.issue(Stream::kCompute, proj0, mb.ready, Wait::kComm);
    if (offload_) {
      const Op d2h{op::kD2HNewEntries, OpKind::kD2H, 0, n * double(m_.latent_entry_bytes()), n, 0, 0, 0, 1};
      s.issue(Stream::kD2H, d2h, e);
    }
    const double qb_out = heads * (m_.qk_nope_head_dim + m_.qk_rope_head_dim);
    const Op pre_q = gemm_op(op::kQbProj, OpKind::kGemmFp8, n, qb_out, m_.q_lora_rank,
                             m_.q_lora_rank * qb_out + n * qb_out * 2, 1);
    Op pre_bmm = gemm_op(op::kAbsorbBmm, OpKind::kGemmBf16, n, m_.kv_lora_rank, m_.qk_nope_head_dim,
                         heads * m_.qk_nope_head_dim * m_.kv_lora_rank * 2.0 + n * heads * m_.mla_head_dim() * 2.0, 2);
    pre_bmm.gemm.groups = heads;
    pre_bmm.flops *= heads;
    const double entry = double(m_.latent_entry_bytes());
    const double misses = offload_ ? mb.misses : 0;
    const Op h2d_all{op::kH2DMisses, OpKind::kH2D, 0, misses * entry, 0, 0, 0, 0, 1};
    mb.fetched = 0;
    if (misses <= 0 || mb.mode == OverlapMode::kNone) {
      e = s.issue(Stream::kCompute, pre_q, e);
      e = s.issue(Stream::kCompute, pre_bmm, e);
      e = indexer(s, mb, e, 1.0);
      if (misses > 0) mb.fetched = s.issue(Stream::kH2D, h2d_all, e);
      return;
    }
    if (mb.mode == OverlapMode::kDualAttention) {
      e = indexer(s, mb, e, 1.0);
      mb.fetched = s.issue(Stream::kH2D, h2d_all, e);
    } else {  // DBA: two halves of the batch; the first half's copy runs under the second's indexer
      e = indexer(s, mb, e, 0.5);
      s.issue(Stream::kH2D, Op{op::kH2DMissesHalf0, OpKind::kH2D, 0, 0.5 * misses * entry, 0, 0, 0, 0, 1}, e);
      e = indexer(s, mb, e, 0.5);
      mb.fetched = s.issue(Stream::kH2D, Op{op::kH2DMissesHalf1, OpKind::kH2D, 0, 0.5 * misses * entry, 0, 0, 0, 0, 1}, e);
    }
    e = s.issue(Stream::kCompute, pre_q, e);
    s.issue(Stream::kCompute, pre_bmm, e);
  }

  // Stage 2: sparse MLA (whole, or Attn0 over the resident entries, Attn1 over the fetched ones
  // and the merge), PostAttn, then the router (MoE) or the dense FFN.
  void core(Scheduler& s, MicroBatch& mb, bool moe) const {
    s.set_category(Category::kAttention);
    const double n = mb.tokens, h = m_.hidden_size, heads = m_.num_attention_heads;
    const double flop_per_entry = 2 * heads * (m_.mla_head_dim() + m_.kv_lora_rank);
    // FlashMLA's sparse decode as SGLang's DSA backend calls it (_forward_flashmla_kv: q viewed
    // as (tokens, 1, heads, 576), so every query token is a row): the main kernel and the
    // combine; the scheduling metadata is computed once per step (init_forward_metadata).
    auto attn = [&](std::string_view name, double entries_per_token) {
      Op o{name, OpKind::kAttention, n * entries_per_token * flop_per_entry,
           n * entries_per_token * double(m_.latent_entry_bytes()) + n * heads * (m_.mla_head_dim() + m_.kv_lora_rank) * 2.0,
           n, ctx64_, 0, 0, 2};
      o.attention = {n, 1, entries_per_token, heads, double(m_.mla_head_dim()), double(m_.kv_lora_rank),
                     double(m_.latent_entry_bytes())};
      return o;
    };
    const double misses = offload_ ? mb.misses : 0;
    const double miss_per_token = std::min(topk_, misses / std::max(n, 1.0));
    const double now = s.compute_end();
    double e = 0;
    if (misses <= 0 || mb.mode == OverlapMode::kNone) {
      e = s.issue(Stream::kCompute, attn(op::kSparseMla, topk_), std::max(now, mb.fetched), Wait::kTransfer);
    } else {
      e = s.issue(Stream::kCompute, attn(op::kAttn0, topk_ - miss_per_token), now);
      e = s.issue(Stream::kCompute, attn(op::kAttn1, miss_per_token), mb.fetched, Wait::kTransfer);
      const Op merge{op::kMerge, OpKind::kMemory, 0, 3 * n * heads * m_.kv_lora_rank * 2.0, n, 0, 0, 0, 1};
      e = s.issue(Stream::kCompute, merge, e);
    }
    Op out_bmm = gemm_op(op::kOutBmm, OpKind::kGemmBf16, n, m_.v_head_dim, m_.kv_lora_rank,
                         heads * m_.kv_lora_rank * m_.v_head_dim * 2.0, 1);
    out_bmm.gemm.groups = heads;
    out_bmm.flops *= heads;
    const Op o_proj = gemm_op(op::kOProj, OpKind::kGemmFp8, n, h, heads * m_.v_head_dim,
                              heads * m_.v_head_dim * h + n * h * 2, 2);  // activation quantise + GEMM
    e = s.issue(Stream::kCompute, out_bmm, e);
    e = s.issue(Stream::kCompute, o_proj, e);
    if (moe) {
      s.set_category(Category::kMoe);
      s.issue(Stream::kCompute, gate(n), e);
    } else {
      s.set_category(Category::kOther);
      mb.ready = s.issue(Stream::kCompute, dense_ffn(n), e);
    }
  }

  // Stages 3-5 of an MoE layer (the stage's index 2, 3 or 4).
  void moe_stage(Scheduler& s, MicroBatch& mb, int stage, bool comm) const {
    if (stage == 2) dispatch_and_shared(s, mb, comm);
    if (stage == 3) experts_and_combine(s, mb, comm);
    if (stage == 4) combine_receive(s, mb, comm);
  }

  // Stage 3: the dispatch leaves, the shared expert runs.
  void dispatch_and_shared(Scheduler& s, MicroBatch& mb, bool comm) const {
    s.set_category(Category::kMoe);
    if (comm) mb.dispatched = s.issue(Stream::kComm, dispatch(mb.tokens), s.compute_end());
    s.issue(Stream::kCompute, shared(mb.tokens), s.compute_end());
  }
  // Stage 4: the routed experts on the tokens received, the combine leaves.
  void experts_and_combine(Scheduler& s, MicroBatch& mb, bool comm) const {
    s.set_category(Category::kMoe);
    const double x = s.issue(Stream::kCompute, experts(mb.tokens), comm ? mb.dispatched : 0.0, Wait::kComm);
    mb.combined = comm ? s.issue(Stream::kComm, combine(mb.tokens), x) : x;
  }
  // Stage 5: the combined tokens are received; the layer is done.
  void combine_receive(Scheduler& s, MicroBatch& mb, bool comm) const {
    if (!comm) {  // the rig: the experts' output is the layer's
      mb.ready = s.compute_end();
      return;
    }
    s.block_compute_until(mb.combined, Wait::kComm);
    s.set_category(Category::kMoe);
    // The receive kernel, then the experts' sum added to the residual.
    const Op add{"moe.combine_recv+residual", OpKind::kMemory, 0, mb.tokens * m_.hidden_size * 2.0 * 3, mb.tokens, 0, 0, 0, 2};
    mb.ready = s.issue(Stream::kCompute, add, mb.combined, Wait::kComm);
  }

  Op gate(double n) const {
    const double h = m_.hidden_size, e = m_.n_routed_experts;
    return gemm_op(op::kGate, OpKind::kGemmBf16, n, e, h, h * e * 2 + n * h * 2 * 2, 3);
  }
  Op shared(double n) const {
    const double inter = double(m_.moe_intermediate_size) * m_.n_shared_experts;
    // Kernels: the dispatch's send, quantise, up GEMM, activation + quantise, down GEMM.
    Op o = gemm_op(op::kSharedExpert, OpKind::kGemmFp8, n, 2 * inter, m_.hidden_size, 3.0 * m_.hidden_size * inter, 5);
    o.gemm2 = {n, double(m_.hidden_size), inter, 1, false};
    o.flops = 2 * n * 3.0 * m_.hidden_size * inter;
    return o;
  }
  Op experts(double n) const {
    const double w = 3.0 * m_.hidden_size * m_.moe_intermediate_size;
    const double local = std::ceil(double(m_.n_routed_experts) / d_.expert_parallel);
    // Tokens routed to this GPU = n x top-k on average (every GPU holds n tokens), spread over
    // its local experts: Poisson rows per expert in a deployment; an expert no token chose is
    // not read.
    const double rows = n * m_.num_experts_per_tok;
    const double per_expert = rows / local;
    const double active = random_rows_ ? local * (1 - std::exp(-per_expert)) : local;
    // Kernels: the dispatch's receive, up GEMM, activation + quantise, down GEMM, the combine's send.
    Op o{op::kRoutedExperts, OpKind::kGemmFp8, 2 * rows * w, active * w + rows * m_.hidden_size * 3.0, n, 0, 0, 0, 5};
    o.gemm = {per_expert, 2.0 * m_.moe_intermediate_size, double(m_.hidden_size), local, random_rows_};
    o.gemm2 = {per_expert, double(m_.hidden_size), double(m_.moe_intermediate_size), local, random_rows_};
    return o;
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
    const double h = m_.hidden_size, inter = m_.intermediate_size;
    Op o = gemm_op("dense.norm+ffn", OpKind::kGemmFp8, n, 2 * inter, h, 3.0 * h * inter + n * h * 4.0, 4);
    o.gemm2 = {n, h, inter, 1, false};
    o.flops = 2 * n * 3.0 * h * inter;
    return o;
  }
  // The final norm and the LM head GEMM over `n` positions (fp32 logits out).
  Op lm_head(double n) const {
    const double h = m_.hidden_size, v = m_.vocab_size;
    return gemm_op("lm_head", OpKind::kGemmBf16, n, v, h, h * v * 2 + n * v * 4, 2);
  }
  // Sampling / verification: `passes` reads of the fp32 logits of `n` positions in `kernels` launches.
  Op sample(std::string_view name, double n, double passes, double kernels) const {
    return {name, OpKind::kMemory, 0, passes * n * double(m_.vocab_size) * 4, n, 0, 0, 0, kernels};
  }
  Op eh_proj(double n) const {
    const double h = m_.hidden_size;
    // DeepseekModelNextN.forward (deepseek_nextn.py): the embedding, fused_eh_norm (enorm +
    // hnorm + concat), eh_proj: 3 kernels.
    return gemm_op("mtp.eh_proj", OpKind::kGemmBf16, n, h, 2 * h, 2 * h * h * 2 + n * h * 6, 3);
  }

 private:
  static Op gemm_op(std::string_view name, OpKind kind, double m, double n, double k, double bytes, double kernels) {
    Op o{name, kind, 2 * m * n * k, bytes, m, 0, 0, 0, kernels};
    o.gemm = {m, n, k, 1, false};
    return o;
  }
  double indexer(Scheduler& s, const MicroBatch& mb, double e0, double frac) const {
    const double nn = mb.tokens * frac, bb = mb.requests * frac;
    const double ih = m_.index_n_heads, id = m_.index_head_dim;
    const Op q = gemm_op(op::kIndexerWqB, OpKind::kGemmFp8, nn, ih * id, m_.q_lora_rank,
                         m_.q_lora_rank * ih * id + nn * ih * id, 2);  // GEMM + rope / quantise
    // Paged MQA logits: each request's key cache is read once for its T x 64 heads, the fp32
    // logits written; the slower of that and the FP8 MMAs.
    const Op logits{op::kIndexerLogits, OpKind::kIndexer, 2 * nn * ctx_ * ih * id,
                    bb * ctx_ * double(m_.indexer_entry_bytes()) + nn * ctx_ * 4, nn, ctx64_, 0, 0, 2};  // + metadata
    // Top-k: one CTA per query token streams its row of logits twice (histogram, select).
    Op topk{op::kIndexerTopk, OpKind::kTopk, 0, 2 * nn * ctx_ * 4, nn, ctx64_, 0, 0, 2};  // + page -> slot ids
    topk.rows = nn;
    double t = s.issue(Stream::kCompute, q, e0);
    t = s.issue(Stream::kCompute, logits, t);
    t = s.issue(Stream::kCompute, topk, t);
    if (offload_) {
      // The swap engine's LRU decision and the FlashTrans list for this batch (GPU swap
      // engine + split kernel). Analytically its memory traffic only (ids in and out, 12 bytes
      // of state per slot), with no per-kernel overhead (kernels = 0); a measured table
      // (`ess bench profile`) gives its real time.
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
  }

  const ModelSpec& m_;
  const Deployment& d_;
  double ctx_;
  double slots_;
  double topk_;
  std::int64_t ctx64_ = 0;
  bool offload_;
  bool random_rows_ = true;
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
  const double topk_eff = static_cast<double>(std::min<std::int64_t>(model_.index_topk, wl.context));
  // A request cannot miss more entries than its query tokens select: the model's value is
  // capped there, for the reported misses as for the step time, and the cap is reported.
  const auto capped = [&](double m, int tokens) {
    const double cap = tokens * topk_eff;
    if (m <= cap) return m;
    ++r.miss_capped_layers;
    return cap;
  };
  // Layer-wise without a threshold: the faster of DA and DBA for a layer's miss count, tried
  // once per distinct (misses, tokens) of each micro-batch slot.
  struct Choice {
    double misses = -1;
    double tokens = -1;
    bool moe = false;
    OverlapMode mode = OverlapMode::kDualAttention;
  } choice[2];
  if (r.overlap == OverlapMode::kLayerWise) r.layer_modes.reserve(static_cast<std::size_t>(3 * (model_.num_hidden_layers + 1)));
  int modes_in_layer = 0;
  // Sets a micro-batch's tokens, misses, split calls and overlap mode for a layer.
  auto enter_layer = [&](MicroBatch& mb, int slot, int tokens_per_request, double misses_per_request, bool moe,
                         bool first_of_layer) {
    misses_per_request = std::min(misses_per_request, tokens_per_request * topk_eff);
    // Steps larger than the pool: any floor(slots / K) query tokens fit together, so greedy
    // grouping makes at most ceil(T / floor(slots / K)) groups; the share of request-layer-
    // steps that split is bounded by the measured working set.
    const double split = offload && tokens_per_request > 1
                             ? wl.misses.split_bound(double(slots), tokens_per_request, model_.index_topk, double(wl.context))
                             : 0.0;
    const double per_group = std::max(1.0, std::floor(double(slots) / topk_eff));
    const double max_groups = std::ceil(double(tokens_per_request) / per_group);
    mb.tokens = mb.requests * tokens_per_request;
    mb.misses = offload ? mb.requests * misses_per_request : 0.0;
    mb.split_calls = split > 0 ? (1 - std::pow(1 - split, mb.requests)) * (max_groups - 1) : 0.0;
    r.split_calls_per_layer = std::max(r.split_calls_per_layer, mb.split_calls);
    OverlapMode mode = r.overlap;
    if (mode == OverlapMode::kLayerWise) {
      if (wl.layerwise_threshold >= 0) {
        mode = mb.misses < wl.layerwise_threshold ? OverlapMode::kDualAttention : OverlapMode::kDualBatchAttention;
      } else if (choice[slot].misses == mb.misses && choice[slot].tokens == mb.tokens && choice[slot].moe == moe) {
        mode = choice[slot].mode;  // same layer inputs as the last trial: same choice
      } else {
        StepResult scratch;
        MicroBatch a = mb, b = mb;
        a.mode = OverlapMode::kDualAttention;
        b.mode = OverlapMode::kDualBatchAttention;
        Scheduler da = s.trial(scratch), dba = s.trial(scratch);
        lb.prepare(da, a);
        lb.core(da, a, moe);
        lb.prepare(dba, b);
        lb.core(dba, b, moe);
        mode = dba.compute_end() < da.compute_end() ? OverlapMode::kDualBatchAttention : OverlapMode::kDualAttention;
        choice[slot] = {mb.misses, mb.tokens, moe, mode};
      }
      (mode == OverlapMode::kDualAttention ? r.layers_da : r.layers_dba) += 1;
      if (first_of_layer && modes_in_layer++ > 0) r.layer_modes += ' ';
      r.layer_modes += mb.misses <= 0 ? '-' : (mode == OverlapMode::kDualAttention ? 'a' : 'b');
    }
    mb.mode = mode;
  };

  const bool comm = !rig;
  const int n_layers = rig ? dep_.rig_layers : model_.num_hidden_layers;
  const int first_moe = rig ? 0 : std::min(model_.first_k_dense_replace, n_layers);
  std::vector<double> layer_misses(static_cast<std::size_t>(n_layers), 0.0);
  double miss_sum = 0;
  for (int layer = 0; layer < n_layers; ++layer) {
    const double m = offload ? capped(wl.misses.misses(layer, slots, double(wl.context), T), T) : 0.0;
    layer_misses[static_cast<std::size_t>(layer)] = m;
    miss_sum += m;
  }
  r.misses_per_request_layer = n_layers > 0 ? miss_sum / n_layers : 0.0;

  // One layer for one micro-batch, every stage in order (no overlap with another micro-batch).
  auto whole_layer = [&](MicroBatch& mb, int layer, bool moe, int tokens_per_request, double misses) {
    s.set_label(layer, mb.label);
    enter_layer(mb, 0, tokens_per_request, misses, moe, true);
    lb.prepare(s, mb);
    lb.core(s, mb, moe);
    if (!moe) return;
    for (int stage = 2; stage < 5; ++stage) lb.moe_stage(s, mb, stage, comm);
  };

  MicroBatch whole;
  whole.requests = batch;
  whole.label = 'A';
  // The dense layers run the whole batch (SGLang overlaps only MoE layers).
  for (int layer = 0; layer < first_moe; ++layer) {
    whole_layer(whole, layer, false, T, layer_misses[static_cast<std::size_t>(layer)]);
  }
  const bool tbo = dep_.two_batch_overlap && batch >= 2 && !rig;
  double ready = whole.ready;
  if (!tbo) {
    for (int layer = first_moe; layer < n_layers; ++layer) {
      whole_layer(whole, layer, true, T, layer_misses[static_cast<std::size_t>(layer)]);
    }
    ready = whole.ready;
  } else {
    // Two-Batch Overlap: the two halves run the five stages of each MoE layer with the second
    // two stages behind the first (SGLang's execute_overlapped_operations, delta 2): A0 A1 A2
    // B0 A3 B1 ..., so one half's dispatch and combine are in flight while the other runs its
    // attention and MoE.
    MicroBatch mbs[2];
    mbs[0].requests = std::ceil(batch / 2.0);
    mbs[1].requests = std::floor(batch / 2.0);
    mbs[1].label = 'B';
    for (MicroBatch& mb : mbs) mb.ready = whole.ready;
    const int stages = 5 * (n_layers - first_moe);
    auto stage = [&](int i, int k) {
      MicroBatch& mb = mbs[i];
      const int layer = first_moe + k / 5;
      s.set_label(layer, mb.label);
      switch (k % 5) {
        case 0:
          enter_layer(mb, i, T, layer_misses[static_cast<std::size_t>(layer)], true, i == 0);
          lb.prepare(s, mb);
          break;
        case 1: lb.core(s, mb, true); break;
        default: lb.moe_stage(s, mb, k % 5, comm); break;
      }
    };
    constexpr int kDelta = 2;
    for (int k = 0; k < std::min(kDelta, stages); ++k) stage(0, k);
    for (int k = kDelta; k < stages; ++k) {
      stage(0, k);
      stage(1, k - kDelta);
    }
    for (int k = std::max(0, stages - kDelta); k < stages; ++k) stage(1, k);
    ready = std::max(mbs[0].ready, mbs[1].ready);
  }
  if (rig) {  // the rig's step ends with its last layer
    r.step_us = s.end();
    const double step_s = r.step_us * 1e-6;
    r.otps = dep_.accept_ratio / step_s;
    r.throughput_tokens_per_s = r.otps * batch;
    r.h2d_gbps_per_node = r.h2d_bytes / step_s / 1e9;
    return r;
  }
  // LM head over every verified position, then sampling and the verification of the drafts,
  // as SGLang 0.5.23 runs them for a greedy batch. MTP (eagle_utils.py:eagle_sample, greedy
  // branch): argmax over the B x T rows of logits (one pass), verify_tree_greedy_func, the
  // zeros / full of predict and accept_index, then prepare_verify_commit_outputs
  // (eagle_worker_common.py:run_eagle_verify): 5 kernels. No MTP (sampler.py:Sampler.forward,
  // is_all_greedy): argmax, one pass, 1 kernel.
  s.set_label(-1, ' ');
  s.set_category(Category::kOther);
  double e = s.issue(Stream::kCompute, lb.lm_head(double(batch) * T), ready, Wait::kComm);
  e = s.issue(Stream::kCompute, lb.sample("sample+verify", double(batch) * T, 1, T > 1 ? 5 : 1), e);
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
  // The draft layer runs its own indexer (index_share_for_mtp_iteration is off for
  // DeepSeek-V3.2) and no Two-Batch Overlap.
  if (T > 1 && model_.num_nextn_predict_layers > 0) {
    const int layer = model_.num_hidden_layers;
    s.set_drafting(true);
    double decode_misses = -1;  // the decode passes' misses: one value, capped (and counted) once
    for (int pass = 0; pass < T - 1; ++pass) {
      const int tokens = pass == 0 ? T : 1;
      double m = 0;
      if (offload && pass == 0) m = capped(wl.misses.misses(layer, slots, double(wl.context), tokens), tokens);
      if (offload && pass > 0) {
        if (decode_misses < 0) decode_misses = capped(wl.misses.misses(layer, slots, double(wl.context), 1), 1);
        m = decode_misses;
      }
      s.set_label(layer, pass == 0 ? 'X' : 'D');
      s.set_category(Category::kOther);
      MicroBatch draft;
      draft.requests = batch;
      draft.label = pass == 0 ? 'X' : 'D';
      draft.ready = s.issue(Stream::kCompute, lb.eh_proj(double(batch) * tokens), e);
      whole_layer(draft, layer, true, tokens, m);
      s.set_label(layer, draft.label);
      s.set_category(Category::kOther);
      e = s.issue(Stream::kCompute, lb.lm_head(batch), draft.ready, Wait::kComm);
      e = s.issue(Stream::kCompute, lb.sample("draft sample", batch, 1, pass == 0 ? 2 : 1), e);
    }
    s.set_drafting(false);
  }
  // Host time between steps: a fixed part (scheduling, the ranks' synchronisation) and a part
  // per request (its bookkeeping: acceptance, outputs, the next batch's inputs).
  r.step_overhead_us = hw_.step_overhead_us + hw_.step_overhead_per_request_us * batch;
  s.host_gap(r.step_overhead_us);
  r.step_us = s.end();
  const double step_s = r.step_us * 1e-6;
  r.otps = dep_.accept_ratio / step_s;
  r.throughput_tokens_per_s = r.otps * batch * dep_.gpus_per_node;
  r.h2d_gbps_per_node = r.h2d_bytes * dep_.gpus_per_node / step_s / 1e9;
  return r;
}

}  // namespace ess::sim
