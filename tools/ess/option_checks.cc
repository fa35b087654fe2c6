// The checks every value-taking option of `ess` gets from its type, and the list of options the
// bad-flag table is held to (tests/cli/flags.tsv).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "commands.h"

namespace ess::cli {
namespace {

// The option's value type as CLI11 names it (INT, UINT, FLOAT, TEXT, ...), without the
// descriptions of its validators.
std::string base_type(const CLI::Option& o) {
  const std::string t = o.get_type_name();
  return t.substr(0, t.find(':'));
}

bool is_digits(const std::string& s) { return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos; }

// A decimal integer in [INT64_MIN, INT64_MAX], or one with a k suffix (x 1024: "32k" = 32768, as
// context lengths are named); leading zeros are dropped (CLI11 would read "010" as octal 8), so
// that CLI11's own conversion reads it as written.
std::string check_int(std::string& s) {
  const bool negative = !s.empty() && s[0] == '-';
  std::string digits = negative ? s.substr(1) : s;
  const bool kilo = digits.size() > 1 && (digits.back() == 'k' || digits.back() == 'K');
  if (kilo) digits.pop_back();
  if (!is_digits(digits)) return "'" + s + "' is not an integer";
  digits = digits.substr(std::min(digits.find_first_not_of('0'), digits.size() - 1));
  const std::string most = negative ? "9223372036854775808" : "9223372036854775807";
  if (digits.size() > most.size() || (digits.size() == most.size() && digits > most)) {
    return "'" + s + "' is outside the 64-bit integers";
  }
  if (kilo) {
    // digits fit in 2^63 (checked above); times 1024 they must still fit the 64-bit integers.
    const unsigned long long value = std::stoull(digits);
    const unsigned long long limit = static_cast<unsigned long long>(std::numeric_limits<std::int64_t>::max()) +
                                     (negative ? 1ULL : 0ULL);
    if (value > limit / 1024) return "'" + s + "' is outside the 64-bit integers";
    digits = fmt::format("{}", value * 1024);
  }
  s = (negative ? "-" : "") + digits;
  return {};
}

// A finite decimal number (no nan, inf or hexadecimal float).
std::string check_float(const std::string& s) {
  if (s.empty() || s.find_first_not_of("0123456789+-.eE") != std::string::npos) {
    return "'" + s + "' is not a finite decimal number";
  }
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return "'" + s + "' is not a number";
  if (!std::isfinite(v) || errno == ERANGE) return "'" + s + "' is not a finite number (or is too large)";
  return {};
}

void add_checks(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    if (o->get_expected_max() == 0 || o->get_name() == "--help" || o->get_name() == "--version") continue;
    const std::string type = base_type(*o);
    o->transform(CLI::Validator(
        [type](std::string& s) -> std::string {
          if (s.empty()) return "an empty value";
          if (type == "INT") return check_int(s);
          if (type == "FLOAT") return check_float(s);
          return {};
        },
        "", "value"));
  }
  for (CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) add_checks(*sub);
}

void list(const CLI::App& app, const std::string& path) {
  for (const CLI::Option* o : app.get_options()) {
    if (o->get_name() == "--help" || o->get_name() == "--version" || o->get_positional()) continue;
    const std::string type = o->get_expected_max() == 0 ? "FLAG" : base_type(*o);
    fmt::print("{}\t{}\t{}\n", path, o->get_name(), type);
  }
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    list(*sub, path.empty() ? sub->get_name() : path + " " + sub->get_name());
  }
}

}  // namespace

void check_option_values(CLI::App& app) { add_checks(app); }

void list_options(const CLI::App& app) { list(app, ""); }

}  // namespace ess::cli
