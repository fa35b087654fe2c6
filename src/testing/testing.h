// Helpers shared by the tests.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

#include "ess/core/error.h"
#include "ess/runtime/backend.h"

namespace ess::test {

// A test with a fresh folder of its own (dir_, empty at the start), removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) / ("ess_test_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

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
