// The split of a swap decision (runtime/ops/split/split.h) over seeded awkward shapes, on a
// backend (backend.h): the device's split kernels in split_test.cc, the CPU reference in
// split_host_test.cc. Every result is held to the contract stated independently here (the
// FlashTrans list in request and miss order; each query row's valid ids split into resident
// and fetched lists that keep the row's order), and the device's bit for bit to the
// reference. Include in exactly one source file per binary.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "runtime/ops/split/split.h"
#include "testing/backend.h"

namespace ess::split_test {

struct SplitBackend {
  test::BackendInfo info;
  SplitResult (*split)(const SplitProblem& p);
};
const SplitBackend& split_backend();  // defined by the including binary

// Per position: T rows of K distinct slot ids (some -1), the misses a random subset of the
// distinct selected slots, random host offsets; S rows per request; every 5th position padded;
// pool rows in reverse order; with `blocked`, a paged buffer (blocks of 64 rows, padding); with
// `regions`, each pool row's rows in a region of blocks of 16 rows drawn in a shuffled order from
// twice as many, and every 11th pool row without a region (its position, with no misses, lists nothing).
inline SplitProblem make_split_problem(int B, int T, int K, std::int32_t S, bool split, std::uint32_t seed,
                                       bool blocked = false, bool regions = false) {
  SplitProblem p;
  p.batch = B;
  p.query_tokens = T;
  p.positions = T * K;
  p.rows_per_request = S;
  p.buffer.row_stride = blocked ? 672 : 656;
  p.buffer.block_rows = blocked ? 64 : 0;
  p.buffer.block_stride = blocked ? 64 * 672 + 4096 : 0;
  p.split = split;
  std::mt19937 rng(seed);
  if (regions) {
    p.block_rows = 16;
    p.buffer.block_rows = 16;
    p.buffer.block_stride = 16 * p.buffer.row_stride + 2048;
    p.region_blocks = (S + 15) / 16 + 1;  // a spare block: regions may be larger than the rows
    std::vector<std::int32_t> blocks(static_cast<std::size_t>(2 * B * p.region_blocks));
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    blocks.resize(static_cast<std::size_t>(B * p.region_blocks));
    p.region = blocks;
    for (int r = 10; r < B; r += 11) {
      std::fill_n(p.region.begin() + static_cast<std::ptrdiff_t>(r) * p.region_blocks, p.region_blocks, -1);
    }
  }
  const auto P = static_cast<std::size_t>(p.positions);
  p.slot_ids.assign(static_cast<std::size_t>(B) * P, -1);
  p.fill_slots.assign(p.slot_ids.size(), -7);  // past each request's misses: never read
  p.fill_host_offsets.assign(p.slot_ids.size(), 0);
  std::vector<std::int32_t> perm(static_cast<std::size_t>(S));
  for (int b = 0; b < B; ++b) {
    const bool padded = b % 5 == 4;
    p.rows.push_back(padded ? -1 : B - 1 - b);
    std::set<std::int32_t> selected;
    for (int t = 0; t < T; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      for (int k = 0; k < K && k < S; ++k) std::swap(perm[static_cast<std::size_t>(k)], perm[k + rng() % static_cast<std::size_t>(S - k)]);
      for (int k = 0; k < K; ++k) {
        const std::int32_t s = k < S && rng() % 6 != 0 ? perm[static_cast<std::size_t>(k)] : -1;
        p.slot_ids[static_cast<std::size_t>(b) * P + static_cast<std::size_t>(t * K + k)] = s;
        if (s >= 0) selected.insert(s);
      }
    }
    std::vector<std::int32_t> ws(selected.begin(), selected.end());
    std::shuffle(ws.begin(), ws.end(), rng);
    // A pool row without a region: the swap engine saw only padding, so it has no misses.
    const bool no_rows = !padded && !p.region.empty() && p.region[static_cast<std::size_t>(p.rows.back() * p.region_blocks)] < 0;
    const std::size_t misses = padded || no_rows || b % 7 == 3 ? 0 : (b % 7 == 5 ? ws.size() : rng() % (ws.size() + 1));
    for (std::size_t m = 0; m < misses; ++m) {
      p.fill_slots[static_cast<std::size_t>(b) * P + m] = ws[m];
      p.fill_host_offsets[static_cast<std::size_t>(b) * P + m] = (rng() % 100000) * 656;
    }
    p.counts.push_back(padded ? 0 : static_cast<std::int32_t>(ws.size() - misses));
    p.counts.push_back(static_cast<std::int32_t>(misses));
  }
  return p;
}

// The contract, stated without the reference's code.
inline void expect_contract(const SplitProblem& p, const SplitResult& r) {
  const auto P = static_cast<std::size_t>(p.positions);
  const auto T = static_cast<std::size_t>(p.query_tokens);
  const std::size_t K = P / T;
  // Physical row of slot s of position b, and where it lives (stated directly, not through
  // PoolRows or RowLayout::offset). A pool row without a region has no rows.
  const auto region_of = [&](std::size_t b) {
    return p.region.begin() + static_cast<std::ptrdiff_t>(p.rows[b]) * p.region_blocks;
  };
  const auto has_rows = [&](std::size_t b) { return p.rows[b] >= 0 && (p.region.empty() || *region_of(b) >= 0); };
  const auto physical = [&](std::size_t b, std::int32_t s) -> std::int64_t {
    if (p.region.empty()) return p.rows[b] * p.rows_per_request + s;
    return region_of(b)[s / 16] * 16 + s % 16;
  };
  const auto address = [&](std::int64_t row) -> std::uint64_t {
    if (p.buffer.block_rows == 0) return static_cast<std::uint64_t>(row) * p.buffer.row_stride;
    const std::int64_t block = row / p.buffer.block_rows, in_block = row - block * p.buffer.block_rows;
    return static_cast<std::uint64_t>(block) * p.buffer.block_stride + static_cast<std::uint64_t>(in_block) * p.buffer.row_stride;
  };
  std::size_t at = 0;
  for (std::size_t b = 0; b < static_cast<std::size_t>(p.batch); ++b) {
    if (!has_rows(b)) continue;  // padded, or no region: nothing listed
    for (std::int32_t m = 0; m < p.counts[2 * b + 1]; ++m, ++at) {
      ASSERT_LT(at, r.src_offsets.size());
      ASSERT_EQ(r.src_offsets[at], p.fill_host_offsets[b * P + static_cast<std::size_t>(m)]) << "position " << b << " miss " << m;
      ASSERT_EQ(r.dst_offsets[at], address(physical(b, p.fill_slots[b * P + static_cast<std::size_t>(m)])))
          << "position " << b << " miss " << m;
    }
  }
  ASSERT_EQ(r.total, static_cast<std::int64_t>(at));
  if (!p.split) return;
  for (std::size_t b = 0; b < static_cast<std::size_t>(p.batch); ++b) {
    const std::set<std::int32_t> fetched(p.fill_slots.begin() + static_cast<std::ptrdiff_t>(b * P),
                                         p.fill_slots.begin() + static_cast<std::ptrdiff_t>(b * P) + p.counts[2 * b + 1]);
    for (std::size_t t = 0; t < T; ++t) {
      const std::size_t row = b * P + t * K;
      const auto nh = static_cast<std::size_t>(r.resident_count[b * T + t]), nm = static_cast<std::size_t>(r.fetched_count[b * T + t]);
      std::size_t h = 0, m = 0;
      for (std::size_t k = 0; k < K; ++k) {  // each valid id, in row order, is the next of its list
        const std::int32_t s = p.slot_ids[row + k];
        if (s < 0 || !has_rows(b)) continue;  // a padded position's halves are empty
        if (fetched.contains(s)) {
          ASSERT_LT(m, nm);
          ASSERT_EQ(r.fetched[row + m++], physical(b, s)) << fmt::format("position {} row {} id {}", b, t, k);
        } else {
          ASSERT_LT(h, nh);
          ASSERT_EQ(r.resident[row + h++], physical(b, s)) << fmt::format("position {} row {} id {}", b, t, k);
        }
      }
      ASSERT_EQ(h, nh);
      ASSERT_EQ(m, nm);
      for (std::size_t k = nh; k < K; ++k) ASSERT_EQ(r.resident[row + k], -1);
      for (std::size_t k = nm; k < K; ++k) ASSERT_EQ(r.fetched[row + k], -1);
    }
  }
}

// (batch, T, K, slots, with the resident / fetched split, in regions); odd shapes use a paged buffer.
class SplitShapes : public testing::TestWithParam<std::tuple<int, int, int, int, bool, bool>> {};

TEST_P(SplitShapes, KeepsTheContractAndEqualsTheReference) {
  ESS_REQUIRE_BACKEND(split_backend().info);
  const auto [B, T, K, S, split, regions] = GetParam();
  const SplitProblem p =
      make_split_problem(B, T, K, S, split, static_cast<std::uint32_t>(B * 31 + T * 7 + K + S), B % 2 == 1, regions);
  const SplitResult got = split_backend().split(p);
  expect_contract(p, got);
  const SplitResult want = split_reference(p);
  EXPECT_EQ(got.total, want.total);
  EXPECT_EQ(got.src_offsets, want.src_offsets);
  EXPECT_EQ(got.dst_offsets, want.dst_offsets);
  EXPECT_EQ(got.resident, want.resident);
  EXPECT_EQ(got.fetched, want.fetched);
  EXPECT_EQ(got.resident_count, want.resident_count);
  EXPECT_EQ(got.fetched_count, want.fetched_count);
}

// Batches past one scan tile (1,024 requests) and thousands of requests: the place of each
// request's misses in the list comes from a block scan, not a per-request sum.
INSTANTIATE_TEST_SUITE_P(Awkward, SplitShapes,
                         testing::Values(std::make_tuple(1, 1, 1, 4, true, false), std::make_tuple(3, 2, 41, 100, true, false),
                                         std::make_tuple(5, 3, 7, 21, false, false), std::make_tuple(1025, 1, 41, 64, true, false),
                                         std::make_tuple(3000, 2, 16, 64, true, false), std::make_tuple(4097, 1, 3, 8, false, false),
                                         std::make_tuple(9, 2, 2048, 6554, true, false), std::make_tuple(23, 2, 41, 100, true, true),
                                         std::make_tuple(12, 3, 7, 21, false, true), std::make_tuple(9, 2, 2048, 6554, true, true)));

}  // namespace ess::split_test
