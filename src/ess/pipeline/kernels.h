// Small kernels of the decode-step executor (CUDA target only): turning the swap engine's
// per-request miss lists into one FlashTrans list, splitting the selected slots into the
// resident and the fetched ones for the DA / DBA schedules, and filling stand-in tensors.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ess/cuda/flashtrans.h"

namespace ess::pipeline {

struct SplitArgs {
  int batch = 0;                                 // requests of this launch
  int positions = 0;                             // T x K ids per request
  std::int32_t slots = 0;                        // slots per request-layer
  int entry_bytes = 656;
  const std::int32_t* slot_ids = nullptr;        // [batch][positions] (swap engine output)
  const std::int32_t* counts = nullptr;          // [batch][2]: hits, misses
  const std::int32_t* fill_slots = nullptr;      // [batch][positions]: slot of miss m
  const std::uint64_t* fill_host_offsets = nullptr;  // [batch][positions]: host pool byte offset
  const std::uint64_t* kv_offsets = nullptr;     // [batch]: byte offset of the request-layer's slots
  std::uint8_t* flags = nullptr;                 // [batch][slots] scratch
  std::uint64_t* src_offsets = nullptr;          // [batch x positions] out: FlashTrans list,
  std::uint64_t* dst_offsets = nullptr;          //   requests in batch order, misses in order
  std::int64_t* total = nullptr;                 // [1] out: entries in the list
  // Optional split for DA / DBA, per query row (b, t) of K = positions / query_tokens ids:
  // the row's resident slot ids and its fetched slot ids, each compacted to the front of the
  // row in their original order, -1 after; *_count[b * T + t] = how many. The two lists
  // together hold the row's valid ids exactly once (attention is order-independent up to
  // rounding, so Attn0 + Attn1 + merge see the same entries as one attention over the row).
  int query_tokens = 1;
  std::int32_t* hit_ids = nullptr;               // [batch][positions] out or nullptr
  std::int32_t* miss_ids = nullptr;              // [batch][positions] out
  std::int32_t* hit_count = nullptr;             // [batch][T] out
  std::int32_t* miss_count = nullptr;            // [batch][T] out
};
// One block per request; no host synchronization. Returns a cudaError_t value.
int split_misses(const SplitArgs& args, cuda::Stream stream);

// n bf16 values of a fixed pseudo-random pattern in [-scale, scale] (stand-in weights and
// activations: tensor cores run at data-dependent power, so they must not be zeros).
int fill_bf16(std::uint16_t* p, std::size_t n, float scale, std::uint64_t seed, cuda::Stream stream);
// n bytes of random FP8 e4m3 values of magnitude <= 2 (indexer queries).
int fill_fp8(std::uint8_t* p, std::size_t n, std::uint64_t seed, cuda::Stream stream);
// n floats uniform in [lo, hi).
int fill_f32(float* p, std::size_t n, float lo, float hi, std::uint64_t seed, cuda::Stream stream);

}  // namespace ess::pipeline
