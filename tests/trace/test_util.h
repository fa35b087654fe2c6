// Helpers shared by the trace tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "ess/core/error.h"
#include "ess/trace/generator.h"

namespace ess::trace::testing {

// A small generator profile: 4 layers of different drift, top-64, MTP 2, 4 prefill windows.
inline GeneratorProfile tiny_profile() {
  GeneratorProfile p;
  p.name = "tiny";
  p.layers = 4;
  p.topk = 64;
  p.mtp = 2;
  p.accept_ratio = 1.5;
  p.prefill_windows = 4;
  p.sink_tokens = 2;
  p.recent_window = 8;
  p.candidate_base = 300;
  p.reference_context = 1000;
  p.topic_shift_rate = 0.1;
  p.candidate_churn = 0.01;
  p.drift = {0.5, 0.05, 0.2, 0.01};
  p.validate("test");
  return p;
}

inline std::string temp_path(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const auto dir = std::filesystem::path(::testing::TempDir()) / "ess_trace_tests";
  std::filesystem::create_directories(dir);
  return (dir / (std::string(info->test_suite_name()) + "." + info->name() + "." + name)).string();
}

inline std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::string& path, const std::vector<std::uint8_t>& b) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Expects fn() to throw ess::Error whose message contains every one of `parts`.
inline void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected an ess::Error";
  } catch (const ess::Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

}  // namespace ess::trace::testing
