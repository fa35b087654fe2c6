// The CPU-side entry points of the ops (ess/ops/*.h, ess::split_misses,
// ess::make_device_slot_storage): each goes to the CUDA backend's table (cuda_ops.h), or
// reports that this build has none.
#include "ess/cache/sparse_pool.h"
#include "ess/core/error.h"
#include "ess/runtime/backend.h"
#include "runtime/ops/cuda_ops.h"
#include "runtime/ops/split/split.h"

namespace ess {
namespace detail {
namespace {
// Constant-initialized: null until the backend registers (before main).
const CudaOps* g_ops = nullptr;
}  // namespace

const CudaOps* cuda_ops() { return g_ops; }
void register_cuda_ops(const CudaOps* ops) { g_ops = ops; }

}  // namespace detail

std::unique_ptr<SlotStorage> make_device_slot_storage(int device, cuda::Stream stream) {
  const auto* ops = detail::cuda_ops();
  ESS_CHECK(ops != nullptr, "device slot storage: this build has no CUDA backend (nvcc was not found when it was built)");
  ESS_CHECK(device >= 0 && device < cuda_device_count(), "device slot storage: no CUDA device {} (found {})", device,
            cuda_device_count());
  return ops->make_slot_storage(device, stream);
}

int split_misses(const SplitArgs& args, cuda::Stream stream) {
  const auto* ops = detail::cuda_ops();
  return ops != nullptr ? ops->split_misses(args, stream) : cuda::kNoCudaDevice;
}

namespace cuda {

int flashtrans_gather(const EntryCopy& copy, Stream stream) {
  const auto* ops = detail::cuda_ops();
  return ops != nullptr ? ops->flashtrans(copy, stream) : kNoCudaDevice;
}
int flashtrans_scatter(const EntryCopy& copy, Stream stream) {
  const auto* ops = detail::cuda_ops();
  return ops != nullptr ? ops->flashtrans(copy, stream) : kNoCudaDevice;
}
int sparse_mla_decode(const SparseMlaArgs& args, Stream stream) {
  const auto* ops = detail::cuda_ops();
  return ops != nullptr ? ops->sparse_mla_decode(args, stream) : kNoCudaDevice;
}
int merge_states(const MergeArgs& args, Stream stream) {
  const auto* ops = detail::cuda_ops();
  return ops != nullptr ? ops->merge_states(args, stream) : kNoCudaDevice;
}
int indexer_logits(const IndexerArgs& args, Stream stream) {
  const auto* ops = detail::cuda_ops();
  return ops != nullptr ? ops->indexer_logits(args, stream) : kNoCudaDevice;
}
int topk(const TopkArgs& args, Stream stream) {
  const auto* ops = detail::cuda_ops();
  return ops != nullptr ? ops->topk(args, stream) : kNoCudaDevice;
}

}  // namespace cuda
}  // namespace ess
