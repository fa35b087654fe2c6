// Every format the harness's reports print in: `ess verify` (table, JSON, CSV) and the GPU
// benchmarks of `ess bench` (table, JSON). Host code: the command line formats results
// without the CUDA target. The analysis reports (trace, sim, plan) format themselves in the
// analysis library (ess/trace/analyzer.h, ess/sim/report.h).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "ess/model/model_spec.h"
#include "harness/rig/bench.h"
#include "harness/verify/decode_loop.h"
#include "runtime/ops/flashtrans/flashtrans_bench.h"
#include "runtime/ops/gpu_swap/swap_engine_bench.h"
#include "runtime/ops/indexer/indexer_bench.h"
#include "runtime/ops/sparse_mla/sparse_mla_bench.h"

namespace ess::harness {

// ess verify (verify/decode_loop.h).
std::string to_table(const ModelSpec& model, const VerifyConfig& c, const VerifyReport& r);
nlohmann::json to_json(const ModelSpec& model, const VerifyConfig& c, const VerifyReport& r);
std::string to_csv(const VerifyReport& r);

// ess bench transfer | swap | attention | indexer (report/bench.cc).
std::string to_table(const cuda::FlashTransBenchConfig& c, const cuda::FlashTransBenchResult& r);
nlohmann::json to_json(const cuda::FlashTransBenchConfig& c, const cuda::FlashTransBenchResult& r);
std::string to_table(const cuda::SwapEngineBenchConfig& c, const cuda::SwapEngineBenchResult& r);
nlohmann::json to_json(const cuda::SwapEngineBenchConfig& c, const cuda::SwapEngineBenchResult& r);
std::string to_table(const cuda::SparseMlaBenchConfig& c, const cuda::SparseMlaBenchResult& r);
nlohmann::json to_json(const cuda::SparseMlaBenchConfig& c, const cuda::SparseMlaBenchResult& r);
std::string to_table(const cuda::IndexerBenchConfig& c, const cuda::IndexerBenchResult& r);
nlohmann::json to_json(const cuda::IndexerBenchConfig& c, const cuda::IndexerBenchResult& r);

// ess bench step (report/step.cc; its JSON is StepBenchResult::to_json, rig/bench.h).
std::string to_table(const rig::StepBenchConfig& c, const rig::StepBenchResult& r);

}  // namespace ess::harness
