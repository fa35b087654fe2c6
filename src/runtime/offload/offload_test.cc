// The per-layer step on the CUDA backend (offload_cases.h; the CPU backend runs the same cases
// in offload_host_test.cc): every pointer of a step is device memory, the step runs on a
// stream (harness/support/offload_io_cuda.cc), nothing synchronizes until the outputs are
// read. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <deque>

#include "ess/runtime/backend.h"
#include "runtime/cuda/device_buffer.h"
#include "offload_cases.h"

namespace ess::offload_test {
namespace {

LatentBuffer cuda_engine_buffer(int layers, std::int64_t rows, std::uint64_t row_stride, std::int64_t block_rows,
                                std::uint64_t block_stride) {
  static std::deque<cuda::DeviceBuffer<std::uint8_t>> keep;
  LatentBuffer b;
  b.rows.row_stride = row_stride;
  b.rows.block_rows = block_rows;
  b.rows.block_stride = block_stride;
  const std::uint64_t bytes = static_cast<std::uint64_t>((rows + block_rows - 1) / block_rows) * block_stride;
  for (int l = 0; l < layers; ++l) {
    keep.emplace_back(bytes);
    b.layer_base.push_back(keep.back().get());
  }
  return b;
}

bool device_present() { return cuda_device_present(); }

}  // namespace

const OffloadHarness& harness() {
  static const OffloadHarness h{{"cuda", device_present}, Backend::kCuda, cuda_engine_buffer};
  return h;
}

}  // namespace ess::offload_test
