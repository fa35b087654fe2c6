// The harness's CUDA calls on the emulated target: offload_io.h's device copies
// (support/offload_io_cuda.cc, compiled here against the emulated runtime), registered when
// the program starts as the CUDA target's harness part does (gpu_benchmarks_cuda.cc).
#include "harness/support/offload_io.h"

namespace ess::harness {
namespace {

[[maybe_unused]] const bool kRegistered = (register_cuda_offload_io(&cuda_offload_io()), true);

}  // namespace
}  // namespace ess::harness
