// offload_io.h's CUDA calls: device copies of the host arrays, one stream per call. They
// register themselves when the program starts (CUDA target, or the emulated CUDA target); a
// program that links ess_testing keeps this object through `--undefined=ess_testing_cuda_anchor`
// (src/testing/CMakeLists.txt).
#include <cuda_runtime_api.h>

#include <memory>
#include <optional>

#include "testing/device_io.h"
#include "testing/offload_io.h"

extern "C" {
extern const int ess_testing_cuda_anchor;
const int ess_testing_cuda_anchor = 1;
}

namespace ess::test {
namespace {

// A stream for one call, destroyed with it.
class CallStream {
 public:
  CallStream() { ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "offload io: stream"); }
  ~CallStream() { cudaStreamDestroy(s_); }
  CallStream(const CallStream&) = delete;
  CallStream& operator=(const CallStream&) = delete;
  cudaStream_t get() const { return s_; }
  void sync(const char* what) const { ESS_CUDA_CHECK(cudaStreamSynchronize(s_), "offload io: {}", what); }

 private:
  cudaStream_t s_ = nullptr;
};

OffloadStepOut cuda_step(Offload& o, const OffloadStepIn& in) {
  const std::size_t n = in.topk.size();
  const std::size_t rows = static_cast<std::size_t>(in.batch) * static_cast<std::size_t>(o.config().query_tokens);
  const auto d_rows = upload(in.rows), d_topk = upload(in.topk), d_len = upload(in.lengths);
  auto d_phys = upload(std::vector<std::int32_t>(n, -7)), d_counts = upload(std::vector<std::int32_t>(2 * static_cast<std::size_t>(in.batch), -7));
  auto d_res = upload(std::vector<std::int32_t>(n, -7)), d_fet = upload(std::vector<std::int32_t>(n, -7));
  auto d_rc = upload(std::vector<std::int32_t>(rows, -7)), d_fc = upload(std::vector<std::int32_t>(rows, -7));
  CallStream stream;
  LayerStep s;
  s.layer = in.layer;
  s.batch = in.batch;
  s.rows = d_rows.get();
  s.topk = d_topk.get();
  s.lengths = d_len.get();
  s.physical = d_phys.get();
  s.counts = d_counts.get();
  s.query_begin = in.query_begin;
  s.query_end = in.query_end;
  if (in.split) {
    s.resident = d_res.get();
    s.fetched = d_fet.get();
    s.resident_count = d_rc.get();
    s.fetched_count = d_fc.get();
  }
  s.stream = stream.get();
  std::optional<CallStream> copy;
  cudaEvent_t done = nullptr;
  if (in.copy_stream) {
    copy.emplace();
    ESS_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "offload io: event");
    s.copy_stream = copy->get();
    s.copy_done = done;
  }
  o.step(s);
  OffloadStepOut out;
  if (in.copy_stream) {
    if (in.wait_for_copy) ESS_CUDA_CHECK(cudaStreamWaitEvent(stream.get(), done, 0), "offload io: waiting for the copy");
    // What attention on the step's stream would read: the layer's rows, taken on that stream.
    out.seen.resize(buffer_extent(o));
    ESS_CUDA_CHECK(cudaMemcpyAsync(out.seen.data(), o.buffer().layer_base[static_cast<std::size_t>(in.layer)], out.seen.size(),
                                   cudaMemcpyDeviceToHost, stream.get()),
                   "offload io: reading layer {} on the step's stream", in.layer);
  }
  // Only the step's stream: what it did not wait for may still be pending.
  stream.sync("step");
  if (done != nullptr) cudaEventDestroy(done);
  out.physical = download(d_phys);
  out.counts = download(d_counts);
  if (in.split) {
    out.resident = download(d_res);
    out.fetched = download(d_fet);
    out.resident_count = download(d_rc);
    out.fetched_count = download(d_fc);
  }
  return out;
}

void cuda_write_back(Offload& o, int layer, const std::vector<std::int32_t>& rows, const std::vector<std::int32_t>& lengths,
                     const std::vector<std::int32_t>& sources) {
  const auto d_rows = upload(rows), d_len = upload(lengths), d_src = upload(sources);
  CallStream stream;
  WriteBack w;
  w.layer = layer;
  w.batch = static_cast<int>(rows.size());
  w.rows = d_rows.get();
  w.lengths = d_len.get();
  w.source_rows = sources.empty() ? nullptr : d_src.get();
  w.stream = stream.get();
  o.write_back(w);
  stream.sync("write-back");
}

void cuda_write_row(Offload& o, int layer, std::int32_t p, std::span<const std::uint8_t> bytes) {
  const LatentBuffer& b = o.buffer();
  const std::size_t head = b.split() ? static_cast<std::size_t>(b.tail.head_bytes) : bytes.size();
  ESS_CUDA_CHECK(cudaMemcpy(b.layer_base[static_cast<std::size_t>(layer)] + b.rows.offset(p), bytes.data(), head,
                            cudaMemcpyHostToDevice),
                 "offload io: writing row {} of layer {}", p, layer);
  if (b.split()) {
    ESS_CUDA_CHECK(cudaMemcpy(b.tail_base[static_cast<std::size_t>(layer)] + b.tail.rows.offset(p), bytes.data() + head,
                              static_cast<std::size_t>(b.tail.bytes), cudaMemcpyHostToDevice),
                   "offload io: writing the tail of row {} of layer {}", p, layer);
  }
  // The pageable copy's DMA may land after cudaMemcpy returns (legacy stream; non-blocking
  // streams do not wait for it).
  ESS_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy), "offload io: writing row {} of layer {}", p, layer);
}

std::vector<std::uint8_t> cuda_dump(const Offload& o, int layer) {
  std::vector<std::uint8_t> v(buffer_extent(o));
  ESS_CUDA_CHECK(cudaMemcpy(v.data(), o.buffer().layer_base[static_cast<std::size_t>(layer)], v.size(), cudaMemcpyDeviceToHost),
                 "offload io: reading the buffer of layer {}", layer);
  return v;
}

std::shared_ptr<std::uint8_t> cuda_allocate(std::size_t bytes) {
  void* p = nullptr;
  ESS_CUDA_CHECK(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "offload io: allocating {} bytes", bytes);
  if (const cudaError_t e = cudaMemset(p, 0, bytes); e != cudaSuccess) {
    cudaFree(p);
    ESS_CUDA_CHECK(e, "offload io: zeroing {} bytes", bytes);
  }
  return {static_cast<std::uint8_t*>(p), [](std::uint8_t* q) { cudaFree(q); }};
}

const OffloadIo kCudaIo{cuda_step, cuda_write_back, cuda_write_row, cuda_dump, cuda_allocate};
[[maybe_unused]] const bool kRegistered = (register_cuda_offload_io(&kCudaIo), true);

}  // namespace
}  // namespace ess::test
