// Kernel tests written once and run on two backends.
//
// Each op's cases live in <op>_cases.h against a small backend interface: what the op
// computes, given a problem built on the host. Two binaries include the same cases:
//   cuda_<op>_test       the device backend (the CUDA launchers); ctest label `gpu`; every
//                        case skips itself without a device;
//   cuda_<op>_host_test  the CPU backend (the reference kernels standing in for the device);
//                        label `unit`, so every CI run executes it, ASan build included.
// The host run therefore executes everything a GPU run does except the launches: problem
// construction (pools, layouts, page tables), the reference values, the launchers' argument
// checks (launch_args.h) and the test's own assertions, against the reference's output.
// A mistake there fails on a CPU machine instead of costing scarce GPU time.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>

namespace ess::test {

// An address with cudaMalloc's alignment (256 bytes), for the pointers of a launch whose
// arguments a host run checks (launch_args.h); never read or written.
template <typename T>
T* device_pointer() {
  alignas(256) static const std::uint8_t kAddress[256] = {};
  return reinterpret_cast<T*>(const_cast<std::uint8_t*>(kAddress));
}

struct BackendInfo {
  const char* name;   // "cuda" or "cpu-reference"
  bool (*available)();  // a device is present (always true for the CPU backend)
};

}  // namespace ess::test

// Skips the case when the backend cannot run here (the device backend without a device).
#define ESS_REQUIRE_BACKEND(info)                                                         \
  do {                                                                                    \
    if (!(info).available()) GTEST_SKIP() << (info).name << ": no CUDA device present";   \
  } while (0)
