// ess: the command-line program. Subcommands: sim and plan (simulator, capacity planner),
// trace (record / generate / analyze top-k traces), verify (the lossless offloaded decode
// loop on the CPU), bench (GPU benchmarks).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <exception>
#include <map>
#include <string>

#include "commands.h"
#include "ess/core/error.h"
#include "ess/runtime/backend.h"
#include "ess/version.h"

namespace ess::cli {

void add_format_option(CLI::App& cmd, Format& format) {
  static const std::map<std::string, Format> names{
      {"table", Format::kTable}, {"json", Format::kJson}, {"csv", Format::kCsv}};
  cmd.add_option_function<std::string>(
         "--format", [&format](const std::string& s) { format = names.at(s); },
         "Output format: table, json or csv")
      ->check(CLI::IsMember({"table", "json", "csv"}))
      ->default_str("table");
}

}  // namespace ess::cli

int main(int argc, char** argv) {
  CLI::App app{"ESS: offloaded latent cache for DeepSeek-V3.2-style sparse attention"};
  app.set_version_flag("--version", fmt::format("ess {} (CUDA target: {})", ESS_VERSION,
                                                 ess::cuda_backend_built() ? "built" : "not built"));
  app.require_subcommand(1);
  int exit_code = 0;
  ess::cli::add_sim(app, exit_code);
  ess::cli::add_plan(app, exit_code);
  ess::cli::add_trace(app, exit_code);
  ess::cli::add_verify(app, exit_code);
  ess::cli::add_bench(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const ess::Error& e) {
    fmt::print(stderr, "ess: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "ess: unexpected error: {}\n", e.what());
    return 3;
  }
  return exit_code;
}
