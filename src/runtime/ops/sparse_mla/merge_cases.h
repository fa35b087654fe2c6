// The merge of two partial attention states (FlashMLA's split-KV combine, the DA schedule's
// merge), checked against the CPU reference (ref::merge_states) on a backend (backend.h): the
// device in sparse_mla_test.cc, the reference in sparse_mla_host_test.cc, the kernel's own
// block program on the CTA emulator in merge_emulation_test.cc. Include in exactly one
// source file per binary.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "ess/model/numerics.h"
#include "ess/ops/reference.h"
#include "testing/backend.h"

namespace ess::mla_test {

// Merge rows: finite pairs (close and far apart), one or both partials empty (-inf or
// FlashMLA's +inf), an empty partial whose o is NaN (must not be read).
struct MergeInput {
  std::int64_t rows = 0;
  int dim = 512;
  std::vector<float> oa, ob, la, lb;
};
// Where the merged fp32 output and lse go: their own buffers, or over partial a or b.
enum class MergePlace { kSeparate, kOverA, kOverB };
struct MergeOutput {
  std::vector<float> o32, lse;
  std::vector<std::uint16_t> o16;  // with want_bf16 only
};

struct MergeBackend {
  test::BackendInfo info;
  MergeOutput (*merge)(const MergeInput& in, MergePlace place, bool want_bf16);
};
const MergeBackend& merge_backend();  // defined by the including binary

inline MergeInput make_merge_case(std::int64_t rows, int dim) {
  MergeInput m;
  m.rows = rows;
  m.dim = dim;
  std::mt19937 rng(static_cast<std::uint32_t>(rows * 31 + dim));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-8.0f, 24.0f);
  constexpr float kMergeInf = std::numeric_limits<float>::infinity();
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(dim);
  m.oa.resize(n);
  m.ob.resize(n);
  for (auto& x : m.oa) x = normal(rng);
  for (auto& x : m.ob) x = normal(rng);
  for (std::int64_t r = 0; r < rows; ++r) {
    float a = uni(rng), b = uni(rng);
    switch (r % 9) {
      case 1: a = -kMergeInf; break;
      case 2: b = kMergeInf; break;
      case 3: a = kMergeInf; b = -kMergeInf; break;
      case 4: a = -kMergeInf; b = -kMergeInf; break;
      case 5:
        a = -kMergeInf;
        std::fill(m.oa.begin() + r * dim, m.oa.begin() + (r + 1) * dim, std::numeric_limits<float>::quiet_NaN());
        break;
      case 6: b = a + 90.0f; break;
      case 7: b = a; break;
      default: break;
    }
    m.la.push_back(a);
    m.lb.push_back(b);
  }
  return m;
}

TEST(MergeStates, MatchesTheReferenceIncludingEmptyPartialsAndAliasing) {
  ESS_REQUIRE_BACKEND(merge_backend().info);
  for (const auto& [rows, dim] : {std::make_pair(std::int64_t{301}, 512), std::make_pair(std::int64_t{37}, 12)}) {
    const MergeInput mc = make_merge_case(rows, dim);
    const std::size_t n = mc.oa.size();
    std::vector<float> ref_o(n), ref_l(static_cast<std::size_t>(rows));
    ref::merge_states(static_cast<int>(rows), dim, mc.oa, mc.la, mc.ob, mc.lb, ref_o, ref_l);
    const MergeOutput got = merge_backend().merge(mc, MergePlace::kSeparate, true);
    const auto& o = got.o32;
    const auto& o16 = got.o16;
    const auto& l = got.lse;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::size_t rs = static_cast<std::size_t>(r);
      const bool ea = std::isinf(mc.la[rs]), eb = std::isinf(mc.lb[rs]);
      if (ea || eb) {
        // Empty partials: the result is the other partial (or nothing), exactly.
        ASSERT_EQ(l[rs], ref_l[rs]) << "row " << r;
      } else {
        // fp32 weights exp(lse_i - lse): lse to a few ulp of its magnitude, so the weights to
        // 2^-20 (1 + |lse|) relative; bf16 adds one rounding.
        ASSERT_NEAR(l[rs], ref_l[rs], std::ldexp(1.0 + std::fabs(ref_l[rs]), -20)) << "row " << r;
      }
      for (int d = 0; d < dim; ++d) {
        const std::size_t i = rs * static_cast<std::size_t>(dim) + static_cast<std::size_t>(d);
        if (ea || eb) {
          ASSERT_EQ(o[i], ref_o[i]) << "row " << r << " dim " << d;
          ASSERT_EQ(o16[i], bf16_from_float(ref_o[i])) << "row " << r << " dim " << d;
          continue;
        }
        const double tol = std::ldexp(1.0 + std::fabs(ref_l[rs]), -20) * (std::fabs(mc.oa[i]) + std::fabs(mc.ob[i])) + 1e-30;
        ASSERT_NEAR(o[i], ref_o[i], tol) << "row " << r << " dim " << d;
        ASSERT_NEAR(bf16_to_float(o16[i]), ref_o[i], tol + std::ldexp(std::fabs(ref_o[i]) + tol, -8)) << "row " << r << " dim " << d;
      }
    }
    // In place over a (then over b): the same values, bit for bit.
    for (const MergePlace place : {MergePlace::kOverA, MergePlace::kOverB}) {
      const MergeOutput in_place = merge_backend().merge(mc, place, false);
      const char* where = place == MergePlace::kOverA ? "over a" : "over b";
      EXPECT_EQ(0, std::memcmp(in_place.o32.data(), o.data(), n * 4)) << where;
      EXPECT_EQ(0, std::memcmp(in_place.lse.data(), l.data(), l.size() * 4)) << where;
    }
  }
}

}  // namespace ess::mla_test
