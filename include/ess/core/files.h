// Input files: every file a run reads (model configs, profiles, traces) is refused by name
// unless it is a readable regular file. Outputs are the analysis layer's (ess/io/output_file.h).
#pragma once

#include <string>

namespace ess {

// Throws ess::Error unless `path` is an existing regular file ("what 'path' does not exist",
// "... is a directory, not a file").
void check_input_file(const std::string& path, const char* what);
// The whole file as text (check_input_file first).
std::string read_text_file(const std::string& path, const char* what);

}  // namespace ess
