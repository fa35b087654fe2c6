#include "ess/io/lists.h"

#include <charconv>

#include "ess/core/error.h"

namespace ess {

std::vector<std::string> split_list(std::string_view text, char separator) {
  std::vector<std::string> items;
  std::size_t pos = 0;
  while (true) {
    const std::size_t end = text.find(separator, pos);
    items.emplace_back(text.substr(pos, end == std::string_view::npos ? std::string_view::npos : end - pos));
    if (end == std::string_view::npos) return items;
    pos = end + 1;
  }
}

std::vector<int> parse_positive_ints(std::string_view text, std::string_view what) {
  std::vector<int> v;
  for (const std::string& item : split_list(text)) {
    int x = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), x);
    ESS_CHECK(ec == std::errc{} && end == item.data() + item.size() && !item.empty() && item[0] != '-' && x >= 1,
              "{}: '{}' is not a positive integer", what, item);
    v.push_back(x);
  }
  return v;
}

}  // namespace ess
