// The CUDA backend registers its device services (src/runtime/backend/cuda_backend.h) and the
// ops' kernels (src/runtime/ops/cuda_ops.h) when the program starts; the per-layer step's CUDA
// backend registers itself (offload_cuda.cc). The runtime library's users link with
// `--undefined=ess_cuda_backend_anchor` (src/runtime/CMakeLists.txt), which keeps this object
// in every program that links the runtime statically.
#include <memory>

#include "runtime/backend/cuda_backend.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/cuda/device_slot_storage.h"
#include "runtime/cuda/runtime.h"
#include "runtime/ops/cuda_ops.h"

extern "C" {
extern const int ess_cuda_backend_anchor;
const int ess_cuda_backend_anchor = 1;
}

namespace ess::cuda {
namespace {

std::unique_ptr<SlotStorage> make_slot_storage(int device, Stream stream) {
  return std::make_unique<DeviceSlotStorage>(device, stream);
}

const detail::CudaBackend kBackend{device_count, device_name, host_alloc_pinned, host_free_pinned, device_view_cuda};
const detail::CudaOps kOps{flashtrans_cuda, sparse_mla_decode_cuda, merge_states_cuda, indexer_logits_cuda,
                           topk_cuda,       split_misses_cuda,      make_slot_storage};

[[maybe_unused]] const bool kRegistered =
    (detail::register_cuda_backend(&kBackend), detail::register_cuda_ops(&kOps), true);

}  // namespace
}  // namespace ess::cuda
