// The safetensors container as the trace format uses it (docs/trace-format.md): the 8-byte
// header length, the JSON header (a key given twice is refused), its string metadata, and the
// tensor entries checked to tile the data section exactly. Every error names the file, the
// tensor and the byte offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace ess::trace {

// Bytes per element of a safetensors dtype name; nullopt for a name safetensors does not define.
std::optional<std::size_t> dtype_size(const std::string& dtype);

struct TensorInfo {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // relative to the data section
  std::uint64_t end = 0;
};

// The file's two sections: the JSON header (after its 8-byte length) and the data after it.
struct Header {
  nlohmann::json json;
  std::uint64_t data_start = 0;  // file offset of the data section
  std::uint64_t data_size = 0;
};

// Checks the header length at offset 0 and parses the JSON header that follows it.
Header read_header(const std::string& path, const std::uint8_t* base, std::size_t size);
// The header's '__metadata__' object (string values only), empty when absent.
std::map<std::string, std::string> read_metadata(const std::string& path, const nlohmann::json& header);
// Every tensor entry of the header, by name, checked to tile the data section.
std::map<std::string, TensorInfo> read_tensors(const std::string& path, std::size_t size, const Header& h);

}  // namespace ess::trace
