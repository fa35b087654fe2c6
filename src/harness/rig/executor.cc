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
#include "harness/rig/executor_impl.h"
#include "harness/rig/gemm.h"
#include "harness/rig/kernels.h"
#include "harness/rig/rig_data.h"
#include "harness/support/device.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"

namespace ess::pipeline {
namespace {

#define ESS_LAUNCH(call, ...) ESS_CUDA_CHECK(static_cast<cudaError_t>(call), __VA_ARGS__)

// The untimed set-up copies (resident cache fill, warm-up fill) take the whole GPU.
constexpr int kSetupCopyBlocks = 4096;

}  // namespace

void StepExecutor::Impl::setup() {
  c.validate(m);
  ESS_CHECK(in->layers == c.layers && in->batch == c.batch && in->steps == c.steps,
            "executor: inputs for {} layers x {} requests x {} steps, configuration asks {} x {} x {}", in->layers,
            in->batch, in->steps, c.layers, c.batch, c.steps);
  device = cuda::use_device(c.device, "executor");
  layout = LatentLayout::for_model(m);
  ilayout = IndexerLayout::for_model(m);
  B = c.batch;
  L = c.layers;
  T = in->mtp;
  K = in->topk;
  P = T * K;
  H = m.num_attention_heads;
  IH = m.index_n_heads;
  entry = layout.bytes();
  rig = std::make_unique<RigData>(m, B, T, c.seed);
  softmax_scale = rig->softmax_scale();
  modes = layer_modes(c, *in);
  const std::int64_t max_len = in->max_length();
  const std::int64_t cap = (max_len + kPageTokens - 1) / kPageTokens * kPageTokens;
  S = c.offload ? c.resolved_slots() : static_cast<std::int32_t>(cap);
  idx_pages = static_cast<int>(cap / kPageTokens);
  stride = cap;

  // Device memory, checked up front so that a batch that does not fit says so.
  const double kv_bytes = static_cast<double>(B) * L * (S + (c.offload ? T : 0)) * static_cast<double>(entry);
  const double idx_bytes = static_cast<double>(L) * B * idx_pages * static_cast<double>(ilayout.page_bytes());
  const double tokens = static_cast<double>(bt());
  const double act_bytes = (L * 2.0 + 2 * 4.0) * tokens * H * layout.nope_dim + static_cast<double>(c.steps) * L * B * P * 4.0 +
                           tokens * static_cast<double>(stride) * 4.0;
  std::size_t free_b = 0, total_b = 0;
  ESS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b), "executor: reading free device memory");
  const double need = kv_bytes + idx_bytes + act_bytes + (c.stand_in_gemms ? 1.5e9 : 0.0);
  ESS_CHECK(need < 0.95 * static_cast<double>(free_b),
            "executor: batch {} {} needs about {:.1f} GB of device memory ({:.1f} GB latent, {:.1f} GB indexer cache); "
            "{:.1f} GB of {:.1f} GB is free on {}",
            B, c.offload ? fmt::format("with {} slots per request-layer", S) : std::string("all-resident"), need / 1e9,
            kv_bytes / 1e9, idx_bytes / 1e9, static_cast<double>(free_b) / 1e9, static_cast<double>(total_b) / 1e9, device);

  ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), "executor: compute stream");
  // The copy streams at the highest priority: their FlashTrans blocks take SMs as soon as
  // any free up, ahead of compute blocks still waiting (the copy is on the critical path).
  int least = 0, greatest = 0;
  ESS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest), "executor: stream priorities");
  ESS_CUDA_CHECK(cudaStreamCreateWithPriority(&hs, cudaStreamNonBlocking, greatest), "executor: H2D stream");
  ESS_CUDA_CHECK(cudaStreamCreateWithPriority(&ds, cudaStreamNonBlocking, greatest), "executor: D2H stream");
  auto make = [](std::vector<cudaEvent_t>& v, std::size_t n, bool timing) {
    v.resize(n, nullptr);
    for (cudaEvent_t& e : v) {
      ESS_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming), "executor: events");
    }
  };
  make(ev_proj0, static_cast<std::size_t>(L), false);
  make(ev_d2h, static_cast<std::size_t>(L), false);
  make(ev_h2d, 2 * static_cast<std::size_t>(L), false);
  make(t0, static_cast<std::size_t>(c.steps), true);
  make(t1, static_cast<std::size_t>(c.steps), true);
  ESS_CUDA_CHECK(cudaEventCreateWithFlags(&ev_join_h, cudaEventDisableTiming), "executor: events");
  ESS_CUDA_CHECK(cudaEventCreateWithFlags(&ev_join_d, cudaEventDisableTiming), "executor: events");

  if (c.stand_in_gemms) gemms = std::make_unique<StandInGemms>(m, static_cast<int>(bt()), c.expert_parallel);

  // Inputs of every step, uploaded once.
  ids = DeviceBuffer<std::int32_t>(in->ids.size());
  ESS_CUDA_CHECK(cudaMemcpy(ids.get(), in->ids.data(), in->ids.size() * 4, cudaMemcpyHostToDevice), "executor: uploading the ids");
  q = DeviceBuffer<std::uint16_t>(bt() * H * (layout.nope_dim + layout.rope_dim));
  out = DeviceBuffer<std::uint16_t>(static_cast<std::size_t>(L) * bt() * H * layout.nope_dim);
  lse = DeviceBuffer<float>(static_cast<std::size_t>(L) * bt() * H);
  ESS_CUDA_CHECK(cudaMemcpy(q.get(), rig->queries().data(), q.size() * 2, cudaMemcpyHostToDevice), "executor: queries");
  if (c.offload) {
    o_a = DeviceBuffer<float>(bt() * H * layout.nope_dim);
    o_b = DeviceBuffer<float>(bt() * H * layout.nope_dim);
    lse_a = DeviceBuffer<float>(bt() * H);
    lse_b = DeviceBuffer<float>(bt() * H);
  }
  // Indexer: random FP8 queries and keys (finite by construction), full-length pages.
  idx_q = DeviceBuffer<std::uint8_t>(bt() * IH * ilayout.head_dim);
  idx_w = DeviceBuffer<float>(bt() * IH);
  idx_cache = DeviceBuffer<std::uint8_t>(static_cast<std::size_t>(L) * B * idx_pages * ilayout.page_bytes());
  idx_table = DeviceBuffer<std::int32_t>(static_cast<std::size_t>(B) * idx_pages);
  logits = DeviceBuffer<float>(bt() * static_cast<std::size_t>(stride));
  topk_out = DeviceBuffer<std::int32_t>(bt() * K);
  ESS_LAUNCH(fill_fp8(idx_q.get(), idx_q.size(), c.seed + 2, cs), "executor: indexer queries");
  ESS_LAUNCH(fill_f32(idx_w.get(), idx_w.size(), 0.0f, 1.0f / static_cast<float>(IH), c.seed + 3, cs), "executor: indexer weights");
  ESS_LAUNCH(fill_fp8(idx_cache.get(), idx_cache.size(), c.seed + 4, cs), "executor: indexer cache");
  {
    std::vector<std::int32_t> pages(static_cast<std::size_t>(B) * idx_pages);
    for (std::size_t i = 0; i < pages.size(); ++i) pages[i] = static_cast<std::int32_t>(i);
    ESS_CUDA_CHECK(cudaMemcpy(idx_table.get(), pages.data(), pages.size() * 4, cudaMemcpyHostToDevice), "executor: indexer pages");
    std::vector<std::int32_t> len(static_cast<std::size_t>(c.steps) * bt());
    for (int s = 0; s < c.steps; ++s) {
      for (int b = 0; b < B; ++b) {
        const std::int64_t l0 = in->lengths[static_cast<std::size_t>(s) * B + static_cast<std::size_t>(b)];
        for (int t = 0; t < T; ++t) {
          len[(static_cast<std::size_t>(s) * B + static_cast<std::size_t>(b)) * T + static_cast<std::size_t>(t)] =
              static_cast<std::int32_t>(l0 - T + 1 + t);
        }
      }
    }
    idx_len = DeviceBuffer<std::int32_t>(len.size());
    ESS_CUDA_CHECK(cudaMemcpy(idx_len.get(), len.data(), len.size() * 4, cudaMemcpyHostToDevice), "executor: indexer lengths");
  }
  fill_caches();
  if (c.offload) warm_up();
  ESS_CUDA_CHECK(cudaDeviceSynchronize(), "executor: setup");
}

