// The sparse MLA decode (the merge's own cases: merge_cases.h), checked against the CPU reference
// (ess::ref) over seeded awkward shapes, on a backend (backend.h): the device in
// sparse_mla_test.cc, the CPU reference standing in for it in sparse_mla_host_test.cc.
// Include in exactly one source file per binary.
//
// Tolerances. The decode is held to the accuracy contract of test::check_decode_token
// (testing/accuracy.h), derived from the kernel's arithmetic: dequantization is exact,
// so the scores are exact products summed in fp32 (error <= 577 x 2^-23 x scale x sum |q||k|,
// plus the rounding of the prescale and of exp2); the softmax weights of perturbed scores are
// off by at most a factor e^(2 Delta); P is rounded to bf16 before P V (relative 2^-8, the
// dominant term: |o - o_ref| <= 2^-8 max_j |v_jd|); O and l accumulate n entries in fp32
// (2 n 2^-23); the bf16 output adds one rounding (2^-8 |o|). Nothing is loosened beyond that.
// Because that bound (~2^-8 of the largest value) cannot see one wrong entry among 2,048, two
// exact tests pin the data paths where the arithmetic is exact by construction:
//   - all scores equal (q = 0) with values k/8: P = 1 exactly, O = sum of values exactly, so
//     o = mean of the valid values to within the final division (2^-20 relative);
//   - one valid entry per query: o = that entry's value exactly and lse = its score, which
//     is exact in fp32 for values k/8 and q = j/4 (error: the prescale and ln 2 roundings).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "ess/model/numerics.h"
#include "ess/ops/reference.h"
#include "merge_cases.h"
#include "mla_problem.h"
#include "testing/backend.h"

