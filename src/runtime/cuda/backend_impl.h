// The CUDA backend's implementations, registered in the runtime's backend table
// (register.cc; src/runtime/backend/cuda_backend.h). CUDA target only.
#pragma once

#include <cstdint>
#include <memory>

#include "ess/ops/flashtrans.h"
#include "ess/ops/indexer.h"
#include "ess/ops/sparse_mla.h"
#include "ess/runtime/offload.h"

namespace ess {
struct SplitArgs;
class OffloadBackend;
}

namespace ess::cuda {

int flashtrans_cuda(const EntryCopy& copy, Stream stream);
const std::uint8_t* device_view_cuda(const std::uint8_t* host);
int sparse_mla_decode_cuda(const SparseMlaArgs& args, Stream stream);
int merge_states_cuda(const MergeArgs& args, Stream stream);
int indexer_logits_cuda(const IndexerArgs& args, Stream stream);
int topk_cuda(const TopkArgs& args, Stream stream);
int split_misses_cuda(const SplitArgs& args, Stream stream);
// Offload's CUDA backend (src/runtime/offload/offload_cuda.cc).
std::unique_ptr<OffloadBackend> make_cuda_offload(Offload::Impl& front, bool owned);

}  // namespace ess::cuda
