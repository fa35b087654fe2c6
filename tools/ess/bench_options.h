// The options the op benchmarks share (`ess bench transfer | swap | attention | indexer`): one
// definition of each, with its check and name; a command sets the defaults it wants, then adds the
// options it takes, naming what they mean for it.
#pragma once

#include <cstdint>
#include <limits>

#include "commands.h"

namespace ess::cli {

struct BenchOptions {
  int requests = 64, mtp = 2, topk = 2048, slots = 6554, repeats = 20, warmup = 5, device = 0;
  long long context = 32768;
  std::uint64_t seed = 1;
  Format format = Format::kTable;

  static constexpr int kInt32Max = std::numeric_limits<std::int32_t>::max();

  // --requests,-b (the batch): `names` for a command that calls it otherwise (--batch,-b).
  void add_requests(CLI::App& cmd, const char* help, int most = kInt32Max, const char* names = "--requests,-b") {
    cmd.add_option(names, requests, help)->capture_default_str()->check(in_range(1, most));
  }
  void add_mtp(CLI::App& cmd) {
    cmd.add_option("--mtp,-t", mtp, "Query tokens per request (MTP T)")->capture_default_str()->check(in_range(1, 32));
  }
  void add_topk(CLI::App& cmd, const char* help, int most = kInt32Max) {
    cmd.add_option("--topk,-k", topk, help)->capture_default_str()->check(in_range(1, most));
  }
  void add_slots(CLI::App& cmd, const char* help) {
    cmd.add_option("--slots", slots, help)->capture_default_str()->check(in_range(1, kInt32Max));
  }
  void add_context(CLI::App& cmd, const char* help, long long least = 1) {
    cmd.add_option("--context,-c", context, help)->capture_default_str()->check(in_range(double(least), 1 << 30));
  }
  void add_repeats(CLI::App& cmd, const char* help) {
    cmd.add_option("--repeats,-r", repeats, help)->capture_default_str()->check(in_range(1, 1 << 20));
  }
  void add_warmup(CLI::App& cmd, const char* help) {
    cmd.add_option("--warmup", warmup, help)->capture_default_str()->check(in_range(0, 1 << 20));
  }
  // --device, --seed and --format (table or json): every benchmark has them.
  void add_run(CLI::App& cmd) {
    cmd.add_option("--device", device, "CUDA device")->capture_default_str()->check(in_range(0, 1023));
    cmd.add_option("--seed", seed, "Random seed")->capture_default_str()->check(unsigned_integer());
    add_format_option(cmd, format, false);
  }
};

}  // namespace ess::cli
