// The sparse MLA decode and the merge of partial states on the GPU against the CPU reference
// (ess::ref), over seeded awkward shapes. Skipped without a CUDA device.
//
// Tolerances. The decode is held to the accuracy contract of cuda::check_decode_token
// (attention_bench.h), derived from the kernel's arithmetic: dequantization is exact, so the
// scores are exact products summed in fp32 (error <= 577 x 2^-23 x scale x sum |q||k|, plus
// the rounding of the prescale and of exp2); the softmax weights of perturbed scores are off
// by at most a factor e^(2 Delta); P is rounded to bf16 before P V (relative 2^-8, the
// dominant term: |o - o_ref| <= 2^-8 max_j |v_jd|); O and l accumulate n entries in fp32
// (2 n 2^-23); the bf16 output adds one rounding (2^-8 |o|). Nothing is loosened beyond that.
// Because that bound (~2^-8 of the largest value) cannot see one wrong entry among 2,048, two
// exact tests pin the data paths where the arithmetic is exact by construction:
//   - all scores equal (q = 0) with values k/8: P = 1 exactly, O = sum of values exactly, so
//     o = mean of the valid values to within the final division (2^-20 relative);
//   - one valid entry per query: o = that entry's value exactly and lse = its score, which
//     is exact in fp32 for values k/8 and q = j/4 (error: the prescale and ln 2 roundings).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>

#include "ess/core/error.h"
#include "ess/cuda/device_buffer.h"
#include "ess/cuda/sparse_mla.h"
#include "ess/kernels/ref/reference.h"
#include "ess/model/numerics.h"
#include "mla_problem.h"
#include "testing.h"

