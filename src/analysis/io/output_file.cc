#include "ess/io/output_file.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <system_error>

#include "ess/core/error.h"

namespace ess {

namespace fs = std::filesystem;

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec);
  const auto ca = fs::weakly_canonical(a, ec);
  const auto cb = fs::weakly_canonical(b, ec);
  return !ec && ca == cb;
}

void check_output_file(const std::string& output, const char* what, const std::vector<std::string>& inputs) {
  ESS_CHECK(!output.empty(), "{}: no file name given", what);
  std::error_code ec;
  ESS_CHECK(!fs::is_directory(output, ec), "{} '{}' is a directory, not a file", what, output);
  const fs::path parent = fs::path(output).parent_path();
  ESS_CHECK(parent.empty() || fs::is_directory(parent, ec), "{} '{}': its folder '{}' does not exist", what, output,
            parent.string());
  for (const auto& in : inputs) {
    if (in.empty()) continue;
    ESS_CHECK(!same_file(output, in),
              "{} '{}' is also an input ('{}'): it would be overwritten; write elsewhere", what, output, in);
  }
}

namespace {

// The temporaries of the AtomicFiles alive now, for the signal handler: an interrupted command
// (Ctrl-C, kill) leaves no partial file behind. Fixed storage, as a handler may only call
// async-signal-safe functions (unlink, raise).
constexpr int kMaxTemps = 16;
char g_temp_paths[kMaxTemps][4096];
std::atomic<bool> g_temp_live[kMaxTemps];

extern "C" void remove_temps_and_reraise(int sig) {
  for (int i = 0; i < kMaxTemps; ++i) {
    if (g_temp_live[i].load()) ::unlink(g_temp_paths[i]);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// A slot for `path` (-1 when every slot is taken or the path is too long: then only the
// destructor removes it).
int register_temp(const std::string& path) {
  static std::mutex m;
  const std::lock_guard lock(m);
  if (path.size() >= sizeof(g_temp_paths[0])) return -1;
  for (int i = 0; i < kMaxTemps; ++i) {
    if (!g_temp_live[i].load()) {
      std::memcpy(g_temp_paths[i], path.c_str(), path.size() + 1);
      g_temp_live[i].store(true);
      return i;
    }
  }
  return -1;
}

void unregister_temp(int slot) {
  if (slot >= 0) g_temp_live[slot].store(false);
}

}  // namespace

AtomicFile::AtomicFile(const std::string& path, const char* what) : path_(path), what_(what) {
  check_output_file(path, what);
  std::error_code ec;
  // A link is followed: the file it names is replaced, the link stays.
  fs::path target = fs::is_symlink(fs::symlink_status(path, ec)) ? fs::weakly_canonical(path, ec) : fs::path(path);
  const auto st = fs::status(target, ec);
  if (fs::exists(st) && !fs::is_regular_file(st)) {
    // A device or a pipe (/dev/null, /dev/stdout): written in place, never replaced.
    file_ = std::fopen(target.c_str(), "wb");
    ESS_CHECK(file_ != nullptr, "{} '{}': cannot open: {}", what, path, std::strerror(errno));
    return;
  }
  target_ = target.string();
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::string pattern = (dir / fmt::format(".{}.tmp.XXXXXX", target.filename().string())).string();
  const int fd = ::mkstemp(pattern.data());
  ESS_CHECK(fd >= 0, "{} '{}': cannot create a file in '{}': {}", what, path, dir.string(), std::strerror(errno));
  temp_ = pattern;
  temp_slot_ = register_temp(temp_);
  file_ = ::fdopen(fd, "wb");
  if (file_ == nullptr) {
    ::close(fd);
    unregister_temp(temp_slot_);
    ::unlink(temp_.c_str());
    ESS_THROW("{} '{}': cannot open: {}", what, path, std::strerror(errno));
  }
}

AtomicFile::~AtomicFile() {
  if (file_ != nullptr) {
    std::fclose(file_);
    if (!temp_.empty()) ::unlink(temp_.c_str());
  }
  unregister_temp(temp_slot_);
}

void AtomicFile::write(const void* data, std::size_t bytes) {
  ESS_CHECK(file_ != nullptr, "{} '{}': already closed", what_, path_);
  ESS_CHECK(bytes == 0 || std::fwrite(data, 1, bytes, file_) == bytes, "{} '{}': write failed: {}", what_, path_,
            std::strerror(errno));
}

void AtomicFile::commit() {
  ESS_CHECK(file_ != nullptr, "{} '{}': already closed", what_, path_);
  if (temp_.empty()) {  // written in place
    const bool flushed = std::fflush(file_) == 0;
    const int err = errno;
    const int rc = std::fclose(file_);
    file_ = nullptr;
    ESS_CHECK(flushed && rc == 0, "{} '{}': write failed: {}", what_, path_, std::strerror(flushed ? errno : err));
    return;
  }
  const bool flushed = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  const int err = errno;
  const int rc = std::fclose(file_);
  file_ = nullptr;
  if (!flushed || rc != 0) {
    ::unlink(temp_.c_str());
    ESS_THROW("{} '{}': write failed: {}", what_, path_, std::strerror(flushed ? errno : err));
  }
  // mkstemp creates 0600; an output gets the usual permissions.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::chmod(temp_.c_str(), 0666 & ~mask);
  unregister_temp(temp_slot_);  // from here the temporary is the target, or is removed below
  temp_slot_ = -1;
  if (std::rename(temp_.c_str(), target_.c_str()) != 0) {
    const int e = errno;
    ::unlink(temp_.c_str());
    ESS_THROW("{} '{}': cannot move the finished file into place: {}", what_, path_, std::strerror(e));
  }
}

void install_output_cleanup() {
  static const bool installed = [] {
    for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
      struct sigaction old {};
      if (::sigaction(sig, nullptr, &old) != 0 || old.sa_handler != SIG_DFL) continue;
      struct sigaction sa {};
      sa.sa_handler = remove_temps_and_reraise;
      sigemptyset(&sa.sa_mask);
      ::sigaction(sig, &sa, nullptr);
    }
    return true;
  }();
  (void)installed;
}

void write_text_file(const std::string& path, const std::string& text, const char* what) {
  AtomicFile f(path, what);
  f.write(text);
  f.commit();
}

}  // namespace ess