// The latent caches: offloaded, the Offload (its pinned host pool holding every request's
// prompt, pre-extended to the request's last step so that the page tables are complete
// before any step is captured) over this executor's layer buffers; all-resident, the whole
// cache on the device. And where each step's new entries are written.
void StepExecutor::Impl::fill_caches() {
  const std::vector<std::uint8_t>& host_table = rig->table();
  table = DeviceBuffer<std::uint8_t>(host_table.size());
  ESS_CUDA_CHECK(cudaMemcpy(table.get(), host_table.data(), host_table.size(), cudaMemcpyHostToDevice), "executor: entry table");
  std::vector<std::int64_t> prompt(static_cast<std::size_t>(B)), max_len(static_cast<std::size_t>(B));
  for (int b = 0; b < B; ++b) {
    prompt[static_cast<std::size_t>(b)] = in->lengths[static_cast<std::size_t>(b)] - T;
    std::int64_t mx = 0;
    for (int s = 0; s < c.steps; ++s) mx = std::max(mx, in->lengths[static_cast<std::size_t>(s) * B + static_cast<std::size_t>(b)]);
    max_len[static_cast<std::size_t>(b)] = mx;
  }
  const auto layer_bytes = [&] { return static_cast<std::uint64_t>(layer_rows) * entry; };
  std::vector<std::int32_t> first_new(static_cast<std::size_t>(B));  // [B]: row of the first new entry of position b
  std::vector<std::uint64_t> kvo(static_cast<std::size_t>(B), 0);
  if (c.offload) {
    OffloadConfig oc = OffloadConfig::for_model(m, B, S, *std::max_element(max_len.begin(), max_len.end()), T);
    oc.layers = L;
    oc.topk = K;
    oc.reserve_newest = c.reserve_newest;
    oc.warmup_windows = std::max(in->prefill_windows, 0);
    oc.copy_blocks = c.copy_blocks;
    oc.backend = Backend::kCuda;
    oc.device = c.device;
    std::uint64_t pages = 0;
    for (int b = 0; b < B; ++b) pages += static_cast<std::uint64_t>((max_len[static_cast<std::size_t>(b)] + kPageTokens - 1) / kPageTokens) * L;
    oc.host_bytes = pages * kPageTokens * entry;
    const std::int64_t offload_rows = static_cast<std::int64_t>(B) * oc.rows_per_request();
    layer_rows = offload_rows + (c.reserve_newest ? 0 : static_cast<std::int64_t>(B) * T);
    kv = DeviceBuffer<std::uint8_t>(static_cast<std::size_t>(L) * layer_bytes());
    ESS_CUDA_CHECK(cudaMemset(kv.get(), 0, kv.size()), "executor: zeroing the latent buffers");
    LatentBuffer buffer;
    for (int l = 0; l < L; ++l) buffer.layer_base.push_back(kv.get() + static_cast<std::size_t>(l) * layer_bytes());
    offload = std::make_unique<Offload>(oc, std::move(buffer));
    std::vector<std::int32_t> r(static_cast<std::size_t>(B));
    for (int b = 0; b < B; ++b) {
      const auto id = static_cast<RequestId>(b);
      r[static_cast<std::size_t>(b)] = offload->admit(id, prompt[static_cast<std::size_t>(b)]);
      if (max_len[static_cast<std::size_t>(b)] > prompt[static_cast<std::size_t>(b)]) {
        offload->extend(id, max_len[static_cast<std::size_t>(b)] - prompt[static_cast<std::size_t>(b)]);
      }
      for (int l = 0; l < L; ++l) {
        for (std::int64_t p = 0; p < prompt[static_cast<std::size_t>(b)]; ++p) {
          const std::span<std::uint8_t> dst = offload->host_entry(id, l, p);
          const std::span<const std::uint8_t> src = rig->entry(b, l, p);
          std::copy(src.begin(), src.end(), dst.begin());
        }
      }
      first_new[static_cast<std::size_t>(b)] =
          c.reserve_newest ? r[static_cast<std::size_t>(b)] * oc.rows_per_request() + S
                           : static_cast<std::int32_t>(offload_rows + static_cast<std::int64_t>(b) * T);
    }
    rows = DeviceBuffer<std::int32_t>(r.size());
    ESS_CUDA_CHECK(cudaMemcpy(rows.get(), r.data(), r.size() * 4, cudaMemcpyHostToDevice), "executor: rows");
    std::vector<std::int32_t> nr(bt()), len(static_cast<std::size_t>(c.steps) * B);
    for (int b = 0; b < B; ++b) {
      for (int t = 0; t < T; ++t) nr[static_cast<std::size_t>(b) * T + static_cast<std::size_t>(t)] = first_new[static_cast<std::size_t>(b)] + t;
    }
    for (std::size_t i = 0; i < len.size(); ++i) len[i] = static_cast<std::int32_t>(in->lengths[i]);
    new_rows = DeviceBuffer<std::int32_t>(nr.size());
    step_lengths = DeviceBuffer<std::int32_t>(len.size());
    ESS_CUDA_CHECK(cudaMemcpy(new_rows.get(), nr.data(), nr.size() * 4, cudaMemcpyHostToDevice), "executor: new-entry rows");
    ESS_CUDA_CHECK(cudaMemcpy(step_lengths.get(), len.data(), len.size() * 4, cudaMemcpyHostToDevice), "executor: lengths");
    slot_ids = DeviceBuffer<std::int32_t>(static_cast<std::size_t>(B) * P);
    hit_ids = DeviceBuffer<std::int32_t>(slot_ids.size());
    miss_ids = DeviceBuffer<std::int32_t>(slot_ids.size());
    hit_count = DeviceBuffer<std::int32_t>(bt());
    miss_count = DeviceBuffer<std::int32_t>(bt());
    counts = DeviceBuffer<std::int32_t>(static_cast<std::size_t>(c.steps) * L * B * 2);
  } else {
    // Position b's token p of layer l at row b x S + p of the layer's buffer, filled on the
    // device from the entry table.
    layer_rows = static_cast<std::int64_t>(B) * S;
    kv = DeviceBuffer<std::uint8_t>(static_cast<std::size_t>(L) * layer_bytes());
    for (int b = 0; b < B; ++b) kvo[static_cast<std::size_t>(b)] = static_cast<std::uint64_t>(b) * static_cast<std::uint64_t>(S) * entry;
    std::vector<std::uint64_t> fs, fd;
    DeviceBuffer<std::uint64_t> ds_src(static_cast<std::size_t>(L) * static_cast<std::size_t>(S));
    DeviceBuffer<std::uint64_t> ds_dst(ds_src.size());
    for (int b = 0; b < B; ++b) {
      fs.clear();
      fd.clear();
      for (int l = 0; l < L; ++l) {
        for (std::int64_t p = 0; p < prompt[static_cast<std::size_t>(b)]; ++p) {
          fs.push_back(RigData::entry_index(b, l, p) * entry);
          fd.push_back(static_cast<std::uint64_t>(l) * layer_bytes() + kvo[static_cast<std::size_t>(b)] + static_cast<std::uint64_t>(p) * entry);
        }
      }
      ESS_CUDA_CHECK(cudaMemcpy(ds_src.get(), fs.data(), fs.size() * 8, cudaMemcpyHostToDevice), "executor: cache fill");
      ESS_CUDA_CHECK(cudaMemcpy(ds_dst.get(), fd.data(), fd.size() * 8, cudaMemcpyHostToDevice), "executor: cache fill");
      cuda::EntryCopy copy{table.get(), kv.get(), ds_src.get(), ds_dst.get(), static_cast<std::int64_t>(fs.size()),
                           static_cast<int>(entry), nullptr, kSetupCopyBlocks};
      ESS_LAUNCH(cuda::flashtrans_gather(copy, nullptr), "executor: resident cache fill of request {}", b);
      ESS_CUDA_CHECK(cudaDeviceSynchronize(), "executor: resident cache fill");
    }
  }
  kv_offsets = DeviceBuffer<std::uint64_t>(kvo.size());
  ESS_CUDA_CHECK(cudaMemcpy(kv_offsets.get(), kvo.data(), kvo.size() * 8, cudaMemcpyHostToDevice), "executor: row offsets");

  // New entries of each step: token positions [length - T, length) of every request-layer,
  // written where the model writes them (the staging or reserved rows, or the resident cache).
  std::vector<std::uint64_t> src(static_cast<std::size_t>(c.steps) * L * bt()), dst(src.size());
  for (int s = 0; s < c.steps; ++s) {
    for (int l = 0; l < L; ++l) {
      for (int b = 0; b < B; ++b) {
        const std::int64_t len = in->lengths[static_cast<std::size_t>(s) * B + static_cast<std::size_t>(b)];
        for (int t = 0; t < T; ++t) {
          const std::int64_t p = len - T + t;
          const std::size_t i = ((static_cast<std::size_t>(s) * L + static_cast<std::size_t>(l)) * B + static_cast<std::size_t>(b)) * T +
                                static_cast<std::size_t>(t);
          src[i] = RigData::entry_index(b, l, p) * entry;
          const std::uint64_t row = c.offload ? static_cast<std::uint64_t>(first_new[static_cast<std::size_t>(b)] + t)
                                              : kvo[static_cast<std::size_t>(b)] / entry + static_cast<std::uint64_t>(p);
          dst[i] = static_cast<std::uint64_t>(l) * layer_bytes() + row * entry;
        }
      }
    }
  }
  new_src = DeviceBuffer<std::uint64_t>(src.size());
  new_dst = DeviceBuffer<std::uint64_t>(dst.size());
  ESS_CUDA_CHECK(cudaMemcpy(new_src.get(), src.data(), src.size() * 8, cudaMemcpyHostToDevice), "executor: new-entry offsets");
  ESS_CUDA_CHECK(cudaMemcpy(new_dst.get(), dst.data(), dst.size() * 8, cudaMemcpyHostToDevice), "executor: new-entry offsets");
}

