// CPU reference kernels (each beside its op: src/runtime/ops/<op>/<op>_ref.cc): written for
// clarity and exactness, not speed. Every GPU kernel is checked against these. Accumulation
// is in double, in a fixed order, so the references are deterministic and their rounding
// error is far below the tolerances the GPU is held to.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ess/model/entry_layout.h"
#include "ess/ops/row_layout.h"

namespace ess::ref {

// ---- FlashTrans (entry copies) -------------------------------------------------------------
//
// For i < count: dst_base + dst_offsets[i] <- src_base + src_offsets[i], entry_bytes bytes
// each (ess/ops/flashtrans.h copies exactly this; the entries of one call never overlap).
void copy_entries(const std::uint8_t* src_base, std::uint8_t* dst_base, std::span<const std::uint64_t> src_offsets,
                  std::span<const std::uint64_t> dst_offsets, std::int64_t count, int entry_bytes);
// The same with a side that keeps entries in two parts (RowTail; EntryCopy's src_tail /
// dst_tail): the head at the listed offset, the tail at the tail's place; a whole side holds
// head then tail. Bytes past head + tail of a whole side's entry are not copied.
void copy_entries(const std::uint8_t* src_base, std::uint8_t* dst_base, std::span<const std::uint64_t> src_offsets,
                  std::span<const std::uint64_t> dst_offsets, std::int64_t count, int entry_bytes, const RowTail& src_tail,
                  const RowTail& dst_tail);

// ---- Lightning indexer -------------------------------------------------------------------
//
// Score of key j for one query token:
//     I_j = sum_h  w_h * ReLU( sum_d q[h][d] * k_j[d] )
// with k_j the dequantized FP8 key (fp8 * scale_j). The scale is positive, so it factors out
// of the ReLU: I_j = scale_j * sum_h w_h * ReLU(q_h . k8_j), k8_j the raw FP8 values.
//
// q: [H][D] floats (the indexer query, any FP8 query scale already folded into w),
// w: [H], pages: the request's indexer cache as 64-token pages (IndexerLayout), holding
// `length` keys. Writes `length` logits.
void indexer_logits(const IndexerLayout& layout, std::span<const float> q, std::span<const float> w,
                    int heads, std::span<const std::uint8_t* const> pages, std::int64_t length,
                    std::span<float> logits);

// Deterministic top-k: the min(k, n) largest logits, ordered by logit descending, ties to
// the lower index; the rest of `out` (k values) is -1. NaN logits are an error.
void topk(std::span<const float> logits, int k, std::span<std::int32_t> out);

// ---- Sparse MLA decode (absorbed form) ---------------------------------------------------
//
// For one query token, head h, and the selected entries j (index -1 = masked):
//     s_j  = scale * ( q[h][0:512] . nope_j + q[h][512:576] . rope_j )
//     lse  = log sum_j exp(s_j)                       (natural log)
//     o[h] = sum_j exp(s_j - lse) * nope_j            (value = the 512 dequantized latents)
// nope_j and rope_j are the dequantized entry (LatentLayout). A query with no valid entry
// gives o = 0 and lse = -inf (an empty partial state).
//
// q: [heads][nope+rope] bf16 bits; entries: K pointers to layout.bytes()-byte entries
// (nullptr where masked); out: [heads][nope] bf16 bits; lse: [heads].
struct SparseMlaParams {
  LatentLayout layout;
  int heads = 128;
  float softmax_scale = 0.0f;
};
void sparse_mla_decode(const SparseMlaParams& p, std::span<const std::uint16_t> q,
                       std::span<const std::uint8_t* const> entries, std::span<std::uint16_t> out,
                       std::span<float> lse);
// The same with fp32 output (the un-rounded partial state used by the DA merge).
void sparse_mla_decode_f32(const SparseMlaParams& p, std::span<const std::uint16_t> q,
                           std::span<const std::uint8_t* const> entries, std::span<float> out,
                           std::span<float> lse);

// ---- Merge of two partial attention states -----------------------------------------------
//
//     lse = logaddexp(lse_a, lse_b);   o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b
// per head. A partial with lse = -inf (or +inf, FlashMLA's marker for a row with no valid
// index) is empty and contributes nothing; two empty partials give o = 0, lse = -inf.
// o_a, o_b, out: [heads][dim] fp32; lse_*: [heads]. `out`/`lse` may alias `o_a`/`lse_a`.
void merge_states(int heads, int dim, std::span<const float> o_a, std::span<const float> lse_a,
                  std::span<const float> o_b, std::span<const float> lse_b, std::span<float> out,
                  std::span<float> lse);

}  // namespace ess::ref
