// One simulated step as events on streams, written as Chrome-trace JSON (opens in Perfetto
// and chrome://tracing): one track per stream (compute, comm, h2d, d2h).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <string_view>
#include <vector>

#include "ess/sim/op_cost.h"

namespace ess::sim {

enum class Stream { kCompute, kComm, kH2D, kD2H };
std::string_view to_string(Stream s);

struct TimelineEvent {
  Stream stream = Stream::kCompute;
  std::string name;  // op name, with layer and micro-batch
  double start_us = 0;
  double dur_us = 0;
  CostSource source = CostSource::kAnalytical;
};

struct Timeline {
  std::vector<TimelineEvent> events;
  nlohmann::json to_chrome_trace(const std::string& title) const;
  void write(const std::string& path, const std::string& title) const;
};

}  // namespace ess::sim
