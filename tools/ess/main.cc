// ess: the command-line program. Subcommands: sim and plan (simulator, capacity planner),
// trace (record / generate / analyze top-k traces), verify (the lossless offloaded decode
// loop on the CPU), bench (GPU benchmarks).
#include <algorithm>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <exception>
#include <functional>
#include <limits>
#include <type_traits>
#include <map>
#include <new>
#include <string>
#include <system_error>
#include <vector>

#include "commands.h"
#include "ess/core/error.h"
#include "ess/io/lists.h"
#include "ess/io/output_file.h"
#include "ess/runtime/backend.h"
#include "ess/trace/format.h"
#include "ess/version.h"

namespace ess::cli {

void add_format_option(CLI::App& cmd, Format& format, bool csv) {
  static const std::map<std::string, Format> names{
      {"table", Format::kTable}, {"json", Format::kJson}, {"csv", Format::kCsv}};
  const std::vector<std::string> known =
      csv ? std::vector<std::string>{"table", "json", "csv"} : std::vector<std::string>{"table", "json"};
  cmd.add_option_function<std::string>(
         "--format", [&format](const std::string& s) { format = names.at(s); },
         csv ? "Output format: table, json or csv" : "Output format: table or json")
      ->check(CLI::IsMember(known))
      ->default_str("table");
}

namespace {

template <typename T>
T list_item(const std::string& item, const std::string& option) {
  if constexpr (std::is_same_v<T, std::string>) {
    return item;
  } else {
    // An integer, or one with a k suffix (x 1024: "32k" = 32768, as context lengths are named).
    const bool kilo = item.size() > 1 && (item.back() == 'k' || item.back() == 'K');
    const std::size_t digits = item.size() - (kilo ? 1 : 0);
    T v{};
    const auto [end, ec] = std::from_chars(item.data(), item.data() + digits, v);
    ESS_CHECK(ec == std::errc{} && end == item.data() + digits, "{}: '{}' is not an integer", option, item);
    if (kilo) {
      ESS_CHECK(v <= std::numeric_limits<T>::max() / 1024 && v >= std::numeric_limits<T>::min() / 1024,
                "{}: '{}' is outside the {}-bit integers", option, item, 8 * sizeof(T));
      v *= 1024;
    }
    return v;
  }
}

}  // namespace

CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& s) {
        const bool digits = !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
        if (!digits) return "'" + s + "' is not a non-negative integer";
        // At most 2^64 - 1 = 18446744073709551615 (20 digits): CLI11's conversion would wrap.
        const std::string max = "18446744073709551615";
        const std::string d = s.substr(std::min(s.find_first_not_of('0'), s.size()));
        const bool fits = d.size() < max.size() || (d.size() == max.size() && d <= max);
        return fits ? std::string() : "'" + s + "' exceeds 2^64 - 1";
      },
      "UINT");
}

std::function<std::string(const std::string&)> item_of(std::vector<std::string> names) {
  return [names](const std::string& v) {
    return std::find(names.begin(), names.end(), v) != names.end() ? std::string()
                                                                     : fmt::format("is not one of {}", fmt::join(names, ", "));
  };
}

CLI::Validator in_range(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) {
        double v = 0;
        const bool number = CLI::detail::lexical_cast(s, v);
        if (number && v >= lo && v <= hi) return std::string();
        return fmt::format("'{}' is outside [{}, {}]", s, lo, hi);
      },
      fmt::format("[{}, {}]", lo, hi));
}

CLI::Validator above_at_most(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) {
        double v = 0;
        const bool number = CLI::detail::lexical_cast(s, v);
        if (number && v > lo && v <= hi) return std::string();
        return fmt::format("'{}' is outside ({}, {}]", s, lo, hi);
      },
      fmt::format("({}, {}]", lo, hi));
}

template <typename T>
CLI::Option* add_list_option(CLI::App& cmd, const std::string& name, std::vector<T>& out, const std::string& help,
                             std::function<std::string(const T&)> item_check) {
  const std::string option = name.substr(0, name.find(','));
  return cmd.add_option_function<std::vector<std::string>>(
      name,
      [&out, option, item_check](const std::vector<std::string>& args) {
        std::vector<T> items;
        for (const std::string& arg : args) {
          for (const std::string& item : split_list(arg)) {
            ESS_CHECK(!item.empty(), "{}: an empty item in '{}'", option, arg);
            items.push_back(list_item<T>(item, option));
            const std::string why = item_check ? item_check(items.back()) : std::string();
            ESS_CHECK(why.empty(), "{}: '{}' {}", option, item, why);
          }
        }
        out = std::move(items);
      },
      help);
}

