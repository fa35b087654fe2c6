// The emulated CUDA target's streams and faults: work on a stream runs only when a
// synchronization needs it (streams.h, lazy orders), so a missing wait reads stale bytes; and each
// CUDA call of an engine's life fails in turn (Device::fail_call), reported by name, the engine
// unusable after, every allocation given back.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "device.h"
#include "ess/runtime/offload.h"
#include "runtime/cuda/device_buffer.h"
#include "streams.h"
#include "testing/cache_fixtures.h"
#include "testing/offload_io.h"

namespace ess::emu {
namespace {

// ---- stream order (streams.h): work runs when a synchronization needs it ----

// Sets a lazy order for one test and restores the one before.
class LazyOrder {
 public:
  explicit LazyOrder(std::uint64_t seed) : before_(stream_order()) { set_stream_order({true, seed}); }
  ~LazyOrder() { set_stream_order(before_); }

 private:
  StreamOrder before_;
};

class StreamOrderSeeds : public ::testing::TestWithParam<std::uint64_t> {};

// Stream B reads what stream A wrote: with B's wait for A's event the read sees A's bytes in
// every order; without it a lazy order has not run A's work when B is synchronized.
TEST_P(StreamOrderSeeds, WorkOnAnotherStreamIsSeenOnlyAfterItsEvent) {
  LazyOrder lazy(GetParam());
  cuda::DeviceBuffer<std::uint8_t> buf(64);
  std::uint8_t* host = nullptr;
  ASSERT_EQ(cudaHostAlloc(&host, 64, cudaHostAllocMapped), cudaSuccess);
  cudaStream_t a = nullptr, b = nullptr;
  cudaEvent_t ev = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
  for (const bool wait : {true, false}) {
    ASSERT_EQ(cudaMemsetAsync(buf.get(), wait ? 7 : 9, 64, a), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(ev, a), cudaSuccess);
    if (wait) {
      ASSERT_EQ(cudaStreamWaitEvent(b, ev, 0), cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpyAsync(host, buf.get(), 64, cudaMemcpyDeviceToHost, b), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
    // With the wait, A's 7s; without it, still the 7s of before: A's 9s have not run.
    EXPECT_EQ(host[0], 7) << (wait ? "after the wait" : "no wait");
    EXPECT_EQ(cudaStreamSynchronize(a), cudaSuccess);
  }
  std::uint8_t now = 0;
  ASSERT_EQ(cudaMemcpy(&now, buf.get(), 1, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(now, 9);  // A's work ran once its own stream was synchronized
  cudaEventDestroy(ev);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  cudaFreeHost(host);
}

// A blocking stream and the legacy stream order each other; a non-blocking stream does neither.
TEST_P(StreamOrderSeeds, TheLegacyStreamWaitsForBlockingStreamsOnly) {
  LazyOrder lazy(GetParam());
  cuda::DeviceBuffer<std::uint8_t> x(16), y(16);
  cudaStream_t blocking = nullptr, free = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&blocking, cudaStreamDefault), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&free, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(x.get(), 1, 16, blocking), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(y.get(), 2, 16, free), cudaSuccess);
  std::uint8_t hx = 0, hy = 0;
  ASSERT_EQ(cudaMemcpy(&hx, x.get(), 1, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&hy, y.get(), 1, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(hx, 1);
  EXPECT_EQ(hy, Device::kPoisonByte);  // the non-blocking stream's memset has not run
  EXPECT_GT(queued_operations(), 0u);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(queued_operations(), 0u);
  ASSERT_EQ(cudaMemcpy(&hy, y.get(), 1, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(hy, 2);
  cudaStreamDestroy(blocking);
  cudaStreamDestroy(free);
}

// The CUDA backend's DA fetch on its own stream: a consumer that waits for copy_done reads the
// host pool's entries in every order; one that forgets the wait reads rows the copy has not
// filled yet, and the test sees it.
TEST_P(StreamOrderSeeds, TheFetchOnTheCopyStreamIsReadOnlyAfterCopyDone) {
  LazyOrder lazy(GetParam());
  const int K = 16;
  OffloadConfig c;
  c.layers = 1;
  c.layout = test::small_layout();
  c.max_requests = 1;
  c.topk = K;
  c.slots = 24;
  c.max_context = 256;
  c.backend = Backend::kCuda;
  const std::size_t E = c.layout.bytes();
  for (const bool wait : {true, false}) {
    Offload o(c);
    o.admit(5, 200);
    for (std::int64_t t = 0; t < 200; ++t) std::memset(o.host_entry(5, 0, t).data(), static_cast<int>(t % 251) + 1, E);
    const auto& io = test::offload_io(Backend::kCuda);
    test::OffloadStepIn in;
    in.batch = 1;
    in.rows = {o.row(5)};
    in.lengths = {200};
    for (int i = 0; i < K; ++i) in.topk.push_back(10 * i);  // nothing resident yet: every id is fetched
    in.split = true;
    in.copy_stream = true;
    in.wait_for_copy = wait;
    const test::OffloadStepOut got = io.step(o, in);
    const std::vector<std::uint8_t>& buf = got.seen;  // read on the step's stream
    int wrong = 0;
    for (int i = 0; i < K; ++i) {
      const std::uint8_t* row = buf.data() + o.buffer().rows.offset(got.physical[static_cast<std::size_t>(i)]);
      wrong += row[0] != static_cast<std::uint8_t>((10 * i) % 251 + 1);
    }
    if (wait) {
      EXPECT_EQ(wrong, 0) << "seed " << GetParam();
    } else {
      EXPECT_EQ(wrong, K) << "seed " << GetParam() << ": without the wait the fetched rows are read before the copy";
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
}

// cudaEventQuery runs nothing: in a lazy order an event is not ready until a synchronization ran
// the work before its record; an event never recorded is ready, as CUDA's.
TEST_P(StreamOrderSeeds, AnEventQueryRunsNothing) {
  LazyOrder lazy(GetParam());
  cuda::DeviceBuffer<std::uint8_t> buf(64);
  cudaStream_t a = nullptr;
  cudaEvent_t ev = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(ev), cudaSuccess) << "never recorded";
  ASSERT_EQ(cudaMemsetAsync(buf.get(), 3, 64, a), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ev, a), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(ev), cudaErrorNotReady);
  EXPECT_EQ(cudaEventQuery(ev), cudaErrorNotReady) << "a query ran the work";
  ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(ev), cudaSuccess);
  ASSERT_EQ(cudaEventDestroy(ev), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(a), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(Lazy, StreamOrderSeeds, ::testing::Values(1u, 2u, 3u));

// ---- faults: every CUDA call of an engine's life fails in turn ----

// One engine's life on the CUDA backend, every CUDA call of it the engine's own: made, a request
// admitted, written, warmed up, grown, a step with the DA split and its fetch on a copy stream,
// the write-back, released. The step's device arrays, streams and event are the caller's, made first.
struct LifeInputs {
  explicit LifeInputs(const OffloadConfig& c)
      : rows(1), lengths(1), topk(static_cast<std::size_t>(c.query_tokens) * c.topk), physical(topk.size()),
        resident(topk.size()), fetched(topk.size()), resident_count(static_cast<std::size_t>(c.query_tokens)),
        fetched_count(resident_count.size()) {
    const std::int32_t row = 0, length = 100 + c.query_tokens;
    std::vector<std::int32_t> ids;
    for (std::size_t i = 0; i < topk.size(); ++i) ids.push_back(static_cast<std::int32_t>((i * 7) % 100));
    EXPECT_EQ(cudaMemcpy(rows.get(), &row, 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(lengths.get(), &length, 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(topk.get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  }
  ~LifeInputs() {
    cudaEventDestroy(done);
    cudaStreamDestroy(stream);
    cudaStreamDestroy(copy);
  }
  cuda::DeviceBuffer<std::int32_t> rows, lengths, topk, physical, resident, fetched, resident_count, fetched_count;
  cudaStream_t stream = nullptr, copy = nullptr;
  cudaEvent_t done = nullptr;
};

void life(std::unique_ptr<Offload>& o, const OffloadConfig& c, LifeInputs& in) {
  o = std::make_unique<Offload>(c);
  EXPECT_EQ(o->admit(5, 100), 0);
  for (std::int64_t t = 0; t < 100; ++t) std::memset(o->host_entry(5, 0, t).data(), static_cast<int>(t) + 1, c.layout.bytes());
  std::vector<std::int32_t> windows;
  for (int i = 0; i < c.layers * c.topk; ++i) windows.push_back(i % 90);
  o->warmup(5, windows, 1);
  o->extend(5, c.query_tokens);
  LayerStep s;
  s.batch = 1;
  s.rows = in.rows.get();
  s.topk = in.topk.get();
  s.lengths = in.lengths.get();
  s.physical = in.physical.get();
  s.resident = in.resident.get();
  s.fetched = in.fetched.get();
  s.resident_count = in.resident_count.get();
  s.fetched_count = in.fetched_count.get();
  s.stream = in.stream;
  s.copy_stream = in.copy;
  s.copy_done = in.done;
  o->step(s);
  WriteBack w;
  w.batch = 1;
  w.rows = in.rows.get();
  w.lengths = in.lengths.get();
  w.stream = in.stream;
  o->write_back(w);
  o->release(5);
}

// Each injectable CUDA call of that life fails in turn (an allocation, a launch, an event record
// or wait, a copy, a synchronization): the call throws ess::DeviceError or ess::OutOfMemory
// naming what failed; an engine made before it refuses every later call by name; destroying it
// gives back every allocation, and a construction that failed took nothing.
TEST(FaultInjection, EveryCudaCallOfAnEnginesLifeFailsCleanly) {
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 2;
  c.query_tokens = 2;
  c.topk = 16;
  c.slots = 40;
  c.reserve_newest = true;
  c.max_context = 256;
  c.backend = Backend::kCuda;
  Device& d = Device::get();
  LifeInputs in(c);
  const std::size_t before = d.live_allocations();
  std::uint64_t calls = 0;
  {
    std::unique_ptr<Offload> o;
    const std::uint64_t start = d.calls();
    life(o, c, in);
    calls = d.calls() - start;
  }
  ASSERT_EQ(d.live_allocations(), before);
  ASSERT_GT(calls, 20u);
  for (std::uint64_t n = 1; n <= calls; ++n) {
    SCOPED_TRACE(fmt::format("call {} of {}", n, calls));
    std::unique_ptr<Offload> o;
    d.fail_call(n, cudaErrorLaunchFailure);
    std::string message;
    bool device_error = false;
    try {
      life(o, c, in);
    } catch (const DeviceError& e) {
      message = e.what();
      device_error = true;
    } catch (const OutOfMemory& e) {
      message = e.what();
    }
    d.fail_call(0, cudaSuccess);
    (void)cudaGetLastError();
    ASSERT_FALSE(message.empty()) << "the failed " << d.last_injected() << " was not reported";
    EXPECT_NE(message.find(device_error ? "CUDA error" : "memory"), std::string::npos) << message;
    if (o != nullptr) {
      // Every later call is refused, naming itself and the first failure.
      try {
        o->admit(6, 10);
        ADD_FAILURE() << "an engine after a failed " << d.last_injected() << " admitted a request";
      } catch (const DeviceError& e) {
        EXPECT_NE(std::string(e.what()).find("admit: the engine is unusable since a device call failed"), std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
      }
      EXPECT_THROW((void)o->row(5), DeviceError);
      EXPECT_NO_THROW((void)o->stats());
    }
    o.reset();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(d.live_allocations(), before) << "after the failed " << d.last_injected();
  }
}

TEST(StreamOrder, TheOrderIsParsedAndRefusedByName) {
  EXPECT_FALSE(StreamOrder::parse("issue").lazy);
  EXPECT_EQ(StreamOrder::parse("lazy:42").seed, 42u);
  for (const char* bad : {"", "lazy", "lazy:", "lazy:-1", "lazy:x", "random:1", "lazy:123456789012345678901"}) {
    EXPECT_THROW((void)StreamOrder::parse(bad), std::invalid_argument) << bad;
  }
}

}  // namespace
}  // namespace ess::emu