// LRU-Warmup of every request from the trace's prefill top-k; the Offload loads the warmed
// rows from the host pool (not part of any timed step).
void StepExecutor::Impl::warm_up() {
  if (in->prefill_windows <= 0) return;
  const std::size_t W = static_cast<std::size_t>(in->prefill_windows);
  const std::size_t per_layer = W * static_cast<std::size_t>(K);
  std::vector<std::int32_t> windows(static_cast<std::size_t>(L) * per_layer);  // [L][W][K] of one request
  for (int b = 0; b < B; ++b) {
    for (int l = 0; l < L; ++l) {
      const std::int32_t* w = in->prefill.data() + (static_cast<std::size_t>(l) * B + static_cast<std::size_t>(b)) * per_layer;
      std::copy(w, w + per_layer, windows.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(l) * per_layer));
    }
    offload->warmup(static_cast<RequestId>(b), windows, static_cast<int>(W));
  }
}

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
    st.resident = hit_ids.get() + pos0;
    st.fetched = miss_ids.get() + pos0;
    st.resident_count = hit_count.get() + static_cast<std::size_t>(b0) * T;
    st.fetched_count = miss_count.get() + static_cast<std::size_t>(b0) * T;
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
    if (!c.offload) {
      pre_attention();
      indexer_half(s, l, 0, B, 0);
      attention(l, token_ids, nullptr, o16, nullptr, layer_lse(l));
    } else if (mode == OverlapMode::kNone) {
      pre_attention();
      indexer_half(s, l, 0, B, 0);
      ESS_CUDA_CHECK(cudaStreamWaitEvent(cs, ev_h2d[2 * lz], 0), "executor: attention waits for the copy");
      attention(l, slot_ids.get(), nullptr, o16, nullptr, layer_lse(l));
    } else {
      int last = 0;
      if (mode == OverlapMode::kDualBatchAttention && B >= 2) {
        const int b_half = (B + 1) / 2;
        indexer_half(s, l, 0, b_half, 0);
        indexer_half(s, l, b_half, B - b_half, 1);
        last = 1;
      } else {
        indexer_half(s, l, 0, B, 0);
      }
      pre_attention();
      attention(l, hit_ids.get(), hit_count.get(), nullptr, o_a.get(), lse_a.get());  // Attn0: resident, under the copy
      ESS_CUDA_CHECK(cudaStreamWaitEvent(cs, ev_h2d[2 * lz + static_cast<std::size_t>(last)], 0),
                     "executor: Attn1 waits for the copy");
      attention(l, miss_ids.get(), miss_count.get(), nullptr, o_b.get(), lse_b.get());  // Attn1: fetched entries
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
  r.date = utc_now();
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
  r.step = summarize(r.step_us);
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

}  // namespace ess::pipeline
