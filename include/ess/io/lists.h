// Comma-separated lists, as flags and CSV lines carry them.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ess {

// "a,b,,c" -> {"a", "b", "", "c"}: empty items are kept, so that callers can refuse them by
// name; "" -> {""}.
std::vector<std::string> split_list(std::string_view text, char separator = ',');
// Every item a positive integer (decimal, no sign, no spaces); the first that is not is named
// with `what`.
std::vector<int> parse_positive_ints(std::string_view text, std::string_view what);

}  // namespace ess
