// Shared helpers of the cache tests: small pools, recognisable entry bytes, and an
// independently written LRU model the engine must match bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ess/cache/sparse_pool.h"
#include "ess/cache/swap_engine.h"
#include "ess/cache/total_pool.h"

namespace ess::test {

// A small valid entry layout for fast tests: 128 FP8 + 1 scale + 6 bf16 = 144 bytes = 9 x 16.
inline LatentLayout small_layout() { return LatentLayout{128, 6}; }

// Fills every entry of (id, layer, [from, to)) with bytes derived from (id, layer, token), so
// that any misplaced copy is visible.
inline void write_pattern(TotalPool& total, RequestId id, int layer, std::int64_t from, std::int64_t to) {
  std::vector<std::uint8_t> e(total.entry_bytes());
  for (std::int64_t t = from; t < to; ++t) {
    for (std::size_t i = 0; i < e.size(); ++i) {
      e[i] = static_cast<std::uint8_t>((id * 131 + layer * 31 + t * 7 + static_cast<std::int64_t>(i)) & 0xff);
    }
    total.write(id, layer, t, e);
  }
}

// Straightforward LRU over (recency, slot): the specification of LruPolicy + LayerCache,
// written without linked lists, epochs or placeholders.
class NaiveLru {
 public:
  explicit NaiveLru(std::int32_t slots) : token_(static_cast<std::size_t>(slots), -1), stamp_(static_cast<std::size_t>(slots), -1) {}

  // ids: [T][K]; returns slot ids and appends (token, slot) fills.
  std::vector<std::int32_t> step(std::span<const std::int32_t> ids, std::vector<std::pair<std::int32_t, std::int32_t>>& fills) {
    std::vector<std::int32_t> ws;  // canonical first-occurrence order
    std::unordered_set<std::int32_t> seen;
    for (std::int32_t t : ids) {
      if (t >= 0 && seen.insert(t).second) ws.push_back(t);
    }
    std::vector<bool> in_ws(token_.size(), false);
    std::vector<std::int32_t> misses;
    for (std::int32_t t : ws) {
      auto it = slot_.find(t);
      if (it != slot_.end()) {
        in_ws[static_cast<std::size_t>(it->second)] = true;
      } else {
        misses.push_back(t);
      }
    }
    std::vector<std::int32_t> candidates;
    for (std::size_t s = 0; s < token_.size(); ++s) {
      if (!in_ws[s]) candidates.push_back(static_cast<std::int32_t>(s));
    }
    std::stable_sort(candidates.begin(), candidates.end(), [&](std::int32_t a, std::int32_t b) {
      return stamp_[a] != stamp_[b] ? stamp_[a] < stamp_[b] : a < b;
    });
    for (std::size_t m = 0; m < misses.size(); ++m) {
      const std::int32_t s = candidates.at(m);
      if (token_[s] >= 0) slot_.erase(token_[s]);
      token_[s] = misses[m];
      slot_[misses[m]] = s;
      in_ws[s] = true;
      fills.emplace_back(misses[m], s);
    }
    for (std::size_t s = 0; s < token_.size(); ++s) {
      if (in_ws[s]) stamp_[s] = clock_;
    }
    ++clock_;
    std::vector<std::int32_t> out;
    for (std::int32_t t : ids) out.push_back(t < 0 ? -1 : slot_.at(t));
    return out;
  }
  const std::vector<std::int64_t>& stamps() const { return stamp_; }
  const std::vector<std::int32_t>& tokens() const { return token_; }

 private:
  std::vector<std::int32_t> token_;
  std::vector<std::int64_t> stamp_;
  std::unordered_map<std::int32_t, std::int32_t> slot_;
  std::int64_t clock_ = 0;
};

// [T][K] ids with decode-like locality: each query keeps most of its previous selection (all
// but `fresh` ids of `prev`, which it updates), later query rows differ in one id, rows are
// duplicate-free, some ids -1.
inline std::vector<std::int32_t> decode_like_ids(std::vector<std::int32_t>& prev, int T, int K, std::int64_t len, int fresh,
                                          std::mt19937& rng) {
  std::set<std::int32_t> q;
  const auto want = static_cast<std::size_t>(std::min<std::int64_t>(K, len));
  for (std::int32_t t : prev) {
    if (q.size() + static_cast<std::size_t>(fresh) < want) q.insert(t);
  }
  while (q.size() < want) q.insert(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(len)));
  prev.assign(q.begin(), q.end());
  std::vector<std::int32_t> out;
  for (int t = 0; t < T; ++t) {
    std::vector<std::int32_t> row(prev);
    std::shuffle(row.begin(), row.end(), rng);
    if (t > 0 && !row.empty()) row[0] = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(len));
    std::set<std::int32_t> uniq;
    for (auto& x : row) {
      if (!uniq.insert(x).second) x = -1;  // keep rows duplicate-free
    }
    row.resize(static_cast<std::size_t>(K), -1);
    if (rng() % 5 == 0) row[rng() % static_cast<std::uint64_t>(K)] = -1;
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

}  // namespace ess::test