namespace ess {
namespace {

using namespace mla_test;  // NOLINT: the shared problems and checks

template <typename T>
cuda::DeviceBuffer<T> upload(const std::vector<T>& v) {
  cuda::DeviceBuffer<T> d(v.size());
  if (!v.empty()) ESS_CUDA_CHECK(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return d;
}
template <typename T>
std::vector<T> download(const cuda::DeviceBuffer<T>& d, std::size_t n) {
  std::vector<T> v(n);
  ESS_CUDA_CHECK(cudaMemcpy(v.data(), d.get(), n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return v;
}

// Runs the decode on the GPU; outputs are pre-filled with NaN so that unwritten values show.
Output run_decode(const Problem& p, const std::vector<std::int32_t>& ids, bool want_f32, bool want_bf16,
                  const std::vector<std::int32_t>& row_lengths = {}) {
  const auto d_len = upload(row_lengths);
  const auto d_kv = upload(p.kv);
  const auto d_off = upload(p.offsets);
  const auto d_ids = upload(ids);
  const auto d_q = upload(p.q);
  const std::size_t rows = p.tokens() * static_cast<std::size_t>(p.H);
  cuda::DeviceBuffer<float> d_o32(rows * kV), d_lse(rows);
  cuda::DeviceBuffer<std::uint16_t> d_o16(rows * kV);
  cuda::DeviceBuffer<int> d_bad(1);
  ESS_CUDA_CHECK(cudaMemset(d_o32.get(), 0xff, rows * kV * 4), "fill");
  ESS_CUDA_CHECK(cudaMemset(d_o16.get(), 0xff, rows * kV * 2), "fill");
  ESS_CUDA_CHECK(cudaMemset(d_lse.get(), 0xff, rows * 4), "fill");
  ESS_CUDA_CHECK(cudaMemset(d_bad.get(), 0xff, 4), "fill");  // -1
  cuda::SparseMlaArgs a;
  a.batch = p.B;
  a.query_tokens = p.T;
  a.heads = p.H;
  a.topk = p.K;
  a.softmax_scale = p.scale;
  a.q = d_q.get();
  a.kv = d_kv.get();
  a.kv_offsets = d_off.get();
  a.slots = p.slots;
  a.indices = d_ids.get();
  a.out = want_bf16 ? d_o16.get() : nullptr;
  a.out_f32 = want_f32 ? d_o32.get() : nullptr;
  a.lse = d_lse.get();
  a.bad_index = d_bad.get();
  a.row_lengths = row_lengths.empty() ? nullptr : d_len.get();
  ESS_CUDA_CHECK(static_cast<cudaError_t>(cuda::sparse_mla_decode(a, nullptr)), "sparse_mla_decode");
  ESS_CUDA_CHECK(cudaDeviceSynchronize(), "sparse_mla_decode");
  Output out;
  if (want_f32) out.o32 = download(d_o32, rows * kV);
  if (want_bf16) out.o16 = download(d_o16, rows * kV);
  out.lse = download(d_lse, rows);
  out.bad = download(d_bad, 1)[0];
  return out;
}

class SparseMlaShapes : public testing::TestWithParam<Shape> {};

TEST_P(SparseMlaShapes, MatchesTheReferenceWithinTheContract) {
  ESS_SKIP_WITHOUT_GPU();
  const auto [B, T, H, K, mask] = GetParam();
  const Problem p = make_problem(B, T, H, K, mask, Values::kRandom,
                                 static_cast<std::uint32_t>(B * 1000003 + T * 10007 + H * 101 + K * 7 + static_cast<int>(mask)));
  const Output both = run_decode(p, p.ids, true, true);
  EXPECT_EQ(both.bad, p.expected_bad);
  expect_within_contract(p, p.ids, both);
  // Each output alone: the same values, bit for bit (the other pointer is nullptr).
  const Output f32 = run_decode(p, p.ids, true, false);
  const Output b16 = run_decode(p, p.ids, false, true);
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
  ESS_SKIP_WITHOUT_GPU();
  const Problem p = equal_scores_problem(2, 2, 128, 2048, 17);
  expect_equal_scores_average(p, run_decode(p, p.ids, true, true));
}

TEST(SparseMlaExact, OneValidEntryGivesItsValueAndScore) {
  ESS_SKIP_WITHOUT_GPU();
  for (const int H : {64, 128}) {
    const Problem p = one_valid_problem(3, 2, H, 100, static_cast<std::uint32_t>(H));
    expect_one_valid_entry(p, run_decode(p, p.ids, true, true));
  }
}

// The DA schedule: attention over the hits (misses masked) and over the misses (hits masked),
// merged, equals attention over all ids.
TEST(SparseMlaSplit, HitAndMissPartialsMergeToTheFullDecode) {
  ESS_SKIP_WITHOUT_GPU();
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
  const Output h = run_decode(p, hit, true, false);
  const Output m = run_decode(p, miss, true, false);
  const std::size_t rows = p.tokens() * static_cast<std::size_t>(p.H);
  auto d_oa = upload(h.o32);
  const auto d_la = upload(h.lse), d_ob = upload(m.o32), d_lb = upload(m.lse);
  cuda::DeviceBuffer<std::uint16_t> d_o16(rows * kV);
  cuda::DeviceBuffer<float> d_lse(rows);
  cuda::MergeArgs a;
  a.rows = static_cast<std::int64_t>(rows);
  a.o_a = d_oa.get();
  a.lse_a = d_la.get();
  a.o_b = d_ob.get();
  a.lse_b = d_lb.get();
  a.out_f32 = d_oa.get();  // in place, as the schedule does
  a.out = d_o16.get();
  a.lse = d_lse.get();
  ASSERT_EQ(cuda::merge_states(a, nullptr), 0);
  ESS_CUDA_CHECK(cudaDeviceSynchronize(), "merge");
  Output merged;
  merged.o32 = download(d_oa, rows * kV);
  merged.o16 = download(d_o16, rows * kV);
  merged.lse = download(d_lse, rows);
  expect_within_contract(p, p.ids, merged, std::ldexp(1.0, -19), true);
}

// Row lengths (how the DA halves pass their compacted lists): only the first len ids of a row
// count, the rest are ignored even when valid; len 0 is an empty partial, len > K is K.
TEST(SparseMlaRowLengths, OnlyTheFirstLengthIdsOfARowCount) {
  ESS_SKIP_WITHOUT_GPU();
  const Problem p = make_problem(3, 3, 64, 200, Mask::kNone, Values::kRandom, 41);
  const std::vector<std::int32_t> len = {0, 1, 31, 32, 33, 64, 100, 199, 5000};
  std::vector<std::int32_t> masked = p.ids;
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    for (std::size_t k = static_cast<std::size_t>(std::min(len[t], 200)); k < 200; ++k) masked[t * 200 + k] = -1;
  }
  const Output out = run_decode(p, p.ids, true, true, len);
  expect_within_contract(p, masked, out);
  for (int h = 0; h < p.H; ++h) EXPECT_EQ(out.lse[static_cast<std::size_t>(h)], -kInf) << "length 0, head " << h;
}

// Merge rows: finite pairs (close and far apart), one or both partials empty (-inf or
// FlashMLA's +inf), an empty partial whose o is NaN (must not be read).
struct MergeCase {
  std::vector<float> oa, ob, la, lb;
};
MergeCase make_merge_case(std::int64_t rows, int dim) {
  MergeCase m;
  std::mt19937 rng(static_cast<std::uint32_t>(rows * 31 + dim));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-8.0f, 24.0f);
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(dim);
  m.oa.resize(n);
  m.ob.resize(n);
  for (auto& x : m.oa) x = normal(rng);
  for (auto& x : m.ob) x = normal(rng);
  for (std::int64_t r = 0; r < rows; ++r) {
    float a = uni(rng), b = uni(rng);
    switch (r % 9) {
      case 1: a = -kInf; break;
      case 2: b = kInf; break;
      case 3: a = kInf; b = -kInf; break;
      case 4: a = -kInf; b = -kInf; break;
      case 5:
        a = -kInf;
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
  ESS_SKIP_WITHOUT_GPU();
  for (const auto& [rows, dim] : {std::make_pair(std::int64_t{301}, 512), std::make_pair(std::int64_t{37}, 12)}) {
    const MergeCase mc = make_merge_case(rows, dim);
    const std::size_t n = mc.oa.size();
    std::vector<float> ref_o(n), ref_l(static_cast<std::size_t>(rows));
    ref::merge_states(static_cast<int>(rows), dim, mc.oa, mc.la, mc.ob, mc.lb, ref_o, ref_l);
    const auto d_oa = upload(mc.oa), d_ob = upload(mc.ob), d_la = upload(mc.la), d_lb = upload(mc.lb);
    cuda::DeviceBuffer<float> d_o(n), d_l(static_cast<std::size_t>(rows));
    cuda::DeviceBuffer<std::uint16_t> d_o16(n);
    cuda::MergeArgs a;
    a.rows = rows;
    a.dim = dim;
    a.o_a = d_oa.get();
    a.lse_a = d_la.get();
    a.o_b = d_ob.get();
    a.lse_b = d_lb.get();
    a.out_f32 = d_o.get();
    a.out = d_o16.get();
    a.lse = d_l.get();
    ASSERT_EQ(cuda::merge_states(a, nullptr), 0);
    ESS_CUDA_CHECK(cudaDeviceSynchronize(), "merge");
    const auto o = download(d_o, n);
    const auto o16 = download(d_o16, n);
    const auto l = download(d_l, static_cast<std::size_t>(rows));
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
    for (const bool over_a : {true, false}) {
      auto d_x = upload(over_a ? mc.oa : mc.ob);
      auto d_xl = upload(over_a ? mc.la : mc.lb);
      cuda::MergeArgs b = a;
      (over_a ? b.o_a : b.o_b) = d_x.get();
      (over_a ? b.lse_a : b.lse_b) = d_xl.get();
      b.out_f32 = d_x.get();
      b.lse = d_xl.get();
      b.out = nullptr;
      ASSERT_EQ(cuda::merge_states(b, nullptr), 0);
      ESS_CUDA_CHECK(cudaDeviceSynchronize(), "merge");
      const auto o2 = download(d_x, n);
      const auto l2 = download(d_xl, static_cast<std::size_t>(rows));
      EXPECT_EQ(0, std::memcmp(o2.data(), o.data(), n * 4)) << (over_a ? "over a" : "over b");
      EXPECT_EQ(0, std::memcmp(l2.data(), l.data(), l.size() * 4)) << (over_a ? "over a" : "over b");
    }
  }
}

TEST(SparseMlaArguments, UnsupportedShapesAreRejected) {
  // Argument checks happen before any CUDA call: no device needed.
  std::vector<std::uint8_t> dummy(64);
  cuda::SparseMlaArgs ok;
  ok.batch = 1;
  ok.heads = 64;
  ok.topk = 1;
  ok.softmax_scale = 0.1f;
  ok.q = reinterpret_cast<const std::uint16_t*>(dummy.data() + 16 - reinterpret_cast<std::uintptr_t>(dummy.data()) % 16);
  ok.kv = dummy.data() + 16 - reinterpret_cast<std::uintptr_t>(dummy.data()) % 16;
  ok.kv_offsets = reinterpret_cast<const std::uint64_t*>(ok.kv);
  ok.indices = reinterpret_cast<const std::int32_t*>(ok.kv);
  ok.lse = reinterpret_cast<float*>(dummy.data());
  const auto bad = [&](auto&& change) {
    cuda::SparseMlaArgs a = ok;
    change(a);
    return cuda::sparse_mla_decode(a, nullptr);
  };
  const int kInvalid = static_cast<int>(cudaErrorInvalidValue);
  EXPECT_EQ(bad([](auto& a) { a.heads = 96; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.heads = 192; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.heads = 0; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.topk = 0; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.query_tokens = 0; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.softmax_scale = 0.0f; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.softmax_scale = kInf; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.lse = nullptr; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.q = reinterpret_cast<const std::uint16_t*>(a.kv + 2); }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.batch = 0; }), 0);  // nothing to do
  cuda::MergeArgs m;
  m.rows = 1;
  m.dim = 6;
  EXPECT_EQ(cuda::merge_states(m, nullptr), kInvalid);
  m.rows = 0;
  m.dim = 8;
  m.o_a = m.o_b = m.lse_a = m.lse_b = ok.lse;
  EXPECT_EQ(cuda::merge_states(m, nullptr), 0);
  EXPECT_DOUBLE_EQ(cuda::sparse_mla_flops(128, 2, 128, 2048), 128.0 * 2 * 128 * 2048 * 2 * (576 + 512));
}

}  // namespace
}  // namespace ess
