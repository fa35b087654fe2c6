// The registry of the CUDA backend and the CPU-side entry points that dispatch to it.
#include "ess/runtime/backend.h"

#include "ess/cache/sparse_pool.h"
#include "ess/core/error.h"
#include "runtime/backend/cuda_backend.h"
#include "runtime/offload/split.h"

namespace ess {
namespace detail {
namespace {
// Constant-initialized, so it is null before any dynamic initializer (the backend's
// registration included) runs.
const CudaBackend* g_cuda = nullptr;
}  // namespace

const CudaBackend* cuda_backend() { return g_cuda; }
void register_cuda_backend(const CudaBackend* backend) { g_cuda = backend; }

}  // namespace detail

bool cuda_backend_built() { return detail::cuda_backend() != nullptr; }

int cuda_device_count() {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->device_count() : 0;
}

bool cuda_device_present() { return cuda_device_count() > 0; }

std::string cuda_device_name(int device) {
  const auto* b = detail::cuda_backend();
  return b != nullptr && device >= 0 && device < b->device_count() ? b->device_name(device) : std::string();
}

std::unique_ptr<SlotStorage> make_device_slot_storage(int device, cuda::Stream stream) {
  const auto* b = detail::cuda_backend();
  ESS_CHECK(b != nullptr, "device slot storage: this build has no CUDA backend (nvcc was not found when it was built)");
  ESS_CHECK(device >= 0 && device < b->device_count(), "device slot storage: no CUDA device {} (found {})", device,
            b->device_count());
  return b->make_slot_storage(device, stream);
}

namespace cuda {

// Each op goes to the backend, or reports that there is none.
int flashtrans_gather(const EntryCopy& copy, Stream stream) {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->flashtrans(copy, stream) : kNoCudaDevice;
}
int flashtrans_scatter(const EntryCopy& copy, Stream stream) {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->flashtrans(copy, stream) : kNoCudaDevice;
}
const std::uint8_t* device_view(const std::uint8_t* host) {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->device_view(host) : nullptr;
}
int sparse_mla_decode(const SparseMlaArgs& args, Stream stream) {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->sparse_mla_decode(args, stream) : kNoCudaDevice;
}
int merge_states(const MergeArgs& args, Stream stream) {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->merge_states(args, stream) : kNoCudaDevice;
}
int indexer_logits(const IndexerArgs& args, Stream stream) {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->indexer_logits(args, stream) : kNoCudaDevice;
}
int topk(const TopkArgs& args, Stream stream) {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->topk(args, stream) : kNoCudaDevice;
}

}  // namespace cuda

int split_misses(const SplitArgs& args, cuda::Stream stream) {
  const auto* b = detail::cuda_backend();
  return b != nullptr ? b->split_misses(args, stream) : cuda::kNoCudaDevice;
}

}  // namespace ess
