// The sparse MLA decode's and the merge's CPU references (ess/ops/reference.h).
#include "ess/ops/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "ess/core/error.h"
#include "ess/model/numerics.h"

namespace ess::ref {

void sparse_mla_decode_f32(const SparseMlaParams& p, std::span<const std::uint16_t> q,
                           std::span<const std::uint8_t* const> entries, std::span<float> out,
                           std::span<float> lse) {
  const int V = p.layout.nope_dim;
  const int R = p.layout.rope_dim;
  const std::size_t qdim = static_cast<std::size_t>(V + R);
  ESS_CHECK(p.heads > 0 && q.size() == static_cast<std::size_t>(p.heads) * qdim,
            "sparse_mla_decode: q has {} values, expected {} heads x {}", q.size(), p.heads, qdim);
  ESS_CHECK(out.size() == static_cast<std::size_t>(p.heads) * V && lse.size() == static_cast<std::size_t>(p.heads),
            "sparse_mla_decode: output {} / lse {} values, expected {} / {}", out.size(), lse.size(),
            static_cast<std::size_t>(p.heads) * V, p.heads);
  ESS_CHECK(std::isfinite(p.softmax_scale) && p.softmax_scale > 0.0f,
            "sparse_mla_decode: softmax_scale = {} must be positive", p.softmax_scale);

  // Dequantize the valid entries once.
  std::vector<float> nope;
  std::vector<float> rope;
  std::size_t n = 0;
  for (const std::uint8_t* e : entries) n += e != nullptr ? 1 : 0;
  nope.resize(n * V);
  rope.resize(n * R);
  {
    std::size_t i = 0;
    for (const std::uint8_t* e : entries) {
      if (e == nullptr) continue;
      dequantize_latent(p.layout, {e, p.layout.bytes()}, {nope.data() + i * V, static_cast<std::size_t>(V)},
                        {rope.data() + i * R, static_cast<std::size_t>(R)});
      ++i;
    }
  }
  // Scores s[j][h]: q transposed to [dim][heads] so the heads advance together; each dot
  // product still sums d = 0..dim-1 in order.
  const std::size_t H = static_cast<std::size_t>(p.heads);
  std::vector<double> qt(qdim * H);
  for (std::size_t h = 0; h < H; ++h) {
    for (std::size_t d = 0; d < qdim; ++d) qt[d * H + h] = bf16_to_float(q[h * qdim + d]);
  }
  std::vector<double> s(n * H, 0.0);
  for (std::size_t j = 0; j < n; ++j) {
    double* sj = s.data() + j * H;
    for (std::size_t d = 0; d < qdim; ++d) {
      const double kv = d < static_cast<std::size_t>(V) ? nope[j * V + d] : rope[j * R + (d - V)];
      const double* qd = qt.data() + d * H;
      for (std::size_t h = 0; h < H; ++h) sj[h] += qd[h] * kv;
    }
  }
  std::vector<double> acc(static_cast<std::size_t>(V));
  for (std::size_t h = 0; h < H; ++h) {
    float* o = out.data() + h * V;
    if (n == 0) {
      std::fill(o, o + V, 0.0f);
      lse[h] = -std::numeric_limits<float>::infinity();
      continue;
    }
    double smax = -std::numeric_limits<double>::infinity();
    for (std::size_t j = 0; j < n; ++j) smax = std::max(smax, s[j * H + h] * p.softmax_scale);
    double sum = 0.0;
    for (std::size_t j = 0; j < n; ++j) sum += std::exp(s[j * H + h] * p.softmax_scale - smax);
    const double l = smax + std::log(sum);
    std::fill(acc.begin(), acc.end(), 0.0);
    for (std::size_t j = 0; j < n; ++j) {
      const double pj = std::exp(s[j * H + h] * p.softmax_scale - l);
      for (int d = 0; d < V; ++d) acc[d] += pj * nope[j * V + d];
    }
    for (int d = 0; d < V; ++d) o[d] = static_cast<float>(acc[d]);
    lse[h] = static_cast<float>(l);
  }
}

void sparse_mla_decode(const SparseMlaParams& p, std::span<const std::uint16_t> q,
                       std::span<const std::uint8_t* const> entries, std::span<std::uint16_t> out,
                       std::span<float> lse) {
  ESS_CHECK(out.size() == static_cast<std::size_t>(p.heads) * p.layout.nope_dim,
            "sparse_mla_decode: output has {} values, expected {}", out.size(),
            static_cast<std::size_t>(p.heads) * p.layout.nope_dim);
  std::vector<float> o(out.size());
  sparse_mla_decode_f32(p, q, entries, o, lse);
  for (std::size_t i = 0; i < o.size(); ++i) out[i] = bf16_from_float(o[i]);
}

void merge_states(int heads, int dim, std::span<const float> o_a, std::span<const float> lse_a,
                  std::span<const float> o_b, std::span<const float> lse_b, std::span<float> out,
                  std::span<float> lse) {
  const std::size_t n = static_cast<std::size_t>(heads) * dim;
  ESS_CHECK(heads > 0 && dim > 0 && o_a.size() == n && o_b.size() == n && out.size() == n &&
                lse_a.size() == static_cast<std::size_t>(heads) && lse_b.size() == static_cast<std::size_t>(heads) &&
                lse.size() == static_cast<std::size_t>(heads),
            "merge_states: shapes do not match {} heads x {} dims", heads, dim);
  for (int h = 0; h < heads; ++h) {
    const double a = lse_a[static_cast<std::size_t>(h)];
    const double b = lse_b[static_cast<std::size_t>(h)];
    ESS_CHECK(!std::isnan(a) && !std::isnan(b), "merge_states: head {} has a NaN log-sum-exp", h);
    const bool ea = std::isinf(a);
    const bool eb = std::isinf(b);
    double wa = 0.0;
    double wb = 0.0;
    double l = -std::numeric_limits<double>::infinity();
    if (!ea && !eb) {
      const double m = std::max(a, b);
      l = m + std::log(std::exp(a - m) + std::exp(b - m));
      wa = std::exp(a - l);
      wb = std::exp(b - l);
    } else if (!ea) {
      l = a;
      wa = 1.0;
    } else if (!eb) {
      l = b;
      wb = 1.0;
    }
    const std::size_t base = static_cast<std::size_t>(h) * dim;
    for (int d = 0; d < dim; ++d) {
      const double va = wa != 0.0 ? wa * o_a[base + d] : 0.0;
      const double vb = wb != 0.0 ? wb * o_b[base + d] : 0.0;
      out[base + d] = static_cast<float>(va + vb);
    }
    lse[static_cast<std::size_t>(h)] = static_cast<float>(l);
  }
}

}  // namespace ess::ref
