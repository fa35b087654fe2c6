// The per-layer step on the CUDA backend (offload_cases.h, offload_residency_cases.h; the CPU backend runs the same cases;
// offload_lifecycle_cases.h: the stream-ordered lifecycle, CUDA only
// in offload_host_test.cc): every pointer of a step is device memory, the step runs on a
// stream (testing/offload_io_cuda.cc), nothing synchronizes until the outputs are
// read. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <deque>

#include "ess/runtime/backend.h"
#include "offload_cases.h"
#include "offload_lifecycle_cases.h"
#include "offload_residency_cases.h"
#include "runtime/cuda/device_buffer.h"

namespace ess::offload_test {
namespace {

std::uint8_t* cuda_allocate(std::size_t bytes) {  // cudaMalloc: 256-byte aligned
  static std::deque<cuda::DeviceBuffer<std::uint8_t>> keep;
  keep.emplace_back(bytes);
  return keep.back().get();
}

bool device_present() { return cuda_device_present(); }

}  // namespace

const OffloadHarness& harness() {
  static const OffloadHarness h{{"cuda", device_present}, Backend::kCuda, cuda_allocate};
  return h;
}

}  // namespace ess::offload_test
