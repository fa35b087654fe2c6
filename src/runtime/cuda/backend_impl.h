// The CUDA backend's op implementations, registered in the ops' table (register.cc;
// src/runtime/ops/cuda_ops.h). CUDA target only.
#pragma once

#include "ess/ops/flashtrans.h"
#include "ess/ops/indexer.h"
#include "ess/ops/sparse_mla.h"

namespace ess {
struct SplitArgs;
}

namespace ess::cuda {

int flashtrans_cuda(const EntryCopy& copy, Stream stream);
int sparse_mla_decode_cuda(const SparseMlaArgs& args, Stream stream);
int merge_states_cuda(const MergeArgs& args, Stream stream);
int indexer_logits_cuda(const IndexerArgs& args, Stream stream);
int topk_cuda(const TopkArgs& args, Stream stream);
int split_misses_cuda(const SplitArgs& args, Stream stream);

}  // namespace ess::cuda
