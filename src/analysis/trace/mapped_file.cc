#include "analysis/trace/mapped_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "ess/core/error.h"
#include "ess/core/files.h"
#include "ess/io/text.h"
#include "ess/trace/format.h"

namespace ess::trace {

// The mappings alive now are kept in fixed storage for the handler, which may only call
// async-signal-safe functions: a fault inside one ends the process with exit status 3 and a
// message naming the file, as `ess` does for any run that cannot complete; a fault elsewhere
// goes to the handler that was there before (the default one, or a sanitizer's). Mappings are
// registered whether or not the handler is installed, so installing it later guards them too.
namespace {

constexpr int kMaxGuarded = 64;
struct GuardedMapping {
  std::atomic<bool> live{false};
  std::atomic<std::uintptr_t> begin{0};
  std::atomic<std::size_t> size{0};
  char message[1024] = {};
  std::size_t message_size = 0;
};
GuardedMapping g_guarded[kMaxGuarded];
struct sigaction g_previous_sigbus {};

extern "C" void trace_mapping_fault(int sig, siginfo_t* info, void*) {
  const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (auto& g : g_guarded) {
    if (!g.live.load()) continue;
    const std::uintptr_t b = g.begin.load();
    if (addr >= b && addr - b < g.size.load()) {
      [[maybe_unused]] const auto n = ::write(STDERR_FILENO, g.message, g.message_size);
      ::_exit(3);
    }
  }
  // Not a trace's page: the fault repeats under the previous handler when this returns.
  ::sigaction(sig, &g_previous_sigbus, nullptr);
}

// A slot for the mapping (-1 when all are taken: the mapping is then unguarded).
int guard_mapping(const void* begin, std::size_t size, const std::string& path) {
  for (int i = 0; i < kMaxGuarded; ++i) {
    bool expected = false;
    if (!g_guarded[i].live.compare_exchange_strong(expected, true)) continue;
    auto& g = g_guarded[i];
    const std::string text = fmt::format(
        "ess: cannot complete: {}: the trace file shrank while it was read (truncated by another process, or lost by "
        "its filesystem); nothing was written\n",
        printable(path));
    g.message_size = std::min(text.size(), sizeof(g.message));
    std::memcpy(g.message, text.data(), g.message_size);
    g.size.store(size);
    g.begin.store(reinterpret_cast<std::uintptr_t>(begin));
    return i;
  }
  return -1;
}

void unguard_mapping(int slot) {
  if (slot < 0) return;
  g_guarded[slot].begin.store(0);
  g_guarded[slot].size.store(0);
  g_guarded[slot].live.store(false);
}

}  // namespace

void install_mapping_guard() {
  static const bool installed = [] {
    if (::sigaction(SIGBUS, nullptr, &g_previous_sigbus) != 0) return false;
    struct sigaction sa {};
    sa.sa_sigaction = trace_mapping_fault;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    return ::sigaction(SIGBUS, &sa, nullptr) == 0;
  }();
  (void)installed;
}

MappedFile::MappedFile(const std::string& path) {
  check_input_file(path, "trace");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ESS_CHECK(fd >= 0, "{}: cannot open trace: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    ESS_THROW("{}: cannot stat trace: {}", path, std::strerror(err));
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return;
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  ESS_CHECK(p != MAP_FAILED, "{}: cannot map trace ({} bytes): {}", path, size, std::strerror(err));
  data_ = static_cast<const std::uint8_t*>(p);
  size_ = size;
  guard_ = guard_mapping(p, size, path);
}

MappedFile::~MappedFile() {
  unguard_mapping(guard_);
  if (data_ != nullptr) ::munmap(const_cast<std::uint8_t*>(data_), size_);
}

}  // namespace ess::trace
