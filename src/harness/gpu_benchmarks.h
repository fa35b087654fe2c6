// The GPU benchmarks `ess bench` runs, reached through a table so that the command line needs
// no knowledge of the build: the harness's CUDA part registers them when the program starts
// (gpu_benchmarks_cuda.cc); without it the table is empty and each command says so.
#pragma once

#include <functional>
#include <vector>

#include "harness/rig/bench.h"
#include "runtime/ops/flashtrans/transfer_bench.h"
#include "runtime/ops/gpu_swap/swap_bench.h"
#include "runtime/ops/indexer/indexer_bench.h"
#include "runtime/ops/sparse_mla/attention_bench.h"

namespace ess::harness {

struct GpuBenchmarks {
  cuda::TransferBenchResult (*transfer)(const cuda::TransferBenchConfig& config);
  cuda::SwapBenchResult (*swap)(const cuda::SwapBenchConfig& config);
  cuda::AttentionBenchResult (*attention)(const cuda::AttentionBenchConfig& config, const std::vector<int>& batches);
  cuda::IndexerBenchResult (*indexer)(const cuda::IndexerBenchConfig& config);
  pipeline::StepBenchResult (*step)(const pipeline::StepBenchConfig& config,
                                   const std::function<void(const pipeline::StepPoint&)>& on_point);
  pipeline::ProfileResult (*profile)(const pipeline::ProfileConfig& config);
};

// The registered benchmarks; throws ess::Error naming `command` when this build has none, or
// when it asks for the rig's (step, profile: `rig` true) and the program does not link the rig.
const GpuBenchmarks& gpu_benchmarks(const char* command, bool rig = false);
// Called once before main: the ops' benchmarks by the harness's CUDA part, the rig's (step,
// profile) by the rig's CUDA part (ess_rig, which alone links cuBLAS).
void register_gpu_benchmarks(const GpuBenchmarks& ops);
void register_rig_benchmarks(decltype(GpuBenchmarks::step) step, decltype(GpuBenchmarks::profile) profile);

}  // namespace ess::harness
