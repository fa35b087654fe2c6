#include "ess/ops/reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "ess/core/error.h"
#include "ess/model/numerics.h"

namespace ess {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- indexer ---------------------------------------------------------------------------

TEST(IndexerLogits, HandComputed) {
  const IndexerLayout l;
  std::vector<std::uint8_t> page(l.page_bytes(), 0);
  std::vector<float> key(128, 0.0f);
  key[0] = 3.0f;
  key[1] = 1.0f;
  quantize_indexer_key(l, key, page, 0);  // k0 = (3, 1, 0, ...), exact in FP8
  key[0] = -2.0f;
  key[1] = 0.0f;
  quantize_indexer_key(l, key, page, 1);  // k1 = (-2, 0, ...)
  // Two heads: q0 = e0, q1 = e1; w = (2, -1).
  std::vector<float> q(2 * 128, 0.0f);
  q[0] = 1.0f;
  q[128 + 1] = 1.0f;
  const std::vector<float> w = {2.0f, -1.0f};
  std::vector<float> logits(2);
  const std::vector<const std::uint8_t*> pages = {page.data()};
  ref::indexer_logits(l, q, w, 2, pages, 2, logits);
  EXPECT_EQ(logits[0], 2.0f * 3.0f - 1.0f * 1.0f);   // 5
  EXPECT_EQ(logits[1], 2.0f * 0.0f - 1.0f * 0.0f);   // ReLU(-2) = 0
}

TEST(IndexerLogits, MatchesTheDequantizedFormulaOverManyPages) {
  const IndexerLayout l;
  std::mt19937 rng(4);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const int H = 8;
  const std::int64_t len = 200;  // 4 pages, the last partial
  std::vector<std::vector<std::uint8_t>> pages(4, std::vector<std::uint8_t>(l.page_bytes(), 0));
  std::vector<float> key(128);
  for (std::int64_t j = 0; j < len; ++j) {
    const float mag = std::exp2(static_cast<float>(j % 7) - 3.0f);
    for (float& v : key) v = n(rng) * mag;
    quantize_indexer_key(l, key, pages[static_cast<std::size_t>(j / 64)], static_cast<int>(j % 64));
  }
  std::vector<float> q(static_cast<std::size_t>(H) * 128), w(H);
  for (float& v : q) v = n(rng);
  for (float& v : w) v = n(rng);
  std::vector<const std::uint8_t*> ptrs;
  for (auto& p : pages) ptrs.push_back(p.data());
  std::vector<float> logits(len);
  ref::indexer_logits(l, q, w, H, ptrs, len, logits);
  for (std::int64_t j = 0; j < len; ++j) {
    dequantize_indexer_key(l, pages[static_cast<std::size_t>(j / 64)], static_cast<int>(j % 64), key);
    long double expect = 0;
    for (int h = 0; h < H; ++h) {
      long double dot = 0;
      for (int d = 0; d < 128; ++d) dot += static_cast<long double>(q[h * 128 + d]) * key[d];
      expect += w[h] * std::max(dot, 0.0L);
    }
    EXPECT_NEAR(logits[static_cast<std::size_t>(j)], static_cast<double>(expect), 1e-5 * (1 + std::fabs(static_cast<double>(expect))))
        << "key " << j;
  }
  EXPECT_THROW(ref::indexer_logits(l, q, w, H, ptrs, 257, logits), Error);  // 4 pages hold 256
}

// ---- top-k -----------------------------------------------------------------------------

TEST(TopK, OrdersByLogitThenLowerIndexAndPads) {
  const std::vector<float> logits = {1.0f, 5.0f, 3.0f, 5.0f, -kInf, 3.0f};
  std::vector<std::int32_t> out(4);
  ref::topk(logits, 4, out);
  EXPECT_EQ(out, (std::vector<std::int32_t>{1, 3, 2, 5}));
  std::vector<std::int32_t> big(8);
  ref::topk(logits, 8, big);
  EXPECT_EQ(big, (std::vector<std::int32_t>{1, 3, 2, 5, 0, 4, -1, -1}));
  std::vector<std::int32_t> none(3);
  ref::topk(std::vector<float>{}, 3, none);
  EXPECT_EQ(none, (std::vector<std::int32_t>{-1, -1, -1}));
  EXPECT_THROW(ref::topk(std::vector<float>{1.0f, NAN}, 1, out = std::vector<std::int32_t>(1)), Error);
  std::vector<std::int32_t> zero;
  EXPECT_THROW(ref::topk(logits, 0, zero), Error);
}

TEST(TopK, AllTiesSelectTheLowestIndices) {
  const std::vector<float> logits(3000, 0.5f);
  std::vector<std::int32_t> out(2048);
  ref::topk(logits, 2048, out);
  for (int i = 0; i < 2048; ++i) ASSERT_EQ(out[i], i);
}

// ---- sparse MLA decode -----------------------------------------------------------------

struct Entries {
  explicit Entries(int n, std::uint32_t seed) : layout{}, bytes(static_cast<std::size_t>(n), std::vector<std::uint8_t>(656)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> nope(512), rope(64);
    for (auto& e : bytes) {
      for (float& v : nope) v = d(rng);
      for (float& v : rope) v = d(rng);
      quantize_latent(layout, nope, rope, e);
    }
  }
  std::vector<const std::uint8_t*> ptrs(const std::vector<int>& idx) const {
    std::vector<const std::uint8_t*> p;
    for (int i : idx) p.push_back(i < 0 ? nullptr : bytes[static_cast<std::size_t>(i)].data());
    return p;
  }
  LatentLayout layout;
  std::vector<std::vector<std::uint8_t>> bytes;
};

std::vector<std::uint16_t> random_q(int heads, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<std::uint16_t> q(static_cast<std::size_t>(heads) * 576);
  for (auto& v : q) v = bf16_from_float(d(rng));
  return q;
}

// Independent reference: dequantize, softmax with the textbook formula in long double.
void naive_attention(const Entries& e, const std::vector<int>& idx, const std::vector<std::uint16_t>& q, int heads,
                     float scale, std::vector<long double>& out, std::vector<long double>& lse) {
  out.assign(static_cast<std::size_t>(heads) * 512, 0.0L);
  lse.assign(static_cast<std::size_t>(heads), -INFINITY);
  std::vector<float> nope(512), rope(64);
  std::vector<std::vector<float>> vn, vr;
  for (int i : idx) {
    if (i < 0) continue;
    dequantize_latent(e.layout, e.bytes[static_cast<std::size_t>(i)], nope, rope);
    vn.push_back(nope);
    vr.push_back(rope);
  }
  for (int h = 0; h < heads; ++h) {
    if (vn.empty()) continue;
    std::vector<long double> s;
    for (std::size_t j = 0; j < vn.size(); ++j) {
      long double dot = 0;
      for (int d = 0; d < 512; ++d) dot += static_cast<long double>(bf16_to_float(q[h * 576 + d])) * vn[j][d];
      for (int d = 0; d < 64; ++d) dot += static_cast<long double>(bf16_to_float(q[h * 576 + 512 + d])) * vr[j][d];
      s.push_back(dot * scale);
    }
    long double denom = 0;
    for (long double x : s) denom += std::exp(x);
    lse[h] = std::log(denom);
    for (std::size_t j = 0; j < vn.size(); ++j) {
      for (int d = 0; d < 512; ++d) out[h * 512 + d] += std::exp(s[j]) / denom * vn[j][d];
    }
  }
}

TEST(SparseMlaDecode, MatchesTheTextbookFormula) {
  const int heads = 16;
  const Entries e(300, 1);
  const auto q = random_q(heads, 2);
  const ref::SparseMlaParams p{e.layout, heads, 0.04f};
  std::vector<int> idx;
  for (int i = 0; i < 300; i += 2) idx.push_back(i);
  idx[5] = -1;
  idx[77] = -1;
  std::vector<std::uint16_t> out(heads * 512);
  std::vector<float> lse(heads);
  ref::sparse_mla_decode(p, q, e.ptrs(idx), out, lse);
  std::vector<long double> eo, el;
  naive_attention(e, idx, q, heads, 0.04f, eo, el);
  double max_err = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double got = bf16_to_float(out[i]);
    const double want = static_cast<double>(eo[i]);
    // bf16 output: half an ulp (2^-9 relative) plus a little for the accumulation.
    ASSERT_LE(std::fabs(got - want), std::fabs(want) * 0.0040 + 1e-6) << "element " << i;
    max_err = std::max(max_err, std::fabs(got - want));
  }
  for (int h = 0; h < heads; ++h) EXPECT_NEAR(lse[h], static_cast<double>(el[h]), 1e-5 * std::fabs(static_cast<double>(el[h])) + 1e-6);
}

