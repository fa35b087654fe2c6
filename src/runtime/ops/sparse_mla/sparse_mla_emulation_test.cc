// The sparse MLA decode kernel's own CTA program (sparse_mla_cta.h), run on
// the CPU by the warp emulator (warp_emulator.h: one fiber per thread, PTX semantics for
// every primitive, cp.async completed as late as allowed, shared memory poisoned with NaN),
// against the reference: the accuracy contract and the two exact cases of mla_problem.h,
// bad_index, and untouched memory past the outputs. Small shapes (the emulator is slow); it
// checks the pipeline, the masks, the online softmax and the epilogue of the code the GPU
// runs. The emulated mma sums in double, so this is not a test of the GPU's rounding (the
// GPU test is). Runs without a device.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <tuple>

#include "ess/ops/sparse_mla.h"
#include "mla_problem.h"
#include "runtime/ops/sparse_mla/mma_layout.h"
#include "runtime/ops/sparse_mla/sparse_mla_cta.h"
#include "testing/emulator/warp_emulator.h"

namespace ess {
namespace {

using namespace mla_test;  // NOLINT: the shared problems and checks

constexpr std::size_t kGuard = 256;  // values past each output that must stay untouched

Output emulate_decode(const Problem& p, const std::vector<std::int32_t>& ids, bool want_f32, bool want_bf16,
                      std::uint64_t seed) {
  const std::size_t rows = p.tokens() * static_cast<std::size_t>(p.H);
  std::vector<float> o32(rows * kV + kGuard, std::numeric_limits<float>::quiet_NaN());
  std::vector<std::uint16_t> o16(rows * kV + kGuard, 0xffff);
  std::vector<float> lse(rows + kGuard, std::numeric_limits<float>::quiet_NaN());
  int bad = -1;
  cuda::SparseMlaArgs a = shape_args(p);
  a.q = p.q.data();
  a.kv = p.kv.data();
  a.kv_offsets = p.offsets.data();
  a.indices = ids.data();
  a.out = want_bf16 ? o16.data() : nullptr;
  a.out_f32 = want_f32 ? o32.data() : nullptr;
  a.lse = lse.data();
  a.bad_index = &bad;
  const float scale_log2 = a.softmax_scale * cuda::mla::kLog2e;  // as sparse_mla_decode passes it
  const int head_blocks = p.H / cuda::mla::kHeadsPerCta;
  const auto blocks = static_cast<unsigned>(p.tokens() * static_cast<std::size_t>(head_blocks));
  for (unsigned block = 0; block < blocks; ++block) {
    std::unique_ptr<emu::Block> blk;
    emu::Fibers fibers(
        cuda::mla::kThreads,
        [&](int tid) {
          emu::Prims prims(*blk, tid);
          cuda::mla::sparse_mla_cta(a, scale_log2, head_blocks, block, blk->smem.data(), prims);
        },
        seed * 7919 + block);
    blk = std::make_unique<emu::Block>(cuda::mla::kThreads, static_cast<std::size_t>(cuda::mla::kSmemBytes), fibers);
    blk->global = {{p.kv.data(), p.kv.size()},
                   {reinterpret_cast<const std::uint8_t*>(p.q.data()), p.q.size() * sizeof(std::uint16_t)}};
    EXPECT_TRUE(fibers.run()) << "block " << block;
  }
  for (std::size_t i = 0; i < kGuard; ++i) {
    EXPECT_TRUE(std::isnan(o32[rows * kV + i])) << "fp32 output written past its end";
    EXPECT_EQ(o16[rows * kV + i], 0xffff) << "bf16 output written past its end";
    EXPECT_TRUE(std::isnan(lse[rows + i])) << "lse written past its end";
  }
  Output out;
  if (want_f32) out.o32.assign(o32.begin(), o32.begin() + static_cast<std::ptrdiff_t>(rows * kV));
  if (want_bf16) out.o16.assign(o16.begin(), o16.begin() + static_cast<std::ptrdiff_t>(rows * kV));
  out.lse.assign(lse.begin(), lse.begin() + static_cast<std::ptrdiff_t>(rows));
  out.bad = bad;
  return out;
}

class EmulatedSparseMla : public testing::TestWithParam<Shape> {};

TEST_P(EmulatedSparseMla, MatchesTheReferenceWithinTheContract) {
  const auto [B, T, H, K, mask] = GetParam();
  const Problem p = make_problem(B, T, H, K, mask, Values::kRandom,
                                 static_cast<std::uint32_t>(B * 1000003 + T * 10007 + H * 101 + K * 7 + static_cast<int>(mask)));
  const Output both = emulate_decode(p, p.ids, true, true, 1);
  EXPECT_EQ(both.bad, p.expected_bad);
  expect_within_contract(p, p.ids, both);
  for (std::size_t i = 0; i < both.o32.size(); ++i) {
    ASSERT_EQ(both.o16[i], bf16_from_float(both.o32[i])) << "output " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Small, EmulatedSparseMla,
                         testing::Values(std::make_tuple(1, 1, 64, 1, Mask::kNone), std::make_tuple(1, 1, 128, 64, Mask::kNone),
                                         std::make_tuple(1, 2, 128, 100, Mask::kSome), std::make_tuple(3, 1, 64, 41, Mask::kBad),
                                         std::make_tuple(1, 1, 64, 200, Mask::kDuplicates), std::make_tuple(1, 2, 64, 33, Mask::kAll)),
                         shape_name);

TEST(EmulatedSparseMlaExact, EqualScoresAverageTheValues) {
  const Problem p = equal_scores_problem(1, 3, 64, 150, 17);
  expect_equal_scores_average(p, emulate_decode(p, p.ids, true, true, 2));
}

TEST(EmulatedSparseMlaExact, OneValidEntryGivesItsValueAndScore) {
  const Problem p = one_valid_problem(3, 1, 128, 100, 5);
  expect_one_valid_entry(p, emulate_decode(p, p.ids, true, true, 3));
}

// The DA schedule's split (as in sparse_mla_test.cc, merged here by ess::ref::merge_states):
// partials over the hits and over the misses merge to the full decode within the contract.
TEST(EmulatedSparseMla, HitAndMissPartialsMergeToTheFullDecode) {
  const Problem p = make_problem(1, 4, 64, 100, Mask::kSome, Values::kRandom, 99);
  std::mt19937 rng(3);
  std::vector<std::int32_t> hit = p.ids, miss = p.ids;
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    for (std::size_t k = 0; k < 100; ++k) {
      const bool is_hit = t == 0 ? true : t == 2 ? false : rng() % 10 < 7;
      (is_hit ? miss : hit)[t * 100 + k] = -1;
    }
  }
  const Output h = emulate_decode(p, hit, true, false, 7);
  const Output m = emulate_decode(p, miss, true, false, 8);
  Output merged;
  merged.o32.resize(h.o32.size());
  merged.lse.resize(h.lse.size());
  ref::merge_states(static_cast<int>(h.lse.size()), kV, h.o32, h.lse, m.o32, m.lse, merged.o32, merged.lse);
  expect_within_contract(p, p.ids, merged, std::ldexp(1.0, -19), true);
}

TEST(EmulatedSparseMla, OnlyOneOutputAsked) {
  const Problem p = make_problem(1, 1, 64, 40, Mask::kSome, Values::kRandom, 8);
  const Output both = emulate_decode(p, p.ids, true, true, 4);
  const Output f32 = emulate_decode(p, p.ids, true, false, 5);
  const Output b16 = emulate_decode(p, p.ids, false, true, 6);
  EXPECT_EQ(0, std::memcmp(f32.o32.data(), both.o32.data(), both.o32.size() * 4));
  EXPECT_EQ(0, std::memcmp(b16.o16.data(), both.o16.data(), both.o16.size() * 2));
  EXPECT_EQ(0, std::memcmp(f32.lse.data(), both.lse.data(), both.lse.size() * 4));
}

}  // namespace
}  // namespace ess
