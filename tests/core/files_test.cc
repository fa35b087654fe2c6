// Inputs refused by name unless readable regular files; strict JSON.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "ess/core/error.h"
#include "ess/core/files.h"
#include "ess/core/json.h"
#include "testing/testing.h"

namespace ess {
namespace {

namespace fs = std::filesystem;

using Files = test::TempDirTest;

TEST_F(Files, BadInputsAreRefusedByName) {
  EXPECT_NE(test::error_of([&] { check_input_file((dir_ / "none").string(), "model config"); }).find("does not exist"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { check_input_file(dir_.string(), "model config"); }).find("is a directory"),
            std::string::npos);
  const auto in = dir_ / "in.json";
  std::ofstream(in) << "{\"a\": 1}";
  EXPECT_EQ(read_text_file(in.string(), "model config"), "{\"a\": 1}");
}

TEST(Json, AKeyGivenTwiceInOneObjectIsRefused) {
  EXPECT_NE(test::error_of([] { parse_json(R"({"a": 1, "b": {"c": 2, "c": 3}})", "x.json"); }).find("key 'c' is given twice"),
            std::string::npos);
  const auto j = parse_json(R"({"a": {"k": 1}, "b": {"k": 2}, "c": [{"k": 3}, {"k": 4}]})", "x.json");
  EXPECT_EQ(j["b"]["k"], 2);
  EXPECT_NE(test::error_of([] { parse_json("{", "x.json"); }).find("x.json: malformed JSON"), std::string::npos);
}

}  // namespace
}  // namespace ess
