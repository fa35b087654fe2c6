// Internal to ess_pipeline: the executor's state, shared by the schedule (executor.cc) and
// the per-op timings of `ess bench profile` (profile.cc).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "ess/cache/total_pool.h"
#include "ess/cuda/device_buffer.h"
#include "ess/cuda/indexer.h"
#include "ess/cuda/sparse_mla.h"
#include "ess/cuda/swap_engine_gpu.h"
#include "ess/model/entry_layout.h"
#include "ess/pipeline/executor.h"
#include "ess/pipeline/gemm.h"
#include "ess/pipeline/rig_data.h"

namespace ess::pipeline {

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
  // Per layer: proj0 done, D2H done, indexer half done (2), H2D half done (2); join events.
  std::vector<cudaEvent_t> ev_proj0, ev_d2h, ev_idx, ev_h2d;
  cudaEvent_t ev_join_h = nullptr, ev_join_d = nullptr;
  std::vector<cudaEvent_t> t0, t1;

  std::unique_ptr<RigData> rig;             // entries and queries (host), also the CPU reference's
  std::unique_ptr<StandInGemms> gemms;
  std::unique_ptr<TotalPool> pool;
  const std::uint8_t* pool_dev = nullptr;   // the pool's arena as kernels see it
  std::unique_ptr<cuda::GpuSwapEngine> swap;

  DeviceBuffer<std::uint8_t> table;         // [kEntryTable][656]
  DeviceBuffer<std::uint8_t> kv;            // slots [B][L][S][656] or the resident cache
  DeviceBuffer<std::uint64_t> kv_offsets;   // [L][B]
  DeviceBuffer<std::int32_t> ids;           // [steps][L][B][P] token ids from the trace
  DeviceBuffer<std::int32_t> rows;          // [B]: 0, 1, ..., B - 1
  DeviceBuffer<std::int32_t> slot_ids;      // [B][P]
  DeviceBuffer<std::int32_t> hit_ids, miss_ids;      // [B][P]: DA / DBA halves, compacted per row
  DeviceBuffer<std::int32_t> hit_count, miss_count;  // [B][T]
  DeviceBuffer<std::int32_t> fill_tokens, fill_slots;
  DeviceBuffer<std::uint64_t> fill_host;
  DeviceBuffer<std::int32_t> counts;        // [steps][L][B][2]
  DeviceBuffer<std::int32_t> page_table;    // host pool pages [B][L][pool_pages]
  int pool_pages = 0;
  DeviceBuffer<std::uint8_t> flags;         // [B][S]
  DeviceBuffer<std::uint64_t> h2d_src, h2d_dst;  // [B x P]
  DeviceBuffer<std::int64_t> h2d_total;     // [2] (DBA halves)
  DeviceBuffer<std::int64_t> miss_offsets;  // [B]: each request's place in the FlashTrans list
  DeviceBuffer<std::uint64_t> new_src, new_dst;  // [steps][L][B x T]
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
    for (auto* v : {&ev_proj0, &ev_d2h, &ev_idx, &ev_h2d, &t0, &t1}) {
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
  void swap_split(int s, int l, int b0, int nb, int half);    // swap engine + split (offload)
  void issue_copy(int l, int b0, int nb, int half);           // H2D of the half's misses
  void attention(int l, const std::int32_t* idx, const std::int32_t* lengths, std::uint16_t* o16, float* o32, float* l32);
};

}  // namespace ess::pipeline
