// The host memory a run may take: checked before the work starts, so that a run that would
// not fit stops with a message naming the estimate instead of being killed half-way.
#pragma once

#include <cstdint>
#include <string>

namespace ess {

// Host memory a new allocation can have now (MemAvailable, bounded by an address-space limit
// such as ulimit -v), bytes; 0 when unknown.
std::uint64_t available_host_memory();
// Throws ess::Error naming `what` when `bytes` exceed the host memory available now.
void check_host_memory(double bytes, const std::string& what);

}  // namespace ess
