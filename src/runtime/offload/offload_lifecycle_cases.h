// The CUDA backend's stream-ordered lifecycle (Offload::set_lifecycle_stream): admissions,
// warm-ups, growth, releases, demotions and promotions enqueued on one stream with the steps
// and write-backs, nothing waited for until the end, as an engine's scheduler issues them
// between forwards. Every step's rows and the bytes a reader on that stream sees right after it
// are kept (copies on the stream into pinned memory) and checked once the stream has run: each
// id's row holds exactly the full cache's entry of its token. On the emulated target in a lazy
// stream order, work runs only when a synchronization needs it, so a lifecycle call that waited
// for the device, a load before its table upload, a host page handed on while a write-back of
// its last holder is pending, or pinned staging reused too early reads or writes other bytes.
// CUDA target only (cuda_offload_test and its emulated build); include in one source file.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "ess/runtime/offload.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "testing/backend.h"
#include "testing/cache_fixtures.h"

namespace ess::offload_test {

// One stream and what the test hands it: pinned host copies of every input (never reused),
// device copies of every step's arguments, and what each step returned, checked at the end.
class OrderedLoop {
 public:
  explicit OrderedLoop(Offload& o) : o_(o), E_(o.config().layout.bytes()) {
    ESS_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "test stream");
  }
  ~OrderedLoop() {
    cudaStreamSynchronize(s_);
    for (void* p : pinned_) cudaFreeHost(p);
    cudaStreamDestroy(s_);
  }
  OrderedLoop(const OrderedLoop&) = delete;
  OrderedLoop& operator=(const OrderedLoop&) = delete;

  cudaStream_t stream() const { return s_; }

  // The engine's KV write of a request's new token into its reserved row `t` (on the stream).
  void write_reserved(int layer, std::int32_t row, int t, RequestId id, std::int64_t token) {
    const std::int64_t p = static_cast<std::int64_t>(row) * o_.rows_per_request() + o_.config().slots + t;
    const auto e = entry_of(id, layer, token, E_);
    ESS_CUDA_CHECK(cudaMemcpyAsync(o_.buffer().layer_base[static_cast<std::size_t>(layer)] + o_.buffer().rows.offset(p), host(e), E_,
                                   cudaMemcpyHostToDevice, s_),
                   "writing a reserved row");
  }

  // A step on the stream; its rows and the layer's bytes right after it are kept for check().
  void step(int layer, const std::vector<RequestId>& ids, const std::vector<std::int32_t>& topk) {
    const int B = static_cast<int>(ids.size());
    std::vector<std::int32_t> rows, lengths;
    for (const RequestId id : ids) {
      rows.push_back(id < 0 ? -1 : o_.row(id));
      lengths.push_back(id < 0 ? 0 : static_cast<std::int32_t>(o_.length(id)));
    }
    LayerStep st;
    st.layer = layer;
    st.batch = B;
    st.rows = device(rows);
    st.topk = device(topk);
    st.lengths = device(lengths);
    st.physical = device(std::vector<std::int32_t>(topk.size(), -7));
    st.stream = s_;
    o_.step(st);
    Kept k;
    k.layer = layer;
    k.ids = ids;
    k.lengths = lengths;
    k.topk = topk;
    k.physical = back(st.physical, topk.size() * 4);
    k.bytes = extent();
    k.seen = back(o_.buffer().layer_base[static_cast<std::size_t>(layer)], k.bytes);
    kept_.push_back(std::move(k));
  }

  void write_back(int layer, const std::vector<RequestId>& ids) {
    std::vector<std::int32_t> rows, lengths;
    for (const RequestId id : ids) {
      rows.push_back(o_.row(id));
      lengths.push_back(static_cast<std::int32_t>(o_.length(id)));
    }
    WriteBack w;
    w.layer = layer;
    w.batch = static_cast<int>(ids.size());
    w.rows = device(rows);
    w.lengths = device(lengths);
    w.stream = s_;
    o_.write_back(w);
  }