namespace ess::mla_test {

struct MlaBackend {
  test::BackendInfo info;
  // The decode of p over `ids` (optional row lengths [B][T]); outputs not asked stay empty.
  Output (*decode)(const Problem& p, const std::vector<std::int32_t>& ids, bool want_f32, bool want_bf16,
                   const std::vector<std::int32_t>& row_lengths);
};
const MlaBackend& mla_backend();  // defined by the including binary

inline Output decode(const Problem& p, const std::vector<std::int32_t>& ids, bool want_f32, bool want_bf16,
                     const std::vector<std::int32_t>& row_lengths = {}) {
  return mla_backend().decode(p, ids, want_f32, want_bf16, row_lengths);
}

class SparseMlaShapes : public testing::TestWithParam<Shape> {};

TEST_P(SparseMlaShapes, MatchesTheReferenceWithinTheContract) {
  ESS_REQUIRE_BACKEND(mla_backend().info);
  const auto [B, T, H, K, mask] = GetParam();
  const Problem p = make_problem(B, T, H, K, mask, Values::kRandom,
                                 static_cast<std::uint32_t>(B * 1000003 + T * 10007 + H * 101 + K * 7 + static_cast<int>(mask)));
  const Output both = decode(p, p.ids, true, true);
  EXPECT_EQ(both.bad, p.expected_bad);
  expect_within_contract(p, p.ids, both);
  // Each output alone: the same values, bit for bit (the other pointer is nullptr).
  const Output f32 = decode(p, p.ids, true, false);
  const Output b16 = decode(p, p.ids, false, true);
  EXPECT_EQ(0, std::memcmp(f32.o32.data(), both.o32.data(), both.o32.size() * 4));
  EXPECT_EQ(0, std::memcmp(b16.o16.data(), both.o16.data(), both.o16.size() * 2));
  EXPECT_EQ(0, std::memcmp(f32.lse.data(), both.lse.data(), both.lse.size() * 4));
  // bf16 output = the fp32 output rounded to nearest even.
  for (std::size_t i = 0; i < both.o32.size(); ++i) {
    ASSERT_EQ(both.o16[i], bf16_from_float(both.o32[i])) << "output " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Awkward, SparseMlaShapes,
    testing::Values(std::make_tuple(1, 1, 128, 1, Mask::kNone), std::make_tuple(2, 2, 64, 1, Mask::kSome),
                    std::make_tuple(1, 1, 64, 41, Mask::kSome), std::make_tuple(3, 1, 128, 64, Mask::kSome),
                    std::make_tuple(1, 3, 64, 100, Mask::kDuplicates), std::make_tuple(127, 1, 64, 100, Mask::kSome),
                    std::make_tuple(127, 1, 128, 41, Mask::kNone), std::make_tuple(2, 2, 128, 2048, Mask::kSome),
                    std::make_tuple(2, 2, 64, 2048, Mask::kNone), std::make_tuple(2, 2, 128, 100, Mask::kAll),
                    std::make_tuple(1, 1, 128, 2048, Mask::kBad), std::make_tuple(3, 1, 64, 64, Mask::kBad),
                    std::make_tuple(1, 3, 128, 2048, Mask::kDuplicates), std::make_tuple(3, 1, 64, 41, Mask::kBad)),
    shape_name);

TEST(SparseMlaExact, EqualScoresAverageTheValues) {
  ESS_REQUIRE_BACKEND(mla_backend().info);
  const Problem p = equal_scores_problem(2, 2, 128, 2048, 17);
  expect_equal_scores_average(p, decode(p, p.ids, true, true));
}

TEST(SparseMlaExact, OneValidEntryGivesItsValueAndScore) {
  ESS_REQUIRE_BACKEND(mla_backend().info);
  for (const int H : {64, 128}) {
    const Problem p = one_valid_problem(3, 2, H, 100, static_cast<std::uint32_t>(H));
    expect_one_valid_entry(p, decode(p, p.ids, true, true));
  }
}

// The DA schedule: attention over the hits (misses masked) and over the misses (hits masked),
// merged in place over the hit partial (as the schedule does), equals attention over all ids.
TEST(SparseMlaSplit, HitAndMissPartialsMergeToTheFullDecode) {
  ESS_REQUIRE_BACKEND(mla_backend().info);
  const Problem p = make_problem(2, 3, 128, 2048, Mask::kSome, Values::kRandom, 99);
  std::mt19937 rng(3);
  std::vector<std::int32_t> hit = p.ids, miss = p.ids;
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    for (std::size_t k = 0; k < 2048; ++k) {
      const std::size_t i = t * 2048 + k;
      // token 0: all hits (empty miss partial); token 2: all misses (empty hit partial);
      // token 1 has no valid id at all; tokens 3-5 split 70 / 30
      const bool is_hit = t == 0 ? true : t == 2 ? false : rng() % 10 < 7;
      (is_hit ? miss : hit)[i] = -1;
    }
  }
  const Output h = decode(p, hit, true, false);
  const Output m = decode(p, miss, true, false);
  MergeInput in;
  in.rows = static_cast<std::int64_t>(p.tokens()) * p.H;
  in.dim = kV;
  in.oa = h.o32;
  in.la = h.lse;
  in.ob = m.o32;
  in.lb = m.lse;
  const MergeOutput mo = merge_backend().merge(in, MergePlace::kOverA, true);
  Output merged;
  merged.o32 = mo.o32;
  merged.o16 = mo.o16;
  merged.lse = mo.lse;
  expect_within_contract(p, p.ids, merged, std::ldexp(1.0, -19), true);
}

// Row lengths (how the DA halves pass their compacted lists): only the first len ids of a row
// count, the rest are ignored even when valid; len 0 is an empty partial, len > K is K.
TEST(SparseMlaRowLengths, OnlyTheFirstLengthIdsOfARowCount) {
  ESS_REQUIRE_BACKEND(mla_backend().info);
  const Problem p = make_problem(3, 3, 64, 200, Mask::kNone, Values::kRandom, 41);
  const std::vector<std::int32_t> len = {0, 1, 31, 32, 33, 64, 100, 199, 5000};
  std::vector<std::int32_t> masked = p.ids;
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    for (std::size_t k = static_cast<std::size_t>(std::min(len[t], 200)); k < 200; ++k) masked[t * 200 + k] = -1;
  }
  const Output out = decode(p, p.ids, true, true, len);
  expect_within_contract(p, masked, out);
  for (int h = 0; h < p.H; ++h) EXPECT_EQ(out.lse[static_cast<std::size_t>(h)], -kInf) << "length 0, head " << h;
}

}  // namespace ess::mla_test
