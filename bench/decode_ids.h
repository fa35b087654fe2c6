// What the CPU step benchmarks share: top-k id sequences with the temporal locality of decode
// (each query keeps most of its previous selection and draws `new_per_query` fresh ids), and
// the swap engine of one layer over a batch of requests, at steady state.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "ess/cache/sparse_pool.h"
#include "ess/cache/swap_engine.h"
#include "ess/cache/total_pool.h"

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

// The CPU swap engine of one layer for s.B requests of s.context tokens, ratio s.ratio, run
// once over `steps` (steady state) by the constructor; step(i) runs steps[i % size].
struct SwapDecision {
  explicit SwapDecision(const Shape& s, std::vector<std::vector<std::int32_t>> id_steps)
      : total(1, LatentLayout{}, static_cast<std::uint64_t>(s.B) * ((s.context + 63) / 64) * 64 * LatentLayout{}.bytes()),
        sparse(config(s), std::make_unique<CpuSlotStorage>()),
        engine(total, sparse),
        steps(std::move(id_steps)) {
    for (int b = 0; b < s.B; ++b) {
      total.admit(b, s.context);
      engine.admit(b);
      batch.push_back(b);
      lengths.push_back(s.context);
    }
    for (std::size_t i = 0; i < steps.size(); ++i) step(i);
  }
  const SwapResult& step(std::size_t i) {
    engine.step({0, batch, steps[i % steps.size()], lengths}, result);
    return result;
  }
  static SparsePoolConfig config(const Shape& s) {
    SparsePoolConfig sc;
    sc.num_layers = 1;
    sc.max_requests = s.B;
    sc.slots = slots_for_ratio(s.ratio, s.context);
    sc.query_tokens = s.T;
    sc.topk = s.K;
    return sc;
  }

  TotalPool total;
  SparsePool sparse;
  SwapEngine engine;
  std::vector<std::vector<std::int32_t>> steps;
  std::vector<RequestId> batch;
  std::vector<std::int64_t> lengths;
  SwapResult result;
};

}  // namespace ess::bench
