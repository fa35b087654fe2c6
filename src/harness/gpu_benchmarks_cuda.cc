// The harness's CUDA part registers its benchmarks (gpu_benchmarks.h) and its Offload calls
// (support/offload_io.h) when the program starts. Programs that link the harness link with `--undefined=ess_harness_cuda_anchor`
// (src/harness/CMakeLists.txt), which keeps this object in them.
#include "harness/gpu_benchmarks.h"
#include "harness/support/offload_io.h"

extern "C" {
extern const int ess_harness_cuda_anchor;
const int ess_harness_cuda_anchor = 1;
}

namespace ess::harness {
namespace {

const GpuBenchmarks kBenchmarks{cuda::run_transfer_bench, cuda::run_swap_bench, cuda::run_attention_bench,
                                cuda::run_indexer_bench, nullptr, nullptr};  // step, profile: the rig's (rig_cuda.cc)
[[maybe_unused]] const bool kRegistered =
    (register_gpu_benchmarks(kBenchmarks), register_cuda_offload_io(&cuda_offload_io()), true);

}  // namespace
}  // namespace ess::harness
