// The lightning-indexer logits and the top-k against the CPU references over seeded awkward
// shapes, on a backend (backend.h): the device in indexer_test.cc, the CPU reference standing
// in for it in indexer_host_test.cc. Tolerances: indexer_problem.h. Include in exactly one
// source file per binary.
#pragma once

#include <gtest/gtest.h>

#include <tuple>

#include "indexer_problem.h"
#include "testing/backend.h"

namespace ess::indexer_test {

// Top-k of host logits ([rows][stride], row r over its first lengths[r]), with or without a
// nan_row to report to.
struct TopkRun {
  std::vector<std::int32_t> out;  // [rows][k]
  int nan_row = -1;
};

struct IndexerBackend {
  test::BackendInfo info;
  // The logits of p, [B][T][stride]: kSentinel wherever the launch writes nothing.
  std::vector<float> (*logits)(const Problem& p);
  TopkRun (*topk)(const std::vector<float>& logits, std::int64_t stride, const std::vector<std::int32_t>& lengths, int k,
                  bool report_nan);
};
const IndexerBackend& indexer_backend();  // defined by the including binary

inline TopkRun run_topk(const std::vector<float>& logits, std::int64_t stride, const std::vector<std::int32_t>& lengths,
                        int k, bool report_nan = true) {
  return indexer_backend().topk(logits, stride, lengths, k, report_nan);
}

// (B, T, heads, mode)
class IndexerShapes : public testing::TestWithParam<std::tuple<int, int, int, Mode>> {};

std::string shape_name(const testing::TestParamInfo<IndexerShapes::ParamType>& info) {
  const auto& [B, T, H, mode] = info.param;
  const char* m = mode == Mode::kRandom ? "random" : (mode == Mode::kExact ? "exact" : "special");
  return fmt::format("B{}_T{}_H{}_{}", B, T, H, m);
}

TEST_P(IndexerShapes, LogitsMatchTheReferenceAndTopkEndToEnd) {
  ESS_REQUIRE_BACKEND(indexer_backend().info);
  const auto [B, T, H, mode] = GetParam();
  std::mt19937 rng(static_cast<std::uint32_t>(B * 1009 + T * 101 + H * 7 + static_cast<int>(mode)));
  // Lengths of each request's last query token: below / above 2,048, off the 64 grid, 0.
  std::vector<std::int64_t> lens = {5000, 0, 2049, 1, 63, 64, 65, 2047, 130, 777, 3001};
  if (B > 8) {  // many requests: mostly short (the CPU reference is O(length x 64 x 128))
    lens.clear();
    for (int b = 0; b < B; ++b) lens.push_back(b % 41 == 0 ? 2100 + b : static_cast<std::int64_t>(rng() % 400));
    lens[1] = 0;
  }
  const Problem p = make_problem(B, T, H, mode, lens, rng);
  const Reference r = reference(p);
  const std::vector<float> logits = indexer_backend().logits(p);
  expect_logits_match(p, r, logits, mode == Mode::kExact);

  // End to end: top-k of the backend's logits on the backend, for two k.
  const std::int64_t rows = static_cast<std::int64_t>(B) * T;
  for (const int k : {7, 2048}) {
    SCOPED_TRACE(fmt::format("k = {}", k));
    const TopkRun run = run_topk(logits, p.stride, p.lengths, k);
    ASSERT_FALSE(HasFailure());
    const std::vector<std::int32_t>& sel = run.out;
    int expect_nan_row = -1;
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::size_t off = static_cast<std::size_t>(row) * static_cast<std::size_t>(p.stride);
      const auto len = static_cast<std::size_t>(p.lengths[static_cast<std::size_t>(row)]);
      const std::span<const float> g(logits.data() + off, len);
      const std::vector<std::int32_t> got(sel.begin() + row * k, sel.begin() + (row + 1) * k);
      if (std::any_of(g.begin(), g.end(), [](float v) { return std::isnan(v); })) {
        if (expect_nan_row < 0) expect_nan_row = static_cast<int>(row);
        continue;
      }
      std::vector<std::int32_t> want(static_cast<std::size_t>(k));
      ref::topk(g, k, want);
      ASSERT_EQ(got, want) << "row " << row << " (length " << len << "): top-k of the backend's logits";
      const std::span<const float> e(r.logits.data() + off, len);
      if (std::all_of(e.begin(), e.end(), [](float v) { return std::isfinite(v); })) {
        std::vector<std::int32_t> ref_sel(static_cast<std::size_t>(k));
        ref::topk(e, k, ref_sel);
        expect_near_tie_agreement(got, ref_sel, r.logits.data() + off, r.bound.data() + off, fmt::format("row {}", row));
      }
    }
    EXPECT_EQ(run.nan_row, expect_nan_row);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, IndexerShapes,
                         testing::Values(std::make_tuple(1, 1, 64, Mode::kRandom), std::make_tuple(1, 2, 64, Mode::kRandom),
                                         std::make_tuple(3, 2, 64, Mode::kRandom), std::make_tuple(3, 1, 32, Mode::kRandom),
                                         std::make_tuple(127, 2, 64, Mode::kRandom), std::make_tuple(127, 1, 16, Mode::kRandom),
                                         std::make_tuple(1, 2, 64, Mode::kExact), std::make_tuple(3, 2, 64, Mode::kExact),
                                         std::make_tuple(127, 2, 48, Mode::kExact), std::make_tuple(3, 2, 64, Mode::kSpecial)),
                         shape_name);

class TopkK : public testing::TestWithParam<int> {};

TEST_P(TopkK, MatchesTheReferenceBitForBit) {
  ESS_REQUIRE_BACKEND(indexer_backend().info);
  const int k = GetParam();
  std::mt19937 rng(static_cast<std::uint32_t>(4242 + k));
  const std::vector<std::int32_t> lens = {0, 1, std::max(k - 1, 0), k, k + 1, 2048, 5000, 32768, 131071};
  const std::vector<Pattern> pats = {Pattern::kRandom,      Pattern::kFewValues,  Pattern::kAllEqual,
                                     Pattern::kSignedZeros, Pattern::kInfinities, Pattern::kDenormals};
  const std::int64_t stride = 131071 + 5;
  std::vector<std::int32_t> lengths;
  for (auto len : lens) {
    for (std::size_t i = 0; i < pats.size(); ++i) lengths.push_back(len);
  }
  const std::int64_t rows = static_cast<std::int64_t>(lengths.size());
  // Past the length: NaN, which must neither be selected nor reported.
  std::vector<float> logits(static_cast<std::size_t>(rows * stride), std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t row = 0; row < rows; ++row) {
    const Pattern pat = pats[static_cast<std::size_t>(row) % pats.size()];
    for (std::int32_t j = 0; j < lengths[static_cast<std::size_t>(row)]; ++j) {
      logits[static_cast<std::size_t>(row * stride + j)] = draw(pat, rng);
    }
  }
  const TopkRun run = run_topk(logits, stride, lengths, k);
  ASSERT_FALSE(HasFailure());
  const std::vector<std::int32_t>& got = run.out;
  EXPECT_EQ(run.nan_row, -1);
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::span<const float> x(logits.data() + row * stride, static_cast<std::size_t>(lengths[static_cast<std::size_t>(row)]));
    std::vector<std::int32_t> want(static_cast<std::size_t>(k));
    ref::topk(x, k, want);
    const std::vector<std::int32_t> g(got.begin() + row * k, got.begin() + (row + 1) * k);
    ASSERT_EQ(g, want) << "row " << row << ": length " << x.size() << ", pattern "
                       << static_cast<int>(pats[static_cast<std::size_t>(row) % pats.size()]);
  }
}