  // Waits for the stream, then checks every kept step. Returns the ids checked.
  std::int64_t check() {
    ESS_CUDA_CHECK(cudaStreamSynchronize(s_), "the test stream");
    const int T = o_.config().query_tokens, K = o_.config().topk;
    std::int64_t checked = 0;
    for (std::size_t n = 0; n < kept_.size(); ++n) {
      const Kept& k = kept_[n];
      const auto* phys = static_cast<const std::int32_t*>(k.physical);
      const auto* seen = static_cast<const std::uint8_t*>(k.seen);
      for (std::size_t b = 0; b < k.ids.size(); ++b) {
        for (int i = 0; i < T * K; ++i) {
          const std::size_t at = b * static_cast<std::size_t>(T * K) + static_cast<std::size_t>(i);
          const std::int32_t id = k.topk[at];
          if (k.ids[b] < 0 || id < 0) {
            EXPECT_EQ(phys[at], -1) << "step " << n << " position " << b << " index " << i;
            continue;
          }
          const std::int32_t p = phys[at];
          if (p < 0) {
            ADD_FAILURE() << "step " << n << " position " << b << " token " << id << ": no row";
            return checked;
          }
          const auto e = entry_of(k.ids[b], k.layer, id, E_);
          if (std::memcmp(seen + o_.buffer().rows.offset(p), e.data(), E_) != 0) {
            ADD_FAILURE() << fmt::format("step {} (layer {}) position {} (request {}, {} tokens): token {} in row {} does not "
                                         "hold its entry",
                                         n, k.layer, b, k.ids[b], k.lengths[b], id, p);
            return checked;
          }
          ++checked;
        }
      }
    }
    return checked;
  }

 private:
  struct Kept {
    int layer = 0;
    std::vector<RequestId> ids;
    std::vector<std::int32_t> lengths, topk;
    void* physical = nullptr;
    void* seen = nullptr;
    std::size_t bytes = 0;
  };

  void* pinned(std::size_t bytes) {
    void* p = nullptr;
    ESS_CUDA_CHECK(cudaHostAlloc(&p, bytes + 1, cudaHostAllocDefault), "test pinned memory");
    pinned_.push_back(p);
    return p;
  }
  template <typename T>
  const T* host(const std::vector<T>& v) {
    void* p = pinned(v.size() * sizeof(T));
    std::memcpy(p, v.data(), v.size() * sizeof(T));
    return static_cast<const T*>(p);
  }
  template <typename T>
  T* device(const std::vector<T>& v) {
    buffers_.emplace_back(v.size() * sizeof(T));
    std::uint8_t* d = buffers_.back().get();
    ESS_CUDA_CHECK(cudaMemcpyAsync(d, host(v), v.size() * sizeof(T), cudaMemcpyHostToDevice, s_), "test upload");
    return reinterpret_cast<T*>(d);
  }
  // A copy of `bytes` device bytes into pinned memory, on the stream.
  void* back(const void* d, std::size_t bytes) {
    void* h = pinned(bytes);
    ESS_CUDA_CHECK(cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, s_), "test download");
    return h;
  }
  std::size_t extent() const {
    const std::int64_t rows = static_cast<std::int64_t>(o_.config().max_requests) * o_.rows_per_request();
    return static_cast<std::size_t>(o_.buffer().rows.offset(rows - 1) + E_);
  }

  Offload& o_;
  std::size_t E_;
  cudaStream_t s_ = nullptr;
  std::vector<void*> pinned_;
  std::deque<cuda::DeviceBuffer<std::uint8_t>> buffers_;
  std::vector<Kept> kept_;
};

// A stand-in for the forward in flight: work on the stream, and an event after it. pending():
// whether that work has still not run. On the emulated target in a lazy order nothing runs until a
// synchronization needs it, so a lifecycle call that waited for the device (or the stream) would
// have run it. Elsewhere the device may finish it on its own: unknown (false).
class StandInForward {
 public:
  explicit StandInForward(cudaStream_t stream) : work_(1 << 16) {
    ESS_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "event");
    ESS_CUDA_CHECK(cudaMemsetAsync(work_.get(), 1, 1 << 16, stream), "the forward");
    ESS_CUDA_CHECK(cudaEventRecord(done_, stream), "event");
  }
  ~StandInForward() { cudaEventDestroy(done_); }
  StandInForward(const StandInForward&) = delete;
  StandInForward& operator=(const StandInForward&) = delete;
  bool pending() const {
#if defined(ESS_EMULATED_CUDA)
    return cudaEventQuery(done_) == cudaErrorNotReady;
#else
    return false;
#endif
  }

 private:
  cuda::DeviceBuffer<std::uint8_t> work_;
  cudaEvent_t done_ = nullptr;
};

