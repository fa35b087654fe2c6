// Files in and out, for every input file and every output the tools write: an input is
// refused by name unless it is a readable regular file; an output is written beside its
// target and renamed into place only when complete, so an existing file is never truncated or
// half-written, whatever happens before (a refused argument, an exhausted disk, a kill).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace ess {

// Throws ess::Error unless `path` is an existing regular file ("what 'path' does not exist",
// "... is a directory, not a file").
void check_input_file(const std::string& path, const char* what);
// The whole file as text (check_input_file first).
std::string read_text_file(const std::string& path, const char* what);

// Whether two paths name one file (by identity when both exist, else by canonical path).
bool same_file(const std::string& a, const std::string& b);

// Throws ess::Error when `output` names no writable place (its folder missing, a directory) or
// the same file as one of `inputs` (by identity, so links and ./x count).
void check_output_file(const std::string& output, const char* what, const std::vector<std::string>& inputs = {});

// An output file written atomically: the bytes go to a temporary file in the target's folder;
// commit() renames it over the target (the file a link names, the link kept). Without commit
// (an error, an exception, SIGINT / SIGTERM / SIGHUP where the program installed no handler of
// its own) the temporary is removed and the target stays as it was. A device or pipe
// (/dev/null, /dev/stdout) is written in place.
class AtomicFile {
 public:
  AtomicFile(const std::string& path, const char* what);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  std::FILE* file() { return file_; }
  const std::string& path() const { return path_; }
  // Writes bytes; throws ess::Error naming the target when the write fails (disk full...).
  void write(const void* data, std::size_t bytes);
  void write(const std::string& text) { write(text.data(), text.size()); }
  // Flushes, closes and renames into place.
  void commit();

 private:
  std::string path_, target_, temp_, what_;  // temp_ empty: a device or pipe written in place
  std::FILE* file_ = nullptr;
  int temp_slot_ = -1;  // where the interrupt handler finds temp_ (-1: not registered)
};

// Host memory a new allocation can have now (MemAvailable), bytes; 0 when unknown.
std::uint64_t available_host_memory();
// Throws ess::Error naming `what` when `bytes` exceed the host memory available now.
void check_host_memory(double bytes, const std::string& what);

// Writes `text` to `path` atomically.
void write_text_file(const std::string& path, const std::string& text, const char* what);

}  // namespace ess
