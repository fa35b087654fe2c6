// Test problems for the sparse MLA decode, shared by the GPU test (sparse_mla_test.cc) and
// the CPU emulation of the kernel (sparse_mla_emulation_test.cc): seeded slot arrays, ids
// with masks, q, and the checks against the reference (the accuracy contract of
// test::check_decode_token, and two exact cases; the tolerances are justified in
// sparse_mla_test.cc).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "ess/model/entry_layout.h"
#include "ess/model/numerics.h"
#include "ess/ops/reference.h"
#include "ess/ops/sparse_mla.h"
#include "testing/accuracy.h"

namespace ess::mla_test {

inline constexpr float kInf = std::numeric_limits<float>::infinity();
inline constexpr int kQkDim = 576;
inline constexpr int kV = 512;
inline constexpr std::size_t kE = 656;
inline const LatentLayout kLayout{};

enum class Mask { kNone, kSome, kAll, kDuplicates, kBad };
enum class Values { kRandom, kNice };

inline const char* mask_name(Mask m) {
  switch (m) {
    case Mask::kNone: return "none";
    case Mask::kSome: return "some";
    case Mask::kAll: return "all";
    case Mask::kDuplicates: return "duplicates";
    case Mask::kBad: return "bad";
  }
  return "?";
}

// A parameterized decode shape, (B, T, heads, K, mask), and its test name.
using Shape = std::tuple<int, int, int, int, Mask>;
inline std::string shape_name(const testing::TestParamInfo<Shape>& param_info) {
  const auto [B, T, H, K, mask] = param_info.param;
  return fmt::format("B{}_T{}_H{}_K{}_{}", B, T, H, K, mask_name(mask));
}

// One latent entry. kRandom: each 128-value tile has its own magnitude 2^-6 .. 2^6 (so the
// tile scales differ widely), values N(0, 1) x magnitude with a few x16 outliers (small values
// become FP8 subnormals), 1 tile in 12 all zero. kNice: values k/8, |k| <= 15 (exact in FP8
// after any power-of-two scale, and in bf16).
inline void make_entry(std::mt19937& rng, Values kind, std::uint8_t* out) {
  std::vector<float> nope(static_cast<std::size_t>(kV)), rope(64);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  if (kind == Values::kNice) {
    for (auto& x : nope) x = static_cast<float>(static_cast<int>(rng() % 31) - 15) / 8.0f;
    for (auto& x : rope) x = static_cast<float>(static_cast<int>(rng() % 31) - 15) / 8.0f;
  } else {
    for (int t = 0; t < 4; ++t) {
      const bool zero = rng() % 12 == 0;
      const float mag = std::ldexp(1.0f, static_cast<int>(rng() % 13) - 6);
      for (int i = 0; i < 128; ++i) {
        float v = zero ? 0.0f : mag * normal(rng);
        if (rng() % 32 == 0) v *= 16.0f;
        nope[static_cast<std::size_t>(t * 128 + i)] = v;
      }
    }
    const float rmag = std::ldexp(1.0f, static_cast<int>(rng() % 5) - 2);
    for (auto& x : rope) x = rmag * normal(rng);
  }
  quantize_latent(kLayout, nope, rope, {out, kE});
}

// A batch: slot regions (in reverse order, with gaps, to exercise kv_offsets), ids, q.
struct Problem {
  int B = 0, T = 0, H = 0, K = 0;
  std::int32_t slots = 0;
  float scale = 0.0f;
  std::vector<std::uint8_t> kv;         // host copy of the slot array
  std::vector<std::uint64_t> offsets;   // [B] bytes
  std::vector<std::int32_t> ids;        // [B][T][K]
  std::vector<std::uint16_t> q;         // [B][T][H][576]
  int expected_bad = -1;                // smallest flat position of an out-of-range id

