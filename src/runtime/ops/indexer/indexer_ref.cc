// The lightning indexer's and top-k's CPU references (ess/ops/reference.h).
#include "ess/ops/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "ess/core/error.h"
#include "ess/model/numerics.h"

namespace ess::ref {

void indexer_logits(const IndexerLayout& layout, std::span<const float> q, std::span<const float> w,
                    int heads, std::span<const std::uint8_t* const> pages, std::int64_t length,
                    std::span<float> logits) {
  const int D = layout.head_dim;
  ESS_CHECK(heads > 0 && q.size() == static_cast<std::size_t>(heads) * D && w.size() == static_cast<std::size_t>(heads),
            "indexer_logits: q has {} values and w {} for {} heads x {} dims", q.size(), w.size(), heads, D);
  ESS_CHECK(length >= 0 && static_cast<std::int64_t>(pages.size()) * kPageTokens >= length,
            "indexer_logits: {} pages cannot hold {} keys", pages.size(), length);
  ESS_CHECK(logits.size() >= static_cast<std::size_t>(length), "indexer_logits: {} logits for {} keys",
            logits.size(), length);
  // q transposed to [D][H] so that the per-head dot products advance together (the same
  // summation order, d = 0..D-1, for every head; only the loop nest differs).
  std::vector<double> qt(static_cast<std::size_t>(D) * heads);
  for (int h = 0; h < heads; ++h) {
    for (int d = 0; d < D; ++d) qt[static_cast<std::size_t>(d) * heads + h] = q[static_cast<std::size_t>(h) * D + d];
  }
  std::vector<double> dot(static_cast<std::size_t>(heads));
  for (std::int64_t j = 0; j < length; ++j) {
    const std::uint8_t* page = pages[static_cast<std::size_t>(j / kPageTokens)];
    const int jj = static_cast<int>(j % kPageTokens);
    std::fill(dot.begin(), dot.end(), 0.0);
    for (int d = 0; d < D; ++d) {
      const double k8 = fp8_e4m3_to_float(page[layout.key_offset(jj) + d]);
      const double* qd = qt.data() + static_cast<std::size_t>(d) * heads;
      for (int h = 0; h < heads; ++h) dot[h] += qd[h] * k8;
    }
    float scale = 0.0f;
    std::memcpy(&scale, page + layout.scale_offset(jj), 4);
    double score = 0.0;
    for (int h = 0; h < heads; ++h) score += static_cast<double>(w[h]) * std::max(dot[h], 0.0);
    logits[static_cast<std::size_t>(j)] = static_cast<float>(score * scale);
  }
}

void topk(std::span<const float> logits, int k, std::span<std::int32_t> out) {
  ESS_CHECK(k > 0 && out.size() == static_cast<std::size_t>(k), "topk: k = {} with an output of {}", k,
            out.size());
  ESS_CHECK(logits.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
            "topk: {} logits exceed int32 ids", logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) {
    ESS_CHECK(!std::isnan(logits[i]), "topk: logit {} is NaN", i);
  }
  std::vector<std::int32_t> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  const std::size_t n = std::min(idx.size(), static_cast<std::size_t>(k));
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(n), idx.end(),
                    [&](std::int32_t a, std::int32_t b) {
                      return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
                    });
  std::fill(out.begin(), out.end(), -1);
  std::copy(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(n), out.begin());
}

}  // namespace ess::ref
