// The ops of one layer of the step model (step_model.cc) for one micro-batch, issued on the
// schedule (step_scheduler.h). Internal to the simulator.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>

#include "analysis/sim/step_scheduler.h"
#include "ess/model/model_spec.h"
#include "ess/sim/deployment.h"
#include "ess/sim/memory_model.h"
#include "ess/sim/op_cost.h"
#include "ess/sim/op_names.h"

namespace ess::sim {

// The ops of one layer for one micro-batch, in the stages SGLang's decode runs them
// (operations_strategy.py, "deepseek blog decode"): prepare | core attention + gate | dispatch
// send + shared expert | dispatch receive + routed experts + combine send | combine receive.
class LayerBuilder {
 public:
  // sparse_share: the share of the requests that are sparse (the rest whole: no swap decision).
  LayerBuilder(const ModelSpec& m, const Deployment& d, std::int64_t context, bool offload, double slots,
               double sparse_share = 1.0)
      : m_(m), d_(d), ctx_(static_cast<double>(context_in_entries(m, context))), tokens_(static_cast<double>(context)),
        slots_(slots), sparse_share_(sparse_share), offload_(offload) {
    topk_ = std::min(static_cast<double>(m.selected_entries()), ctx_);
    if (m.is_deepseek_v4()) v4_entry_ = V4Caches::of(m).entry_data_bytes;
    if (m.is_minimax_m3()) m3_ = M3Rank::of(m, d);
    ctx64_ = context;
    random_rows_ = d.rig_layers == 0;  // the rig routes tokens evenly; a deployment at random
  }

  // Stage 1: projections, the indexer, the swap decision and the misses' copy (placed by the
  // micro-batch's mode), PreAttn. A shared-index layer runs no indexer; with the prefetch its
  // decision and copy were issued at its leader's, which issues its followers' after its own.
  void prepare(Scheduler& s, MicroBatch& mb) const {
    if (m_.is_deepseek_v4()) return prepare_v4(s, mb);
    if (m_.is_minimax_m3()) return prepare_m3(s, mb);
    s.set_category(Category::kAttention);
    const double n = mb.tokens, h = m_.hidden_size, heads = m_.num_attention_heads;
    const double ih = m_.index_n_heads, id = m_.index_head_dim;
    const double own_indexer = mb.index_shared ? 0.0 : 1.0;  // the indexer's key and weights projections
    const double proj0_out = m_.q_lora_rank + m_.kv_lora_rank + m_.qk_rope_head_dim + own_indexer * (id + ih);
    // Kernels: input norm, the GEMM, q_a / kv_a norms, rope + latent store, indexer key quantise + store.
    const Op proj0 = gemm_op(op::kProj0, OpKind::kGemmFp8, n, proj0_out, h, h * proj0_out + n * h * 2 * 3, 5 + own_indexer);
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
    const double misses = offload_ && !mb.prefetched ? mb.misses : 0;
    const Op h2d_all{op::kH2DMisses, OpKind::kH2D, 0, misses * entry, 0, 0, 0, 0, 1};
    mb.fetched = mb.prefetched ? mb.prefetch_end[static_cast<std::size_t>(mb.layer)] : 0;
    const AttentionSchedule sched = attention_schedule(mb.mode, misses > 0, mb.requests, d_.preattn_in_copy_window);
    if (sched.preattn_first) {
      e = s.issue(Stream::kCompute, pre_q, e);
      e = s.issue(Stream::kCompute, pre_bmm, e);
    }
    if (misses <= 0) {
      e = indexer(s, mb, e, 1.0);
    } else if (sched.indexer_parts == 1) {
      e = indexer(s, mb, e, 1.0);
      mb.fetched = s.issue(Stream::kH2D, h2d_all, e);
    } else {  // DBA: two halves of the batch; the first half's copy runs under the second's indexer
      e = indexer(s, mb, e, 0.5);
      s.issue(Stream::kH2D, Op{op::kH2DMissesHalf0, OpKind::kH2D, 0, 0.5 * misses * entry, 0, 0, 0, 0, 1}, e);
      e = indexer(s, mb, e, 0.5);
      mb.fetched = s.issue(Stream::kH2D, Op{op::kH2DMissesHalf1, OpKind::kH2D, 0, 0.5 * misses * entry, 0, 0, 0, 0, 1}, e);
    }
    // The followers' decisions (each over its own pool) and copies, queued behind this layer's.
    for (const auto& [layer, follower_misses] : mb.followers) {
      s.set_label(layer, mb.label);  // the follower's ops, issued now
      e = s.issue(Stream::kCompute, swap_decision(mb.tokens, mb.requests), e);
      const Op copy{op::kH2DPrefetch, OpKind::kH2D, 0, follower_misses * entry, 0, 0, 0, 0, 1};
      mb.prefetch_end[static_cast<std::size_t>(layer)] = s.issue(Stream::kH2D, copy, e);
    }
    if (!mb.followers.empty()) s.set_label(mb.layer, mb.label);
    if (sched.preattn_first) return;
    e = s.issue(Stream::kCompute, pre_q, e);
    s.issue(Stream::kCompute, pre_bmm, e);
  }

