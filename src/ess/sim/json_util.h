// Small strict JSON readers shared by the simulator's input files: each names the file and
// the field in its error.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace ess::sim {

nlohmann::json read_json_file(const std::string& path, const char* what);
// A required number (throws when missing or not a number).
double json_number(const nlohmann::json& j, const char* field, const std::string& source);
// An optional number; `fallback` when absent.
double json_number_or(const nlohmann::json& j, const char* field, const std::string& source,
                      double fallback);
std::int64_t json_int_or(const nlohmann::json& j, const char* field, const std::string& source,
                         std::int64_t fallback);
bool json_bool_or(const nlohmann::json& j, const char* field, const std::string& source, bool fallback);
std::string json_string(const nlohmann::json& j, const char* field, const std::string& source,
                        bool required);

}  // namespace ess::sim
