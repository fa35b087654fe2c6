// A file mapped read-only for the trace reader, and the guard against a file that shrinks
// while it is read: such a file raises SIGBUS on the next touch of a page past its new end. The
// guard is the program's choice (install_mapping_guard(), ess/trace/format.h); without it the
// fault goes to whatever handler the program has (by default it ends the process).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ess::trace {

class MappedFile {
 public:
  MappedFile() = default;
  // Maps `path` (an empty file maps to no bytes); throws ess::Error naming it when it cannot.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  int guard_ = -1;  // the mapping's slot among the guarded ones, -1 when none
};

}  // namespace ess::trace
