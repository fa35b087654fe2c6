// The executor's set-up (executor_impl.h): streams and events, the rig's data, the stand-in
// GEMMs, the Offload and the device buffers of every op (setup); the caches the steps read
// (fill_caches); LRU-Warmup from the trace's prefill windows (warm_up). The schedule of a step
// is executor.cc's.
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
#include "harness/rig/fills.h"
#include "harness/rig/gemm.h"
#include "harness/rig/rig_data.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "testing/device.h"

namespace ess::rig {
namespace {

// The untimed set-up copies (resident cache fill, warm-up fill) take the whole GPU.
constexpr int kSetupCopyBlocks = 4096;

}  // namespace

void StepExecutor::Impl::setup() {
  c.validate(m);
  ESS_CHECK(in->layers == c.layers && in->batch == c.batch && in->steps == c.steps,
            "executor: inputs for {} layers x {} requests x {} steps, configuration asks {} x {} x {}", in->layers,
            in->batch, in->steps, c.layers, c.batch, c.steps);
  device = test::use_device(c.device, "executor");
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
    resident = DeviceBuffer<std::int32_t>(slot_ids.size());
    fetched = DeviceBuffer<std::int32_t>(slot_ids.size());
    resident_count = DeviceBuffer<std::int32_t>(bt());
    fetched_count = DeviceBuffer<std::int32_t>(bt());
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

}  // namespace ess::rig
