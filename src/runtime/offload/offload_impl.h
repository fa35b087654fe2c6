// Internal to the runtime: what Offload's front (offload.cc: configuration, requests, rows, the
// Total Memory Pool) shares with its backends (offload_cpu.cc; offload_cuda.cc with the CUDA
// backend).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "ess/cache/total_pool.h"
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
  virtual void step(const LayerStep& s) = 0;
  virtual void write_back(const WriteBack& w) = 0;
  virtual std::vector<std::uint8_t> read_row(int layer, std::int32_t p) const = 0;
  virtual void add_stats(OffloadStats& stats) const = 0;
  virtual std::uint64_t device_bytes() const = 0;  // Offload::device_bytes
};

class Offload::Impl {
 public:
  Impl(const OffloadConfig& config, LatentBuffer buffer, HostAllocator& host);

  OffloadConfig config;
  LatentBuffer buffer;                // resolved: strides set, one base per layer
  std::unique_ptr<TotalPool> pool;
  std::vector<RequestId> request_of_row;  // -1 = free
  std::unordered_map<RequestId, std::int32_t> row_of_request;
  std::unique_ptr<OffloadBackend> backend;

  // Admission with `pool_admit` taking the host pages (all-or-nothing); returns the row.
  std::int32_t admit(RequestId id, std::int64_t prompt_length, std::int32_t wanted_row,
                     const std::function<void()>& pool_admit);
  std::int32_t find_row(RequestId id, const char* what) const;
  RequestId request_at(std::int32_t row, const char* what, int position) const;
};

// The CPU backend (offload_cpu.cc; the CUDA one, offload_cuda.cc, is reached through the backend
// table): it gets the front to read requests and the host pool from. With `owned`, the backend
// allocates the layer buffers and sets front.buffer.layer_base.
std::unique_ptr<OffloadBackend> make_cpu_offload(Offload::Impl& front, bool owned);

}  // namespace ess
