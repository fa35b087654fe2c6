// The CPU "device" behind the emulated CUDA target (include/cuda_runtime.h): its memory, its
// handles and its checks. One per process; the emulated runtime API and the emulated kernel
// launchers (kernels.cc) are its only users.
//
// Memory: every allocation is host memory, aligned as CUDA's are (device memory to 256 bytes,
// pinned host memory to a page), filled with
// poison bytes (a kernel or copy that reads what nothing wrote sees garbage, as on a GPU) and
// framed by guard bytes. Guards are checked after every launch, at every synchronization and
// at free; a damaged guard, a copy whose device side leaves its allocation, an unknown or
// twice-freed pointer, or a kernel access outside every allocation fails the running test
// (gtest) and, where an API call is the culprit, returns an error as CUDA would.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>

namespace ess::emu {

class Device {
 public:
  // What the emulated device reports: an H100 SXM's limits.
  static constexpr int kSharedMemoryOptin = 232448;  // bytes per block, opt-in
  static constexpr int kSharedMemoryDefault = 49152;
  static constexpr int kMultiprocessors = 132;
  static constexpr std::size_t kDeviceAlignment = 256;  // cudaMalloc's
  static constexpr std::size_t kHostAlignment = 4096;   // cudaHostAlloc's: whole pages
  static constexpr std::uint8_t kGuardByte = 0x5c;
  static constexpr std::uint8_t kPoisonByte = 0xa5;

  enum class Kind { kDevice, kPinnedHost };
  struct Allocation {
    std::uint8_t* begin = nullptr;  // the usable bytes
    std::size_t bytes = 0;
    Kind kind = Kind::kDevice;
    std::uint64_t serial = 0;  // allocation order, for messages
    std::size_t guard() const { return kind == Kind::kDevice ? kDeviceAlignment : kHostAlignment; }
  };

  static Device& get();

  void* allocate(std::size_t bytes, Kind kind);
  // Frees what allocate(kind) returned; false (and a test failure) for anything else.
  bool release(void* p, Kind kind, const char* call);
  // The allocation holding [p, p + bytes), of any kind; nullptr if none does.
  const Allocation* find(const void* p, std::size_t bytes) const;
  // Every allocation's guards intact; fails the test naming the first damaged one.
  bool check_guards(const std::string& when);

  // A failed call: recorded as the last error, and a test failure when `bug` (a misuse that
  // a real device might not report).
  cudaError_t fail(cudaError_t e, const std::string& message, bool bug);
  cudaError_t take_last_error();
  cudaError_t peek_last_error() const { return last_error_; }

  cudaStream_t create_stream();
  bool destroy_stream(cudaStream_t s);
  bool valid_stream(cudaStream_t s) const;  // nullptr, the legacy and per-thread streams, or a live one
  cudaEvent_t create_event();
  bool destroy_event(cudaEvent_t e);
  bool valid_event(cudaEvent_t e) const;

  // Fault injection: the n-th injectable call from now (1: the next) fails with `e` (a device
  // fault, not a misuse: no test failure); 0 disarms. Injectable: allocations, copies and
  // memsets, launches, stream and event creation, records, waits and synchronizations (not
  // frees and destroys). calls() counts every injectable call made.
  void fail_call(std::uint64_t n, cudaError_t e);
  // The error the current injectable call `call` fails with, or cudaSuccess.
  cudaError_t injected(const char* call);
  std::uint64_t calls() const;
  const std::string& last_injected() const { return injected_call_; }

  int current_device() const { return current_; }
  void set_current_device(int d) { current_ = d; }
  std::uint64_t next_seed() { return ++seed_; }  // one schedule per launch
  std::size_t live_allocations() const;
  std::size_t live_device_bytes() const;  // the bytes asked for by the live device allocations

 private:
  Device() = default;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, Allocation> allocations_;  // by begin
  std::set<const void*> streams_, events_;
  std::uint64_t serial_ = 0, seed_ = 0;
  cudaError_t last_error_ = cudaSuccess;
  int current_ = 0;
  std::uint64_t calls_ = 0, fail_at_ = 0;
  cudaError_t fail_with_ = cudaSuccess;
  std::string injected_call_;
};

}  // namespace ess::emu
