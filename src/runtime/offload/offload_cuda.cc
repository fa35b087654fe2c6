// Offload's CUDA backend: the GPU swap engine decides, the split turns its decision into one
// FlashTrans list (and the DA halves), FlashTrans fetches; every launch on the caller's
// stream(s), nothing allocated or synchronized inside a step. CUDA target only: it registers
// itself with the front (offload_impl.h) when the program starts, kept in every program that
// links the runtime by `--undefined=ess_cuda_offload_anchor` (src/runtime/CMakeLists.txt).
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <numeric>

#include "ess/core/error.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "runtime/cuda/pinned_staging.h"
#include "runtime/cuda/runtime.h"
#include "runtime/offload/offload_impl.h"
#include "runtime/offload/offload_launch.h"
#include "runtime/ops/gpu_swap/swap_engine_gpu.h"
#include "runtime/ops/split/split.h"

extern "C" {
extern const int ess_cuda_offload_anchor;
const int ess_cuda_offload_anchor = 1;
}

namespace ess::cuda {
namespace {

// The scratch of one step in flight (LayerStep::part), sized for a full batch.
struct Part {
  DeviceBuffer<std::int32_t> lru_ids, lru_slots, slot_ids, fill_tokens, fill_slots, counts;
  DeviceBuffer<std::uint64_t> fill_host, src, dst;
  DeviceBuffer<std::uint8_t> flags;
  DeviceBuffer<std::int64_t> miss_offsets, total;
  cudaEvent_t decided = nullptr;  // the copy stream waits for the decision
};

class CudaOffload final : public OffloadBackend {
 public:
  CudaOffload(OffloadState& state, bool owned) : x_(state) {
    const OffloadConfig& c = state.config;
    ESS_CUDA_CHECK(cudaSetDevice(c.device), "offload: selecting device {}", c.device);
    P_ = static_cast<std::size_t>(c.query_tokens) * static_cast<std::size_t>(c.topk);
    B_ = static_cast<std::size_t>(c.max_requests);
    rpr_ = c.rows_per_request();
    max_pages_ = static_cast<int>((c.max_context + kPageTokens - 1) / kPageTokens);
    GpuSwapConfig gc;
    gc.rows = c.max_requests;
    gc.layers = c.layers;
    gc.slots = c.slots;
    gc.max_positions = static_cast<int>(P_);
    gc.device = c.device;
    swap_ = std::make_unique<GpuSwapEngine>(gc);
    if (owned) {
      const std::uint64_t bytes = state.buffer.rows.offset(static_cast<std::int64_t>(B_) * rpr_);
      for (int l = 0; l < c.layers; ++l) {
        owned_.emplace_back(bytes);
        ESS_CUDA_CHECK(cudaMemset(owned_.back().get(), 0, bytes), "offload: zeroing the buffer of layer {}", l);
        state.buffer.layer_base.push_back(owned_.back().get());
      }
    }
    for (Part& p : parts_) {
      p.lru_ids = DeviceBuffer<std::int32_t>(B_ * P_);
      p.lru_slots = DeviceBuffer<std::int32_t>(B_ * P_);
      p.slot_ids = DeviceBuffer<std::int32_t>(B_ * P_);
      p.fill_tokens = DeviceBuffer<std::int32_t>(B_ * P_);
      p.fill_slots = DeviceBuffer<std::int32_t>(B_ * P_);
      p.counts = DeviceBuffer<std::int32_t>(2 * B_);
      p.fill_host = DeviceBuffer<std::uint64_t>(B_ * P_);
      p.src = DeviceBuffer<std::uint64_t>(B_ * P_);
      p.dst = DeviceBuffer<std::uint64_t>(B_ * P_);
      p.flags = DeviceBuffer<std::uint8_t>(B_ * static_cast<std::size_t>(rpr_));
      p.miss_offsets = DeviceBuffer<std::int64_t>(B_);
      p.total = DeviceBuffer<std::int64_t>(1);
      ESS_CUDA_CHECK(cudaEventCreateWithFlags(&p.decided, cudaEventDisableTiming), "offload: events");
    }
    if (c.residency != Residency::kSparse) {
      max_units_ = c.whole_rows(c.max_context);
      whole_units_ = DeviceBuffer<std::int32_t>(B_ * static_cast<std::size_t>(max_units_));
      ESS_CUDA_CHECK(cudaMemset(whole_units_.get(), 0xff, whole_units_.size() * 4), "offload: whole rows");
      const std::size_t W = static_cast<std::size_t>(c.recorded_windows());
      if (W > 0) {
        recorded_ = DeviceBuffer<std::int32_t>(B_ * static_cast<std::size_t>(c.layers) * W * static_cast<std::size_t>(c.topk));
        recorded_head_ = DeviceBuffer<std::int32_t>(B_ * static_cast<std::size_t>(c.layers) * 2);
        ESS_CUDA_CHECK(cudaMemset(recorded_head_.get(), 0, recorded_head_.size() * 4), "offload: recorded windows");
      }
      wb_whole_src_ = DeviceBuffer<std::uint64_t>(B_ * static_cast<std::size_t>(c.query_tokens));
      wb_whole_dst_ = DeviceBuffer<std::uint64_t>(B_ * static_cast<std::size_t>(c.query_tokens));
      wb_whole_total_ = DeviceBuffer<std::int64_t>(1);
    }
    if (c.region_blocks > 0) {  // every pool row without a region until placed
      regions_ = DeviceBuffer<std::int32_t>(static_cast<std::size_t>(c.region_groups()) * B_ * static_cast<std::size_t>(c.region_blocks));
      ESS_CUDA_CHECK(cudaMemset(regions_.get(), 0xff, regions_.size() * 4), "offload: the regions");
    }
    wb_src_ = DeviceBuffer<std::uint64_t>(B_ * static_cast<std::size_t>(c.query_tokens));
    wb_dst_ = DeviceBuffer<std::uint64_t>(B_ * static_cast<std::size_t>(c.query_tokens));
    wb_total_ = DeviceBuffer<std::int64_t>(1);
    page_table_ = DeviceBuffer<std::int32_t>(B_ * static_cast<std::size_t>(max_pages_) * static_cast<std::size_t>(c.layers));
    ESS_CUDA_CHECK(cudaMemset(page_table_.get(), 0xff, page_table_.size() * 4), "offload: page tables");
    // The lifecycle's loads: a request's windows, the GPU swap engine's warm-up outputs, one list.
    const std::size_t S = static_cast<std::size_t>(c.slots), K = static_cast<std::size_t>(c.topk);
    row_index_ = DeviceBuffer<std::int32_t>(B_);
    warm_ids_ = DeviceBuffer<std::int32_t>(static_cast<std::size_t>(std::max(c.warmup_windows, 1)) * K);
    warm_before_ = DeviceBuffer<std::int32_t>(S);
    warm_tokens_ = DeviceBuffer<std::int32_t>(S);
    warm_slots_ = DeviceBuffer<std::int32_t>(S);
    warm_count_ = DeviceBuffer<std::int32_t>(1);
    warm_step_slots_ = DeviceBuffer<std::int32_t>(K);
    warm_step_tokens_ = DeviceBuffer<std::int32_t>(K);
    warm_step_fill_slots_ = DeviceBuffer<std::int32_t>(K);
    warm_step_counts_ = DeviceBuffer<std::int32_t>(2);
    const std::size_t list = std::max({S, static_cast<std::size_t>(c.query_tokens),
                                       c.residency != Residency::kSparse ? static_cast<std::size_t>(c.max_context) : 0});
    fill_src_ = DeviceBuffer<std::uint64_t>(list);
    fill_dst_ = DeviceBuffer<std::uint64_t>(list);
    fill_total_ = DeviceBuffer<std::int64_t>(1);
    warmup_tally_ = DeviceBuffer<std::int64_t>(1);
    ESS_CUDA_CHECK(cudaMemset(warmup_tally_.get(), 0, 8), "offload: the warm-up tally");
    std::vector<std::int32_t> rows(B_);
    std::iota(rows.begin(), rows.end(), 0);
    ESS_CUDA_CHECK(cudaMemcpy(row_index_.get(), rows.data(), B_ * 4, cudaMemcpyHostToDevice), "offload: the row index");
    ESS_CUDA_CHECK(cudaEventCreateWithFlags(&handoff_, cudaEventDisableTiming), "offload: events");
    ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&stats_stream_, cudaStreamNonBlocking), "offload: the statistics stream");
    pool_dev_ = device_view_cuda(state.pool->base());
    ESS_CHECK(pool_dev_ != nullptr, "offload: the host pool is not mapped into the device's address space");
    ESS_CUDA_CHECK(cudaDeviceSynchronize(), "offload: set-up");
  }