TEST(SparseMlaDecode, MaskedPositionsAreIgnoredExactly) {
  const int heads = 4;
  const Entries e(40, 3);
  const auto q = random_q(heads, 4);
  const ref::SparseMlaParams p{e.layout, heads, 0.07f};
  std::vector<std::uint16_t> a(heads * 512), b(heads * 512);
  std::vector<float> la(heads), lb(heads);
  ref::sparse_mla_decode(p, q, e.ptrs({3, -1, 7, -1, -1, 9}), a, la);
  ref::sparse_mla_decode(p, q, e.ptrs({3, 7, 9}), b, lb);
  EXPECT_EQ(a, b);
  EXPECT_EQ(la, lb);
}

TEST(SparseMlaDecode, SingleEntryAndEmptySelection) {
  const int heads = 2;
  const Entries e(1, 5);
  const auto q = random_q(heads, 6);
  const ref::SparseMlaParams p{e.layout, heads, 0.1f};
  std::vector<float> out(heads * 512), lse(heads);
  ref::sparse_mla_decode_f32(p, q, e.ptrs({0}), out, lse);
  std::vector<float> nope(512), rope(64);
  dequantize_latent(e.layout, e.bytes[0], nope, rope);
  for (int d = 0; d < 512; ++d) EXPECT_EQ(out[d], nope[d]);  // softmax weight exactly 1
  ref::sparse_mla_decode_f32(p, q, e.ptrs({-1, -1}), out, lse);
  for (float v : out) ASSERT_EQ(v, 0.0f);
  EXPECT_EQ(lse[0], -kInf);
  EXPECT_EQ(lse[1], -kInf);
  std::vector<float> short_out(10);
  EXPECT_THROW(ref::sparse_mla_decode_f32(p, q, e.ptrs({0}), short_out, lse), Error);
}

