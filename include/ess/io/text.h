// Text read from files, made safe to print: a string from a trace or a config reaches the
// terminal without its control characters acting on it.
#pragma once

#include <string>
#include <string_view>

namespace ess {

// `text` with each control character written as \xNN (bytes 0x00-0x1f and 0x7f, and the C1
// controls U+0080-U+009F as their two UTF-8 bytes), each byte that is not part of well-formed
// UTF-8 as \xNN too, and each backslash as \\, so the result is valid UTF-8, prints as one line
// and says what the bytes were.
inline std::string printable(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  auto escape = [&](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  for (std::size_t i = 0; i < text.size();) {
    const unsigned char c = byte(i);
    if (c == '\\') {
      out += "\\\\";
      ++i;
      continue;
    }
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f) {
        escape(c);
      } else {
        out += static_cast<char>(c);
      }
      ++i;
      continue;
    }
    // A well-formed UTF-8 sequence (no overlong forms, surrogates or values past U+10FFFF).
    const std::size_t n = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    bool ok = n > 0 && i + n <= text.size();
    for (std::size_t k = 1; ok && k < n; ++k) ok = (byte(i + k) & 0xc0) == 0x80;
    if (ok && n == 3) {
      const unsigned char d = byte(i + 1);
      ok = !(c == 0xe0 && d < 0xa0) && !(c == 0xed && d >= 0xa0);
    }
    if (ok && n == 4) {
      const unsigned char d = byte(i + 1);
      ok = !(c == 0xf0 && d < 0x90) && !(c == 0xf4 && d >= 0x90);
    }
    if (!ok) {
      escape(c);
      ++i;
    } else if (n == 2 && c == 0xc2 && byte(i + 1) < 0xa0) {  // C1 control
      escape(c);
      escape(byte(i + 1));
      i += 2;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace ess
