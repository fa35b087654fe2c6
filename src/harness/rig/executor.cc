// The executor's schedule (executor_impl.h): each op's arguments, one step enqueued on the
// compute, H2D and D2H streams for its overlap mode (enqueue), captured as a CUDA graph and
// timed (run). The set-up is executor_setup.cc's.
#include "harness/rig/executor.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "ess/core/error.h"
#include "ess/model/entry_layout.h"
#include "ess/ops/flashtrans.h"
#include "ess/ops/indexer.h"
#include "ess/ops/sparse_mla.h"
#include "ess/runtime/offload.h"
#include "ess/sim/overlap.h"
#include "harness/rig/executor_impl.h"
#include "harness/rig/fills.h"
#include "harness/rig/gemm.h"
#include "harness/rig/rig_data.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "testing/device.h"

namespace ess::rig {

cuda::SparseMlaArgs StepExecutor::Impl::mla_args(int l, const std::int32_t* idx, const std::int32_t* lengths) const {
  cuda::SparseMlaArgs a;
  a.batch = B;
  a.query_tokens = T;
  a.heads = H;
  a.topk = K;
  a.softmax_scale = softmax_scale;
  a.q = q.get();
  a.kv = kv.get() + static_cast<std::size_t>(l) * static_cast<std::size_t>(layer_rows) * entry;
  a.kv_offsets = kv_offsets.get();
  a.slots = static_cast<std::int32_t>(c.offload ? layer_rows : S);
  a.indices = idx;
  a.row_lengths = lengths;
  return a;
}

cuda::MergeArgs StepExecutor::Impl::merge_args(int l, std::uint16_t* o16) const {
  cuda::MergeArgs mg;
  mg.rows = static_cast<std::int64_t>(bt()) * H;
  mg.dim = layout.nope_dim;
  mg.o_a = o_a.get();
  mg.lse_a = lse_a.get();
  mg.o_b = o_b.get();
  mg.lse_b = lse_b.get();
  mg.out = o16;
  mg.lse = layer_lse(l);
  return mg;
}

void StepExecutor::Impl::attention(int l, const std::int32_t* idx, const std::int32_t* lengths, std::uint16_t* o16,
                                   float* o32, float* l32) {
  cuda::SparseMlaArgs a = mla_args(l, idx, lengths);
  a.out = o16;
  a.out_f32 = o32;
  a.lse = l32;
  ESS_LAUNCH(cuda::sparse_mla_decode(a, cs), "executor: sparse MLA of layer {}", l);
}

// The indexer of requests [b0, b0 + nb) and, offloaded, their swap decision, FlashTrans list
// and H2D copy (half 0 or 1 of the batch under DBA; the whole batch as half 0 otherwise).
void StepExecutor::Impl::indexer_half(int s, int l, int b0, int nb, int half) {
  run_indexer(s, l, b0, nb);
  if (c.offload) offload_step(s, l, b0, nb, half, !c.skip_transfers);
}

void StepExecutor::Impl::run_indexer(int s, int l, int b0, int nb) {
  if (gemms) gemms->run(GemmOp::kIndexerWqB, nb * T, cs);
  const cuda::IndexerArgs ia = indexer_args(s, l, b0, nb);
  ESS_LAUNCH(cuda::indexer_logits(ia, cs), "executor: indexer of layer {}", l);
  ESS_LAUNCH(cuda::topk(topk_args(ia, b0), cs), "executor: top-k of layer {}", l);
}

cuda::IndexerArgs StepExecutor::Impl::indexer_args(int s, int l, int b0, int nb) const {
  const std::size_t rows0 = static_cast<std::size_t>(b0) * T;
  cuda::IndexerArgs ia;
  ia.batch = nb;
  ia.query_tokens = T;
  ia.heads = IH;
  ia.head_dim = ilayout.head_dim;
  ia.q = idx_q.get() + rows0 * IH * ilayout.head_dim;
  ia.weights = idx_w.get() + rows0 * IH;
  ia.pages = idx_cache.get() + static_cast<std::size_t>(l) * B * idx_pages * ilayout.page_bytes();
  ia.page_table = idx_table.get() + static_cast<std::size_t>(b0) * idx_pages;
  ia.max_pages = idx_pages;
  ia.lengths = idx_len.get() + static_cast<std::size_t>(s) * bt() + rows0;
  ia.logits = logits.get() + rows0 * static_cast<std::size_t>(stride);
  ia.logits_stride = stride;
  return ia;
}

cuda::TopkArgs StepExecutor::Impl::topk_args(const cuda::IndexerArgs& ia, int b0) const {
  cuda::TopkArgs ta;
  ta.rows = static_cast<std::int64_t>(ia.batch) * T;
  ta.k = K;
  ta.logits = ia.logits;
  ta.stride = stride;
  ta.lengths = ia.lengths;
  ta.out = topk_out.get() + static_cast<std::size_t>(b0) * T * K;
  return ta;
}

void StepExecutor::Impl::offload_step(int s, int l, int b0, int nb, int half, bool fetch) {
  const std::size_t pos0 = static_cast<std::size_t>(b0) * P;
  // A step's own new entries may be among its misses: without the reserved rows, they are
  // fetched from the host pool, after their D2H.
  if (!c.reserve_newest) {
    ESS_CUDA_CHECK(cudaStreamWaitEvent(hs, ev_d2h[static_cast<std::size_t>(l)], 0), "executor: H2D waits for the new entries");
  }
  LayerStep st;
  st.layer = l;
  st.batch = nb;
  st.rows = rows.get() + b0;
  st.topk = ids.get() + (static_cast<std::size_t>(s) * L + static_cast<std::size_t>(l)) * B * P + pos0;
  st.lengths = step_lengths.get() + static_cast<std::size_t>(s) * B + static_cast<std::size_t>(b0);
  st.physical = slot_ids.get() + pos0;
  if (modes[static_cast<std::size_t>(l)] != OverlapMode::kNone) {
    st.resident = resident.get() + pos0;
    st.fetched = fetched.get() + pos0;
    st.resident_count = resident_count.get() + static_cast<std::size_t>(b0) * T;
    st.fetched_count = fetched_count.get() + static_cast<std::size_t>(b0) * T;
  }
  st.counts = counts.get() + ((static_cast<std::size_t>(s) * L + static_cast<std::size_t>(l)) * B + static_cast<std::size_t>(b0)) * 2;
  st.stream = cs;
  st.copy_stream = hs;
  st.copy_done = ev_h2d[2 * static_cast<std::size_t>(l) + static_cast<std::size_t>(half)];
  st.part = half;
  st.fetch = fetch;
  offload->step(st);
}

// One decode step of every layer, enqueued on the three streams (or captured).
void StepExecutor::Impl::enqueue(int s) {
  const std::size_t n_out = bt() * H * static_cast<std::size_t>(layout.nope_dim);
  const int n = static_cast<int>(bt());
  for (int l = 0; l < L; ++l) {
    const auto lz = static_cast<std::size_t>(l);
    const OverlapMode mode = modes[lz];
    if (gemms) gemms->run(GemmOp::kProj0, n, cs);
    // The step's new entries, written into the latent buffer as the model writes them; then,
    // offloaded, their D2H into the host pool (Offload::write_back) on the D2H stream.
    cuda::EntryCopy nc{table.get(), kv.get(), new_src.get() + (static_cast<std::size_t>(s) * L + lz) * bt(),
                       new_dst.get() + (static_cast<std::size_t>(s) * L + lz) * bt(), static_cast<std::int64_t>(bt()),
                       static_cast<int>(entry), nullptr, c.copy_blocks};
    ESS_LAUNCH(cuda::flashtrans_gather(nc, cs), "executor: new entries of layer {}", l);
    if (c.offload) {
      ESS_CUDA_CHECK(cudaEventRecord(ev_proj0[lz], cs), "executor: event");
      ESS_CUDA_CHECK(cudaStreamWaitEvent(ds, ev_proj0[lz], 0), "executor: D2H waits for the new entries");
      if (!c.skip_transfers) {
        WriteBack wb;
        wb.layer = l;
        wb.batch = B;
        wb.rows = rows.get();
        wb.lengths = step_lengths.get() + static_cast<std::size_t>(s) * B;
        wb.source_rows = c.reserve_newest ? nullptr : new_rows.get();
        wb.stream = ds;
        offload->write_back(wb);
      }
      ESS_CUDA_CHECK(cudaEventRecord(ev_d2h[lz], ds), "executor: event");
    }
    std::uint16_t* o16 = out.get() + lz * n_out;
    auto pre_attention = [&] {
      if (gemms) {
        gemms->run(GemmOp::kQbProj, n, cs);
        gemms->run(GemmOp::kAbsorbBmm, n, cs);
      }
    };
    const std::int32_t* token_ids = ids.get() + (static_cast<std::size_t>(s) * L + lz) * B * P;
    // The order of the block: sim::attention_schedule, which the simulator follows too.
    const AttentionSchedule sched = attention_schedule(c.offload ? mode : OverlapMode::kNone, c.offload, B,
                                                       c.preattn_in_copy_window);
    if (sched.preattn_first) pre_attention();
    if (!c.offload) {
      indexer_half(s, l, 0, B, 0);
      attention(l, token_ids, nullptr, o16, nullptr, layer_lse(l));
    } else if (!sched.split_attention) {
      indexer_half(s, l, 0, B, 0);
      ESS_CUDA_CHECK(cudaStreamWaitEvent(cs, ev_h2d[2 * lz], 0), "executor: attention waits for the copy");
      attention(l, slot_ids.get(), nullptr, o16, nullptr, layer_lse(l));
    } else {
      int last = 0;
      if (sched.indexer_parts == 2) {
        const int b_half = (B + 1) / 2;
        indexer_half(s, l, 0, b_half, 0);
        indexer_half(s, l, b_half, B - b_half, 1);
        last = 1;
      } else {
        indexer_half(s, l, 0, B, 0);
      }
      if (!sched.preattn_first) pre_attention();
      attention(l, resident.get(), resident_count.get(), nullptr, o_a.get(), lse_a.get());  // Attn0: resident, under the copy
      ESS_CUDA_CHECK(cudaStreamWaitEvent(cs, ev_h2d[2 * lz + static_cast<std::size_t>(last)], 0),
                     "executor: Attn1 waits for the copy");
      attention(l, fetched.get(), fetched_count.get(), nullptr, o_b.get(), lse_b.get());  // Attn1: fetched entries
      ESS_LAUNCH(cuda::merge_states(merge_args(l, o16), cs), "executor: merge of layer {}", l);
    }
    if (gemms) {
      gemms->run(GemmOp::kOutBmm, n, cs);
      gemms->run(GemmOp::kOProj, n, cs);
      gemms->run(GemmOp::kGate, n, cs);
      gemms->run(GemmOp::kSharedExpert, n, cs);
      gemms->run(GemmOp::kRoutedExperts, n, cs);
    }
  }
  if (c.offload) {  // join the copy streams back into the compute stream (required by capture)
    ESS_CUDA_CHECK(cudaEventRecord(ev_join_h, hs), "executor: event");
    ESS_CUDA_CHECK(cudaEventRecord(ev_join_d, ds), "executor: event");
    ESS_CUDA_CHECK(cudaStreamWaitEvent(cs, ev_join_h, 0), "executor: join");
    ESS_CUDA_CHECK(cudaStreamWaitEvent(cs, ev_join_d, 0), "executor: join");
  }
}

StepExecutor::StepExecutor(const ExecutorConfig& config, const ModelSpec& model, const StepInputs& inputs)
    : impl_(std::make_unique<Impl>(config, model, inputs)) {
  impl_->setup();
}

StepExecutor::~StepExecutor() = default;

ExecutorReport StepExecutor::run(const std::function<void(int)>& after_step) {
  Impl& x = *impl_;
  ExecutorReport r;
  r.device = x.device;
  r.date = test::utc_now();
  r.batch = x.B;
  r.layers = x.L;
  r.mtp = x.T;
  r.topk = x.K;
  r.context = x.in->prompt;
  r.offload = x.c.offload;
  r.slots = x.S;
  r.graph = x.c.graph;
  r.modes = x.modes;
  r.profile_misses = x.in->profile_misses;
  r.inputs = x.in->source;
  r.host_pool_bytes = x.offload ? x.offload->host_pool().capacity_bytes() : 0;
  r.device_cache_bytes = x.kv.size() + x.idx_cache.size();
  x.drop_graphs();
  x.graphs.assign(static_cast<std::size_t>(x.c.steps), nullptr);
  ESS_CUDA_CHECK(cudaMemsetAsync(x.out.get(), 0xff, x.out.size() * 2, x.cs), "executor: poisoning the outputs");
  ESS_CUDA_CHECK(cudaMemsetAsync(x.lse.get(), 0xff, x.lse.size() * 4, x.cs), "executor: poisoning the outputs");
  for (int s = 0; s < x.c.steps; ++s) {
    const auto sz = static_cast<std::size_t>(s);
    // Step 0 runs eagerly (it performs any one-time initialisation of the kernels); later
    // steps are captured once step 0 has finished and replayed as graphs.
    const bool use_graph = x.c.graph && s > 0;
    if (use_graph && x.graphs[sz] == nullptr) {
      cudaGraph_t g = nullptr;
      ESS_CUDA_CHECK(cudaStreamBeginCapture(x.cs, cudaStreamCaptureModeThreadLocal), "executor: capturing step {}", s);
      try {
        x.enqueue(s);
      } catch (...) {
        cudaStreamEndCapture(x.cs, &g);
        if (g != nullptr) cudaGraphDestroy(g);
        throw;
      }
      ESS_CUDA_CHECK(cudaStreamEndCapture(x.cs, &g), "executor: capturing step {}", s);
      // Node priorities (FlashTrans's stream priority) hold in a graph only with this flag.
      const cudaError_t e = cudaGraphInstantiateWithFlags(&x.graphs[sz], g, cudaGraphInstantiateFlagUseNodePriority);
      cudaGraphDestroy(g);
      ESS_CUDA_CHECK(e, "executor: instantiating the graph of step {}", s);
    }
    ESS_CUDA_CHECK(cudaEventRecord(x.t0[sz], x.cs), "executor: timing");
    if (use_graph) {
      ESS_CUDA_CHECK(cudaGraphLaunch(x.graphs[sz], x.cs), "executor: launching step {}", s);
    } else {
      x.enqueue(s);
    }
    ESS_CUDA_CHECK(cudaEventRecord(x.t1[sz], x.cs), "executor: timing");
    if (after_step || s == 0) {
      ESS_CUDA_CHECK(cudaStreamSynchronize(x.cs), "executor: step {}", s);
      if (after_step) after_step(s);
    }
  }
  ESS_CUDA_CHECK(cudaStreamSynchronize(x.cs), "executor: steps");
  for (int s = x.c.warm_steps; s < x.c.steps; ++s) {
    float ms = 0;
    ESS_CUDA_CHECK(cudaEventElapsedTime(&ms, x.t0[static_cast<std::size_t>(s)], x.t1[static_cast<std::size_t>(s)]), "executor: timing");
    r.step_us.push_back(static_cast<double>(ms) * 1e3);
  }
  r.step = test::summarize(r.step_us);
  r.misses.assign(static_cast<std::size_t>(x.L), 0.0);
  if (x.c.offload) {
    std::vector<std::int32_t> counts(x.counts.size());
    ESS_CUDA_CHECK(cudaMemcpy(counts.data(), x.counts.get(), counts.size() * 4, cudaMemcpyDeviceToHost), "executor: counts");
    const int timed = x.c.steps - x.c.warm_steps;
    double misses = 0;
    for (int s = x.c.warm_steps; s < x.c.steps; ++s) {
      for (int l = 0; l < x.L; ++l) {
        for (int b = 0; b < x.B; ++b) {
          const double v = counts[((static_cast<std::size_t>(s) * x.L + static_cast<std::size_t>(l)) * x.B + static_cast<std::size_t>(b)) * 2 + 1];
          r.misses[static_cast<std::size_t>(l)] += v / (static_cast<double>(timed) * x.B);
          misses += v;
        }
      }
    }
    r.h2d_bytes_per_step = misses * static_cast<double>(x.entry) / timed;
    r.d2h_bytes_per_step = static_cast<double>(x.bt()) * x.L * static_cast<double>(x.entry);
  }
  return r;
}

void StepExecutor::rearm(OverlapMode mode, bool skip_transfers) {
  Impl& x = *impl_;
  ExecutorConfig next = x.c;
  next.overlap = mode;
  next.skip_transfers = skip_transfers;
  next.validate(x.m);
  ESS_CUDA_CHECK(cudaDeviceSynchronize(), "executor: finishing the last run");
  x.drop_graphs();
  x.c = next;
  x.modes = layer_modes(x.c, *x.in);
  if (x.c.offload) {
    for (int b = 0; b < x.B; ++b) x.offload->reset(static_cast<RequestId>(b));
    x.warm_up();
  }
  ESS_CUDA_CHECK(cudaDeviceSynchronize(), "executor: rearming");
}

std::vector<float> StepExecutor::attention_lse(int layer) const {
  const Impl& x = *impl_;
  ESS_CHECK(layer >= 0 && layer < x.L, "executor: layer {} out of [0, {})", layer, x.L);
  std::vector<float> v(x.bt() * x.H);
  ESS_CUDA_CHECK(cudaMemcpy(v.data(), x.layer_lse(layer), v.size() * 4, cudaMemcpyDeviceToHost),
                 "executor: reading the attention lse of layer {}", layer);
  return v;
}

std::vector<std::uint16_t> StepExecutor::attention_output(int layer) const {
  const Impl& x = *impl_;
  ESS_CHECK(layer >= 0 && layer < x.L, "executor: layer {} out of [0, {})", layer, x.L);
  const std::size_t n = x.bt() * x.H * static_cast<std::size_t>(x.layout.nope_dim);
  std::vector<std::uint16_t> v(n);
  ESS_CUDA_CHECK(cudaMemcpy(v.data(), x.out.get() + static_cast<std::size_t>(layer) * n, n * 2, cudaMemcpyDeviceToHost),
                 "executor: reading the attention output of layer {}", layer);
  return v;
}

}  // namespace ess::rig
