#include "analysis/trace/safetensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include "ess/core/error.h"
#include "ess/io/text.h"

namespace ess::trace {

namespace {

// A header larger than this is not a trace (safetensors' own limit, MAX_HEADER_SIZE).
constexpr std::uint64_t kMaxHeader = 100'000'000;

}  // namespace

std::optional<std::size_t> dtype_size(const std::string& d) {
  static const std::map<std::string, std::size_t> sizes{
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},   {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4},  {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  auto it = sizes.find(d);
  if (it == sizes.end()) return std::nullopt;
  return it->second;
}

// Checks the header length at offset 0 and parses the JSON header that follows it.
Header read_header(const std::string& path, const std::uint8_t* base, std::size_t size) {
  ESS_CHECK(size >= 8, "{}: truncated: the file has {} bytes, less than the 8-byte header length at offset 0", path,
            size);
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);
  ESS_CHECK(header_len <= size - 8,
            "{}: header length {} at offset 0 runs past the end of the file ({} bytes; truncated or not a trace)",
            path, header_len, size);
  ESS_CHECK(header_len <= kMaxHeader, "{}: header length {} at offset 0 exceeds the {} byte limit", path,
            header_len, kMaxHeader);
  const char* hb = reinterpret_cast<const char*>(base + 8);
  Header h;
  // Keys seen in each open object: a key given twice is refused (the parser would keep the
  // last one, and a tensor named twice would leave the other's bytes unaccounted for).
  std::vector<std::set<std::string>> open;
  std::string twice;
  const nlohmann::json::parser_callback_t note = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::object_start) {
      open.emplace_back();
    } else if (event == nlohmann::json::parse_event_t::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == nlohmann::json::parse_event_t::key && !open.empty()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!open.back().insert(key).second && twice.empty()) twice = key;
    }
    return true;
  };
  try {
    h.json = nlohmann::json::parse(hb, hb + header_len, note);
  } catch (const nlohmann::json::parse_error& e) {
    ESS_THROW("{}: malformed JSON header at byte offset {}: {}", path, 8 + (e.byte > 0 ? e.byte - 1 : 0),
              printable(e.what()));
  } catch (const nlohmann::json::exception& e) {  // e.g. a number too large for any type
    ESS_THROW("{}: malformed JSON header (offset 8, {} bytes): {}", path, header_len, printable(e.what()));
  }
  ESS_CHECK(twice.empty(), "{}: the JSON header (offset 8, {} bytes) gives the key '{}' twice in one object", path,
            header_len, printable(twice));
  ESS_CHECK(h.json.is_object(), "{}: the JSON header at offset 8 is a {}, not an object", path, h.json.type_name());
  h.data_start = 8 + header_len;
  h.data_size = size - h.data_start;
  return h;
}

// The header's '__metadata__' object (string values only), empty when absent.
std::map<std::string, std::string> read_metadata(const std::string& path, const nlohmann::json& header) {
  std::map<std::string, std::string> md;
  if (auto it = header.find("__metadata__"); it != header.end()) {
    ESS_CHECK(it->is_object(), "{}: header '__metadata__' is a {}, not an object of strings", path, it->type_name());
    for (const auto& [k, v] : it->items()) {
      ESS_CHECK(v.is_string(), "{}: metadata '{}' is a {}, not a string (safetensors metadata values are strings)",
                path, printable(k), v.type_name());
      md[k] = v.get<std::string>();
    }
  }
  return md;
}

