// The GPU benchmarks `ess bench` runs, reached through a table so that the command line needs
// no knowledge of the build: the harness's CUDA part registers them when the program starts
// (gpu_benchmarks_cuda.cc); without it the table is empty and each command says so.
#pragma once

#include <functional>
#include <vector>

#include "harness/rig/bench.h"
#include "runtime/ops/flashtrans/flashtrans_bench.h"
#include "runtime/ops/gpu_swap/swap_engine_bench.h"
#include "runtime/ops/indexer/indexer_bench.h"
#include "runtime/ops/sparse_mla/sparse_mla_bench.h"

namespace ess::harness {

struct GpuBenchmarks {
  cuda::FlashTransBenchResult (*transfer)(const cuda::FlashTransBenchConfig& config);
  cuda::SwapEngineBenchResult (*swap)(const cuda::SwapEngineBenchConfig& config);
  cuda::SparseMlaBenchResult (*attention)(const cuda::SparseMlaBenchConfig& config, const std::vector<int>& batches);
  cuda::IndexerBenchResult (*indexer)(const cuda::IndexerBenchConfig& config);
  rig::StepBenchResult (*step)(const rig::StepBenchConfig& config,
                                   const std::function<void(const rig::StepPoint&)>& on_point);
  rig::ProfileResult (*profile)(const rig::ProfileConfig& config);
};

// The registered benchmarks; throws ess::Error naming `command` when this build has none, or
// when it asks for the rig's (step, profile: `rig` true) and the program does not link the rig.
const GpuBenchmarks& gpu_benchmarks(const char* command, bool rig = false);
// Called once before main: the ops' benchmarks by the harness's CUDA part, the rig's (step,
// profile) by the rig's CUDA part (ess_rig, which alone links cuBLAS).
void register_gpu_benchmarks(const GpuBenchmarks& ops);
void register_rig_benchmarks(decltype(GpuBenchmarks::step) step, decltype(GpuBenchmarks::profile) profile);

}  // namespace ess::harness
