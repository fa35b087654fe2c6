// Progress of a long command on stderr, only when stderr is a terminal (never in a pipe, a log
// or a test): "\r  <what>: done/total (rate/s)", first after `quiet_s` seconds, then at most
// five times a second; the line is ended when the count completes or the object goes away.
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
    if (!tty_) return;
    const auto now = Clock::now();
    const double s = std::chrono::duration<double>(now - t0_).count();
    const bool last = done >= total;
    if (s < quiet_s_ || (!last && std::chrono::duration<double>(now - shown_).count() < 0.2)) return;
    shown_ = now;
    fmt::print(stderr, "\r  {}: {}/{} ({:.0f}/s)   ", what_, done, total, static_cast<double>(done) / std::max(s, 1e-9));
    printed_ = true;
    if (last) end_line();
  }

 private:
  using Clock = std::chrono::steady_clock;
  void end_line() {
    if (printed_) fmt::print(stderr, "\n");
    printed_ = false;
  }
  std::string what_;
  double quiet_s_;
  bool tty_;
  bool printed_ = false;
  Clock::time_point t0_, shown_{};
};

}  // namespace ess::cli