namespace {

// One tensor entry of the header: dtype, shape and data offsets, checked against the file.
TensorInfo read_tensor(const std::string& path, std::size_t size, const Header& h, const std::string& name,
                       const nlohmann::json& t) {
  ESS_CHECK(t.is_object(), "{}: tensor '{}': header entry is a {}, not an object", path, name, t.type_name());
  for (const auto& [key, value] : t.items()) {
    (void)value;
    ESS_CHECK(key == "dtype" || key == "shape" || key == "data_offsets",
              "{}: tensor '{}': unknown field '{}' (a tensor entry has dtype, shape and data_offsets)", path, name,
              printable(key));
  }
  TensorInfo info;
  const auto d = t.find("dtype");
  ESS_CHECK(d != t.end() && d->is_string(), "{}: tensor '{}': 'dtype' missing or not a string", path, name);
  info.dtype = d->get<std::string>();
  const auto dsize = dtype_size(info.dtype);
  ESS_CHECK(dsize.has_value(), "{}: tensor '{}': unknown dtype '{}'", path, name, printable(info.dtype));
  const auto sh = t.find("shape");
  ESS_CHECK(sh != t.end() && sh->is_array(), "{}: tensor '{}': 'shape' missing or not an array", path, name);
  std::uint64_t numel = 1;
  for (const auto& e : *sh) {
    ESS_CHECK(e.is_number_integer() && e.get<std::int64_t>() >= 0,
              "{}: tensor '{}': shape entry {} is not a non-negative integer", path, name, e.dump());
    const auto v = e.get<std::int64_t>();
    ESS_CHECK(v == 0 || numel <= (std::numeric_limits<std::uint64_t>::max() / 16) / static_cast<std::uint64_t>(v),
              "{}: tensor '{}': shape {} overflows", path, name, sh->dump());
    numel *= static_cast<std::uint64_t>(v);
    info.shape.push_back(v);
  }
  const auto off = t.find("data_offsets");
  ESS_CHECK(off != t.end() && off->is_array() && off->size() == 2 && (*off)[0].is_number_unsigned() &&
                (*off)[1].is_number_unsigned(),
            "{}: tensor '{}': 'data_offsets' must be [begin, end] of non-negative integers", path, name);
  info.begin = (*off)[0].get<std::uint64_t>();
  info.end = (*off)[1].get<std::uint64_t>();
  ESS_CHECK(info.begin <= info.end, "{}: tensor '{}': data_offsets [{}, {}] are reversed", path, name, info.begin,
            info.end);
  ESS_CHECK(info.end <= h.data_size,
            "{}: tensor '{}': data [{}, {}) at file offset {} runs past the end of the file ({} bytes; truncated?)",
            path, name, info.begin, info.end, h.data_start + info.begin, size);
  ESS_CHECK(info.end - info.begin == numel * *dsize,
            "{}: tensor '{}': shape {} of {} needs {} bytes but data_offsets [{}, {}) hold {}", path, name,
            sh->dump(), info.dtype, numel * *dsize, info.begin, info.end, info.end - info.begin);
  return info;
}

// The tensors tile the data section as safetensors requires: in the order of their offsets
// each starts where the one before ended (the first at 0), and the last ends at the end of the
// file. So no bytes lie between or after them and no two share a byte.
void check_layout(const std::string& path, const Header& h, const std::map<std::string, TensorInfo>& tensors) {
  std::vector<std::pair<const std::string*, const TensorInfo*>> order;
  for (const auto& [name, t] : tensors) order.emplace_back(&name, &t);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::tie(a.second->begin, a.second->end, *a.first) < std::tie(b.second->begin, b.second->end, *b.first);
  });
  std::uint64_t at = 0;
  const std::string* prev = nullptr;
  const TensorInfo* prev_t = nullptr;
  for (const auto& [name, t] : order) {
    if (t->begin < at) {
      ESS_THROW("{}: tensor '{}': data [{}, {}) at file offset {} overlaps tensor '{}' at data [{}, {}) (file offset "
                "{}): tensors may not share bytes",
                path, printable(*name), t->begin, t->end, h.data_start + t->begin, printable(*prev), prev_t->begin,
                prev_t->end, h.data_start + prev_t->begin);
    }
    if (t->begin > at) {
      ESS_THROW("{}: tensor '{}': data [{}, {}) at file offset {} leaves a hole of {} bytes at data [{}, {}) (file "
                "offset {}) {}: tensors must follow one another without gaps",
                path, printable(*name), t->begin, t->end, h.data_start + t->begin, t->begin - at, at, t->begin,
                h.data_start + at,
                prev == nullptr ? std::string("at the start of the data section")
                                : fmt::format("after tensor '{}'", printable(*prev)));
    }
    at = t->end;
    prev = name;
    prev_t = t;
  }
  ESS_CHECK(at == h.data_size,
            "{}: {} bytes at data [{}, {}) (file offset {} to the end, {}) follow {}: the tensors must cover the data "
            "section exactly",
            path, h.data_size - at, at, h.data_size, h.data_start + at, h.data_start + h.data_size,
            prev == nullptr ? std::string("a header without tensors") : fmt::format("the last tensor '{}'", printable(*prev)));
}

}  // namespace

// Every tensor entry of the header, by name, checked to tile the data section.
std::map<std::string, TensorInfo> read_tensors(const std::string& path, std::size_t size, const Header& h) {
  std::map<std::string, TensorInfo> tensors;
  for (const auto& [name, t] : h.json.items()) {
    if (name == "__metadata__") continue;
    tensors.emplace(name, read_tensor(path, size, h, printable(name), t));
  }
  check_layout(path, h, tensors);
  return tensors;
}

}  // namespace ess::trace