  std::size_t tokens() const { return static_cast<std::size_t>(B) * static_cast<std::size_t>(T); }
  const std::uint8_t* entry(int b, std::int32_t id) const {
    return id >= 0 && id < slots ? kv.data() + offsets[static_cast<std::size_t>(b)] + static_cast<std::size_t>(id) * kE : nullptr;
  }
  std::vector<const std::uint8_t*> ptrs(std::size_t token, const std::vector<std::int32_t>& id_list) const {
    std::vector<const std::uint8_t*> p(static_cast<std::size_t>(K));
    for (int k = 0; k < K; ++k) {
      p[static_cast<std::size_t>(k)] =
          entry(static_cast<int>(token / static_cast<std::size_t>(T)), id_list[token * static_cast<std::size_t>(K) + static_cast<std::size_t>(k)]);
    }
    return p;
  }
  std::span<const std::uint16_t> q_of(std::size_t token) const {
    const std::size_t n = static_cast<std::size_t>(H) * kQkDim;
    return {q.data() + token * n, n};
  }
};

// The decode's launch arguments for p: its shape; the caller sets the pointers.
inline cuda::SparseMlaArgs shape_args(const Problem& p) {
  cuda::SparseMlaArgs a;
  a.batch = p.B;
  a.query_tokens = p.T;
  a.heads = p.H;
  a.topk = p.K;
  a.softmax_scale = p.scale;
  a.slots = p.slots;
  return a;
}

inline Problem make_problem(int B, int T, int H, int K, Mask mask, Values values, std::uint32_t seed, float scale = 0.0f) {
  Problem p;
  p.B = B;
  p.T = T;
  p.H = H;
  p.K = K;
  p.slots = std::max(K + 37, 64);
  // Default scale: scores of a few units for the random entries (whose tiles reach 2^6 and
  // outliers 2^10), as real attention scores are; the score-error term of the contract
  // (scale x 577 x 2^-23 x sum |q||k|) then stays near the P-rounding term instead of
  // swamping it. Nice entries: DeepSeek-V3.2's 1/sqrt(192).
  p.scale = scale > 0.0f ? scale : values == Values::kRandom ? 1.0f / 256.0f : 1.0f / std::sqrt(192.0f);
  std::mt19937 rng(seed);
  const std::size_t region = static_cast<std::size_t>(p.slots + 3) * kE;
  p.kv.assign(static_cast<std::size_t>(B) * region + kE, 0);
  p.offsets.resize(static_cast<std::size_t>(B));
  for (int b = 0; b < B; ++b) {
    p.offsets[static_cast<std::size_t>(b)] = static_cast<std::uint64_t>(B - 1 - b) * region + kE;
    for (std::int32_t s = 0; s < p.slots; ++s) make_entry(rng, values, p.kv.data() + p.offsets[static_cast<std::size_t>(b)] + static_cast<std::size_t>(s) * kE);
  }
  p.ids.assign(p.tokens() * static_cast<std::size_t>(K), -1);
  std::vector<std::int32_t> perm(static_cast<std::size_t>(p.slots));
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    std::int32_t* row = p.ids.data() + t * static_cast<std::size_t>(K);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < K; ++k) row[k] = perm[static_cast<std::size_t>(k)];
    switch (mask) {
      case Mask::kNone: break;
      case Mask::kAll: std::fill(row, row + K, -1); break;
      case Mask::kDuplicates:
        for (int k = 0; k < K; ++k) row[k] = rng() % 7 == 0 ? -1 : static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(std::max(1, p.slots / 8)));
        break;
      case Mask::kSome:
      case Mask::kBad:
        if (t == 1) {
          std::fill(row, row + K, -1);  // a token with no valid id among valid ones
        } else {
          for (int k = 0; k < K; ++k) {
            if (rng() % 4 == 0) row[k] = -1;
          }
          if (t == 0 && K > 32) std::fill(row, row + std::min(K, 32), -1);  // a fully masked first tile
          if (K >= 64) std::fill(row + 32, row + 64, -1);                   // and a fully masked later one
          if (row[K - 1] == -1 && K > 1) row[K - 1] = perm[0];               // keep a valid id at the end
        }
        break;
    }
  }
  if (mask == Mask::kBad) {
    // Out-of-range ids in the last token (and one in the first): the smallest flat position wins.
    const std::size_t last = p.tokens() - 1;
    const std::int32_t bad_values[] = {p.slots, -5, INT_MAX, -2};
    int n = 0;
    for (int k = K / 3; k < K && n < 4; k += std::max(1, K / 5), ++n) {
      p.ids[last * static_cast<std::size_t>(K) + static_cast<std::size_t>(k)] = bad_values[n];
    }
    if (p.tokens() > 2) p.ids[2 * static_cast<std::size_t>(K) + static_cast<std::size_t>(K - 1)] = p.slots + 1000;
    for (std::size_t i = 0; i < p.ids.size(); ++i) {
      if (p.ids[i] < -1 || p.ids[i] >= p.slots) {
        p.expected_bad = static_cast<int>(i);
        break;
      }
    }
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  p.q.resize(p.tokens() * static_cast<std::size_t>(H) * kQkDim);
  for (auto& x : p.q) {
    x = bf16_from_float(values == Values::kNice ? static_cast<float>(static_cast<int>(rng() % 17) - 8) / 4.0f : normal(rng));
  }
  return p;
}

