// Helpers shared by the tests.
#pragma once

#include <functional>
#include <string>

#include "ess/core/error.h"
#include "ess/runtime/backend.h"

namespace ess::test {

// The message of the ess::Error that `f` throws, or "no error".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace ess::test

// GPU tests skip themselves when no CUDA device is present.
#define ESS_SKIP_WITHOUT_GPU()                                                      \
  do {                                                                              \
    if (!::ess::cuda_device_present()) GTEST_SKIP() << "no CUDA device present";    \
  } while (0)