// Writes a prompt's entries into the host pool (the prefill's, as an engine's transfer would).
inline void write_prompt(Offload& o, RequestId id) {
  const std::size_t E = o.config().layout.bytes();
  for (int l = 0; l < o.config().layers; ++l) {
    for (std::int64_t t = 0; t < o.length(id); ++t) {
      const auto e = entry_of(id, l, t, E);
      std::memcpy(o.host_entry(id, l, t).data(), e.data(), E);
    }
  }
}

// [layers][W][K] warm-up windows over a prompt of `length` tokens.
inline std::vector<std::int32_t> prompt_windows(const OffloadConfig& c, std::int64_t length, int W, std::mt19937& rng) {
  std::vector<std::int32_t> v;
  std::uniform_int_distribution<std::int64_t> pick(0, length - 1);
  for (int i = 0; i < c.layers * W * c.topk; ++i) v.push_back(i % 5 == 4 ? -1 : static_cast<std::int32_t>(pick(rng)));
  return v;
}

// Admits request `id` with a prompt of `length` tokens, writes its entries and warms it up over W
// windows.
inline void admit_written(Offload& o, RequestId id, std::int64_t length, int W, std::mt19937& rng) {
  o.admit(id, length);
  write_prompt(o, id);
  o.warmup(id, prompt_windows(o.config(), length, W, rng), W);
}

inline OffloadConfig ordered_config(Residency residency) {
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 6;
  c.query_tokens = 2;
  c.topk = 24;
  c.slots = 64;
  c.reserve_newest = true;
  c.max_context = 1024;
  c.warmup_windows = 4;
  c.demotion_windows = 3;
  c.residency = residency;
  c.whole_headroom = 0;
  c.backend = Backend::kCuda;
  return c;
}

// One decode step of `live` on the loop: each request grows by T (its new tokens written into
// its reserved rows, as the model's KV write), every layer steps over random ids of its context
// and writes the newest entries back.
inline void decode_step(Offload& o, OrderedLoop& loop, const std::vector<RequestId>& live, std::mt19937& rng) {
  const OffloadConfig& c = o.config();
  const int T = c.query_tokens;
  for (const RequestId id : live) o.extend(id, T);
  std::vector<RequestId> batch = live;
  batch.insert(batch.begin() + static_cast<std::ptrdiff_t>(batch.size() / 2), -1);  // a padded position
  for (int l = 0; l < c.layers; ++l) {
    std::vector<std::int32_t> topk;
    for (const RequestId id : batch) {
      if (id < 0) {
        topk.insert(topk.end(), static_cast<std::size_t>(T * c.topk), -1);
        continue;
      }
      const std::int64_t len = o.length(id);
      for (int t = 0; t < T; ++t) loop.write_reserved(l, o.row(id), t, id, len - T + t);
      std::uniform_int_distribution<std::int64_t> pick(0, len - 1);
      for (int t = 0; t < T; ++t) {
        std::set<std::int32_t> ids;  // distinct within a query row
        while (static_cast<int>(ids.size()) < c.topk - 2) ids.insert(static_cast<std::int32_t>(pick(rng)));
        ids.insert(static_cast<std::int32_t>(len - 1));  // the newest token
        topk.insert(topk.end(), ids.begin(), ids.end());
        topk.insert(topk.end(), static_cast<std::size_t>(c.topk) - ids.size(), -1);
      }
    }
    loop.step(l, batch, topk);
    loop.write_back(l, live);
  }
}

class OffloadOrderedLifecycle : public testing::TestWithParam<Residency> {};

