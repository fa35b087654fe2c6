#include "harness/gpu_benchmarks.h"

#include "ess/core/error.h"

namespace ess::harness {
namespace {
const GpuBenchmarks* g_benchmarks = nullptr;  // constant-initialized: null until registered
}

const GpuBenchmarks& gpu_benchmarks(const char* command) {
  ESS_CHECK(g_benchmarks != nullptr, "{} needs the CUDA target: this ess was built without nvcc", command);
  return *g_benchmarks;
}

void register_gpu_benchmarks(const GpuBenchmarks* benchmarks) { g_benchmarks = benchmarks; }

}  // namespace ess::harness
