#include "ess/io/host_budget.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>

#include "ess/core/error.h"

namespace ess {

namespace {

// A /proc "Key: N kB" field in bytes; 0 when absent.
std::uint64_t proc_kb_field(const char* file, const std::string& field) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::strtoull(line.c_str() + field.size(), nullptr, 10) * 1024;
  }
  return 0;
}

}  // namespace

std::uint64_t available_host_memory() {
  std::uint64_t room = proc_kb_field("/proc/meminfo", "MemAvailable:");
  if (room == 0) {
    const long pages = ::sysconf(_SC_AVPHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    room = pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
  }
  // An address-space limit (ulimit -v) binds before physical memory does.
  rlimit as{};
  if (::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    const std::uint64_t used = proc_kb_field("/proc/self/status", "VmSize:");
    const std::uint64_t left = as.rlim_cur > used ? as.rlim_cur - used : 1;
    room = room == 0 ? left : std::min(room, left);
  }
  return room;
}

void check_host_memory(double bytes, const std::string& what) {
  const std::uint64_t room = available_host_memory();
  ESS_CHECK(room == 0 || bytes <= static_cast<double>(room),
            "{} needs about {:.1f} GB of host memory; {:.1f} GB are available", what, bytes / 1e9,
            static_cast<double>(room) / 1e9);
}

}  // namespace ess