struct Output {
  std::vector<float> o32;          // empty when not asked
  std::vector<std::uint16_t> o16;  // empty when not asked
  std::vector<float> lse;
  int bad = -1;
};

inline std::vector<float> to_float(const std::uint16_t* b, std::size_t n) {
  std::vector<float> f(n);
  for (std::size_t i = 0; i < n; ++i) f[i] = bf16_to_float(b[i]);
  return f;
}

// Every token of `out` against the reference over `ids`, within the accuracy contract.
inline void expect_within_contract(const Problem& p, const std::vector<std::int32_t>& ids, const Output& out, double slack = 0.0,
                            bool merged = false) {
  const std::size_t hv = static_cast<std::size_t>(p.H) * kV;
  const ref::SparseMlaParams params{kLayout, p.H, p.scale};
  double worst = 0.0;
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    const auto ptrs = p.ptrs(t, ids);
    const std::span<const float> lse{out.lse.data() + t * static_cast<std::size_t>(p.H), static_cast<std::size_t>(p.H)};
    if (!out.o32.empty()) {
      const auto c = test::check_decode_token(params, p.q_of(t), ptrs, {out.o32.data() + t * hv, hv}, false, lse, slack, merged);
      EXPECT_TRUE(c.ok()) << "token " << t << " fp32: " << c.structural << " worst " << c.worst << " at " << c.worst_at;
      worst = std::max(worst, c.worst);
    }
    if (!out.o16.empty()) {
      const auto f = to_float(out.o16.data() + t * hv, hv);
      const auto c = test::check_decode_token(params, p.q_of(t), ptrs, f, true, lse, slack, merged);
      EXPECT_TRUE(c.ok()) << "token " << t << " bf16: " << c.structural << " worst " << c.worst << " at " << c.worst_at;
      worst = std::max(worst, c.worst);
    }
  }
  testing::Test::RecordProperty("worst_error_over_bound", fmt::format("{:.4g}", worst));
}

// ---- exact cases ----------------------------------------------------------------------------
// All scores equal (q = 0) with values k/8: P = 1 and O = the exact sum of the values, so
// o = the mean of the valid values (with multiplicity) to within the final division, and
// lse = ln n. Token 2 (when present) has no valid id.
inline Problem equal_scores_problem(int B, int T, int H, int K, std::uint32_t seed) {
  Problem p = make_problem(B, T, H, K, Mask::kDuplicates, Values::kNice, seed);
  std::fill(p.q.begin(), p.q.end(), std::uint16_t{0});
  if (p.tokens() > 2) std::fill(p.ids.begin() + 2 * K, p.ids.begin() + 3 * K, -1);
  return p;
}

