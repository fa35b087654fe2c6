#include "harness/gpu_benchmarks.h"

#include "ess/core/error.h"

namespace ess::harness {
namespace {
// Constant-initialized (null until registered), so the two registrations need no order.
GpuBenchmarks g_benchmarks{};
bool g_ops = false;
}  // namespace

const GpuBenchmarks& gpu_benchmarks(const char* command, bool rig) {
  ESS_CHECK(g_ops, "{} needs the CUDA target: this ess was built without nvcc", command);
  ESS_CHECK(!rig || (g_benchmarks.step != nullptr && g_benchmarks.profile != nullptr),
            "{} needs the rig (its executor and cuBLAS GEMMs), which this program does not link", command);
  return g_benchmarks;
}

void register_gpu_benchmarks(const GpuBenchmarks& ops) {
  g_benchmarks.transfer = ops.transfer;
  g_benchmarks.swap = ops.swap;
  g_benchmarks.attention = ops.attention;
  g_benchmarks.indexer = ops.indexer;
  g_ops = true;
}

void register_rig_benchmarks(decltype(GpuBenchmarks::step) step, decltype(GpuBenchmarks::profile) profile) {
  g_benchmarks.step = step;
  g_benchmarks.profile = profile;
}

}  // namespace ess::harness
