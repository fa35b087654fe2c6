// Internal to the runtime: what Offload's front (offload.cc: configuration, requests, rows, the
// Total Memory Pool) shares with its backends (offload_cpu.cc; offload_cuda.cc with the CUDA
// backend): the state they read (OffloadState, offload_state.cc), and the interface the front
// calls. The front owns a backend; a backend never calls the front.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "ess/cache/total_pool.h"
#include "ess/core/error.h"
#include "ess/runtime/offload.h"

namespace ess {

// One backend of the step (the front validates what it can before calling any of these).
class OffloadBackend {
 public:
  virtual ~OffloadBackend() = default;
  // A fresh LRU in every layer of `row` for the admitted request `id`.
  virtual void admit(std::int32_t row, RequestId id) = 0;
  virtual void release(std::int32_t row, RequestId id) = 0;
  // Every layer of `row` back to a fresh LRU; the request stays admitted.
  virtual void reset(std::int32_t row, RequestId id) = 0;
  // The request's host pages changed (admit, extend): pages [first_page, pages) are new.
  virtual void pages_added(std::int32_t row, RequestId id, std::int64_t first_page) = 0;
  // windows: [layers][W][K], the last W prefill positions to replay.
  virtual void warmup(std::int32_t row, RequestId id, std::span<const std::int32_t> windows, int W) = 0;
  // reserve_newest: the request's newest min(T, length) entries from the host pool into its
  // reserved rows (token length - T + t in reserved row t), as a step at that length reads them.
  virtual void load_newest(std::int32_t row, RequestId id) = 0;
  // Residency (OffloadState::units_of_row). The whole request at `row` now takes the pool rows
  // units_of_row[row] (it became whole, or grew): tables only, nothing is copied.
  virtual void units_changed(std::int32_t row, RequestId id) = 0;
  // Every entry of the whole request at `row`, from the host pool into its rows; the windows it
  // records for a later demotion start as `windows` ([layers][W][K], oldest first; W may be 0).
  virtual void load_whole(std::int32_t row, RequestId id, std::span<const std::int32_t> windows, int W) = 0;
  // The request at `row` was whole and is sparse now (units_of_row[row] is empty): every layer's
  // LRU becomes LRU-Warmup over the windows it recorded while whole, loaded from the host pool.
  virtual void demote(std::int32_t row, RequestId id) = 0;
  // Regions: the request at `row` was placed in a new region (OffloadState::region): every
  // layer's LRU fresh, as reset, and its rows read through the new region from now on.
  virtual void placed(std::int32_t row, RequestId id) = 0;
  // The lifecycle calls' device work from now on: enqueued on `stream` and not waited for
  // (ordered), or waited for by each call (the default). A backend without a device ignores it.
  virtual void set_lifecycle_stream(cuda::Stream, bool) {}
  // A mark after the lifecycle work enqueued so far; 0 when none can be pending (each call waited).
  virtual std::uint64_t fence() { return 0; }
  // Whether the work before `fence` has run (never waits; a passed fence is forgotten), and a wait for it.
  virtual bool fence_passed(std::uint64_t) { return true; }
  virtual void wait_fence(std::uint64_t) {}
  virtual void step(const LayerStep& s) = 0;
  virtual void write_back(const WriteBack& w) = 0;
  virtual std::vector<std::uint8_t> read_row(int layer, std::int32_t p) const = 0;
  // `read_device`: false once the engine is unusable (the counters last read from the device, then).
  virtual void add_stats(OffloadStats& stats, bool read_device) const = 0;
  virtual std::uint64_t device_bytes() const = 0;  // Offload::device_bytes
};

// What the front keeps and its backends read: the configuration, the layer buffers, the host
// pool, and which request holds each pool row. Only the front changes it (a backend that
// allocates the layer buffers sets their bases once, when it is made).
struct OffloadState {
  OffloadConfig config;
  LatentBuffer buffer;                // resolved: strides set, one base per layer
  std::unique_ptr<TotalPool> pool;
  std::vector<RequestId> request_of_row;  // -1 = free
  std::unordered_map<RequestId, std::int32_t> row_of_request;
  // Residency. units_of_row[r]: the pool rows of the whole request whose own row is r, r first,
  // each holding `slots` of its tokens in order; empty while that request is sparse (or r is not
  // a request's own row). borrower_of_row[r]: the own row of the whole request that borrows r, -1
  // when none does. A row is free when it holds no request and no whole request borrows it.
  std::vector<std::vector<std::int32_t>> units_of_row;
  std::vector<std::int32_t> borrower_of_row;
  // Regions (config.region_blocks > 0): region[(g x max_requests + r) x region_blocks ..] the blocks
  // of pool row r's rows in region group g (all -1 until placed, and once released); row_of_block[k]
  // the pool row whose regions hold buffer block k, -1 when none do. Empty without regions.
  std::vector<std::int32_t> region;
  std::vector<std::int32_t> row_of_block;

  // Where pool row `row`'s region of group g starts in `region` (and in the CUDA backend's copy of it).
  std::size_t region_at(int g, std::int32_t row) const {
    return (static_cast<std::size_t>(g) * static_cast<std::size_t>(config.max_requests) + static_cast<std::size_t>(row)) *
           static_cast<std::size_t>(config.region_blocks);
  }
  // Where pool rows' rows lie in `layer`, reading `region` (host memory).
  PoolRows pool_rows(int layer) const {
    return PoolRows{config.rows_per_request(),
                    region.empty() ? nullptr : region.data() + region_at(config.region_group_of(layer), 0),
                    config.region_blocks, buffer.rows.block_rows};
  }
  // The buffer rows a layer holds: max_requests x rows_per_request, or the caller's blocks with regions.
  std::int64_t buffer_rows() const;
  // With regions, throws naming `what`, the request and its row unless the request was placed.
  void check_placed(std::int32_t row, RequestId id, const char* what) const;

