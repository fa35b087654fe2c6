// Subcommands of the `ess` program. Each adds itself to the app; its callback runs the job
// and sets the process exit code through the returned reference.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace ess::cli {

// Shared by every subcommand that prints results.
enum class Format { kTable, kJson, kCsv };
void add_format_option(CLI::App& cmd, Format& format);

// A check for unsigned options (seeds): CLI11 would wrap "-1" to 2^64 - 1.
CLI::Validator unsigned_integer();

// A list option: items as separate arguments and/or comma-separated ("1,2 3"); an empty item
// ("1,,2", a trailing comma) or one that is not a T is refused by name (CLI11's own splitting
// would drop the empty item silently). T: std::string, int or std::int64_t.
template <typename T>
CLI::Option* add_list_option(CLI::App& cmd, const std::string& name, std::vector<T>& out, const std::string& help);

void add_sim(CLI::App& app, int& exit_code);    // sim.cc
void add_plan(CLI::App& app, int& exit_code);   // plan.cc
void add_trace(CLI::App& app, int& exit_code);  // trace.cc
void add_verify(CLI::App& app, int& exit_code);  // verify.cc
void add_bench(CLI::App& app, int& exit_code);  // bench.cc
// `bench attention` and `bench indexer` (bench_kernels.cc); `bench step` and `bench profile`
// (bench_step.cc): added to the `bench` subcommand.
void add_bench_kernels(CLI::App& bench, int& exit_code);
void add_bench_step(CLI::App& bench, int& exit_code);

}  // namespace ess::cli
