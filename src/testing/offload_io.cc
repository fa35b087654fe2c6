#include "testing/offload_io.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "ess/core/error.h"

namespace ess::test {
namespace {

const OffloadIo* g_cuda_io = nullptr;  // constant-initialized: null until registered

OffloadStepOut cpu_step(Offload& o, const OffloadStepIn& in) {
  const std::size_t n = in.topk.size();
  const std::size_t rows = static_cast<std::size_t>(in.batch) * static_cast<std::size_t>(o.config().query_tokens);
  OffloadStepOut out;
  out.physical.assign(n, -7);
  out.counts.assign(2 * static_cast<std::size_t>(in.batch), -7);
  LayerStep s;
  s.layer = in.layer;
  s.batch = in.batch;
  s.rows = in.rows.data();
  s.topk = in.topk.data();
  s.lengths = in.lengths.data();
  s.physical = out.physical.data();
  s.counts = out.counts.data();
  s.query_begin = in.query_begin;
  s.query_end = in.query_end;
  if (in.split) {
    out.resident.assign(n, -7);
    out.fetched.assign(n, -7);
    out.resident_count.assign(rows, -7);
    out.fetched_count.assign(rows, -7);
    s.resident = out.resident.data();
    s.fetched = out.fetched.data();
    s.resident_count = out.resident_count.data();
    s.fetched_count = out.fetched_count.data();
  }
  o.step(s);
  return out;
}

void cpu_write_back(Offload& o, int layer, const std::vector<std::int32_t>& rows, const std::vector<std::int32_t>& lengths,
                    const std::vector<std::int32_t>& sources) {
  WriteBack w;
  w.layer = layer;
  w.batch = static_cast<int>(rows.size());
  w.rows = rows.data();
  w.lengths = lengths.data();
  w.source_rows = sources.empty() ? nullptr : sources.data();
  o.write_back(w);
}

void cpu_write_row(Offload& o, int layer, std::int32_t p, std::span<const std::uint8_t> bytes) {
  const LatentBuffer& b = o.buffer();
  const std::size_t head = b.split() ? static_cast<std::size_t>(b.tail.head_bytes) : bytes.size();
  std::memcpy(b.layer_base[static_cast<std::size_t>(layer)] + b.rows.offset(p), bytes.data(), head);
  if (b.split()) {
    std::memcpy(b.tail_base[static_cast<std::size_t>(layer)] + b.tail.rows.offset(p), bytes.data() + head,
                static_cast<std::size_t>(b.tail.bytes));
  }
}

std::vector<std::uint8_t> cpu_dump(const Offload& o, int layer) {
  const std::uint8_t* base = o.buffer().layer_base[static_cast<std::size_t>(layer)];
  return {base, base + buffer_extent(o)};
}

std::shared_ptr<std::uint8_t> cpu_allocate(std::size_t bytes) {
  void* p = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t{256});
  std::memset(p, 0, bytes);
  return {static_cast<std::uint8_t*>(p), [](std::uint8_t* q) { ::operator delete(q, std::align_val_t{256}); }};
}

const OffloadIo kCpuIo{cpu_step, cpu_write_back, cpu_write_row, cpu_dump, cpu_allocate};

}  // namespace

const OffloadIo& offload_io(Backend backend) {
  if (backend == Backend::kCpu) return kCpuIo;
  ESS_CHECK(g_cuda_io != nullptr, "the CUDA backend needs the CUDA target: this build has none (nvcc was not found)");
  return *g_cuda_io;
}

std::uint64_t buffer_extent(const Offload& o) {
  const LatentBuffer& b = o.buffer();
  const std::int64_t rows = o.config().region_blocks > 0 ? b.blocks * b.rows.block_rows
                                                         : static_cast<std::int64_t>(o.config().max_requests) * o.rows_per_request();
  std::uint64_t end = b.rows.offset(rows - 1) + b.rows.row_stride;
  if (b.split() && b.tail_base[0] >= b.layer_base[0]) {  // tails after the heads, in the same allocation
    const auto delta = static_cast<std::uint64_t>(b.tail_base[0] - b.layer_base[0]);
    end = std::max(end, delta + b.tail.rows.offset(rows - 1) + b.tail.rows.row_stride);
  }
  return end;
}

void register_cuda_offload_io(const OffloadIo* io) { g_cuda_io = io; }

}  // namespace ess::test
