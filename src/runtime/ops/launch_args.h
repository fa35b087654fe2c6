// The host-side half of every CUDA launcher, in plain C++ (compiled into the host library,
// built and tested without CUDA): argument checks and launch geometry.
//
// Each check_args returns "" when the launcher accepts the arguments, else a message naming
// the field and its value. The launchers run the same check before any CUDA call and return
// cudaErrorInvalidValue when it fails, so a test on a machine without a device covers the
// exact checks a launch performs. Whatever needs the device (its shared-memory limit, its
// SM count) is checked by the launcher itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ess/ops/flashtrans.h"
#include "ess/ops/indexer.h"
#include "ess/ops/sparse_mla.h"
#include "runtime/ops/gpu_swap/swap_engine_gpu.h"

namespace ess::cuda {

std::string check_args(const EntryCopy& copy);
std::string check_args(const SparseMlaArgs& args);
std::string check_args(const MergeArgs& args);
std::string check_args(const IndexerArgs& args);
std::string check_args(const TopkArgs& args);
// A swap engine and one step launched on it (the step's shape must fit the engine).
std::string check_args(const GpuSwapConfig& config);
std::string check_args(const GpuSwapConfig& config, const GpuSwapStep& step);

// FlashTrans's grid for a copy: min(blocks, what the entries need) blocks of `threads`.
struct FlashTransGrid {
  int blocks = 1;
  int threads = kFlashTransDefaultThreads;
};
FlashTransGrid flashtrans_grid(const EntryCopy& copy);

// The GPU swap engine's step kernel: the shared-memory hash of T x K = `positions`
// selections (a power of two, at least twice the positions and at least kSwapMaxCluster), and
// the dynamic shared memory of one block of a request's `ranks` (per hash entry a token and its state; the miss tokens; a
// flag per slot; each spread over the ranks in equal parts; the cluster scan's exchange:
// swap_engine_cta.h).
int swap_hash_capacity(int positions);
std::size_t swap_step_smem_bytes(int positions, std::int32_t slots, int ranks = 1);
// The blocks that decide one request's step together (a thread-block cluster): the largest of
// 1, 2, 4, 8 up to max_cluster with batch x ranks <= multiprocessors and at least one item (a
// selection or a slot: positions + slots) per thread of each block, so a small batch spreads over
// the SMs, a large one keeps one block per request, and a small step is not spread thinner than
// its barriers are worth.
inline constexpr int kSwapMaxCluster = 8;  // the portable cluster size
inline constexpr int kSwapStepThreads = 1024;  // threads of a step block (swap::kStepThreads)
int swap_cluster_size(int batch, int positions, std::int32_t slots, int multiprocessors, int max_cluster);
// Static shared memory of the step kernel (its block scan's storage) is at most this; the
// kernel asserts it at compile time, so host code can bound a block's total.
inline constexpr std::size_t kSwapStepStaticSmemBound = 8192;
// Opt-in shared memory per block of the devices ESS targets (H100, H200, H20, H800:
// 227 KB), for host-side checks of shapes before any device is present.
inline constexpr std::size_t kHopperSmemOptin = 232448;

}  // namespace ess::cuda