  bool whole(std::int32_t row) const { return !units_of_row[static_cast<std::size_t>(row)].empty(); }
  bool row_free(std::int32_t row) const {
    return request_of_row[static_cast<std::size_t>(row)] < 0 && borrower_of_row[static_cast<std::size_t>(row)] < 0;
  }
  std::int32_t free_rows() const;

  // The pool row of an admitted request; throws naming `what` when it is not admitted.
  std::int32_t find_row(RequestId id, const char* what) const;
  // The request at pool row `row`, which batch position `position` names; throws naming them
  // when the row is out of range or free.
  RequestId request_at(std::int32_t row, const char* what, int position) const;
  // A step's length of a request against what it holds: equal, or on foreign pages from 1 to it (the
  // other engine may give the pages of tokens its device has not confirmed yet; a step reads the first
  // `length`). Throws naming the call (`what`, of `layer` when >= 0), the position, the request and both lengths.
  void check_step_length(const char* what, int layer, int position, RequestId id, std::int64_t length) const;
  // Whether batch position `position` is padding (row -1); any other negative row throws, naming
  // `what`, the position and the row.
  bool padding(std::int32_t row, const char* what, int position) const;
  // Row p of a layer of a buffer in host memory (the CPU backend's): an entry (layout.bytes()) into
  // it, or out of it, in two parts when the buffer is split (the bytes of `entry` after a split
  // entry's tail are neither copied into the row nor overwritten from it).
  void put_row(int layer, std::int32_t p, std::span<const std::uint8_t> entry) const;
  void get_row(int layer, std::int32_t p, std::span<std::uint8_t> entry) const;
};

class Offload::Impl : public OffloadState {
 public:
  Impl(const OffloadConfig& config, LatentBuffer buffer, HostAllocator& host);

  std::unique_ptr<OffloadBackend> backend;

  // The first device failure of a backend call (its device state may be half-updated): from then
  // on every call is refused, naming it. Empty while the engine is usable.
  mutable std::string broken;
  // Throws ess::DeviceError naming `call` and that failure once the engine is unusable.
  void usable(const char* call) const;
  // Runs a backend call; a DeviceError or OutOfMemory from it makes the engine unusable.
  template <typename F>
  decltype(auto) device(const char* call, F&& f) const {
    try {
      return f();
    } catch (const DeviceError& e) {
      if (broken.empty()) broken = fmt::format("{}: {}", call, e.what());
      throw;
    } catch (const OutOfMemory& e) {
      if (broken.empty()) broken = fmt::format("{}: {}", call, e.what());
      throw;
    }
  }

  // Released requests whose host pages wait for the lifecycle work before their release (an
  // ordered lifecycle stream: a write-back or fetch enqueued earlier may still touch them).
  struct Retiring {
    RequestId id = -1;
    std::uint64_t fence = 0;
  };
  std::vector<Retiring> retiring;
  RequestId retired_serial = 0;  // retiring requests are renamed -1, -2, ...: their ids are free at once
  // Hands the released request's host pages back to the pool, now or once its fence has passed.
  void retire_host(RequestId id);
  // Releases the host pages of retiring requests whose fence has passed; `wait`: of all of them.
  void reap(bool wait);
  // Runs a host pool change that takes pages; when it is refused and requests are retiring,
  // waits for them, releases their pages and runs it once more.
  void with_retired_pages(const std::function<void()>& take);

  // Admission with `pool_admit` taking the host pages (all-or-nothing); returns the row.
  std::int32_t admit(RequestId id, std::int64_t prompt_length, std::int32_t wanted_row,
                     const std::function<void()>& pool_admit);

  // Regions: the blocks of `row`'s region are free again, and it has none.
  void free_region(std::int32_t row);

  // Residency (offload_residency.cc).
  std::int64_t demotions = 0, promotions = 0;
  // The whole request borrowing the most rows (ties: the highest own row), -1 when none borrows any.
  std::int32_t demotion_victim() const;
  // The whole request at `row` borrows the `n` highest free rows (kept clear of the lowest, which
  // admissions take first); give_back: its borrowed rows are free again, and it holds none.
  void borrow(std::int32_t row, std::int32_t n);
  void give_back(std::int32_t row);
  // The whole request at `row` becomes sparse; its borrowed rows are free again.
  void demote(std::int32_t row);
  // The request at `row` becomes whole on its row and `extra` borrowed ones; `load`: its entries
  // are copied in now.
  void make_whole(std::int32_t row, std::int32_t extra, bool load);
  // Before a whole request at `row` grows to `length` tokens: kWhole refuses, naming `what`, when
  // the rows it lacks are not free (kAdaptive demotes it then, in grow_whole).
  void check_growth(std::int32_t row, std::int64_t length, const char* what) const;
  // After it grew: borrows the rows it lacks, or is demoted when they are not free.
  void grow_whole(std::int32_t row, std::int64_t length);
  // kAdaptive, after a release: sparse requests made whole while rows stay free beyond the
  // headroom, the fewest rows first.
  void promote_waiting();
};

// A backend reads the requests and the host pool from the front's state. With `owned`, it
// allocates the layer buffers and sets state.buffer.layer_base.
using OffloadBackendFactory = std::unique_ptr<OffloadBackend> (*)(OffloadState& state, bool owned);
// The CPU backend (offload_cpu.cc).
std::unique_ptr<OffloadBackend> make_cpu_offload(OffloadState& state, bool owned);
// The CUDA backend (offload_cuda.cc) registers its factory once, before main; nullptr without it.
void register_cuda_offload(OffloadBackendFactory make);
OffloadBackendFactory cuda_offload_factory();

}  // namespace ess
