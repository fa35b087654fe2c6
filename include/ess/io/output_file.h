// Output files, for every output the tools write: an output is written beside its target and
// renamed into place only when complete, so an existing file is never truncated or
// half-written, whatever happens before (a refused argument, an exhausted disk, an exception).
// A program that wants an interrupt (Ctrl-C, kill) to leave no temporary behind either calls
// install_output_cleanup() once; the library itself never installs a signal handler.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace ess {

// Whether two paths name one file (by identity when both exist, else by canonical path).
bool same_file(const std::string& a, const std::string& b);

// Throws ess::Error when `output` names no writable place (its folder missing, a directory) or
// the same file as one of `inputs` (by identity, so links and ./x count).
void check_output_file(const std::string& output, const char* what, const std::vector<std::string>& inputs = {});

// An output file written atomically: the bytes go to a temporary file in the target's folder;
// commit() renames it over the target (the file a link names, the link kept). Without commit
// (an error, an exception; SIGINT / SIGTERM / SIGHUP once install_output_cleanup() ran) the
// temporary is removed and the target stays as it was. A device or pipe (/dev/null,
// /dev/stdout) is written in place.
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

// The program's choice: SIGINT, SIGTERM and SIGHUP, where the program has no handler of its
// own, remove the temporaries of the AtomicFiles alive then and end the process by the same
// signal. Idempotent; async-signal-safe inside the handler (unlink, raise).
void install_output_cleanup();

// Writes `text` to `path` atomically.
void write_text_file(const std::string& path, const std::string& text, const char* what);

}  // namespace ess
