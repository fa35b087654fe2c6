#include "ess/core/files.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "ess/core/error.h"

namespace ess {

namespace fs = std::filesystem;

void check_input_file(const std::string& path, const char* what) {
  ESS_CHECK(!path.empty(), "{}: no file name given", what);
  std::error_code ec;
  const auto st = fs::status(path, ec);
  ESS_CHECK(fs::exists(st), "{} '{}' does not exist", what, path);
  ESS_CHECK(!fs::is_directory(st), "{} '{}' is a directory, not a file", what, path);
  ESS_CHECK(fs::is_regular_file(st), "{} '{}' is not a regular file", what, path);
}

std::string read_text_file(const std::string& path, const char* what) {
  check_input_file(path, what);
  std::ifstream in(path, std::ios::binary);
  ESS_CHECK(in.good(), "{} '{}': cannot open: {}", what, path, std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  ESS_CHECK(!in.bad(), "{} '{}': read failed", what, path);
  return ss.str();
}

}  // namespace ess
