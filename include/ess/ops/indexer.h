// The lightning indexer on the GPU: FP8 logits of every query token over its request's
// indexer cache, and the deterministic top-k selection of ess::ref::topk.
//
//     I[b][t][j] = scale_j * sum_h w[b][t][h] * ReLU( q[b][t][h] . k8_j )
// with k8_j the raw FP8 e4m3 key of token j and scale_j its fp32 scale (IndexerLayout pages:
// 64 x 128 FP8 bytes, then 64 fp32 scales), q FP8 e4m3 (its scale folded into w), exactly
// ess::ref::indexer_logits's definition with q decoded from FP8.
//
// Plain C++ declarations; kernels in indexer.cu / topk.cu (CUDA target only).
#pragma once

#include <cstdint>

#include "ess/ops/flashtrans.h"

namespace ess::cuda {

struct IndexerArgs {
  int batch = 0;          // B
  int query_tokens = 1;   // T
  int heads = 64;         // index_n_heads (a multiple of 16, at most 64)
  int head_dim = 128;     // index_head_dim (128 only)
  const std::uint8_t* q = nullptr;   // [B][T][heads][128] FP8 e4m3
  const float* weights = nullptr;    // [B][T][heads]
  // Request b's key j lives in page page_table[b * max_pages + j / 64] of the arena:
  //   pages + page * page_bytes   (page_bytes = 64 * 132 = 8448)
  const std::uint8_t* pages = nullptr;
  const std::int32_t* page_table = nullptr;  // [B][max_pages], device memory
  int max_pages = 0;
  // Keys query token (b, t) sees: lengths[b * T + t] (causal MTP: length - T + 1 + t), at most
  // max_pages * 64. Logits at j >= length are not written.
  const std::int32_t* lengths = nullptr;     // [B][T], device memory
  float* logits = nullptr;                   // [B][T][logits_stride]
  std::int64_t logits_stride = 0;            // >= the largest length
};
int indexer_logits(const IndexerArgs& args, Stream stream);

// Floating-point operations of the logits for `keys` keys in total (summed over query tokens).
double indexer_flops(double keys, int heads, int head_dim);

// Top-k per row of logits, exactly ess::ref::topk: the min(k, length) largest logits of
// row r (over j < lengths[r]), ordered by logit descending, ties (including -0 vs +0) to the
// lower index, the rest of the row's k outputs -1.
struct TopkArgs {
  std::int64_t rows = 0;
  int k = 2048;                            // at most 2048
  const float* logits = nullptr;           // [rows][stride]
  std::int64_t stride = 0;
  const std::int32_t* lengths = nullptr;   // [rows], device memory
  std::int32_t* out = nullptr;             // [rows][k]
  // Optional device int, set by the caller to -1: receives the smallest row holding a NaN
  // logit (atomicMin); that row's output is then unspecified.
  int* nan_row = nullptr;
};
int topk(const TopkArgs& args, Stream stream);

}  // namespace ess::cuda
