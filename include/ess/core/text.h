// Text read from files, made safe to print: a string from a trace or a config reaches the
// terminal without its control characters acting on it.
#pragma once

#include <string>
#include <string_view>

namespace ess {

// `text` with each control character (bytes 0x00-0x1f and 0x7f) written as \xNN, and each
// backslash as \\, so the result prints as one line and says what the bytes were.
inline std::string printable(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace ess
