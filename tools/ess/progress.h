// Progress of a long command on stderr. On a terminal: "\r  <what>: done/total (rate/s)", first
// after `quiet_s` seconds, then at most five times a second; the line is ended when the count
// completes or the object goes away. In a pipe or a log: a whole line "  <what>: done/total
// (rate/s)" first after 10 s, then every 30 s, and the last count when a line was printed (a run
// of seconds stays silent, a run of minutes says where it is).
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

namespace ess::cli {

class Progress {
 public:
  explicit Progress(std::string what, double quiet_s = 1.0)
      : what_(std::move(what)), quiet_s_(quiet_s), tty_(::isatty(::fileno(stderr)) != 0), t0_(Clock::now()) {}
  ~Progress() { end_line(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Not thread-safe: callers from several threads serialize the calls.
  void operator()(std::size_t done, std::size_t total) {
    const auto now = Clock::now();
    const double s = std::chrono::duration<double>(now - t0_).count();
    const bool last = done >= total;
    const double rate = static_cast<double>(done) / std::max(s, 1e-9);
    if (!tty_) {
      const bool due = s >= kLogQuietS && std::chrono::duration<double>(now - shown_).count() >= kLogIntervalS;
      if (due || (last && logged_)) {
        shown_ = now;
        logged_ = true;
        fmt::print(stderr, "  {}: {}/{} ({:.0f}/s)\n", what_, done, total, rate);
      }
      return;
    }
    if (s < quiet_s_ || (!last && std::chrono::duration<double>(now - shown_).count() < 0.2)) return;
    shown_ = now;
    fmt::print(stderr, "\r  {}: {}/{} ({:.0f}/s)   ", what_, done, total, rate);
    printed_ = true;
    if (last) end_line();
  }

 private:
  using Clock = std::chrono::steady_clock;
  void end_line() {
    if (printed_) fmt::print(stderr, "\n");
    printed_ = false;
  }
  static constexpr double kLogQuietS = 10, kLogIntervalS = 30;
  std::string what_;
  double quiet_s_;
  bool tty_;
  bool printed_ = false;
  bool logged_ = false;
  Clock::time_point t0_, shown_{};
};

}  // namespace ess::cli
