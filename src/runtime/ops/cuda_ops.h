// The ops' CUDA kernels as the runtime's CPU part reaches them: a table the CUDA backend
// registers when the program starts (src/runtime/cuda/register.cc), so that the CPU-side entry
// points of ess/ops/*.h (dispatch.cc) build without CUDA and return kNoCudaDevice there.
#pragma once

#include <memory>

#include "ess/ops/flashtrans.h"
#include "ess/ops/indexer.h"
#include "ess/ops/sparse_mla.h"

namespace ess {
class SlotStorage;
struct SplitArgs;

namespace detail {

// Each op returns a cudaError_t value.
struct CudaOps {
  int (*flashtrans)(const cuda::EntryCopy& copy, cuda::Stream stream);
  int (*sparse_mla_decode)(const cuda::SparseMlaArgs& args, cuda::Stream stream);
  int (*merge_states)(const cuda::MergeArgs& args, cuda::Stream stream);
  int (*indexer_logits)(const cuda::IndexerArgs& args, cuda::Stream stream);
  int (*topk)(const cuda::TopkArgs& args, cuda::Stream stream);
  int (*split_misses)(const SplitArgs& args, cuda::Stream stream);
  // The Sparse Memory Pool's device slots (cuda/device_slot_storage.h).
  std::unique_ptr<SlotStorage> (*make_slot_storage)(int device, cuda::Stream stream);
};

// nullptr when the CUDA backend is not part of this build.
const CudaOps* cuda_ops();
// Called once by the backend, before main.
void register_cuda_ops(const CudaOps* ops);

}  // namespace detail
}  // namespace ess
