// Problems and checks of the lightning-indexer (FP8 logits) and top-k tests
// (indexer_cases.h): seeded pages, queries and weights, the reference logits with their
// error bounds, and the comparisons.
//
// Logits tolerance. Products of two FP8 e4m3 values are exact in fp32, but the Hopper FP8
// tensor core does not add them in full fp32: each MMA (k = 32) aligns its 32 products and
// the incoming accumulator to the largest exponent and keeps about 13 fraction bits, by
// truncation (DeepSeek-V3 report sec. 3.3.2; bit-level models of the H100 tensor cores).
// So, with u13 = 2^-13, one k-step of one head's dot product errs by at most
// 33 u13 max(|acc|, max |p_i|) <= 33 u13 A, A = sum_d |q_hd k_jd|; four k-steps (128 dims,
// chained through the accumulator), one more truncation per step for the final
// normalization and the slightly grown accumulator give |d_h - dot_h| <= 4 * 35 * 1.03 u13
// A_h < 160 u13 A_h. ReLU is 1-Lipschitz; the fp32 head sum (16 FMAs per thread, two
// shuffle adds), the scale multiply and the reference's own rounding to float add at most
// 24 u24 sum_h |w_h| A_h (u24 = 2^-24). Hence, per logit,
//     |gpu - ref| <= scale_j * sum_h |w_h| A_hj * (160 u13 + 24 u24)       (about 2 %)
// This is a worst case (each test records its largest error / bound as the property
// worst_error_over_bound); typical errors are far smaller. To catch any layout or
// indexing slip that such a bound could hide, the "exact" cases use small
// integers (|q|, |k| <= 3, |w| <= 8, power-of-two scales): every partial dot product is an
// integer of magnitude <= 128 * 9 < 2^11, exact in the truncating accumulator with bits to
// spare, and the head sums stay below 2^24, so the GPU must equal the reference exactly.
//
// Top-k is compared bit for bit with ess::ref::topk on the same logits (the GPU's own,
// downloaded). End to end, the GPU's selection is also held against ref::topk on the
// reference logits: every index the two sets do not share must be a near-tie, i.e. its
// reference logit lies within the logits bound of the other set's boundary (see
// expect_near_tie_agreement).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ess/model/entry_layout.h"
#include "ess/model/numerics.h"
#include "ess/ops/reference.h"
#include "testing/accuracy.h"