// Admissions, warm-ups, growth, a release whose row and host pages the next admission wants,
// (adaptive) whole requests demoted and promoted: all on the loop's stream, none waiting for the
// device, every step lossless.
TEST_P(OffloadOrderedLifecycle, IsLosslessAndWaitsForNothing) {
  ESS_REQUIRE_BACKEND(harness().info);
  const OffloadConfig c = ordered_config(GetParam());
  Offload o(c);
  OrderedLoop loop(o);
  o.set_lifecycle_stream(loop.stream());
  std::mt19937 rng(41);
  // A stand-in for the forward in flight, before any lifecycle call.
  const StandInForward forward(loop.stream());
  const bool pending = forward.pending();

  std::vector<RequestId> live;
  for (const RequestId id : {11, 12}) {
    admit_written(o, id, 90 + 40 * (id - 11), 3, rng);
    live.push_back(id);
  }
  if (pending) {
    EXPECT_TRUE(forward.pending()) << "an admission or warm-up waited for the forward in flight";
  }
  for (int step = 0; step < 4; ++step) decode_step(o, loop, live, rng);
  // The first request finishes; the next admissions take its row, and its host pages once the
  // write-backs still queued for it are done.
  o.release(11);
  live.erase(live.begin());
  for (const RequestId id : {13, 14, 15}) {
    admit_written(o, id, 100 + 30 * (id - 13), 2, rng);
    live.push_back(id);
  }
  for (int step = 0; step < 3; ++step) decode_step(o, loop, live, rng);
  o.release(13);  // (adaptive) frees rows: a demoted request may be promoted back
  live.erase(std::find(live.begin(), live.end(), 13));
  for (int step = 0; step < 3; ++step) decode_step(o, loop, live, rng);
  const OffloadStats st = o.stats();
  const std::int64_t checked = loop.check();
  EXPECT_GT(checked, 1000);
  if (GetParam() == Residency::kAdaptive) {
    EXPECT_GT(st.demotions, 0) << "no demotion ran";
  }
}

INSTANTIATE_TEST_SUITE_P(Residency, OffloadOrderedLifecycle, testing::Values(Residency::kSparse, Residency::kAdaptive),
                         [](const testing::TestParamInfo<Residency>& i) {
                           return i.param == Residency::kSparse ? std::string("Sparse") : std::string("Adaptive");
                         });

// A host pool with room for two requests: the third admission needs the pages of one just
// released, whose last write-backs are still queued: it waits for them, then takes the pages.
TEST(OffloadOrderedLifecycleHostPool, AnAdmissionShortOfPagesTakesAReleasedRequestsOnceItsWorkIsDone) {
  ESS_REQUIRE_BACKEND(harness().info);
  OffloadConfig c = ordered_config(Residency::kSparse);
  const std::int64_t pages_each = 4;  // 256 tokens
  c.host_bytes = static_cast<std::uint64_t>(2 * pages_each * c.layers) * 64 * c.layout.bytes();
  Offload o(c);
  OrderedLoop loop(o);
  o.set_lifecycle_stream(loop.stream());
  std::mt19937 rng(43);
  std::vector<RequestId> live;
  for (const RequestId id : {21, 22}) {
    admit_written(o, id, 200, 2, rng);
    live.push_back(id);
  }
  for (int step = 0; step < 3; ++step) decode_step(o, loop, live, rng);
  const std::uint64_t held = o.stats().host_bytes_used;  // both requests' pages: the whole pool
  o.release(21);
  live.erase(live.begin());
  o.admit(23, 200);  // only the released request's pages are free
  EXPECT_LE(o.stats().host_bytes_used, held) << "the released pages were not reused";
  write_prompt(o, 23);
  o.warmup(23, prompt_windows(c, 200, 2, rng), 2);
  live.push_back(23);
  for (int step = 0; step < 3; ++step) decode_step(o, loop, live, rng);
  EXPECT_GT(loop.check(), 500);
  EXPECT_THROW(o.admit(24, 300), Error);  // no room even after every release: refused, nothing taken
}

