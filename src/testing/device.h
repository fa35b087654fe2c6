// What the benchmarks and the rig share: the device they run on, and the time they ran.
#pragma once

#include <string>

namespace ess::test {

// UTC now, ISO 8601 (the date field of every benchmark's JSON).
std::string utc_now();

// Makes `device` current and returns its name; throws ess::Error naming `who` when there is
// no such device. CUDA target only (testing/device_cuda.cc).
std::string use_device(int device, const char* who);

}  // namespace ess::test