namespace ess::indexer_test {

inline constexpr int kDim = 128;
inline constexpr double kU13 = 1.0 / 8192.0;              // 2^-13: the FP8 MMA accumulator's unit
inline constexpr double kU24 = 1.0 / 16777216.0;          // 2^-24: fp32 unit roundoff
inline constexpr double kBoundFactor = 160 * kU13 + 24 * kU24;
static_assert(kBoundFactor == test::kIndexerLogitsTolerance, "test::indexer_reference (tests and benchmark) uses this bound");
inline constexpr std::uint32_t kSentinel = 0x7fbadbadu;   // a NaN payload no kernel produces

// A random FP8 e4m3 byte that is not NaN (S.1111.111).
inline std::uint8_t random_fp8(std::mt19937& rng) {
  auto b = static_cast<std::uint8_t>(rng() & 0xffu);
  if ((b & 0x7fu) == 0x7fu) b = static_cast<std::uint8_t>(b ^ 1u);
  return b;
}

inline float pow2(int e) { return std::ldexp(1.0f, e); }

// ---- Indexer problems ------------------------------------------------------------------

enum class Mode {
  kRandom,   // q random FP8 bytes; keys half quantized from floats of varied magnitude, half
             // random bytes with random power-of-two scales; w in [-2, 2]
  kExact,    // small integers: every sum is exact, the GPU must equal the reference
  kSpecial,  // a NaN in one token's q; w = +-1e37 so that positive dot products overflow
};

struct Problem {
  int B = 0, T = 0, H = 0;
  int max_pages = 0;
  std::int64_t stride = 0;
  std::vector<std::uint8_t> arena;  // 64-token pages, shuffled
  std::vector<std::int32_t> table;  // [B][max_pages], -1 past each request's pages
  std::vector<std::int32_t> lengths;  // [B][T]
  std::vector<std::uint8_t> q;        // [B][T][H][128]
  std::vector<float> w;               // [B][T][H]
};

inline Problem make_problem(int B, int T, int H, Mode mode, const std::vector<std::int64_t>& last_len, std::mt19937& rng) {
  const IndexerLayout layout;
  const std::size_t page_bytes = layout.page_bytes();
  Problem p;
  p.B = B;
  p.T = T;
  p.H = H;
  std::vector<int> pages(static_cast<std::size_t>(B));
  std::int64_t max_len = 0;
  int total_pages = 0;
  for (int b = 0; b < B; ++b) {
    const std::int64_t L = last_len[static_cast<std::size_t>(b) % last_len.size()];
    max_len = std::max(max_len, L);
    pages[static_cast<std::size_t>(b)] = static_cast<int>((L + 63) / 64);
    total_pages += pages[static_cast<std::size_t>(b)];
    for (int t = 0; t < T; ++t) p.lengths.push_back(static_cast<std::int32_t>(std::max<std::int64_t>(0, L - (T - 1 - t))));
  }
  p.max_pages = *std::max_element(pages.begin(), pages.end()) + 2;
  p.stride = max_len + 5;
  const int arena_pages = total_pages + 3;  // a few pages nobody owns
  p.arena.resize(static_cast<std::size_t>(arena_pages) * page_bytes);
  // Garbage everywhere first: NaN key bytes and NaN scales, which must never reach a logit.
  std::fill(p.arena.begin(), p.arena.end(), std::uint8_t{0x7f});
  std::vector<std::int32_t> perm(static_cast<std::size_t>(arena_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  p.table.assign(static_cast<std::size_t>(B) * p.max_pages, -1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::size_t next = 0;
  std::vector<float> key(kDim);
  for (int b = 0; b < B; ++b) {
    const std::int64_t L = last_len[static_cast<std::size_t>(b) % last_len.size()];
    for (int pg = 0; pg < pages[static_cast<std::size_t>(b)]; ++pg) {
      const std::int32_t phys = perm[next++];
      p.table[static_cast<std::size_t>(b) * p.max_pages + pg] = phys;
      const std::span<std::uint8_t> page(p.arena.data() + static_cast<std::size_t>(phys) * page_bytes, page_bytes);
      for (int jj = 0; jj < 64 && pg * 64 + jj < L; ++jj) {
        std::uint8_t* kb = page.data() + layout.key_offset(jj);
        float scale = 1.0f;
        if (mode == Mode::kRandom && rng() % 2 == 0) {
          const float mag = std::pow(10.0f, -3.0f + 6.0f * uni(rng));
          for (auto& v : key) v = normal(rng) * mag;
          quantize_indexer_key(layout, key, page, jj);
          continue;
        }
        if (mode == Mode::kRandom) {
          for (int d = 0; d < kDim; ++d) kb[d] = random_fp8(rng);
          scale = pow2(static_cast<int>(rng() % 17) - 12);
        } else if (mode == Mode::kExact) {
          for (int d = 0; d < kDim; ++d) kb[d] = fp8_e4m3_from_float(static_cast<float>(static_cast<int>(rng() % 7) - 3));
          scale = pow2(static_cast<int>(rng() % 13) - 6);
        } else {
          const float v = static_cast<float>(1 + rng() % 2) * (rng() % 2 == 0 ? 1.0f : -1.0f);
          std::fill(kb, kb + kDim, fp8_e4m3_from_float(v));
          scale = pow2(static_cast<int>(rng() % 9) - 4);
        }
        std::memcpy(page.data() + layout.scale_offset(jj), &scale, 4);
      }
    }
  }
  const std::size_t rows = static_cast<std::size_t>(B) * T * H;
  p.q.resize(rows * kDim);
  p.w.resize(rows);
  for (std::size_t i = 0; i < p.q.size(); ++i) {
    if (mode == Mode::kRandom) {
      p.q[i] = random_fp8(rng);
    } else if (mode == Mode::kExact) {
      p.q[i] = fp8_e4m3_from_float(static_cast<float>(static_cast<int>(rng() % 7) - 3));
    } else {
      p.q[i] = fp8_e4m3_from_float(1.0f);
    }
  }
  for (std::size_t i = 0; i < rows; ++i) {
    if (mode == Mode::kRandom) {
      p.w[i] = -2.0f + 4.0f * uni(rng);
    } else if (mode == Mode::kExact) {
      p.w[i] = static_cast<float>(static_cast<int>(rng() % 17) - 8);
    } else {
      const std::size_t t = (i / static_cast<std::size_t>(H)) % static_cast<std::size_t>(T);
      p.w[i] = t % 2 == 0 ? 1e37f : -1e37f;
    }
  }
  if (mode == Mode::kSpecial) p.q[5 * kDim + 17] = 0x7f;  // request 0, token 0, head 5: NaN
  return p;
}

// Reference logits and the per-logit error bound, [B][T][stride] (only j < length used).
struct Reference {
  std::vector<float> logits;
  std::vector<double> bound;
};

inline Reference reference(const Problem& p) {
  const IndexerLayout layout;
  Reference r;
  const std::size_t n = static_cast<std::size_t>(p.B) * p.T * static_cast<std::size_t>(p.stride);
  r.logits.assign(n, 0.0f);
  r.bound.assign(n, 0.0);
  const std::size_t q_row = static_cast<std::size_t>(p.H) * kDim;
  for (int b = 0; b < p.B; ++b) {
    std::vector<const std::uint8_t*> pages;
    for (int pg = 0; pg < p.max_pages; ++pg) {
      const std::int32_t phys = p.table[static_cast<std::size_t>(b) * p.max_pages + pg];
      if (phys < 0) break;
      pages.push_back(p.arena.data() + static_cast<std::size_t>(phys) * layout.page_bytes());
    }
    for (int t = 0; t < p.T; ++t) {
      const std::size_t row = static_cast<std::size_t>(b) * p.T + t;
      const std::size_t len = static_cast<std::size_t>(p.lengths[row]);
      const std::size_t at = row * static_cast<std::size_t>(p.stride);
      test::indexer_reference({p.q.data() + row * q_row, q_row},
                              {p.w.data() + row * static_cast<std::size_t>(p.H), static_cast<std::size_t>(p.H)}, p.H,
                              pages, static_cast<std::int64_t>(len), {r.logits.data() + at, len},
                              {r.bound.data() + at, len});
    }
  }
  return r;
}

// Non-finite positions first, then the bound (or equality); positions past the length untouched.
inline void expect_logits_match(const Problem& p, const Reference& r, const std::vector<float>& gpu, bool exact) {
  std::int64_t bad = 0, checked = 0;
  std::string first;
  double worst = 0.0;  // largest |gpu - ref| / bound seen
  const auto fail = [&](std::size_t row, std::int64_t j, const std::string& why) {
    if (bad++ == 0) first = fmt::format("row {} key {}: {}", row, j, why);
  };
  for (std::size_t row = 0; row < static_cast<std::size_t>(p.B) * p.T; ++row) {
    const std::int64_t len = p.lengths[row];
    for (std::int64_t j = 0; j < p.stride; ++j) {
      const std::size_t at = row * static_cast<std::size_t>(p.stride) + static_cast<std::size_t>(j);
      const float g = gpu[at];
      if (j >= len) {
        if (std::bit_cast<std::uint32_t>(g) != kSentinel) fail(row, j, "written past the length");
        continue;
      }
      ++checked;
      const float e = r.logits[at];
      if (std::isnan(e)) {
        if (!std::isnan(g)) fail(row, j, fmt::format("expected NaN, got {}", g));
      } else if (std::isinf(e)) {
        if (g != e) fail(row, j, fmt::format("expected {}, got {}", e, g));
      } else if (!std::isfinite(g)) {
        fail(row, j, fmt::format("expected {}, got {}", e, g));
      } else if (exact) {
        if (g != e) fail(row, j, fmt::format("expected exactly {}, got {}", e, g));
      } else {
        const double err = std::fabs(static_cast<double>(g) - static_cast<double>(e));
        const double bnd = r.bound[at] + 1e-38;  // absolute floor below any scale * product
        worst = std::max(worst, err / bnd);
        if (err > bnd) {
          fail(row, j, fmt::format("|{} - {}| > bound {}", g, e, bnd));
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << bad << " of " << checked << " logits wrong; first: " << first;
  testing::Test::RecordProperty("worst_error_over_bound", fmt::format("{:.3g}", worst));
}

// The GPU's selection against ref::topk on the reference logits: the sets may differ only by
// near-ties. If j is selected by the GPU and not by the reference, some i selected by the
// reference and not by the GPU has gpu_i <= gpu_j, so ref_i - bound_i <= ref_j + bound_j.
inline void expect_near_tie_agreement(const std::vector<std::int32_t>& gpu_sel, const std::vector<std::int32_t>& ref_sel,
                               const float* ref_logits, const double* bound, const std::string& where) {
  std::set<std::int32_t> g, r;
  for (auto i : gpu_sel) {
    if (i >= 0) g.insert(i);
  }
  for (auto i : ref_sel) {
    if (i >= 0) r.insert(i);
  }
  ASSERT_EQ(g.size(), r.size()) << where;
  double lowest_ref_only = std::numeric_limits<double>::infinity();   // min over R \ G of ref - bound
  double highest_gpu_only = -std::numeric_limits<double>::infinity();  // max over G \ R of ref + bound
  for (auto i : r) {
    if (!g.count(i)) lowest_ref_only = std::min(lowest_ref_only, ref_logits[i] - bound[i]);
  }
  for (auto j : g) {
    if (!r.count(j)) highest_gpu_only = std::max(highest_gpu_only, ref_logits[j] + bound[j]);
  }
  for (auto j : g) {
    if (!r.count(j)) {
      EXPECT_GE(ref_logits[j] + bound[j], lowest_ref_only) << where << ": GPU-only index " << j << " is no near-tie";
    }
  }
  for (auto i : r) {
    if (!g.count(i)) {
      EXPECT_LE(ref_logits[i] - bound[i], highest_gpu_only) << where << ": reference-only index " << i << " is no near-tie";
    }
  }
}

// ---- Top-k -------------------------------------------------------------------------------

enum class Pattern { kRandom, kFewValues, kAllEqual, kSignedZeros, kInfinities, kDenormals };

inline float draw(Pattern pat, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const float inf = std::numeric_limits<float>::infinity();
  switch (pat) {
    case Pattern::kRandom:
      return normal(rng);
    case Pattern::kFewValues: {
      static constexpr float kSet[] = {-2.0f, -1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 2.0f};
      return kSet[rng() % 7];
    }
    case Pattern::kAllEqual:
      return 1.5f;
    case Pattern::kSignedZeros: {
      const auto r = rng() % 10;
      return r < 4 ? 0.0f : (r < 8 ? -0.0f : (r == 8 ? 1.0f : -1.0f));
    }
    case Pattern::kInfinities: {
      const auto r = rng() % 50;
      return r == 0 ? inf : (r < 15 ? -inf : normal(rng));
    }
    case Pattern::kDenormals: {
      const auto r = rng() % 8;
      if (r < 5) {  // a subnormal of either sign
        const std::uint32_t bits = (static_cast<std::uint32_t>(rng()) & 0x007fffffu) | 1u;
        return std::bit_cast<float>(bits | (r % 2 == 0 ? 0x80000000u : 0u));
      }
      return r == 5 ? std::numeric_limits<float>::min() : (r == 6 ? -0.0f : 0.0f);
    }
  }
  return 0.0f;
}

}  // namespace ess::indexer_test
