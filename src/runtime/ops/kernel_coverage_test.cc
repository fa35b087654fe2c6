// The emulation coverage report (docs/gpu-validation.md, "Device code that has run before the
// GPU") against the sources: every __global__ kernel of src/ has a row, every row names a
// kernel of its source, and each is run by an emulation test that the build defines
// (ess_add_emulation_test or ess_add_emulated_cuda_test in a CMakeLists.txt) or carries a
// reason it is not.
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; }

// The identifier at `at` (after blanks), and where it ends.
std::string identifier(const std::string& text, std::size_t& at) {
  while (at < text.size() && std::isspace(static_cast<unsigned char>(text[at])) != 0) ++at;
  const std::size_t begin = at;
  while (at < text.size() && word_char(text[at])) ++at;
  return text.substr(begin, at - begin);
}

// Kernel names: "__global__ void [__launch_bounds__(...)] name(".
std::vector<std::string> kernels_in(const std::string& text) {
  std::vector<std::string> out;
  for (std::size_t at = text.find("__global__"); at != std::string::npos; at = text.find("__global__", at)) {
    at += 10;
    if (identifier(text, at) != "void") continue;
    std::size_t next = at;
    std::string name = identifier(text, next);
    if (name == "__launch_bounds__") {
      next = text.find(')', next);
      if (next == std::string::npos) break;
      ++next;
      name = identifier(text, next);
    }
    if (!name.empty()) out.push_back(name);
  }
  return out;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// "`x`" -> "x"; anything else -> "".
std::string ticked(const std::string& cell) {
  return cell.size() > 2 && cell.front() == '`' && cell.back() == '`' && cell.find('`', 1) == cell.size() - 1
             ? cell.substr(1, cell.size() - 2)
             : "";
}

TEST(KernelCoverage, TheReportListsEveryKernelAndHowItRunsWithoutAGpu) {
  const std::filesystem::path root = ESS_SOURCE_DIR;
  std::map<std::string, std::string> kernels;  // name -> source, relative to src/
  std::set<std::string> emulation_tests;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root / "src")) {
    if (e.path().extension() == ".cu") {
      for (const std::string& k : kernels_in(slurp(e.path()))) {
        kernels[k] = std::filesystem::relative(e.path(), root / "src").generic_string();
      }
    }
    if (e.path().filename() == "CMakeLists.txt") {
      const std::string text = slurp(e.path());
      for (const std::string call : {"ess_add_emulation_test(", "ess_add_emulated_cuda_test("}) {
        for (std::size_t at = text.find(call); at != std::string::npos; at = text.find(call, at)) {
          at += call.size();
          emulation_tests.insert(identifier(text, at));
        }
      }
    }
  }
  ASSERT_GE(kernels.size(), 13u) << "the scan found too few kernels: the pattern no longer matches the sources";
  // The report's rows: | `kernel` | `source` | how |
  std::istringstream doc(slurp(root / "docs" / "gpu-validation.md"));
  std::set<std::string> listed;
  for (std::string line; std::getline(doc, line);) {
    if (line.rfind("| `", 0) != 0) continue;
    std::vector<std::string> cells;
    std::istringstream row(line.substr(1));
    for (std::string cell; std::getline(row, cell, '|');) cells.push_back(trim(cell));
    if (cells.size() < 3) continue;
    const std::string name = ticked(cells[0]), source = ticked(cells[1]), how = cells[2];
    if (name.empty() || source.empty() || source.find(".cu") == std::string::npos) continue;  // another table
    listed.insert(name);
    const auto k = kernels.find(name);
    EXPECT_TRUE(k != kernels.end()) << "the report lists " << name << ", which no .cu source defines";
    if (k != kernels.end()) {
      EXPECT_EQ(source, k->second) << name;
    }
    const std::string test = ticked(how);
    if (!test.empty()) {
      EXPECT_TRUE(emulation_tests.contains(test)) << name << ": no ess_add_emulation_test(" << test << ") in the build";
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
