#include "device.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>

namespace ess::emu {

// Never destroyed: device memory held by statics is freed after every other static's end.
Device& Device::get() {
  static Device* const d = new Device;
  return *d;
}

void* Device::allocate(std::size_t bytes, Kind kind) {
  const std::size_t guard = kind == Kind::kDevice ? kDeviceAlignment : kHostAlignment;
  const std::size_t body = (bytes + guard - 1) / guard * guard;
  auto* raw = static_cast<std::uint8_t*>(std::aligned_alloc(guard, body + 2 * guard));
  if (raw == nullptr) return nullptr;
  std::memset(raw, kGuardByte, guard);
  std::memset(raw + guard, kPoisonByte, bytes);
  std::memset(raw + guard + bytes, kGuardByte, body - bytes + guard);
  std::lock_guard lock(mu_);
  Allocation a{raw + guard, bytes, kind, ++serial_};
  allocations_[reinterpret_cast<std::uintptr_t>(a.begin)] = a;
  return a.begin;
}

namespace {

std::string describe(const Device::Allocation& a) {
  return std::string(a.kind == Device::Kind::kDevice ? "device" : "pinned host") + " allocation #" +
         std::to_string(a.serial) + " of " + std::to_string(a.bytes) + " bytes";
}

// The first damaged guard byte's offset from the allocation's start, or 0 when intact.
std::ptrdiff_t damage(const Device::Allocation& a) {
  const std::size_t guard = a.guard();
  const std::size_t body = (a.bytes + guard - 1) / guard * guard;
  const std::uint8_t* before = a.begin - guard;
  for (std::size_t i = 0; i < guard; ++i) {
    if (before[i] != Device::kGuardByte) return -static_cast<std::ptrdiff_t>(guard - i);
  }
  for (std::size_t i = a.bytes; i < body + guard; ++i) {
    if (a.begin[i] != Device::kGuardByte) return static_cast<std::ptrdiff_t>(i);
  }
  return 0;
}

}  // namespace

bool Device::release(void* p, Kind kind, const char* call) {
  if (p == nullptr) return true;
  Allocation a;
  {
    std::lock_guard lock(mu_);
    const auto it = allocations_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == allocations_.end() || it->second.kind != kind) {
      ADD_FAILURE() << call << "(" << p << "): not the start of a live "
                    << (kind == Kind::kDevice ? "device" : "pinned host") << " allocation (freed twice, or never allocated)";
      return false;
    }
    a = it->second;
    allocations_.erase(it);
  }
  if (const std::ptrdiff_t d = damage(a); d != 0) {
    ADD_FAILURE() << call << ": " << describe(a) << " was written out of range, at byte " << d;
  }
  std::free(a.begin - a.guard());
  return true;
}

const Device::Allocation* Device::find(const void* p, std::size_t bytes) const {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard lock(mu_);
  auto it = allocations_.upper_bound(a);
  if (it == allocations_.begin()) return nullptr;
  --it;
  const Allocation& r = it->second;
  const auto begin = reinterpret_cast<std::uintptr_t>(r.begin);
  return a >= begin && bytes <= r.bytes && a - begin <= r.bytes - bytes ? &r : nullptr;
}

bool Device::check_guards(const std::string& when) {
  std::lock_guard lock(mu_);
  for (const auto& [begin, a] : allocations_) {
    if (const std::ptrdiff_t d = damage(a); d != 0) {
      ADD_FAILURE() << when << ": " << describe(a) << " was written out of range, at byte " << d;
      return false;
    }
  }
  return true;
}

std::size_t Device::live_allocations() const {
  std::lock_guard lock(mu_);
  return allocations_.size();
}

std::size_t Device::live_device_bytes() const {
  std::lock_guard lock(mu_);
  std::size_t n = 0;
  for (const auto& [begin, a] : allocations_) n += a.kind == Kind::kDevice ? a.bytes : 0;
  return n;
}

cudaError_t Device::fail(cudaError_t e, const std::string& message, bool bug) {
  if (bug) ADD_FAILURE() << "emulated CUDA: " << message;
  std::lock_guard lock(mu_);
  last_error_ = e;
  return e;
}

void Device::fail_call(std::uint64_t n, cudaError_t e) {
  std::lock_guard lock(mu_);
  fail_at_ = n == 0 ? 0 : calls_ + n;
  fail_with_ = e;
}

cudaError_t Device::injected(const char* call) {
  std::lock_guard lock(mu_);
  if (++calls_ != fail_at_) return cudaSuccess;
  fail_at_ = 0;
  injected_call_ = call;
  const std::string_view c(call);
  last_error_ = c == "cudaMalloc" || c == "cudaHostAlloc" ? cudaErrorMemoryAllocation : fail_with_;
  return last_error_;
}

std::uint64_t Device::calls() const {
  std::lock_guard lock(mu_);
  return calls_;
}

cudaError_t Device::take_last_error() {
  std::lock_guard lock(mu_);
  return std::exchange(last_error_, cudaSuccess);
}

cudaStream_t Device::create_stream() {
  auto* s = reinterpret_cast<cudaStream_t>(new std::uint64_t(0));
  std::lock_guard lock(mu_);
  streams_.insert(s);
  return s;
}

bool Device::destroy_stream(cudaStream_t s) {
  std::lock_guard lock(mu_);
  if (streams_.erase(s) == 0) return false;
  delete reinterpret_cast<std::uint64_t*>(s);
  return true;
}

bool Device::valid_stream(cudaStream_t s) const {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return true;
  std::lock_guard lock(mu_);
  return streams_.count(s) != 0;
}

cudaEvent_t Device::create_event() {
  auto* e = reinterpret_cast<cudaEvent_t>(new std::uint64_t(0));
  std::lock_guard lock(mu_);
  events_.insert(e);
  return e;
}

bool Device::destroy_event(cudaEvent_t e) {
  std::lock_guard lock(mu_);
  if (events_.erase(e) == 0) return false;
  delete reinterpret_cast<std::uint64_t*>(e);
  return true;
}

bool Device::valid_event(cudaEvent_t e) const {
  std::lock_guard lock(mu_);
  return events_.count(e) != 0;
}

}  // namespace ess::emu