  ~CudaOffload() override {
    cudaDeviceSynchronize();  // nothing of this engine's may still run: its memory goes below
    for (Part& p : parts_) {
      if (p.decided != nullptr) cudaEventDestroy(p.decided);
    }
    for (const auto& [serial, e] : fences_) cudaEventDestroy(e);
    if (handoff_ != nullptr) cudaEventDestroy(handoff_);
    if (stats_stream_ != nullptr) cudaStreamDestroy(stats_stream_);
  }

  // ---- lifecycle: each call's device work on the lifecycle stream (begin .. end) ----
  void set_lifecycle_stream(Stream stream, bool ordered) override {
    if (ordered_ && (!ordered || stream != lifecycle_)) {  // the new stream (or the host) after the old one's work
      ESS_CUDA_CHECK(cudaEventRecord(handoff_, static_cast<cudaStream_t>(lifecycle_)), "offload: lifecycle stream handoff");
      if (ordered) {
        ESS_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), handoff_, 0), "offload: lifecycle stream handoff");
      } else {
        ESS_CUDA_CHECK(cudaEventSynchronize(handoff_), "offload: lifecycle stream handoff");
      }
    }
    lifecycle_ = ordered ? stream : nullptr;
    ordered_ = ordered;
  }

  std::uint64_t fence() override {
    if (!ordered_) return 0;  // each call waited for the device
    cudaEvent_t e = nullptr;
    ESS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "offload: a release fence");
    if (const cudaError_t r = cudaEventRecord(e, static_cast<cudaStream_t>(lifecycle_)); r != cudaSuccess) {
      cudaEventDestroy(e);
      ESS_CUDA_CHECK(r, "offload: recording a release fence");
    }
    fences_.emplace(++fence_serial_, e);
    return fence_serial_;
  }

  bool fence_passed(std::uint64_t fence) override {
    const auto it = fences_.find(fence);
    if (it == fences_.end()) return true;
    const cudaError_t e = cudaEventQuery(it->second);
    if (e == cudaErrorNotReady) return false;
    ESS_CUDA_CHECK(e, "offload: querying a release fence");
    cudaEventDestroy(it->second);
    fences_.erase(it);
    return true;
  }

  void wait_fence(std::uint64_t fence) override {
    const auto it = fences_.find(fence);
    if (it == fences_.end()) return;
    ESS_CUDA_CHECK(cudaEventSynchronize(it->second), "offload: waiting for a release fence");
    cudaEventDestroy(it->second);
    fences_.erase(it);
  }

  void admit(std::int32_t row, RequestId) override {
    const Stream s = begin();
    swap_->reset_row(row, s);
    upload_units(row, s);
    clear_recorded(row, s);
    end("admit of row {}", row);
  }

  void release(std::int32_t row, RequestId) override {
    const Stream s = begin();
    swap_->reset_row(row, s);
    clear_units(row, s);
    for (int g = 0; regions_.get() != nullptr && g < x_.config.region_groups(); ++g) {
      const auto n = static_cast<std::size_t>(x_.config.region_blocks);
      ESS_CUDA_CHECK(cudaMemsetAsync(regions_.get() + x_.region_at(g, row), 0xff, n * 4, static_cast<cudaStream_t>(s)),
                     "offload: the region of row {}", row);
    }
    end("release of row {}", row);
  }

  void placed(std::int32_t row, RequestId) override {
    const Stream s = begin();
    swap_->reset_row(row, s);
    clear_recorded(row, s);
    const auto n = static_cast<std::size_t>(x_.config.region_blocks);
    for (int g = 0; g < x_.config.region_groups(); ++g) {
      std::int32_t* blocks = staging_.take<std::int32_t>(n);
      std::copy_n(x_.region.begin() + static_cast<std::ptrdiff_t>(x_.region_at(g, row)), n, blocks);
      ESS_CUDA_CHECK(cudaMemcpyAsync(regions_.get() + x_.region_at(g, row), blocks, n * 4, cudaMemcpyHostToDevice,
                                     static_cast<cudaStream_t>(s)),
                     "offload: the region of row {}", row);
    }
    end("the region of row {}", row);
  }

  void reset(std::int32_t row, RequestId) override {
    const Stream s = begin();
    swap_->reset_row(row, s);
    clear_recorded(row, s);
    end("reset of row {}", row);
  }

  void units_changed(std::int32_t row, RequestId) override {
    const Stream s = begin();
    upload_units(row, s);
    end("the whole rows of row {}", row);
  }

  void load_whole(std::int32_t row, RequestId id, std::span<const std::int32_t> windows, int W) override {
    const OffloadConfig& c = x_.config;
    const Stream s = begin();
    upload_units(row, s);
    const std::int64_t length = x_.pool->length(id);
    for (int l = 0; l < c.layers; ++l) {
      HostFillList f = fill_list(row, l);
      f.units = whole_units_.get() + static_cast<std::size_t>(row) * static_cast<std::size_t>(max_units_);
      f.length = length;
      load(f, length, l, s);
    }
    // The windows it records start as the given ones (their last recorded_windows()).
    clear_recorded(row, s);
    const int Wr = c.recorded_windows();
    const int n = std::min(W, Wr);
    if (n > 0) {
      const std::size_t K = static_cast<std::size_t>(c.topk);
      const std::size_t ring_size = static_cast<std::size_t>(c.layers) * static_cast<std::size_t>(Wr) * K;
      std::int32_t* ring = staging_.take<std::int32_t>(ring_size);
      std::int32_t* head = staging_.take<std::int32_t>(2 * static_cast<std::size_t>(c.layers));
      std::fill(ring, ring + ring_size, -1);
      for (int l = 0; l < c.layers; ++l) {
        for (int w = 0; w < n; ++w) {
          const auto from = windows.begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(l) * W + static_cast<std::size_t>(W - n + w)) * K);
          std::copy(from, from + static_cast<std::ptrdiff_t>(K), ring + (static_cast<std::size_t>(l) * Wr + static_cast<std::size_t>(w)) * K);
        }
        head[2 * static_cast<std::size_t>(l)] = n % Wr;
        head[2 * static_cast<std::size_t>(l) + 1] = n;
      }
      ESS_CUDA_CHECK(cudaMemcpyAsync(recorded_.get() + static_cast<std::size_t>(row) * ring_size, ring, ring_size * 4,
                                     cudaMemcpyHostToDevice, static_cast<cudaStream_t>(s)),
                     "offload: the recorded windows of row {}", row);
      ESS_CUDA_CHECK(cudaMemcpyAsync(recorded_head_.get() + static_cast<std::size_t>(row) * 2 * static_cast<std::size_t>(c.layers), head,
                                     2 * static_cast<std::size_t>(c.layers) * 4, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(s)),
                     "offload: the recorded windows of row {}", row);
    }
    end("whole residency of row {}", row);
  }

  void load_newest(std::int32_t row, RequestId id) override {
    const OffloadConfig& c = x_.config;
    const Stream s = begin();
    const std::int64_t length = x_.pool->length(id);
    for (int l = 0; l < c.layers; ++l) {
      HostFillList f = fill_list(row, l);
      f.reserved = true;
      f.query_tokens = c.query_tokens;
      f.first = std::max<std::int64_t>(0, length - c.query_tokens);
      f.length = length;
      load(f, c.query_tokens, l, s);
    }
    end("the newest entries of row {}", row);
  }

  // The one lifecycle call that reads the device: the windows the request recorded while whole
  // come back to the host (a wait for the lifecycle stream) to be replayed by LRU-Warmup.
  void demote(std::int32_t row, RequestId id) override {
    const OffloadConfig& c = x_.config;
    const int Wr = c.recorded_windows();
    const std::size_t K = static_cast<std::size_t>(c.topk);
    const Stream s = begin();
    const std::size_t ring_size = static_cast<std::size_t>(c.layers) * static_cast<std::size_t>(Wr) * K;
    std::int32_t* ring = nullptr;
    std::int32_t* head = nullptr;
    if (Wr > 0) {
      ring = staging_.take<std::int32_t>(ring_size);
      head = staging_.take<std::int32_t>(2 * static_cast<std::size_t>(c.layers));
      ESS_CUDA_CHECK(cudaMemcpyAsync(ring, recorded_.get() + static_cast<std::size_t>(row) * ring_size, ring_size * 4,
                                     cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(s)),
                     "offload: the recorded windows of row {}", row);
      ESS_CUDA_CHECK(cudaMemcpyAsync(head, recorded_head_.get() + static_cast<std::size_t>(row) * 2 * static_cast<std::size_t>(c.layers),
                                     2 * static_cast<std::size_t>(c.layers) * 4, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(s)),
                     "offload: the recorded windows of row {}", row);
      ESS_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), "offload: demotion of row {}", row);
    }
    upload_units(row, s);  // sparse now
    swap_->reset_row(row, s);
    std::vector<std::int32_t> windows;  // [layers][Wr][K], each layer's oldest first
    std::vector<int> counts(static_cast<std::size_t>(c.layers), 0);
    for (int l = 0; l < c.layers && Wr > 0; ++l) {
      const int next = head[2 * static_cast<std::size_t>(l)], count = head[2 * static_cast<std::size_t>(l) + 1];
      counts[static_cast<std::size_t>(l)] = count;
      for (int i = 0; i < count; ++i) {
        const int w = (next - count + i + Wr) % Wr;
        const std::int32_t* from = ring + (static_cast<std::size_t>(l) * Wr + static_cast<std::size_t>(w)) * K;
        windows.insert(windows.end(), from, from + K);
      }
    }
    replay_windows(row, id, windows, counts, s);
    clear_recorded(row, s);
    end("demotion of row {}", row);
  }

  // New host pages: their ids for every layer, contiguous in [row][page][layer].
  void pages_added(std::int32_t row, RequestId id, std::int64_t first_page) override {
    const int L = x_.config.layers;
    const auto pages = std::ssize(x_.pool->page_table(id, 0));  // pages per layer
    if (pages <= first_page) return;
    const Stream s = begin();
    const std::size_t n = static_cast<std::size_t>(pages - first_page) * static_cast<std::size_t>(L);
    std::int32_t* ids = staging_.take<std::int32_t>(n);
    for (int l = 0; l < L; ++l) {
      const auto table = x_.pool->page_table(id, l);  // arena pages: offset / page_stride
      for (std::int64_t p = first_page; p < pages; ++p) {
        ids[static_cast<std::size_t>(p - first_page) * L + static_cast<std::size_t>(l)] = table[static_cast<std::size_t>(p)];
      }
    }
    const std::size_t at = (static_cast<std::size_t>(row) * static_cast<std::size_t>(max_pages_) + static_cast<std::size_t>(first_page)) *
                           static_cast<std::size_t>(L);
    ESS_CUDA_CHECK(cudaMemcpyAsync(page_table_.get() + at, ids, n * 4, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(s)),
                   "offload: page table of row {}", row);
    end("page table of row {}", row);
  }

  void warmup(std::int32_t row, RequestId id, std::span<const std::int32_t> windows, int W) override {
    const Stream s = begin();
    replay_windows(row, id, windows, std::vector<int>(static_cast<std::size_t>(x_.config.layers), W), s);
    end("warmup of row {}", row);
  }

  void step(const LayerStep& s) override {
    const OffloadConfig& c = x_.config;
    Part& p = parts_[static_cast<std::size_t>(s.part)];
    ++steps_;
    const auto stream = static_cast<Stream>(s.stream);
    StepShape shape;
    shape.batch = s.batch;
    shape.query_tokens = c.query_tokens;
    shape.topk = c.topk;
    shape.slots = c.slots;
    shape.pool = pool_rows(s.layer);
    shape.reserve_newest = c.reserve_newest;
    shape.query_begin = s.query_begin;
    shape.query_end = s.query_end;
    shape.rows = s.rows;
    shape.topk_ids = s.topk;
    shape.lengths = s.lengths;
    shape.whole_units = whole_units_.get();
    shape.max_units = max_units_;
    shape.recorded = recorded_.get();
    shape.recorded_head = recorded_head_.get();
    shape.windows = recorded_head_.get() != nullptr ? c.recorded_windows() : 0;
    shape.layers = c.layers;
    shape.layer = s.layer;
    // Residency: with every admitted request whole (the front's state), no swap decision and no
    // copy are launched. A step being captured into a graph takes the full path, whatever the
    // residency now: a replay may meet sparse requests (the kernels tell them apart on the device).
    const bool residency = whole_units_.get() != nullptr;  // positions may be whole: the device tells which
    const bool whole_path = residency && !capturing(stream) && all_whole();
    std::int32_t* counts = s.counts != nullptr ? s.counts : p.counts.get();
    if (whole_path) {
      shape.whole_only = true;
      ESS_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<std::size_t>(s.batch) * 2 * 4, static_cast<cudaStream_t>(stream)),
                     "offload: the counts of layer {}", s.layer);
      ESS_LAUNCH(launch_finalize_rows(shape, p.lru_slots.get(), p.slot_ids.get(), s.physical, stream),
                 "offload: the rows of layer {}", s.layer);
      if (s.resident != nullptr) {
        ESS_LAUNCH(launch_whole_halves(shape, {s.physical, s.resident, s.fetched, s.resident_count, s.fetched_count}, stream),
                   "offload: the halves of layer {}", s.layer);
      }
      record_copy_done(s, p, stream);
      return;
    }
    // 1. The ids the LRU sees: padded positions, whole requests, invalid ids and reserved newest tokens hidden.
    ESS_LAUNCH(launch_mask_ids(shape, p.lru_ids.get(), stream), "offload: masking the ids of layer {}", s.layer);
    // 2. The LRU decision for the batch.
    GpuSwapStep st;
    st.layer = s.layer;
    st.batch = s.batch;
    st.query_tokens = c.query_tokens;
    st.topk = c.topk;
    st.rows = s.rows;
    st.ids = p.lru_ids.get();
    st.slot_ids = p.lru_slots.get();
    st.fill_tokens = p.fill_tokens.get();
    st.fill_slots = p.fill_slots.get();
    st.fill_host_offsets = p.fill_host.get();
    st.counts = counts;
    st.page_table = page_table_.get();
    st.max_pages = max_pages_;
    st.page_bytes = x_.pool->page_stride();
    st.entry_bytes = x_.config.layout.bytes();
    swap_->step_async(st, stream);
    ++swap_launches_;
    // 3. Each id's slot and physical row.
    ESS_LAUNCH(launch_finalize_rows(shape, p.lru_slots.get(), p.slot_ids.get(), s.physical, stream),
               "offload: the rows of layer {}", s.layer);
    // 4. The FlashTrans list and the DA halves.
    SplitArgs sp;
    sp.batch = s.batch;
    sp.positions = static_cast<int>(P_);
    sp.pool = pool_rows(s.layer);
    sp.buffer = x_.buffer.rows;
    sp.rows = s.rows;
    sp.slot_ids = p.slot_ids.get();
    sp.counts = counts;
    sp.fill_slots = p.fill_slots.get();
    sp.fill_host_offsets = p.fill_host.get();
    sp.miss_offsets = p.miss_offsets.get();
    sp.src_offsets = p.src.get();
    sp.dst_offsets = p.dst.get();
    sp.total = p.total.get();
    sp.query_tokens = c.query_tokens;
    if (s.resident != nullptr) {
      sp.flags = p.flags.get();
      sp.resident = s.resident;
      sp.fetched = s.fetched;
      sp.resident_count = s.resident_count;
      sp.fetched_count = s.fetched_count;
    }
    ESS_LAUNCH(split_misses_cuda(sp, stream), "offload: the miss list of layer {}", s.layer);
    if (s.resident != nullptr && residency) {  // whole positions read every row in place
      ESS_LAUNCH(launch_whole_halves(shape, {s.physical, s.resident, s.fetched, s.resident_count, s.fetched_count}, stream),
                 "offload: the halves of layer {}", s.layer);
    }
    // 5. The fetch, on the copy stream when there is one.
    const Stream copy_stream = on_copy_stream(s, p, stream);
    if (s.fetch) {
      EntryCopy copy{pool_dev_, x_.buffer.layer_base[static_cast<std::size_t>(s.layer)], p.src.get(), p.dst.get(),
                     static_cast<std::int64_t>(s.batch) * static_cast<std::int64_t>(P_),
                     static_cast<int>(x_.config.layout.bytes()), p.total.get(), c.copy_blocks, 0, {}, x_.buffer.tail_of(s.layer)};
      ESS_LAUNCH(flashtrans_cuda(copy, copy_stream), "offload: FlashTrans of layer {}", s.layer);
    }
    if (s.copy_done != nullptr) {
      ESS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(s.copy_done), static_cast<cudaStream_t>(copy_stream)),
                     "offload: recording copy_done");
    }
  }

  // The stream the fetch runs on: `stream`, or the step's copy stream once it waits for the decision.
  Stream on_copy_stream(const LayerStep& s, Part& p, Stream stream) {
    if (s.copy_stream == nullptr) return stream;
    ESS_CUDA_CHECK(cudaEventRecord(p.decided, static_cast<cudaStream_t>(stream)), "offload: event");
    ESS_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.copy_stream), p.decided, 0), "offload: event");
    return s.copy_stream;
  }
  // With nothing to copy, copy_done is still recorded where the copy would have ended.
  void record_copy_done(const LayerStep& s, Part& p, Stream stream) {
    const Stream copy_stream = on_copy_stream(s, p, stream);
    if (s.copy_done != nullptr) {
      ESS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(s.copy_done), static_cast<cudaStream_t>(copy_stream)),
                     "offload: recording copy_done");
    }
  }

  void write_back(const WriteBack& w) override {
    const OffloadConfig& c = x_.config;
    WriteBackList list;
    list.batch = w.batch;
    list.query_tokens = c.query_tokens;
    list.layers = c.layers;
    list.layer = w.layer;
    list.max_pages = max_pages_;
    list.slots = c.slots;
    list.pool = pool_rows(w.layer);
    list.rows = w.rows;
    list.lengths = w.lengths;
    list.source_rows = w.source_rows;
    list.page_table = page_table_.get();
    list.page_bytes = x_.pool->page_stride();
    list.entry_bytes = c.layout.bytes();
    list.buffer = x_.buffer.rows;
    list.src_offsets = wb_src_.get();
    list.dst_offsets = wb_dst_.get();
    list.total = wb_total_.get();
    list.whole_units = whole_units_.get();
    list.max_units = max_units_;
    list.whole_src = wb_whole_src_.get();
    list.whole_dst = wb_whole_dst_.get();
    list.whole_total = wb_whole_total_.get();
    ESS_LAUNCH(launch_write_back_list(list, w.stream), "offload: the write-back list of layer {}", w.layer);
    std::uint8_t* base = x_.buffer.layer_base[static_cast<std::size_t>(w.layer)];
    const RowTail tail = x_.buffer.tail_of(w.layer);
    EntryCopy copy{base, const_cast<std::uint8_t*>(pool_dev_), wb_src_.get(), wb_dst_.get(),
                   static_cast<std::int64_t>(w.batch) * c.query_tokens, static_cast<int>(c.layout.bytes()), wb_total_.get(),
                   c.copy_blocks, 0, tail, {}};
    ESS_LAUNCH(flashtrans_cuda(copy, w.stream), "offload: write-back of layer {}", w.layer);
    if (whole_units_.get() != nullptr) {  // whole requests' newest entries into their own rows too
      EntryCopy own{base, base, wb_whole_src_.get(), wb_whole_dst_.get(), static_cast<std::int64_t>(w.batch) * c.query_tokens,
                    static_cast<int>(c.layout.bytes()), wb_whole_total_.get(), c.copy_blocks, 0, tail, tail};
      ESS_LAUNCH(flashtrans_cuda(own, w.stream), "offload: write-back of layer {} into whole rows", w.layer);
    }
  }

  std::vector<std::uint8_t> read_row(int layer, std::int32_t p) const override {
    std::vector<std::uint8_t> v(x_.config.layout.bytes());
    const bool split = x_.buffer.split();
    const std::size_t head = split ? static_cast<std::size_t>(x_.buffer.tail.head_bytes) : v.size();
    ESS_CUDA_CHECK(cudaDeviceSynchronize(), "offload: read_row");
    ESS_CUDA_CHECK(cudaMemcpy(v.data(), x_.buffer.layer_base[static_cast<std::size_t>(layer)] + x_.buffer.rows.offset(p),
                              head, cudaMemcpyDeviceToHost),
                   "offload: reading row {} of layer {}", p, layer);
    if (split) {  // the tail; the padding after it reads as zeros
      ESS_CUDA_CHECK(cudaMemcpy(v.data() + head, x_.buffer.tail_base[static_cast<std::size_t>(layer)] + x_.buffer.tail.rows.offset(p),
                                static_cast<std::size_t>(x_.buffer.tail.bytes), cudaMemcpyDeviceToHost),
                     "offload: reading the tail of row {} of layer {}", p, layer);
    }
    return v;
  }

  std::uint64_t device_bytes() const override {
    std::uint64_t n = swap_->device_bytes() + wb_src_.bytes() + wb_dst_.bytes() + wb_total_.bytes() + page_table_.bytes() +
                      whole_units_.bytes() + recorded_.bytes() + recorded_head_.bytes() + wb_whole_src_.bytes() +
                      wb_whole_dst_.bytes() + wb_whole_total_.bytes() + regions_.bytes();
    for (const auto& b : owned_) n += b.bytes();
    n += row_index_.bytes() + warm_ids_.bytes() + warm_before_.bytes() + warm_tokens_.bytes() + warm_slots_.bytes() +
         warm_count_.bytes() + warm_step_slots_.bytes() + warm_step_tokens_.bytes() + warm_step_fill_slots_.bytes() +
         warm_step_counts_.bytes() + fill_src_.bytes() + fill_dst_.bytes() + fill_total_.bytes() + warmup_tally_.bytes();
    for (const Part& p : parts_) {
      n += p.lru_ids.bytes() + p.lru_slots.bytes() + p.slot_ids.bytes() + p.fill_tokens.bytes() + p.fill_slots.bytes() +
           p.counts.bytes() + p.fill_host.bytes() + p.src.bytes() + p.dst.bytes() + p.flags.bytes() +
           p.miss_offsets.bytes() + p.total.bytes();
    }
    return n;
  }

  void add_stats(OffloadStats& st, bool read_device) const override {
    st.steps = steps_;
    if (read_device) {  // the loads the device has run so far (a read on a stream of its own: no wait for the others)
      std::int64_t tally = 0;
      ESS_CUDA_CHECK(cudaMemcpyAsync(&tally, warmup_tally_.get(), 8, cudaMemcpyDeviceToHost, stats_stream_),
                     "offload: statistics");
      ESS_CUDA_CHECK(cudaStreamSynchronize(stats_stream_), "offload: statistics");
      warmup_fills_read_ = tally;
    }
    st.warmup_fills = warmup_fills_read_;
    st.swap_launches = swap_launches_;
  }

 private:
  static constexpr int kWholeGpu = 4096;  // the untimed warm-up fills take every SM

  OffloadState& x_;
  std::size_t P_ = 0, B_ = 0;
  std::int32_t rpr_ = 0;
  int max_pages_ = 0;
  std::unique_ptr<GpuSwapEngine> swap_;
  std::vector<DeviceBuffer<std::uint8_t>> owned_;
  Part parts_[Offload::kParts];
  DeviceBuffer<std::uint64_t> wb_src_, wb_dst_;
  DeviceBuffer<std::int64_t> wb_total_;
  DeviceBuffer<std::int32_t> page_table_;
  const std::uint8_t* pool_dev_ = nullptr;
  std::int64_t steps_ = 0, swap_launches_ = 0;
  mutable std::int64_t warmup_fills_read_ = 0;  // the device's warm-up tally when stats last read it
  // The lifecycle (begin, end): its stream, whether its calls return without waiting for the
  // device, the stream handoff, the release fences, the pinned staging of its uploads, and the
  // device scratch of its loads (row_index_[r] = r; one layer's windows; the warm-up's outputs;
  // one FlashTrans list; the warm-up's loads so far, read on the statistics stream).
  Stream lifecycle_ = nullptr;
  bool ordered_ = false;
  cudaEvent_t handoff_ = nullptr;
  std::map<std::uint64_t, cudaEvent_t> fences_;
  std::uint64_t fence_serial_ = 0;
  PinnedStaging staging_;
  cudaStream_t stats_stream_ = nullptr;
  DeviceBuffer<std::int32_t> row_index_, warm_ids_, warm_before_, warm_tokens_, warm_slots_, warm_count_, warm_step_slots_,
      warm_step_tokens_, warm_step_fill_slots_, warm_step_counts_;
  DeviceBuffer<std::uint64_t> fill_src_, fill_dst_;
  DeviceBuffer<std::int64_t> fill_total_, warmup_tally_;
  // Residency (not kSparse): each pool row's whole rows ([rows][max_units], -1 after them, all -1
  // when sparse), the recorded windows ([rows][layers][W][K]) and their heads ([rows][layers][2]:
  // next, count), and the write-back's second list (into whole rows).
  int max_units_ = 0;
  DeviceBuffer<std::int32_t> whole_units_, recorded_, recorded_head_;
  DeviceBuffer<std::uint64_t> wb_whole_src_, wb_whole_dst_;
  DeviceBuffer<std::int64_t> wb_whole_total_;

  // Regions: each pool row's blocks in each region group ([groups][rows][region_blocks], all -1 while it has none).
  DeviceBuffer<std::int32_t> regions_;

  // Where pool rows' rows lie in `layer`, as the kernels read it (the regions on the device).
  PoolRows pool_rows(int layer) const {
    const std::int32_t* region = regions_.get() == nullptr ? nullptr : regions_.get() + x_.region_at(x_.config.region_group_of(layer), 0);
    return PoolRows{rpr_, region, x_.config.region_blocks, x_.buffer.rows.block_rows};
  }
  bool capturing(Stream stream) const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    ESS_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status), "offload: capture status");
    return status != cudaStreamCaptureStatusNone;
  }
  // Every admitted request is whole (so no position of any step is sparse).
  bool all_whole() const {
    for (std::size_t r = 0; r < x_.request_of_row.size(); ++r) {
      if (x_.request_of_row[r] >= 0 && x_.units_of_row[r].empty()) return false;
    }
    return true;
  }
  // A lifecycle call's stream: the lifecycle stream, or (not ordered) the legacy stream once the
  // device is idle, so that no step in flight reads what the call changes.
  Stream begin() {
    if (!ordered_) ESS_CUDA_CHECK(cudaDeviceSynchronize(), "offload: waiting for the device before a lifecycle call");
    return lifecycle_;
  }
  // Its pinned staging is free once the stream passes; not ordered: waits for the device.
  template <typename... Args>
  void end(fmt::format_string<Args...> what, Args&&... args) {
    staging_.retire(lifecycle_);
    if (!ordered_) {
      ESS_CUDA_CHECK(cudaDeviceSynchronize(), "offload: {}", fmt::format(what, std::forward<Args>(args)...));
    }
  }
  // The row's whole rows into the device table (all -1 when sparse).
  void upload_units(std::int32_t row, Stream s) {
    if (whole_units_.get() == nullptr) return;
    std::int32_t* units = staging_.take<std::int32_t>(static_cast<std::size_t>(max_units_));
    std::fill(units, units + max_units_, -1);
    const auto& own = x_.units_of_row[static_cast<std::size_t>(row)];
    std::copy(own.begin(), own.end(), units);
    ESS_CUDA_CHECK(cudaMemcpyAsync(whole_units_.get() + static_cast<std::size_t>(row) * static_cast<std::size_t>(max_units_), units,
                                   static_cast<std::size_t>(max_units_) * 4, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(s)),
                   "offload: the whole rows of row {}", row);
  }
  void clear_units(std::int32_t row, Stream s) {
    if (whole_units_.get() == nullptr) return;
    ESS_CUDA_CHECK(cudaMemsetAsync(whole_units_.get() + static_cast<std::size_t>(row) * static_cast<std::size_t>(max_units_), 0xff,
                                   static_cast<std::size_t>(max_units_) * 4, static_cast<cudaStream_t>(s)),
                   "offload: the whole rows of row {}", row);
  }
  void clear_recorded(std::int32_t row, Stream s) {
    if (recorded_head_.get() == nullptr) return;
    const std::size_t n = 2 * static_cast<std::size_t>(x_.config.layers);
    ESS_CUDA_CHECK(cudaMemsetAsync(recorded_head_.get() + static_cast<std::size_t>(row) * n, 0, n * 4, static_cast<cudaStream_t>(s)),
                   "offload: the recorded windows of row {}", row);
  }
  // The list's shape for a load into `row`'s rows of `layer` (tokens and destinations to set).
  HostFillList fill_list(std::int32_t row, int layer) const {
    HostFillList f;
    f.layers = x_.config.layers;
    f.layer = layer;
    f.max_pages = max_pages_;
    f.row = row;
    f.slots = x_.config.slots;
    f.pool = pool_rows(layer);
    f.page_table = page_table_.get();
    f.page_bytes = x_.pool->page_stride();
    f.entry_bytes = x_.config.layout.bytes();
    f.buffer = x_.buffer.rows;
    f.src_offsets = fill_src_.get();
    f.dst_offsets = fill_dst_.get();
    f.total = fill_total_.get();
    return f;
  }
  // The list, then FlashTrans from the host pool into the layer's buffer (at most `max` entries).
  void load(const HostFillList& f, std::int64_t max, int layer, Stream s) {
    ESS_LAUNCH(launch_host_fill_list(f, s), "offload: the load list of layer {}", layer);
    EntryCopy copy{pool_dev_, x_.buffer.layer_base[static_cast<std::size_t>(layer)], fill_src_.get(), fill_dst_.get(), max,
                   static_cast<int>(x_.config.layout.bytes()), fill_total_.get(), kWholeGpu, 0, {}, x_.buffer.tail_of(layer)};
    ESS_LAUNCH(flashtrans_cuda(copy, s), "offload: the load of layer {}", layer);
  }
  // LRU-Warmup of every layer of `row`: layer l replays counts[l] windows of `windows`
  // ([layers][..][K], each layer's windows after the previous layer's, oldest first) on the GPU
  // swap engine, then loads the slots whose token changed from the host pool.
  void replay_windows(std::int32_t row, RequestId, std::span<const std::int32_t> windows, const std::vector<int>& counts, Stream s) {
    const OffloadConfig& c = x_.config;
    const std::size_t K = static_cast<std::size_t>(c.topk);
    if (windows.empty()) return;
    std::int32_t* staged = staging_.take<std::int32_t>(windows.size());
    std::copy(windows.begin(), windows.end(), staged);
    std::size_t at = 0;
    for (int l = 0; l < c.layers; ++l) {
      const int W = counts[static_cast<std::size_t>(l)];
      if (W <= 0) continue;
      ESS_CUDA_CHECK(cudaMemcpyAsync(warm_ids_.get(), staged + at, static_cast<std::size_t>(W) * K * 4, cudaMemcpyHostToDevice,
                                     static_cast<cudaStream_t>(s)),
                     "offload: the warm-up windows of row {} layer {}", row, l);
      at += static_cast<std::size_t>(W) * K;
      swap_->warmup_async(row, l, c.topk, row_index_.get() + row, warm_ids_.get(), W,
                          GpuSwapEngine::WarmupOut{warm_before_.get(), warm_tokens_.get(), warm_slots_.get(), warm_count_.get(),
                                                   warm_step_slots_.get(), warm_step_tokens_.get(), warm_step_fill_slots_.get(),
                                                   warm_step_counts_.get()},
                          s);
      HostFillList f = fill_list(row, l);
      f.tokens = warm_tokens_.get();
      f.token_slots = warm_slots_.get();
      f.count = warm_count_.get();
      f.max_count = c.slots;
      f.tally = warmup_tally_.get();
      load(f, c.slots, l, s);
    }
  }
};

std::unique_ptr<OffloadBackend> make_cuda_offload(OffloadState& state, bool owned) {
  return std::make_unique<CudaOffload>(state, owned);
}

[[maybe_unused]] const bool kRegistered = (register_cuda_offload(make_cuda_offload), true);

}  // namespace
}  // namespace ess::cuda