template CLI::Option* add_list_option(CLI::App&, const std::string&, std::vector<std::string>&, const std::string&,
                                      std::function<std::string(const std::string&)>);
template CLI::Option* add_list_option(CLI::App&, const std::string&, std::vector<int>&, const std::string&,
                                      std::function<std::string(const int&)>);
template CLI::Option* add_list_option(CLI::App&, const std::string&, std::vector<std::int64_t>&, const std::string&,
                                      std::function<std::string(const std::int64_t&)>);

}  // namespace ess::cli

namespace {

// A word where a subcommand must stand that names none: CLI11 would say only that one is
// required (or that the word was not expected).
// The subcommand the command line's leading words name (options and their values follow them);
// a word that names none is refused with the choices.
const CLI::App* chosen_subcommand(const CLI::App& app, int argc, char** argv) {
  const CLI::App* at = &app;
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word.empty() || word[0] == '-') return at;  // options (and their values) from here on
    const auto subs = at->get_subcommands([](const CLI::App*) { return true; });
    if (subs.empty()) return at;
    const CLI::App* next = nullptr;
    std::string names;
    for (const CLI::App* s : subs) {
      if (s->check_name(word)) next = s;
      names += (names.empty() ? "" : ", ") + s->get_name();
    }
    if (next == nullptr) {
      const std::string where = at == &app ? "ess" : "ess ... " + at->get_name();
      ESS_THROW("{}: unknown subcommand '{}' (one of: {})", where, word, names);
    }
    at = next;
  }
  return at;
}

}  // namespace

// Exit status: 0 done; 1 a check failed (ess verify found a difference, ess plan no
// configuration); 2 bad input (a flag, value or file refused; the message names it); 3 the
// run could not complete (memory, disk, device); 4 an internal error (a bug in ESS).
namespace {

// Levenshtein distance: how many single-character edits turn a into b.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// For an option the command line names that the chosen subcommand does not have: ": did you
// mean --X?" with its closest option (at most 2 edits, or a prefix of one), else nothing.
std::string did_you_mean(const CLI::App& app, int argc, char** argv) {
  const CLI::App* cmd = chosen_subcommand(app, argc, argv);   // checked before the parse: no word refused here
  std::vector<std::string> names;
  for (const CLI::Option* o : cmd->get_options()) {
    for (const std::string& n : o->get_lnames()) names.push_back("--" + n);
  }
  for (int i = 1; i < argc; ++i) {
    std::string given = argv[i];
    if (!given.starts_with("--") || given == "--") continue;
    given = given.substr(0, given.find('='));
    if (std::find(names.begin(), names.end(), given) != names.end()) continue;
    std::string best;
    std::size_t best_distance = 3;
    for (const std::string& n : names) {
      const std::size_t d = n.starts_with(given) ? 1 : edit_distance(given, n);
      if (d < best_distance) best_distance = d, best = n;
    }
    if (!best.empty()) return fmt::format(": did you mean {} (for {})?", best, given);
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  // The program's choices, which the libraries leave to it: an interrupt removes the temporaries
  // of the outputs being written (ess/io/output_file.h), and a trace that shrinks while it is
  // read ends the run with exit status 3 naming it (ess/trace/format.h).
  ess::install_output_cleanup();
  ess::trace::install_mapping_guard();
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
  ess::cli::check_option_values(app);
  // For the tests: every option of every subcommand with its value type (tests/cli/flags.tsv
  // must have a row for each).
  if (argc == 2 && std::string(argv[1]) == "--list-options") {
    ess::cli::list_options(app);
    return 0;
  }
  try {
    chosen_subcommand(app, argc, argv);   // an unknown subcommand refused by name, before CLI11 parses
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "ess: error: {}{} (see --help)\n", e.what(), did_you_mean(app, argc, argv));
    return 2;
  } catch (const ess::OutOfMemory& e) {
    fmt::print(stderr, "ess: cannot complete: {}\n", e.what());
    return 3;
  } catch (const ess::DeviceError& e) {
    fmt::print(stderr, "ess: cannot complete: {}\n", e.what());
    return 3;
  } catch (const ess::Error& e) {
    const std::string what = e.what();
    fmt::print(stderr, "ess: error: {}\n", what);
    return what.rfind("internal error", 0) == 0 ? 4 : 2;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "ess: cannot complete: out of memory\n");
    return 3;
  } catch (const std::system_error& e) {
    fmt::print(stderr, "ess: cannot complete: {}\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    fmt::print(stderr, "ess: internal error: {}\n", e.what());
    return 4;
  }
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    fmt::print(stderr, "ess: cannot complete: writing the output failed\n");
    return 3;
  }
  return exit_code;
}
