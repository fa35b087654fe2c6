// The harness's CUDA part registers the ops' benchmarks (gpu_benchmarks.h) when the program
// starts. Programs that link the harness link with `--undefined=ess_harness_cuda_anchor`
// (src/harness/CMakeLists.txt), which keeps this object in them.
#include "harness/gpu_benchmarks.h"

extern "C" {
extern const int ess_harness_cuda_anchor;
const int ess_harness_cuda_anchor = 1;
}

namespace ess::harness {
namespace {

const GpuBenchmarks kBenchmarks{cuda::run_flashtrans_bench, cuda::run_swap_engine_bench, cuda::run_sparse_mla_bench,
                                cuda::run_indexer_bench, nullptr, nullptr};  // step, profile: the rig's (rig_cuda.cc)
[[maybe_unused]] const bool kRegistered = (register_gpu_benchmarks(kBenchmarks), true);

}  // namespace
}  // namespace ess::harness
