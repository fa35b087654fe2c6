#include "ess/core/json.h"

#include <limits>
#include <set>
#include <vector>

#include "ess/core/error.h"
#include "ess/core/files.h"

namespace ess {

using nlohmann::json;

json parse_json(const std::string& text, const std::string& source) {
  // Keys seen in each open object: a key given twice is refused (the parser would keep the last).
  std::vector<std::set<std::string>> open;
  std::string twice;
  const json::parser_callback_t note = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == json::parse_event_t::key && !open.empty()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!open.back().insert(key).second && twice.empty()) twice = key;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, note);
  } catch (const json::exception& e) {
    ESS_THROW("{}: malformed JSON: {}", source, e.what());
  }
  ESS_CHECK(twice.empty(), "{}: key '{}' is given twice in one object (which value is meant?)", source, twice);
  return j;
}

json read_json_file(const std::string& path, const char* what) { return parse_json(read_text_file(path, what), path); }

double json_number(const json& j, const char* field, const std::string& source) {
  const auto it = j.find(field);
  ESS_CHECK(it != j.end() && !it->is_null(), "{}: required field '{}' is missing", source, field);
  ESS_CHECK(it->is_number(), "{}: field '{}' must be a number, got {}", source, field, it->dump());
  return it->get<double>();
}

double json_number_or(const json& j, const char* field, const std::string& source, double fallback) {
  const auto it = j.find(field);
  if (it == j.end() || it->is_null()) return fallback;
  ESS_CHECK(it->is_number(), "{}: field '{}' must be a number, got {}", source, field, it->dump());
  return it->get<double>();
}

std::int64_t json_int_or(const json& j, const char* field, const std::string& source,
                         std::int64_t fallback) {
  const auto it = j.find(field);
  if (it == j.end() || it->is_null()) return fallback;
  ESS_CHECK(it->is_number_integer(), "{}: field '{}' must be an integer, got {}", source, field,
            it->dump());
  return it->get<std::int64_t>();
}

int json_int(const json& j, const char* field, const std::string& source, bool required, int fallback) {
  const auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    ESS_CHECK(!required, "{}: required field '{}' is missing", source, field);
    return fallback;
  }
  ESS_CHECK(it->is_number_integer(), "{}: field '{}' must be an integer, got {}", source, field, it->dump());
  const auto v = it->get<std::int64_t>();
  ESS_CHECK(v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(),
            "{}: field '{}' = {} is out of range", source, field, v);
  return static_cast<int>(v);
}

bool json_bool_or(const json& j, const char* field, const std::string& source, bool fallback) {
  const auto it = j.find(field);
  if (it == j.end() || it->is_null()) return fallback;
  ESS_CHECK(it->is_boolean(), "{}: field '{}' must be true or false, got {}", source, field, it->dump());
  return it->get<bool>();
}

std::string json_string(const json& j, const char* field, const std::string& source, bool required) {
  const auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    ESS_CHECK(!required, "{}: required field '{}' is missing", source, field);
    return {};
  }
  ESS_CHECK(it->is_string(), "{}: field '{}' must be a string, got {}", source, field, it->dump());
  return it->get<std::string>();
}

void json_wrong_type(const std::string& source, const char* field, const json& value, const char* why) {
  ESS_THROW("{}: field '{}' = {} has the wrong type: {}", source, field, value.dump(), why);
}

void json_check_keys(const json& j, std::initializer_list<std::string_view> known, const std::string& source,
                     const char* what) {
  ESS_CHECK(j.is_object(), "{}: {} must be a JSON object, got {}", source, what, j.type_name());
  for (const auto& [key, value] : j.items()) {
    bool ok = false;
    for (const std::string_view k : known) ok = ok || k == key;
    ESS_CHECK(ok, "{}: unknown {} field '{}'", source, what, key);
  }
}

}  // namespace ess
