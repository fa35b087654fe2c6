// Sparse MLA decode on tensor cores (absorbed form, DeepSeek-V3.2 FP8 latent cache), and the
// merge of two partial attention states used by the DA / DBA overlap schedules.
//
// For query token (b, t), head h and its selected slot ids j (-1 = masked):
//     s_j  = scale * ( q[h][0:512] . nope_j + q[h][512:576] . rope_j )
//     lse  = log sum_j exp(s_j)                      (natural log)
//     o[h] = sum_j exp(s_j - lse) * nope_j           (value = the 512 dequantized latents)
// exactly ess::ref::sparse_mla_decode_f32's definition; entries are 656-byte LatentLayout
// entries (FP8 e4m3 nope, 4 fp32 tile scales, 64 bf16 rope) in Sparse Memory Pool slots. A
// query token with no valid id gives o = 0 and lse = -inf (an empty partial state).
//
// Plain C++ declarations; kernels in sparse_mla.cu (CUDA target only).
#pragma once

#include <cstdint>

#include "ess/ops/flashtrans.h"

namespace ess::cuda {

struct SparseMlaArgs {
  int batch = 0;          // B
  int query_tokens = 1;   // T
  int heads = 128;        // a multiple of 64 (one head block per CTA), at most 128
  int topk = 2048;        // K: slot ids per query token (any positive count)
  float softmax_scale = 0.0f;
  const std::uint16_t* q = nullptr;  // [B][T][heads][576] bf16 bits
  // The slots: batch position b's entry for slot s is at
  //   kv + kv_offsets[b] + s * 656     (kv_offsets in bytes, 16-byte aligned)
  // e.g. DeviceSlotStorage::data() with kv_offsets[b] = slot_offset(row_b, layer, 0).
  const std::uint8_t* kv = nullptr;
  const std::uint64_t* kv_offsets = nullptr;  // [B], device memory
  std::int32_t slots = 0;                     // ids must lie in [-1, slots)
  const std::int32_t* indices = nullptr;      // [B][T][K] slot ids, device memory
  // Optional [B][T], device memory: only the first row_lengths[b * T + t] ids (clamped to
  // [0, K]) of each row are read; the rest count as masked and cost nothing. The DA / DBA
  // halves pass their compacted resident / fetched lists this way, so Attn0 + Attn1 cost
  // about one attention over the row, not two.
  const std::int32_t* row_lengths = nullptr;
  std::uint16_t* out = nullptr;   // [B][T][heads][512] bf16, or nullptr
  float* out_f32 = nullptr;       // [B][T][heads][512] fp32 (the un-rounded partial), or nullptr
  float* lse = nullptr;           // [B][T][heads], required
  // Optional device int, set by the caller to -1: receives the smallest flat position
  // (b * T + t) * K + k holding an id outside [-1, slots) (atomicMin); such ids are treated
  // as masked, so the output stays defined and the caller can report the bad input.
  int* bad_index = nullptr;
};

// Launches the decode (one or more kernels, no host synchronization, graph-capturable).
// Returns a cudaError_t value: cudaErrorInvalidValue for shapes it does not support.
int sparse_mla_decode(const SparseMlaArgs& args, Stream stream);

// Floating-point operations of one decode: B x T x heads x valid entries x 2 x (576 + 512)
// counted for all K ids (the FlashMLA convention, masked ids included).
double sparse_mla_flops(int batch, int query_tokens, int heads, int topk);

// Merge of two partial states, per row r (a row is one (b, t, head)):
//     lse = logaddexp(lse_a, lse_b);  o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b
// with ess::ref::merge_states's rules for empty partials (lse = -inf or +inf contributes
// nothing; two empty partials give o = 0, lse = -inf). out_f32 may alias o_a / o_b.
struct MergeArgs {
  std::int64_t rows = 0;
  int dim = 512;             // a multiple of 4
  const float* o_a = nullptr;
  const float* lse_a = nullptr;
  const float* o_b = nullptr;
  const float* lse_b = nullptr;
  float* out_f32 = nullptr;        // [rows][dim] or nullptr
  std::uint16_t* out = nullptr;    // [rows][dim] bf16 or nullptr
  float* lse = nullptr;            // [rows] or nullptr
};
int merge_states(const MergeArgs& args, Stream stream);

}  // namespace ess::cuda
