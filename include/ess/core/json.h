// Strict JSON readers shared by every input file (model configs, hardware and deployment
// profiles, generator profiles, trace metadata): each error names the file and the field.
#pragma once

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace ess {

// A JSON document; refused by name (`source`) when malformed or when an object gives a key twice.
nlohmann::json parse_json(const std::string& text, const std::string& source);
// The same from a file (refused unless a readable regular file).
nlohmann::json read_json_file(const std::string& path, const char* what);
// A required number (throws when missing or not a number).
double json_number(const nlohmann::json& j, const char* field, const std::string& source);
// An optional number; `fallback` when absent.
double json_number_or(const nlohmann::json& j, const char* field, const std::string& source,
                      double fallback);
std::int64_t json_int_or(const nlohmann::json& j, const char* field, const std::string& source,
                         std::int64_t fallback);
// A 32-bit integer: required (throws when missing), or `fallback` when absent.
int json_int(const nlohmann::json& j, const char* field, const std::string& source, bool required, int fallback = 0);
bool json_bool_or(const nlohmann::json& j, const char* field, const std::string& source, bool fallback);
std::string json_string(const nlohmann::json& j, const char* field, const std::string& source,
                        bool required);
// An optional field of any type nlohmann/json converts to T: `out` is left as it is when the
// field is absent; a value of the wrong type is an error naming the field. Numbers convert
// exactly or not at all: an integral T (or a vector of them) takes integers in its range only
// (not 32768.5, 2^40 for an int, or true), a floating-point T numbers only (not true).
template <typename T>
void json_read(const nlohmann::json& j, const char* field, T& out, const std::string& source);
// Every key of the object `j` is one of `known` (an unknown key is refused by name).
void json_check_keys(const nlohmann::json& j, std::initializer_list<std::string_view> known, const std::string& source,
                     const char* what);

// ---- implementation ----------------------------------------------------------------------
[[noreturn]] void json_wrong_type(const std::string& source, const char* field, const nlohmann::json& value,
                                  const char* why);

namespace detail {
template <typename T>
struct is_vector : std::false_type {};
template <typename U, typename A>
struct is_vector<std::vector<U, A>> : std::true_type {};

// Why `v` does not convert to T exactly (nlohmann/json would truncate or wrap), or null.
template <typename T>
const char* json_inexact(const nlohmann::json& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return nullptr;  // nlohmann/json refuses anything but a boolean
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) return "an integer is needed";
    const bool fits = v.is_number_unsigned() ? std::in_range<T>(v.get<std::uint64_t>())
                                             : std::in_range<T>(v.get<std::int64_t>());
    return fits ? nullptr : "the integer is out of range";
  } else if constexpr (std::is_floating_point_v<T>) {
    return v.is_number() ? nullptr : "a number is needed";
  } else if constexpr (is_vector<T>::value) {
    if (!v.is_array()) return nullptr;  // nlohmann/json says what is wrong
    for (const auto& e : v) {
      if (const char* why = json_inexact<typename T::value_type>(e)) return why;
    }
    return nullptr;
  } else {
    return nullptr;
  }
}
}  // namespace detail

template <typename T>
void json_read(const nlohmann::json& j, const char* field, T& out, const std::string& source) {
  const auto it = j.find(field);
  if (it == j.end()) return;
  if (const char* why = detail::json_inexact<T>(*it)) json_wrong_type(source, field, *it, why);
  try {
    out = it->get<T>();
  } catch (const nlohmann::json::exception& e) {
    json_wrong_type(source, field, *it, e.what());
  }
}

}  // namespace ess
