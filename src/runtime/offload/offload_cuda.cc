// Offload's CUDA backend: the GPU swap engine decides, the split turns its decision into one
// FlashTrans list (and the DA halves), FlashTrans fetches; every launch on the caller's
// stream(s), nothing allocated or synchronized inside a step. CUDA target only: it registers
// itself with the front (offload_impl.h) when the program starts, kept in every program that
// links the runtime by `--undefined=ess_cuda_offload_anchor` (src/runtime/CMakeLists.txt).
#include <cuda_runtime.h>

#include <memory>

#include "ess/core/error.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
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
    ESS_CHECK(c.residency == Residency::kSparse,
              "offload: residency {} is served by the CPU backend only; the CUDA backend keeps every request sparse",
              to_string(c.residency));
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
    wb_src_ = DeviceBuffer<std::uint64_t>(B_ * static_cast<std::size_t>(c.query_tokens));
    wb_dst_ = DeviceBuffer<std::uint64_t>(B_ * static_cast<std::size_t>(c.query_tokens));
    wb_total_ = DeviceBuffer<std::int64_t>(1);
    page_table_ = DeviceBuffer<std::int32_t>(B_ * static_cast<std::size_t>(max_pages_) * static_cast<std::size_t>(c.layers));
    ESS_CUDA_CHECK(cudaMemset(page_table_.get(), 0xff, page_table_.size() * 4), "offload: page tables");
    pool_dev_ = device_view_cuda(state.pool->base());
    ESS_CHECK(pool_dev_ != nullptr, "offload: the host pool is not mapped into the device's address space");
    ESS_CUDA_CHECK(cudaDeviceSynchronize(), "offload: set-up");
  }

  ~CudaOffload() override {
    for (Part& p : parts_) {
      if (p.decided != nullptr) cudaEventDestroy(p.decided);
    }
  }

  void admit(std::int32_t row, RequestId) override {
    swap_->reset_row(row);
    ESS_CUDA_CHECK(cudaDeviceSynchronize(), "offload: admit of row {}", row);
  }

  void release(std::int32_t row, RequestId) override {
    swap_->reset_row(row);
    ESS_CUDA_CHECK(cudaDeviceSynchronize(), "offload: release of row {}", row);
  }

  void reset(std::int32_t row, RequestId) override {
    swap_->reset_row(row);
    ESS_CUDA_CHECK(cudaDeviceSynchronize(), "offload: reset of row {}", row);
  }

  // Never called: the constructor refuses every residency but kSparse.
  void units_changed(std::int32_t, RequestId) override { ESS_ASSERT(false, "offload: whole residency on the CUDA backend"); }
  void load_whole(std::int32_t, RequestId, std::span<const std::int32_t>, int) override {
    ESS_ASSERT(false, "offload: whole residency on the CUDA backend");
  }
  void demote(std::int32_t, RequestId) override { ESS_ASSERT(false, "offload: whole residency on the CUDA backend"); }

  // New host pages: their ids for every layer, contiguous in [row][page][layer].
  void pages_added(std::int32_t row, RequestId id, std::int64_t first_page) override {
    const int L = x_.config.layers;
    const auto pages = std::ssize(x_.pool->page_table(id, 0));  // pages per layer
    if (pages <= first_page) return;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(pages - first_page) * static_cast<std::size_t>(L));
    for (int l = 0; l < L; ++l) {
      const auto table = x_.pool->page_table(id, l);  // arena pages: offset / page_stride
      for (std::int64_t p = first_page; p < pages; ++p) {
        ids[static_cast<std::size_t>(p - first_page) * L + static_cast<std::size_t>(l)] = table[static_cast<std::size_t>(p)];
      }
    }
    const std::size_t at = (static_cast<std::size_t>(row) * static_cast<std::size_t>(max_pages_) + static_cast<std::size_t>(first_page)) *
                           static_cast<std::size_t>(L);
    ESS_CUDA_CHECK(cudaMemcpy(page_table_.get() + at, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice),
                   "offload: page table of row {}", row);
    // A pageable cudaMemcpy may return before its DMA lands, on the legacy stream, which the
    // steps' non-blocking streams do not wait for: the entries are in place once it drains.
    ESS_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy), "offload: page table of row {}", row);
  }

  void warmup(std::int32_t row, RequestId id, std::span<const std::int32_t> windows, int W) override {
    const std::size_t per_layer = static_cast<std::size_t>(W) * static_cast<std::size_t>(x_.config.topk);
    for (int l = 0; l < x_.config.layers; ++l) {
      const auto w = windows.subspan(static_cast<std::size_t>(l) * per_layer, per_layer);
      const std::vector<MissEntry> fills = swap_->warmup(row, l, x_.config.topk, std::vector<std::int32_t>(w.begin(), w.end()));
      if (fills.empty()) continue;
      warmup_fills_ += static_cast<std::int64_t>(fills.size());
      std::vector<std::uint64_t> offsets(2 * fills.size());
      for (std::size_t i = 0; i < fills.size(); ++i) {
        offsets[i] = x_.pool->offset(id, l, fills[i].token);
        offsets[fills.size() + i] = x_.buffer.rows.offset(static_cast<std::int64_t>(row) * rpr_ + fills[i].slot);
      }
      DeviceBuffer<std::uint64_t> d(offsets.size());
      ESS_CUDA_CHECK(cudaMemcpy(d.get(), offsets.data(), offsets.size() * 8, cudaMemcpyHostToDevice), "offload: warm-up list");
      EntryCopy copy{pool_dev_, x_.buffer.layer_base[static_cast<std::size_t>(l)], d.get(), d.get() + fills.size(),
                     static_cast<std::int64_t>(fills.size()), static_cast<int>(x_.config.layout.bytes()), nullptr, kWholeGpu};
      ESS_LAUNCH(flashtrans_cuda(copy, nullptr), "offload: warm-up fill of row {} layer {}", row, l);
      ESS_CUDA_CHECK(cudaDeviceSynchronize(), "offload: warm-up of row {} layer {}", row, l);
    }
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
    shape.rows_per_request = rpr_;
    shape.reserve_newest = c.reserve_newest;
    shape.query_begin = s.query_begin;
    shape.query_end = s.query_end;
    shape.rows = s.rows;
    shape.topk_ids = s.topk;
    shape.lengths = s.lengths;
    // 1. The ids the LRU sees: padded positions, invalid ids and reserved newest tokens hidden.
    ESS_LAUNCH(launch_mask_ids(shape, p.lru_ids.get(), stream), "offload: masking the ids of layer {}", s.layer);
    // 2. The LRU decision for the batch.
    std::int32_t* counts = s.counts != nullptr ? s.counts : p.counts.get();
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
    // 3. Each id's slot and physical row.
    ESS_LAUNCH(launch_finalize_rows(shape, p.lru_slots.get(), p.slot_ids.get(), s.physical, stream),
               "offload: the rows of layer {}", s.layer);
    // 4. The FlashTrans list and the DA halves.
    SplitArgs sp;
    sp.batch = s.batch;
    sp.positions = static_cast<int>(P_);
    sp.rows_per_request = rpr_;
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
    // 5. The fetch, on the copy stream when there is one.
    Stream copy_stream = stream;
    if (s.copy_stream != nullptr) {
      ESS_CUDA_CHECK(cudaEventRecord(p.decided, static_cast<cudaStream_t>(stream)), "offload: event");
      ESS_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.copy_stream), p.decided, 0), "offload: event");
      copy_stream = s.copy_stream;
    }
    if (s.fetch) {
      EntryCopy copy{pool_dev_, x_.buffer.layer_base[static_cast<std::size_t>(s.layer)], p.src.get(), p.dst.get(),
                     static_cast<std::int64_t>(s.batch) * static_cast<std::int64_t>(P_),
                     static_cast<int>(x_.config.layout.bytes()), p.total.get(), c.copy_blocks};
      ESS_LAUNCH(flashtrans_cuda(copy, copy_stream), "offload: FlashTrans of layer {}", s.layer);
    }
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
    list.rows_per_request = rpr_;
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
    ESS_LAUNCH(launch_write_back_list(list, w.stream), "offload: the write-back list of layer {}", w.layer);
    EntryCopy copy{x_.buffer.layer_base[static_cast<std::size_t>(w.layer)], const_cast<std::uint8_t*>(pool_dev_),
                   wb_src_.get(), wb_dst_.get(), static_cast<std::int64_t>(w.batch) * c.query_tokens,
                   static_cast<int>(c.layout.bytes()), wb_total_.get(), c.copy_blocks};
    ESS_LAUNCH(flashtrans_cuda(copy, w.stream), "offload: write-back of layer {}", w.layer);
  }

  std::vector<std::uint8_t> read_row(int layer, std::int32_t p) const override {
    std::vector<std::uint8_t> v(x_.config.layout.bytes());
    ESS_CUDA_CHECK(cudaDeviceSynchronize(), "offload: read_row");
    ESS_CUDA_CHECK(cudaMemcpy(v.data(), x_.buffer.layer_base[static_cast<std::size_t>(layer)] + x_.buffer.rows.offset(p),
                              v.size(), cudaMemcpyDeviceToHost),
                   "offload: reading row {} of layer {}", p, layer);
    return v;
  }

  std::uint64_t device_bytes() const override {
    std::uint64_t n = swap_->device_bytes() + wb_src_.bytes() + wb_dst_.bytes() + wb_total_.bytes() + page_table_.bytes();
    for (const auto& b : owned_) n += b.bytes();
    for (const Part& p : parts_) {
      n += p.lru_ids.bytes() + p.lru_slots.bytes() + p.slot_ids.bytes() + p.fill_tokens.bytes() + p.fill_slots.bytes() +
           p.counts.bytes() + p.fill_host.bytes() + p.src.bytes() + p.dst.bytes() + p.flags.bytes() +
           p.miss_offsets.bytes() + p.total.bytes();
    }
    return n;
  }

  void add_stats(OffloadStats& st) const override {
    st.steps = steps_;
    st.warmup_fills = warmup_fills_;
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
  std::int64_t steps_ = 0, warmup_fills_ = 0;
};

std::unique_ptr<OffloadBackend> make_cuda_offload(OffloadState& state, bool owned) {
  return std::make_unique<CudaOffload>(state, owned);
}

[[maybe_unused]] const bool kRegistered = (register_cuda_offload(make_cuda_offload), true);

}  // namespace
}  // namespace ess::cuda
