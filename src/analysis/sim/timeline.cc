#include "ess/sim/timeline.h"

#include <nlohmann/json.hpp>

#include <fstream>

#include "ess/core/error.h"
#include "ess/io/output_file.h"

namespace ess::sim {

std::string_view to_string(Stream s) {
  switch (s) {
    case Stream::kCompute: return "compute";
    case Stream::kComm: return "comm (EP all-to-all)";
    case Stream::kH2D: return "h2d (FlashTrans misses)";
    case Stream::kD2H: return "d2h (new-token write-back)";
  }
  return "?";
}

nlohmann::json Timeline::to_chrome_trace(const std::string& title) const {
  nlohmann::json trace = nlohmann::json::array();
  trace.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", 0}, {"args", {{"name", title}}}});
  for (int s = 0; s < 4; ++s) {
    trace.push_back({{"ph", "M"},
                     {"name", "thread_name"},
                     {"pid", 0},
                     {"tid", s},
                     {"args", {{"name", std::string(to_string(static_cast<Stream>(s)))}}}});
  }
  for (const auto& e : events) {
    trace.push_back({{"ph", "X"},
                     {"name", e.name},
                     {"pid", 0},
                     {"tid", static_cast<int>(e.stream)},
                     {"ts", e.start_us},
                     {"dur", e.dur_us},
                     {"args", {{"source", std::string(to_string(e.source))}}}});
  }
  return {{"traceEvents", trace}, {"displayTimeUnit", "ms"}};
}

void Timeline::write(const std::string& path, const std::string& title) const {
  write_text_file(path, to_chrome_trace(title).dump() + "\n", "timeline");
}

}  // namespace ess::sim
