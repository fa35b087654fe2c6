#include "testing/accuracy.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ess/core/error.h"
#include "ess/model/entry_layout.h"
#include "ess/model/numerics.h"

namespace ess::test {
namespace {
using ref::indexer_logits;
using ref::sparse_mla_decode_f32;
constexpr int kDim = 128;  // index_head_dim
}  // namespace

DecodeCheck check_decode_token(const ref::SparseMlaParams& p, std::span<const std::uint16_t> q,
                               std::span<const std::uint8_t* const> entries, std::span<const float> out,
                               bool out_is_bf16, std::span<const float> lse, double slack, bool merged) {
  const int H = p.heads;
  const int V = p.layout.nope_dim;
  const int R = p.layout.rope_dim;
  const std::size_t D = static_cast<std::size_t>(V + R);
  ESS_CHECK(H > 0 && q.size() == static_cast<std::size_t>(H) * D && out.size() == static_cast<std::size_t>(H) * V &&
                lse.size() == static_cast<std::size_t>(H),
            "check_decode_token: q {} / out {} / lse {} values do not match {} heads", q.size(), out.size(), lse.size(), H);
  std::vector<float> o_ref(static_cast<std::size_t>(H) * V);
  std::vector<float> lse_ref(static_cast<std::size_t>(H));
  sparse_mla_decode_f32(p, q, entries, o_ref, lse_ref);

  // Valid entries, dequantized as [n][nope ++ rope]; V_d = max_j |v_jd|.
  std::vector<double> kv;
  std::size_t n = 0;
  std::vector<float> nope(static_cast<std::size_t>(V)), rope(static_cast<std::size_t>(R));
  std::vector<double> vmax(static_cast<std::size_t>(V), 0.0);
  for (const std::uint8_t* e : entries) {
    if (e == nullptr) continue;
    dequantize_latent(p.layout, {e, p.layout.bytes()}, nope, rope);
    for (int d = 0; d < V; ++d) {
      kv.push_back(nope[static_cast<std::size_t>(d)]);
      vmax[static_cast<std::size_t>(d)] = std::max(vmax[static_cast<std::size_t>(d)], std::fabs(static_cast<double>(nope[static_cast<std::size_t>(d)])));
    }
    for (int d = 0; d < R; ++d) kv.push_back(rope[static_cast<std::size_t>(d)]);
    ++n;
  }
  const double u23 = std::ldexp(1.0, -23);
  const double acc_n = 2.0 * static_cast<double>(n) * u23;
  DecodeCheck c;
  const auto note = [&](double err, double bound, const std::string& where) {
    const double r = err / bound;
    if (!(r <= c.worst)) {  // also records NaN
      c.worst = std::isnan(r) ? std::numeric_limits<double>::infinity() : r;
      c.worst_at = where;
    }
  };
  std::vector<double> qh(D);
  for (int h = 0; h < H; ++h) {
    const std::size_t hs = static_cast<std::size_t>(h);
    const float* oh = out.data() + hs * V;
    const float* rh = o_ref.data() + hs * V;
    if (n == 0) {
      if (!(lse[hs] == -std::numeric_limits<float>::infinity()) && c.structural.empty()) {
        c.structural = fmt::format("head {}: lse {} for a token with no valid entry (want -inf)", h, lse[hs]);
      }
      for (int d = 0; d < V; ++d) {
        if (oh[d] != 0.0f && c.structural.empty()) {
          c.structural = fmt::format("head {} dim {}: o = {} for a token with no valid entry (want 0)", h, d, oh[d]);
        }
      }
      continue;
    }
    if (!std::isfinite(lse[hs]) && c.structural.empty()) {
      c.structural = fmt::format("head {}: lse {} is not finite", h, lse[hs]);
    }
    for (std::size_t d = 0; d < D; ++d) qh[d] = bf16_to_float(q[hs * D + d]);
    double dq_max = 0.0, s_max = 0.0;
    for (std::size_t j = 0; j < n; ++j) {
      const double* k = kv.data() + j * D;
      double dot = 0.0, mag = 0.0;
      for (std::size_t d = 0; d < D; ++d) {
        dot += qh[d] * k[d];
        mag += std::fabs(qh[d] * k[d]);
      }
      dq_max = std::max(dq_max, mag);
      s_max = std::max(s_max, std::fabs(dot) * p.softmax_scale);
    }
    const double delta = p.softmax_scale * 577.0 * u23 * dq_max + std::ldexp(s_max, -20) + std::ldexp(1.0, -21);
    const double lb = delta + acc_n + std::ldexp(1.0 + std::fabs(static_cast<double>(lse_ref[hs])), -20) + slack;
    const double eps = std::ldexp(1.0, -8) + std::expm1(2.0 * delta) + acc_n + std::ldexp(1.0, -20) + slack +
                       (merged ? std::expm1(2.0 * lb) : 0.0);
    for (int d = 0; d < V; ++d) {
      const double got = oh[d];
      const double want = rh[d];
      if (!std::isfinite(got) && c.structural.empty()) {
        c.structural = fmt::format("head {} dim {}: o = {} is not finite", h, d, got);
      }
      const double vb = eps * vmax[static_cast<std::size_t>(d)];
      const double bound = vb + (out_is_bf16 ? std::ldexp(std::fabs(want) + vb, -8) : 0.0) + 1e-30;
      note(std::fabs(got - want), bound, fmt::format("head {} dim {} (got {}, want {})", h, d, got, want));
    }
    note(std::fabs(static_cast<double>(lse[hs]) - lse_ref[hs]), lb,
         fmt::format("head {} lse (got {}, want {})", h, lse[hs], lse_ref[hs]));
  }
  return c;
}

void indexer_reference(std::span<const std::uint8_t> q_fp8, std::span<const float> w, int heads,
                       std::span<const std::uint8_t* const> pages, std::int64_t length, std::span<float> logits,
                       std::span<double> bound) {
  const IndexerLayout layout;
  const auto H = static_cast<std::size_t>(heads);
  ESS_CHECK(q_fp8.size() == H * kDim && w.size() == H && logits.size() >= static_cast<std::size_t>(length) &&
                bound.size() >= static_cast<std::size_t>(length),
            "indexer reference: {} query bytes, {} weights for {} heads; {} logits / {} bounds for {} keys", q_fp8.size(),
            w.size(), heads, logits.size(), bound.size(), length);
  std::vector<float> qf(H * kDim);
  std::vector<double> qabs(qf.size());
  for (std::size_t i = 0; i < qf.size(); ++i) {
    qf[i] = fp8_e4m3_to_float(q_fp8[i]);
    qabs[i] = std::fabs(static_cast<double>(qf[i]));
  }
  indexer_logits(layout, qf, w, heads, pages, length, logits.first(static_cast<std::size_t>(length)));
  std::vector<double> kabs(kDim);
  for (std::int64_t j = 0; j < length; ++j) {
    const std::uint8_t* page = pages[static_cast<std::size_t>(j / 64)];
    const int jj = static_cast<int>(j % 64);
    for (int d = 0; d < kDim; ++d) kabs[static_cast<std::size_t>(d)] = std::fabs(fp8_e4m3_to_float(page[layout.key_offset(jj) + d]));
    float scale = 0.0f;
    std::memcpy(&scale, page + layout.scale_offset(jj), 4);
    double s = 0.0;
    for (std::size_t h = 0; h < H; ++h) {
      double a = 0.0;
      for (int d = 0; d < kDim; ++d) a += qabs[h * kDim + static_cast<std::size_t>(d)] * kabs[static_cast<std::size_t>(d)];
      s += std::fabs(static_cast<double>(w[h])) * a;
    }
    bound[static_cast<std::size_t>(j)] = s * scale * kIndexerLogitsTolerance;
  }
}

}  // namespace ess::test
