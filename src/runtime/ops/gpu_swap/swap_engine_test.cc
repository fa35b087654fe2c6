// The GPU swap engine on the device (swap_engine_cases.h; the host run of the same cases is
// swap_engine_host_test.cc). Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <memory>

#include "ess/runtime/backend.h"
#include "runtime/ops/gpu_swap/swap_engine_gpu.h"
#include "swap_engine_cases.h"

namespace ess::swap_test {
namespace {

class DeviceEngine final : public EngineUnderTest {
 public:
  explicit DeviceEngine(const cuda::GpuSwapConfig& c) : engine_(c) {}
  cuda::GpuSwapEngine::HostResult step(int layer, const std::vector<std::int32_t>& rows, int T, int K,
                                       const std::vector<std::int32_t>& ids) override {
    return engine_.step(layer, rows, T, K, ids);
  }
  std::vector<MissEntry> warmup(int row, int layer, int K, const std::vector<std::int32_t>& windows) override {
    return engine_.warmup(row, layer, K, windows);
  }
  cuda::GpuSwapEngine::HostState download(int row, int layer) override { return engine_.download(row, layer); }

 private:
  cuda::GpuSwapEngine engine_;
};

std::unique_ptr<EngineUnderTest> make_device(const cuda::GpuSwapConfig& c) { return std::make_unique<DeviceEngine>(c); }
bool device_present() { return cuda_device_present(); }

}  // namespace

const SwapBackend& swap_backend() {
  static const SwapBackend b{{"cuda", device_present}, make_device};
  return b;
}

}  // namespace ess::swap_test
