// Subcommands of the `ess` program. Each adds itself to the app; its callback runs the job
// and sets the process exit code through the returned reference.
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace ess::cli {

// Shared by every subcommand that prints results: --format table, json and, where the
// command has a CSV form (`csv`), csv; any other value is refused by name.
enum class Format { kTable, kJson, kCsv };
void add_format_option(CLI::App& cmd, Format& format, bool csv = true);

// A check for unsigned options (seeds): CLI11 would wrap "-1" to 2^64 - 1.
CLI::Validator unsigned_integer();
// A number in [lo, hi], and one in (lo, hi] (a ratio or fraction of 0 means nothing); the
// message names the option, the value and the range.
CLI::Validator in_range(double lo, double hi);
CLI::Validator above_at_most(double lo, double hi);

// A list option: items as separate arguments and/or comma-separated ("1,2 3"); an empty item
// ("1,,2", a trailing comma) or one that is not a T is refused by name (CLI11's own splitting
// would drop the empty item silently). T: std::string, int or std::int64_t. `item_check`, when
// given, says what is wrong with an item ("" when nothing): the option, the item and that.
template <typename T>
CLI::Option* add_list_option(CLI::App& cmd, const std::string& name, std::vector<T>& out, const std::string& help,
                             std::function<std::string(const T&)> item_check = nullptr);
// An item check: the value lies in [lo, hi].
template <typename T>
std::function<std::string(const T&)> item_in(T lo, T hi) {
  return [lo, hi](const T& v) { return v >= lo && v <= hi ? std::string() : fmt::format("is outside [{}, {}]", lo, hi); };
}
// An item check: the value is one of `names`.
std::function<std::string(const std::string&)> item_of(std::vector<std::string> names);

// Every value-taking option of `app` and its subcommands refuses an empty value, and, by its
// type, an INT anything but a decimal 64-bit integer and a FLOAT anything but a finite decimal
// number (nan, inf), naming the option (option_checks.cc).
void check_option_values(CLI::App& app);
// Prints "subcommand path<TAB>--option<TAB>type" for every option (type FLAG for flags).
void list_options(const CLI::App& app);

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