  // Stage 2: sparse MLA (whole, or Attn0 over the resident entries, Attn1 over the fetched ones
  // and the merge), PostAttn, then the router (MoE) or the dense FFN.
  void core(Scheduler& s, MicroBatch& mb, bool moe) const {
    if (m_.is_deepseek_v4()) return core_v4(s, mb, moe);
    if (m_.is_minimax_m3()) return core_m3(s, mb, moe);
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
    if (!attention_schedule(mb.mode, misses > 0, mb.requests, d_.preattn_in_copy_window).split_attention) {
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
    ffn_entry(s, mb, moe, e);
  }

  // DeepSeek-V4 (models/deepseek_v4.py, layers/attention/deepseek_v4_backend.py, dsv4/): the layer's
  // compress ratio decides its ops. Stage 1: one GEMM for the query's low-rank input, the shared KV
  // head and (ratio 4 / 128) the compressors' inputs (ratio 4: the indexer's too), then q_b; a C4
  // layer runs the indexer over its C4 entries, the swap decision and the misses' copy. Every
  // layer's step writes an entry per 4 tokens to the offloaded C4 cache only in its C4 layers.
  void prepare_v4(Scheduler& s, MicroBatch& mb) const {
    s.set_category(Category::kAttention);
    const int ratio = m_.compress_ratio(mb.layer);
    const double n = mb.tokens, h = m_.hidden_size, hd = m_.head_dim, heads = m_.num_attention_heads;
    const double id = m_.index_head_dim, ih = m_.index_n_heads;
    const double compressors = ratio == 4 ? 2 * 2 * hd + 2 * 2 * id + ih : ratio == 128 ? 2 * hd : 0;
    const double out0 = m_.q_lora_rank + hd + compressors;
    const Op proj0 = gemm_op(op::kProj0, OpKind::kGemmFp8, n, out0, h, h * out0 + n * h * 2 * 3, ratio != 0 ? 6 : 4);
    double e = s.issue(Stream::kCompute, proj0, mb.ready, Wait::kComm);
    mb.fetched = 0;
    if (offload_ && ratio == 4) {
      const Op d2h{op::kD2HNewEntries, OpKind::kD2H, 0, n / 4 * v4_entry_, n, 0, 0, 0, 1};
      s.issue(Stream::kD2H, d2h, e);
    }
    const double qb_out = heads * hd;
    e = s.issue(Stream::kCompute,
                gemm_op(op::kQbProj, OpKind::kGemmFp8, n, qb_out, m_.q_lora_rank, m_.q_lora_rank * qb_out + n * qb_out * 2, 1), e);
    if (ratio != 4) return;
    copy_misses(s, mb, indexer(s, mb, e, 1.0), v4_entry_);
  }

  // Stage 2 of a DeepSeek-V4 layer: FlashMLA's sparse decode over the sliding window and the layer's
  // compressed entries (ratio 4: the top-k of the C4 entries; 128: every C128 entry), one KV head of
  // head_dim serving as key and value, then the grouped low-rank output (o_groups GEMMs to
  // o_lora_rank, one to hidden_size), then the router or the dense FFN.
  void core_v4(Scheduler& s, MicroBatch& mb, bool moe) const {
    s.set_category(Category::kAttention);
    const int ratio = m_.compress_ratio(mb.layer);
    const double n = mb.tokens, h = m_.hidden_size, hd = m_.head_dim, heads = m_.num_attention_heads;
    const double groups = m_.o_groups, rank = m_.o_lora_rank;
    const double entries = std::min(double(m_.window_size), tokens_) +
                           (ratio == 4 ? topk_ : ratio == 128 ? std::floor(tokens_ / 128) : 0.0);
    const double entry = v4_entry_;
    Op attn{op::kSparseMla, OpKind::kAttention, n * entries * 2 * heads * (hd + hd),
            n * entries * entry + n * heads * hd * 2.0 * 2, n, ctx64_, 0, 0, 2};
    attn.attention = {n, 1, entries, heads, hd, hd, entry};
    double e = s.issue(Stream::kCompute, attn, std::max(s.compute_end(), mb.fetched), Wait::kTransfer);
    Op wo_a = gemm_op(op::kOutBmm, OpKind::kGemmFp8, n, rank, heads * hd / groups, heads * hd * rank + n * groups * rank * 2, 1);
    wo_a.gemm.groups = groups;
    wo_a.flops *= groups;
    const Op wo_b = gemm_op(op::kOProj, OpKind::kGemmFp8, n, h, groups * rank, groups * rank * h + n * h * 2, 2);
    e = s.issue(Stream::kCompute, wo_a, e);
    e = s.issue(Stream::kCompute, wo_b, e);
    ffn_entry(s, mb, moe, e);
  }

  // MiniMax-M3 (models/minimax_m3.py, layers/attention/minimax_sparse_backend.py) on one rank of
  // attention TP t: heads / t query heads, max(1, kv_heads / t) KV heads. Stage 1: one GEMM for q, k, v
  // (a sparse layer's index query and key too), the norms and rope; a sparse layer writes its new K / V
  // to the host, scores every block of its index cache (the best of its tokens' index logits), takes
  // the top blocks, runs the swap decision and copies its misses.
  void prepare_m3(Scheduler& s, MicroBatch& mb) const {
    s.set_category(Category::kAttention);
    const bool sparse = m_.offloads(mb.layer);
    const double n = mb.tokens, h = m_.hidden_size, hd = m_.head_dim;
    const double hq = m3_.q_heads, kv = m3_.kv_heads, hi = m3_.index_heads, id = m_.index_head_dim;
    const bool index_values = m_.index_keeps_values(mb.layer);
    const double out0 = (hq + 2 * kv) * hd + (sparse ? (hi + 1 + (index_values ? 1 : 0)) * id : 0.0);
    const Op proj0 = gemm_op(op::kProj0, weight_kind(), n, out0, h, h * out0 * weight_bytes() + n * h * 2 * 3,
                             sparse ? 5 : 4);
    double e = s.issue(Stream::kCompute, proj0, mb.ready, Wait::kComm);
    mb.fetched = 0;
    if (!sparse) return;
    const double entry = m3_.entry_bytes;
    if (offload_) {
      const Op d2h{op::kD2HNewEntries, OpKind::kD2H, 0, n * entry, n, 0, 0, 0, 1};
      s.issue(Stream::kD2H, d2h, e);
    }
    const double blocks = std::ceil(tokens_ / m_.sparse_block_size);
    // The index keys (and values, where the layer keeps them: their attention is a second pass over the context).
    const double index_entry = id * m3_.index_value_bytes;
    const double passes = index_values ? 2.0 : 1.0;
    const Op logits{op::kIndexerLogits, OpKind::kIndexer, passes * 2 * n * tokens_ * hi * id,
                    passes * mb.requests * tokens_ * index_entry + n * hi * blocks * 4, n, ctx64_, 0, 0, 1};
    Op topk{op::kIndexerTopk, OpKind::kTopk, 0, 2 * n * blocks * 4, n, ctx64_, 0, 0, 1};
    topk.rows = n;
    e = s.issue(Stream::kCompute, logits, e);
    e = s.issue(Stream::kCompute, topk, e);
    if (offload_ && sparse_share_ > 0) e = s.issue(Stream::kCompute, swap_decision(n, mb.requests), e);
    copy_misses(s, mb, e, entry);
  }

  // Stage 2 of a MiniMax-M3 layer: grouped-query attention over the selected blocks' tokens (a sparse
  // layer) or the whole context (a dense one), each request's K / V read once for the rank's query
  // heads; o_proj over the rank's heads, the all-reduce that sums the ranks' outputs; then the router
  // or the dense MLP.
  void core_m3(Scheduler& s, MicroBatch& mb, bool moe) const {
    s.set_category(Category::kAttention);
    const double n = mb.tokens, h = m_.hidden_size, hd = m_.head_dim, hq = m3_.q_heads;
    const double entries = m_.offloads(mb.layer) ? topk_ : tokens_;
    const double entry = m3_.entry_bytes;
    const Op attn{op::kGqa, OpKind::kAttention, n * entries * 2 * hq * (hd + hd),
                  mb.requests * entries * entry + n * hq * hd * 2.0 * 2, n, ctx64_, 0, 0, 2};
    double e = s.issue(Stream::kCompute, attn, std::max(s.compute_end(), mb.fetched), Wait::kTransfer);
    // o_proj, and index_o_proj where the layer's index keeps values (its output added to the attention's).
    const double k = hq * hd + (m_.index_keeps_values(mb.layer) ? m3_.index_heads * m_.index_head_dim : 0.0);
    const Op o_proj = gemm_op(op::kOProj, weight_kind(), n, h, k, k * h * weight_bytes() + n * h * 2, 1);
    e = s.issue(Stream::kCompute, o_proj, e);
    ffn_entry(s, mb, moe, all_reduce(s, n, e));
  }

  // The end of stage 2: the router of an MoE layer, or a dense layer's FFN (which ends the layer).
  void ffn_entry(Scheduler& s, MicroBatch& mb, bool moe, double e) const {
    if (moe) {
      s.set_category(Category::kMoe);
      s.issue(Stream::kCompute, gate(mb.tokens), e);
    } else {
      s.set_category(Category::kOther);
      mb.ready = all_reduce(s, mb.tokens, s.issue(Stream::kCompute, dense_ffn(mb.tokens), e));
    }
  }

  // Stages 3-5 of an MoE layer (the stage's index 2, 3 or 4).
  void moe_stage(Scheduler& s, MicroBatch& mb, int stage, bool comm) const {
    if (stage == 2) dispatch_and_shared(s, mb, comm);
    if (stage == 3) experts_and_combine(s, mb, comm);
    if (stage == 4) combine_receive(s, mb, comm);
  }

  // Stage 3: the dispatch leaves, the shared expert runs. Under attention TP every rank holds the
  // batch's tokens: nothing is dispatched, the shared expert runs split over the ranks.
  void dispatch_and_shared(Scheduler& s, MicroBatch& mb, bool comm) const {
    s.set_category(Category::kMoe);
    if (comm && tp() == 1) mb.dispatched = s.issue(Stream::kComm, dispatch(mb.tokens), s.compute_end());
    if (m_.n_shared_experts > 0) s.issue(Stream::kCompute, shared(mb.tokens), s.compute_end());
  }
  // Stage 4: the routed experts on the tokens received, the combine leaves (under attention TP: the
  // local experts on the tokens routed to them, then the all-reduce).
  void experts_and_combine(Scheduler& s, MicroBatch& mb, bool comm) const {
    s.set_category(Category::kMoe);
    if (tp() > 1) {
      const double x = s.issue(Stream::kCompute, experts(mb.tokens), 0.0);
      mb.combined = all_reduce(s, mb.tokens, x);
      return;
    }
    const double x = s.issue(Stream::kCompute, experts(mb.tokens), comm ? mb.dispatched : 0.0, Wait::kComm);
    mb.combined = comm ? s.issue(Stream::kComm, combine(mb.tokens), x) : x;
  }
  // Stage 5: the combined tokens are received; the layer is done.
  void combine_receive(Scheduler& s, MicroBatch& mb, bool comm) const {
    if (!comm) {  // the rig: the experts' output is the layer's
      mb.ready = s.compute_end();
      return;
    }
    if (tp() > 1) {  // the all-reduce's output is the layer's
      mb.ready = mb.combined;
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
    const double inter = double(m_.moe_intermediate_size) * m_.n_shared_experts / tp();
    // Kernels: the dispatch's send, quantise, up GEMM, activation + quantise, down GEMM.
    Op o = gemm_op(op::kSharedExpert, weight_kind(), n, 2 * inter, m_.hidden_size,
                   3.0 * m_.hidden_size * inter * weight_bytes(), 5);
    o.gemm2 = {n, double(m_.hidden_size), inter, 1, false};
    o.flops = 2 * n * 3.0 * m_.hidden_size * inter;
    return o;
  }
  Op experts(double n) const {
    const double w = 3.0 * m_.hidden_size * m_.moe_intermediate_size;
    const double local = std::ceil(double(m_.n_routed_experts) / d_.expert_parallel);
    // Tokens routed to this GPU = n x top-k on average (every GPU holds n tokens of its own; under
    // attention TP the ranks hold the same n, so n x top-k / EP), spread over its local experts:
    // Poisson rows per expert in a deployment; an expert no token chose is not read.
    const double rows = n * m_.num_experts_per_tok / (tp() > 1 ? double(d_.expert_parallel) : 1.0);
    const double per_expert = rows / local;
    const double active = random_rows_ ? local * (1 - std::exp(-per_expert)) : local;
    // Kernels: the dispatch's receive, up GEMM, activation + quantise, down GEMM, the combine's send.
    // DeepSeek-V4's routed experts are MXFP4 (V4Caches::kExpertBytesPerParam a weight), the others' as their weights.
    const double bytes = m_.is_deepseek_v4() ? V4Caches::kExpertBytesPerParam : weight_bytes();
    Op o{op::kRoutedExperts, weight_kind(), 2 * rows * w, active * w * bytes + rows * m_.hidden_size * 3.0, n, 0, 0, 0, 5};
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
    const double h = m_.hidden_size, inter = m_.intermediate_size / tp();
    Op o = gemm_op("dense.norm+ffn", weight_kind(), n, 2 * inter, h, 3.0 * h * inter * weight_bytes() + n * h * 4.0, 4);
    o.gemm2 = {n, h, inter, 1, false};
    o.flops = 2 * n * 3.0 * h * inter;
    return o;
  }
  // The final norm and the LM head GEMM over `n` positions (fp32 logits out).
  Op lm_head(double n) const {
    const double h = m_.hidden_size, v = m_.vocab_size / tp();  // the vocabulary split over attention TP
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
  // The micro-batch's misses of `entry` bytes copied after `e` (its swap decision), whole: DeepSeek-V4's
  // and MiniMax-M3's layers, which run no overlap schedule. Sets mb.fetched when there are any.
  void copy_misses(Scheduler& s, MicroBatch& mb, double e, double entry) const {
    const double misses = offload_ ? mb.misses : 0;
    if (misses <= 0) return;
    const Op h2d{op::kH2DMisses, OpKind::kH2D, 0, misses * entry, 0, 0, 0, 0, 1};
    mb.fetched = s.issue(Stream::kH2D, h2d, e);
  }
  double tp() const { return d_.attention_tensor_parallel; }
  // A GEMM's weights: DSA's and DeepSeek-V4's FP8, MiniMax-M3's its own (M3Rank).
  OpKind weight_kind() const {
    return m_.is_minimax_m3() && !m3_.fp8_weights ? OpKind::kGemmBf16 : OpKind::kGemmFp8;
  }
  double weight_bytes() const { return m_.is_minimax_m3() ? m3_.weight_bytes : 1.0; }
  // The ranks' outputs of n tokens summed in bf16 (a ring over NVLink within a node, over RDMA past it),
  // issued after `e`; compute waits for it. Returns its end.
  double all_reduce(Scheduler& s, double n, double e) const {
    if (tp() <= 1) return e;
    const double bytes = 2 * (tp() - 1) / tp() * n * m_.hidden_size * 2.0;
    const bool across_nodes = tp() > d_.gpus_per_node;
    const Op ar{op::kAllReduce, OpKind::kComm, 0, 0, n, 0, across_nodes ? bytes : 0.0, across_nodes ? 0.0 : bytes, 1};
    const double end = s.issue(Stream::kComm, ar, e);
    s.block_compute_until(end, Wait::kComm);
    return end;
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
    double t = e0;
    if (!mb.index_shared) {
      t = s.issue(Stream::kCompute, q, t);
      t = s.issue(Stream::kCompute, logits, t);
      t = s.issue(Stream::kCompute, topk, t);
    }
    if (offload_ && sparse_share_ > 0 && !mb.prefetched) {
      const Op swap = swap_decision(nn, bb);
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

  // The swap engine's LRU decision and the FlashTrans list for `requests` requests' `tokens` query
  // tokens (GPU swap engine + split kernel), over its sparse requests. Analytically its memory
  // traffic only (ids in and out, 12 bytes of state per slot), with no per-kernel overhead
  // (kernels = 0); a measured table (`ess bench profile`) gives its real time.
  Op swap_decision(double tokens, double requests) const {
    return {op::kSwap, OpKind::kMemory, 0, (tokens * topk_ * 4.0 * 4 + requests * slots_ * 12.0) * sparse_share_, tokens,
            0, 0, 0, 0};
  }

  const ModelSpec& m_;
  const Deployment& d_;
  double ctx_;     // the context in the offloaded cache's entries (MemoryModel::context_entries)
  double tokens_;  // in tokens
  double v4_entry_ = 0;  // DeepSeek-V4: an entry's bytes (V4Caches::entry_data_bytes)
  M3Rank m3_;            // MiniMax-M3: its shape on one rank
  double slots_;
  double sparse_share_ = 1.0;
  double topk_;
  std::int64_t ctx64_ = 0;
  bool offload_;
  bool random_rows_ = true;
};

}  // namespace ess::sim
