// The CUDA backend's entry points, as the runtime's CPU part reaches them: a table the
// backend registers when the program starts (src/runtime/cuda/register.cc). Internal to the
// runtime; the public face is ess/runtime/backend.h and the op headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "ess/ops/flashtrans.h"
#include "ess/ops/indexer.h"
#include "ess/ops/sparse_mla.h"
#include "ess/runtime/offload.h"

namespace ess {
class SlotStorage;
class OffloadBackend;
struct SplitArgs;

namespace detail {

struct CudaBackend {
  // Device services.
  int (*device_count)();
  std::string (*device_name)(int device);
  void* (*host_alloc_pinned)(std::size_t bytes);  // pinned, mapped, portable; nullptr on failure
  void (*host_free_pinned)(void* p);
  const std::uint8_t* (*device_view)(const std::uint8_t* host);
  // Ops (each returns a cudaError_t value).
  int (*flashtrans)(const cuda::EntryCopy& copy, cuda::Stream stream);
  int (*sparse_mla_decode)(const cuda::SparseMlaArgs& args, cuda::Stream stream);
  int (*merge_states)(const cuda::MergeArgs& args, cuda::Stream stream);
  int (*indexer_logits)(const cuda::IndexerArgs& args, cuda::Stream stream);
  int (*topk)(const cuda::TopkArgs& args, cuda::Stream stream);
  int (*split_misses)(const SplitArgs& args, cuda::Stream stream);
  // Objects.
  std::unique_ptr<SlotStorage> (*make_slot_storage)(int device, cuda::Stream stream);
  // Offload's CUDA backend (offload_impl.h); `owned`: it allocates the layer buffers.
  std::unique_ptr<OffloadBackend> (*make_offload)(Offload::Impl& front, bool owned);
};

// nullptr when the backend is not part of this build.
const CudaBackend* cuda_backend();
// Called once by the backend, before main.
void register_cuda_backend(const CudaBackend* backend);

}  // namespace detail
}  // namespace ess
