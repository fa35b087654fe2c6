// Summary statistics of repeated measurements: benchmarks report median / min / max.
#pragma once

#include <algorithm>
#include <vector>

namespace ess::test {

struct Summary {
  double median = 0, min = 0, max = 0;
  int count = 0;
};

inline Summary summarize(std::vector<double> v) {
  Summary s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.count = static_cast<int>(v.size());
  s.min = v.front();
  s.max = v.back();
  s.median = v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  return s;
}

}  // namespace ess::test
