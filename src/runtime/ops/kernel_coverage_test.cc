// The emulation coverage report (docs/gpu-validation.md, "Device code that has run before the
// GPU") against the sources: every __global__ kernel of src/ has a row, every row names a
// kernel of its source, and each is run by an emulation test that the build defines
// (ess_add_emulation_test in a CMakeLists.txt) or carries a reason it is not.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

namespace {

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(KernelCoverage, TheReportListsEveryKernelAndHowItRunsWithoutAGpu) {
  const std::filesystem::path root = ESS_SOURCE_DIR;
  // Kernels in the sources: "__global__ void [__launch_bounds__(...)] name(".
  std::map<std::string, std::string> kernels;  // name -> source, relative to src/
  std::set<std::string> emulation_tests;
  const std::regex global(R"(__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\()");
  const std::regex emulation(R"(ess_add_emulation_test\(\s*(\w+))");
  for (const auto& e : std::filesystem::recursive_directory_iterator(root / "src")) {
    const std::string text = slurp(e.path());
    if (e.path().extension() == ".cu") {
      for (std::sregex_iterator m(text.begin(), text.end(), global), end; m != end; ++m) {
        kernels[(*m)[1]] = std::filesystem::relative(e.path(), root / "src").generic_string();
      }
    }
    if (e.path().filename() == "CMakeLists.txt") {
      for (std::sregex_iterator m(text.begin(), text.end(), emulation), end; m != end; ++m) emulation_tests.insert((*m)[1]);
    }
  }
  ASSERT_GE(kernels.size(), 13u) << "the scan found too few kernels: the pattern no longer matches the sources";
  // The report's rows: | `kernel` | `source` | how |
  const std::string doc = slurp(root / "docs" / "gpu-validation.md");
  const std::regex row(R"(\|\s*`(\w+)`\s*\|\s*`([^`]+)`\s*\|\s*([^|\n]+?)\s*\|)");
  const std::regex test_name(R"(`(\w+)`)");
  std::set<std::string> listed;
  for (std::sregex_iterator m(doc.begin(), doc.end(), row), end; m != end; ++m) {
    const std::string name = (*m)[1], source = (*m)[2], how = (*m)[3];
    listed.insert(name);
    const auto k = kernels.find(name);
    EXPECT_TRUE(k != kernels.end()) << "the report lists " << name << ", which no .cu source defines";
    if (k != kernels.end()) {
      EXPECT_EQ(source, k->second) << name;
    }
    std::smatch t;
    if (std::regex_match(how, t, test_name)) {
      EXPECT_TRUE(emulation_tests.contains(t[1])) << name << ": no ess_add_emulation_test(" << t[1] << ") in the build";
    } else {
      EXPECT_TRUE(how.starts_with("not yet: ") || how.starts_with("not emulated: "))
          << name << ": neither an emulation test nor a reason (\"not yet: ...\" / \"not emulated: ...\"): " << how;
      EXPECT_GT(how.size(), 20u) << name << ": the reason is missing";
    }
  }
  for (const auto& [name, source] : kernels) {
    EXPECT_TRUE(listed.contains(name)) << source << " defines " << name << ", which docs/gpu-validation.md does not list";
  }
}

}  // namespace