// The prefix cache under an ordered lifecycle evolves as under a waiting one: a finished request's
// published prefix stays retained while an admission short of pages can take those of a request
// released earlier whose work is still queued (it waits for that work rather than evict).
TEST(OffloadOrderedLifecycleHostPool, KeepsARetainedPrefixWhileAReleasedRequestsPagesWouldDo) {
  ESS_REQUIRE_BACKEND(harness().info);
  OffloadConfig c = ordered_config(Residency::kSparse);
  c.host_bytes = static_cast<std::uint64_t>(8 * c.layers) * 64 * c.layout.bytes();  // 8 pages per layer
  Offload o(c);
  OrderedLoop loop(o);
  o.set_lifecycle_stream(loop.stream());
  std::mt19937 rng(59);
  std::vector<std::int32_t> prompt(256);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(1000 + 7 * i);
  // A request whose prompt's first 3 pages are published, then finished: they stay retained.
  EXPECT_EQ(o.admit_cached(51, prompt).reused_tokens, 0);
  write_prompt(o, 51);
  EXPECT_EQ(o.publish(51, prompt), 3);
  o.release(51);
  ESS_CUDA_CHECK(cudaStreamSynchronize(loop.stream()), "the device catching up");
  // Another request decodes, then finishes with its last write-backs queued.
  admit_written(o, 52, 200, 2, rng);  // 4 pages
  decode_step(o, loop, {52}, rng);
  o.release(52);
  const std::uint64_t retained = static_cast<std::uint64_t>(3 * c.layers) * 64 * c.layout.bytes();
  // 4 pages: fewer are free until the released request's pages are, and the retained prefix could
  // be evicted for them; a waiting lifecycle would have had them free.
  admit_written(o, 53, 200, 2, rng);
  EXPECT_EQ(o.stats().host_bytes_retained, retained) << "the retained prefix was evicted";
  EXPECT_EQ(o.admit_cached(54, prompt).reused_tokens, 192);
  decode_step(o, loop, {53}, rng);
  EXPECT_GT(loop.check(), 50);
}

// An engine that numbers requests by their slot (SGLang's req_pool_idx) admits an id again right
// after releasing it: the released request's pages wait under another id, and nothing waits for the
// forward in flight.
TEST(OffloadOrderedLifecycleReuse, AnIdReleasedAndAdmittedAgainWaitsForNothing) {
  ESS_REQUIRE_BACKEND(harness().info);
  const OffloadConfig c = ordered_config(Residency::kSparse);
  Offload o(c);
  OrderedLoop loop(o);
  o.set_lifecycle_stream(loop.stream());
  std::mt19937 rng(53);
  admit_written(o, 41, 120, 2, rng);
  decode_step(o, loop, {41}, rng);
  const StandInForward forward(loop.stream());
  const bool pending = forward.pending();
  o.release(41);
  admit_written(o, 41, 90, 2, rng);  // the same id, another prompt
  // Bad input the host pool refuses (a shared prefix longer than the prompt) waits for nothing either.
  EXPECT_THROW(o.admit_shared(42, 50, 41, 60), Error);
  if (pending) {
    EXPECT_TRUE(forward.pending()) << "admitting a released id again, or a refused admission, waited for the forward "
                                      "in flight";
  }
  decode_step(o, loop, {41}, rng);
  EXPECT_GT(loop.check(), 50);
  EXPECT_EQ(o.stats().requests, 1);
}

// Speculative decoding's take-back on the ordered stream: the rejected tokens' entries are
// zeroed once the write-back that wrote them has run, and a released request's pages stay out of
// reach until then.
TEST(OffloadOrderedLifecycleTruncate, TakesBackAfterTheQueuedWriteBack) {
  ESS_REQUIRE_BACKEND(harness().info);
  const OffloadConfig c = ordered_config(Residency::kSparse);
  Offload o(c);
  OrderedLoop loop(o);
  o.set_lifecycle_stream(loop.stream());
  std::mt19937 rng(47);
  admit_written(o, 31, 150, 2, rng);
  decode_step(o, loop, {31}, rng);
  o.truncate(31, o.length(31) - 1);  // the last draft token rejected
  const std::size_t E = c.layout.bytes();
  for (int l = 0; l < c.layers; ++l) {
    const auto kept = o.host_entry(31, l, o.length(31) - 1);
    const auto want = entry_of(31, l, o.length(31) - 1, E);
    EXPECT_EQ(0, std::memcmp(kept.data(), want.data(), E)) << "layer " << l << ": the kept token's entry";
  }
  decode_step(o, loop, {31}, rng);
  EXPECT_GT(loop.check(), 50);
}

}  // namespace ess::offload_test