INSTANTIATE_TEST_SUITE_P(K, TopkK, testing::Values(1, 7, 2048));

TEST(Topk, ReportsTheFirstRowWithANaN) {
  ESS_REQUIRE_BACKEND(indexer_backend().info);
  const int k = 16;
  const std::int64_t stride = 3000;
  const std::vector<std::int32_t> lengths = {3000, 100, 2500, 40, 2999};
  std::mt19937 rng(7);
  std::vector<float> logits(lengths.size() * static_cast<std::size_t>(stride));
  for (auto& v : logits) v = draw(Pattern::kRandom, rng);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  logits[static_cast<std::size_t>(1 * stride + 150)] = nan;   // row 1, past its length: ignored
  logits[static_cast<std::size_t>(2 * stride + 2499)] = nan;  // row 2: the first NaN row
  logits[static_cast<std::size_t>(4 * stride + 0)] = -nan;
  const TopkRun run = run_topk(logits, stride, lengths, k);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(run.nan_row, 2);
  const std::vector<std::int32_t>& got = run.out;
  for (const std::size_t row : {std::size_t{0}, std::size_t{1}, std::size_t{3}}) {  // rows without NaN are exact
    std::vector<std::int32_t> want(static_cast<std::size_t>(k));
    ref::topk(std::span<const float>(logits.data() + row * static_cast<std::size_t>(stride),
                                     static_cast<std::size_t>(lengths[row])),
              k, want);
    EXPECT_EQ(std::vector<std::int32_t>(got.begin() + static_cast<std::ptrdiff_t>(row) * k,
                                        got.begin() + static_cast<std::ptrdiff_t>(row + 1) * k),
              want)
        << "row " << row;
  }
  // Without a nan_row the NaN rows are still processed without fault.
  run_topk(logits, stride, lengths, k, false);
}

}  // namespace ess::indexer_test