// ---- merge -----------------------------------------------------------------------------

TEST(MergeStates, MergingTwoHalvesEqualsAttentionOverTheUnion) {
  const int heads = 8;
  const Entries e(120, 7);
  const auto q = random_q(heads, 8);
  const ref::SparseMlaParams p{e.layout, heads, 0.05f};
  std::vector<int> all, a, b;
  for (int i = 0; i < 120; ++i) {
    all.push_back(i);
    (i % 3 == 0 ? a : b).push_back(i);
  }
  std::vector<float> oa(heads * 512), ob(heads * 512), ou(heads * 512), om(heads * 512);
  std::vector<float> la(heads), lb(heads), lu(heads), lm(heads);
  ref::sparse_mla_decode_f32(p, q, e.ptrs(a), oa, la);
  ref::sparse_mla_decode_f32(p, q, e.ptrs(b), ob, lb);
  ref::sparse_mla_decode_f32(p, q, e.ptrs(all), ou, lu);
  ref::merge_states(heads, 512, oa, la, ob, lb, om, lm);
  for (std::size_t i = 0; i < om.size(); ++i) ASSERT_NEAR(om[i], ou[i], 1e-5 * (1 + std::fabs(ou[i]))) << i;
  for (int h = 0; h < heads; ++h) EXPECT_NEAR(lm[h], lu[h], 1e-5);
}

TEST(MergeStates, EmptyPartialsContributeNothing) {
  const std::vector<float> o = {1.5f, -2.0f};
  const std::vector<float> zero = {9.0f, 9.0f};  // ignored: its lse marks it empty
  std::vector<float> out(2), lse(1);
  ref::merge_states(1, 2, o, std::vector<float>{0.25f}, zero, std::vector<float>{-kInf}, out, lse);
  EXPECT_EQ(out, o);
  EXPECT_EQ(lse[0], 0.25f);
  ref::merge_states(1, 2, zero, std::vector<float>{kInf}, o, std::vector<float>{0.5f}, out, lse);  // FlashMLA's +inf
  EXPECT_EQ(out, o);
  EXPECT_EQ(lse[0], 0.5f);
  ref::merge_states(1, 2, zero, std::vector<float>{-kInf}, zero, std::vector<float>{kInf}, out, lse);
  EXPECT_EQ(out, (std::vector<float>{0.0f, 0.0f}));
  EXPECT_EQ(lse[0], -kInf);
  EXPECT_THROW(ref::merge_states(1, 2, o, std::vector<float>{NAN}, o, std::vector<float>{0.0f}, out, lse), Error);
  // Equal halves: the merged output is the same vector, lse grows by log 2.
  ref::merge_states(1, 2, o, std::vector<float>{1.0f}, o, std::vector<float>{1.0f}, out, lse);
  EXPECT_FLOAT_EQ(out[0], 1.5f);
  EXPECT_FLOAT_EQ(lse[0], 1.0f + std::log(2.0f));
}

}  // namespace
}  // namespace ess
