// A small FNV-1a digest used to compare whole object states ("state before == state after"
// in the strong-guarantee tests, and cheap equality of large tables).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

namespace ess {

class Digest {
 public:
  void bytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) {
      h_ = (h_ ^ p[i]) * 0x100000001b3ULL;
    }
  }
  template <typename T>
    requires std::is_trivially_copyable_v<T>
  void value(const T& v) {
    bytes(&v, sizeof(T));
  }
  template <typename T>
    requires std::is_trivially_copyable_v<T>
  void values(std::span<const T> v) {
    value(v.size());
    bytes(v.data(), v.size_bytes());
  }
  std::uint64_t get() const { return h_; }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ULL;
};

}  // namespace ess