inline void expect_equal_scores_average(const Problem& p, const Output& out) {
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    const auto ptrs = p.ptrs(t, p.ids);
    std::vector<double> sum(kV, 0.0), vmax(kV, 0.0);
    std::vector<float> nope(kV), rope(64);
    int n = 0;
    for (const std::uint8_t* e : ptrs) {
      if (e == nullptr) continue;
      dequantize_latent(kLayout, {e, kE}, nope, rope);
      for (std::size_t d = 0; d < static_cast<std::size_t>(kV); ++d) {
        sum[d] += nope[d];
        vmax[d] = std::max(vmax[d], std::fabs(static_cast<double>(nope[d])));
      }
      ++n;
    }
    for (int h = 0; h < p.H; ++h) {
      const std::size_t row = t * static_cast<std::size_t>(p.H) + static_cast<std::size_t>(h);
      if (n == 0) {
        EXPECT_EQ(out.lse[row], -kInf);
      } else {
        EXPECT_NEAR(out.lse[row], std::log(static_cast<double>(n)), std::ldexp(1.0 + std::log(static_cast<double>(n)), -20));
      }
      for (std::size_t d = 0; d < static_cast<std::size_t>(kV); ++d) {
        const double want = n == 0 ? 0.0 : sum[d] / n;
        const double tol = std::ldexp(vmax[d], -20);
        const std::size_t i = row * kV + d;
        if (!out.o32.empty()) {
          ASSERT_LE(std::fabs(out.o32[i] - want), tol) << "token " << t << " head " << h << " dim " << d;
        }
        if (!out.o16.empty()) {
          ASSERT_LE(std::fabs(bf16_to_float(out.o16[i]) - want), tol + std::ldexp(std::fabs(want), -8))
              << "token " << t << " head " << h << " dim " << d;
        }
      }
    }
  }
}

// One valid id per query token (first position, last, anywhere), nice values and q = j/4: the
// score q . k is exact in fp32, so lse = scale x q . k to a few roundings (the prescale by
// scale log2 e, then ln 2), and o = that entry's value (P = l = exp2(0)).
inline Problem one_valid_problem(int B, int T, int H, int K, std::uint32_t seed) {
  Problem p = make_problem(B, T, H, K, Mask::kNone, Values::kNice, seed, 0.0625f);
  std::mt19937 rng(seed + 1);
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    std::int32_t* row = p.ids.data() + t * static_cast<std::size_t>(K);
    const int keep = t == 0 ? 0 : t == 1 ? K - 1 : static_cast<int>(rng() % static_cast<std::uint32_t>(K));
    const std::int32_t id = row[keep];
    std::fill(row, row + K, -1);
    row[keep] = id;
  }
  return p;
}

inline void expect_one_valid_entry(const Problem& p, const Output& out) {
  EXPECT_EQ(out.bad, -1);
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    const std::uint8_t* e = nullptr;
    for (const std::uint8_t* x : p.ptrs(t, p.ids)) e = x != nullptr ? x : e;
    ASSERT_NE(e, nullptr);
    std::vector<float> nope(kV), rope(64);
    dequantize_latent(kLayout, {e, kE}, nope, rope);
    for (int h = 0; h < p.H; ++h) {
      const std::size_t row = t * static_cast<std::size_t>(p.H) + static_cast<std::size_t>(h);
      double dot = 0.0;
      for (int d = 0; d < kQkDim; ++d) {
        const double k = d < kV ? nope[static_cast<std::size_t>(d)] : rope[static_cast<std::size_t>(d - kV)];
        dot += bf16_to_float(p.q[row * kQkDim + static_cast<std::size_t>(d)]) * k;
      }
      const double want = dot * p.scale;
      EXPECT_NEAR(out.lse[row], want, std::ldexp(std::fabs(want), -20) + 1e-30) << "token " << t << " head " << h;
      for (std::size_t d = 0; d < static_cast<std::size_t>(kV); ++d) {
        const std::size_t i = row * kV + d;
        // o = v p / p with p = exp2(0): 1, or within 2^-22 of it should exp2 not be exact there.
        if (!out.o32.empty()) {
          ASSERT_LE(std::fabs(out.o32[i] - nope[d]), std::ldexp(std::fabs(nope[d]), -21))
              << "token " << t << " head " << h << " dim " << d;
        }
        if (!out.o16.empty()) {
          ASSERT_EQ(bf16_to_float(out.o16[i]), nope[d]) << "token " << t << " head " << h << " dim " << d;
        }
      }
    }
  }
}

}  // namespace ess::mla_test
