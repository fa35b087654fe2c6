// Internal to the rig: the executor's state, shared by the schedule (executor.cc) and
// the per-op timings of `ess bench profile` (profile.cc).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "ess/model/entry_layout.h"
#include "ess/ops/indexer.h"
#include "ess/ops/sparse_mla.h"
#include "ess/runtime/offload.h"
#include "harness/rig/executor.h"
#include "harness/rig/gemm.h"
#include "harness/rig/rig_data.h"
#include "runtime/cuda/device_buffer.h"

namespace ess::rig {

using cuda::DeviceBuffer;

struct StepExecutor::Impl {
  ExecutorConfig c;
  ModelSpec m;
  const StepInputs* in;
  LatentLayout layout;
  IndexerLayout ilayout;
  int B = 0, L = 0, T = 0, K = 0, P = 0, H = 0, IH = 0;
  std::int32_t S = 0;         // slots per request-layer (offload) / resident capacity (all-resident)
  int idx_pages = 0;          // indexer pages per request-layer
  std::int64_t stride = 0;    // logits row stride
  std::uint64_t entry = 0;
  float softmax_scale = 0;
  std::vector<OverlapMode> modes;
  std::string device;

  cudaStream_t cs = nullptr, hs = nullptr, ds = nullptr;
  // Per layer: new entries written, their D2H done, H2D half done (2); join events.
  std::vector<cudaEvent_t> ev_proj0, ev_d2h, ev_h2d;
  cudaEvent_t ev_join_h = nullptr, ev_join_d = nullptr;
  std::vector<cudaEvent_t> t0, t1;

  std::unique_ptr<RigData> rig;             // entries and queries (host), also the CPU reference's
  std::unique_ptr<StandInGemms> gemms;
  std::unique_ptr<Offload> offload;         // the runtime's per-layer step (offloaded mode)

  // Each layer's latent buffer: offloaded, the Offload's rows (B x rows_per_request) and,
  // without reserve_newest, B x T staging rows where the model writes the step's new
  // entries; all-resident, [B][S] rows by token id.
  std::int64_t layer_rows = 0;
  DeviceBuffer<std::uint8_t> table;         // [kEntryTable][656]
  DeviceBuffer<std::uint8_t> kv;            // [L][layer_rows][656]
  DeviceBuffer<std::uint64_t> kv_offsets;   // [B]: each position's first row (resident), 0 (offloaded)
  DeviceBuffer<std::int32_t> ids;           // [steps][L][B][P] token ids from the trace
  DeviceBuffer<std::int32_t> rows;          // [B]: each position's Offload row
  DeviceBuffer<std::int32_t> step_lengths;  // [steps][B]: tokens after the step's new ones
  DeviceBuffer<std::int32_t> new_rows;      // [B][T]: the rows the step's new entries are written to
  DeviceBuffer<std::int32_t> slot_ids;      // [B][P]: the rows attention reads
  DeviceBuffer<std::int32_t> resident, fetched;      // [B][P]: DA / DBA halves, compacted per row
  DeviceBuffer<std::int32_t> resident_count, fetched_count;  // [B][T]
  DeviceBuffer<std::int32_t> counts;        // [steps][L][B][2]
  DeviceBuffer<std::uint64_t> new_src, new_dst;  // [steps][L][B x T]: entry table -> latent buffer
  DeviceBuffer<std::uint16_t> q;            // [B][T][H][576]
  DeviceBuffer<std::uint16_t> out;          // [L][B][T][H][512]
  DeviceBuffer<float> o_a, o_b, lse_a, lse_b;
  DeviceBuffer<float> lse;                  // [L][B][T][H]
  DeviceBuffer<std::uint8_t> idx_q;         // [B][T][IH][128] FP8
  DeviceBuffer<float> idx_w;                // [B][T][IH]
  DeviceBuffer<std::uint8_t> idx_cache;     // [L][B][idx_pages][8448]
  DeviceBuffer<std::int32_t> idx_table;     // [B][idx_pages]
  DeviceBuffer<std::int32_t> idx_len;       // [steps][B][T]
  DeviceBuffer<float> logits;               // [B][T][stride]
  DeviceBuffer<std::int32_t> topk_out;      // [B][T][K]
  std::vector<cudaGraphExec_t> graphs;

  Impl(const ExecutorConfig& config, const ModelSpec& model, const StepInputs& inputs)
      : c(config), m(model), in(&inputs) {}
  ~Impl() {
    drop_graphs();
    for (auto* v : {&ev_proj0, &ev_d2h, &ev_h2d, &t0, &t1}) {
      for (cudaEvent_t e : *v) cudaEventDestroy(e);
    }
    if (ev_join_h != nullptr) cudaEventDestroy(ev_join_h);
    if (ev_join_d != nullptr) cudaEventDestroy(ev_join_d);
    for (cudaStream_t s : {cs, hs, ds}) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
  }

  std::size_t bt() const { return static_cast<std::size_t>(B) * T; }
  void drop_graphs() {
    for (cudaGraphExec_t g : graphs) {
      if (g != nullptr) cudaGraphExecDestroy(g);
    }
    graphs.clear();
  }
  float* layer_lse(int l) const { return lse.get() + static_cast<std::size_t>(l) * bt() * H; }

  void setup();
  void fill_caches();
  void warm_up();
  void enqueue(int s);
  void indexer_half(int s, int l, int b0, int nb, int half);  // the three below
  void run_indexer(int s, int l, int b0, int nb);             // wq_b, logits, top-k
  cuda::IndexerArgs indexer_args(int s, int l, int b0, int nb) const;  // requests [b0, b0 + nb)
  cuda::TopkArgs topk_args(const cuda::IndexerArgs& ia, int b0) const;
  cuda::SparseMlaArgs mla_args(int l, const std::int32_t* idx, const std::int32_t* lengths) const;  // all B
  cuda::MergeArgs merge_args(int l, std::uint16_t* o16) const;  // the DA partials of all B x T tokens
  // The Offload step of requests [b0, b0 + nb): decision, lists, and (unless skipped) the
  // H2D copy of the misses on the H2D stream, recorded in ev_h2d[2 l + half].
  void offload_step(int s, int l, int b0, int nb, int half, bool fetch);
  void attention(int l, const std::int32_t* idx, const std::int32_t* lengths, std::uint16_t* o16, float* o32, float* l32);
};

}  // namespace ess::rig
