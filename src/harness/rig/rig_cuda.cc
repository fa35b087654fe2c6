// The rig's CUDA part registers its benchmarks (`ess bench step`, `ess bench profile`) when the
// program starts. Programs that link ess_rig link with `--undefined=ess_rig_cuda_anchor`
// (src/harness/CMakeLists.txt), which keeps this object, and so the executor and cuBLAS, in
// them; other programs (every kernel test) need no cuBLAS.
#include "harness/gpu_benchmarks.h"

extern "C" {
extern const int ess_rig_cuda_anchor;
const int ess_rig_cuda_anchor = 1;
}

namespace ess::harness {
namespace {

[[maybe_unused]] const bool kRegistered = (register_rig_benchmarks(rig::run_step_bench, rig::run_profile), true);

}  // namespace
}  // namespace ess::harness
