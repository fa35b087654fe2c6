// Top-k id sequences with the temporal locality of decode, shared by the CPU step benchmarks:
// each query keeps most of its previous selection and draws `new_per_query` fresh ids.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

namespace ess::bench {

struct Shape {
  int B, T, K;
  std::int64_t context;
  double ratio;
  int new_per_query;
};

// Pre-generated [steps][B][T][K] ids with decode-like locality.
inline std::vector<std::vector<std::int32_t>> make_steps(const Shape& s, int steps, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(steps));
  std::vector<std::vector<std::int32_t>> cur(static_cast<std::size_t>(s.B));
  const auto rand_id = [&] { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(s.context)); };
  for (int st = 0; st < steps; ++st) {
    auto& ids = out[static_cast<std::size_t>(st)];
    ids.reserve(static_cast<std::size_t>(s.B) * s.T * s.K);
    for (int b = 0; b < s.B; ++b) {
      auto& set = cur[static_cast<std::size_t>(b)];
      std::set<std::int32_t> q(set.begin(), set.end());
      if (q.empty()) {
        while (static_cast<int>(q.size()) < s.K) q.insert(rand_id());
      } else {
        std::vector<std::int32_t> v(q.begin(), q.end());
        std::shuffle(v.begin(), v.end(), rng);
        for (int i = 0; i < s.new_per_query; ++i) q.erase(v[static_cast<std::size_t>(i)]);
        while (static_cast<int>(q.size()) < s.K) q.insert(rand_id());
      }
      set.assign(q.begin(), q.end());
      for (int t = 0; t < s.T; ++t) {
        // MTP query tokens share all but a few of their selections.
        std::vector<std::int32_t> row(set);
        for (int i = 0; i < t * 16; ++i) {
          std::int32_t x = rand_id();
          while (q.count(x) != 0) x = rand_id();
          row[static_cast<std::size_t>(i)] = x;
          q.insert(x);
        }
        ids.insert(ids.end(), row.begin(), row.end());
      }
    }
  }
  return out;
}

}  // namespace ess::bench
