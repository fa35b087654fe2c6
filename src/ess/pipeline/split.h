// The split of one layer's swap decision into copy work and attention halves, as the
// executor's split kernels run it (kernels.cu): the swap engine's per-request miss lists
// become one FlashTrans list for the batch, and, for DA / DBA, each query row's selected
// slots are separated into those resident before the step and those fetched by it.
//
// Plain C++: the arguments, their check (run by the launcher before any CUDA call) and an
// independent CPU reference that the GPU output must equal bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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
  std::int64_t* miss_offsets = nullptr;          // [batch] scratch: each request's first place in the list
  std::uint64_t* src_offsets = nullptr;          // [batch x positions] out: FlashTrans list,
  std::uint64_t* dst_offsets = nullptr;          //   requests in batch order, misses in order
  std::int64_t* total = nullptr;                 // [1] out: entries in the list
  // Optional split for DA / DBA, per query row (b, t) of K = positions / query_tokens ids:
  // the row's resident slot ids and its fetched slot ids, each compacted to the front of the
  // row in their original order, -1 after; *_count[b * T + t] = how many. The two lists
  // together hold the row's valid ids exactly once (attention is order-independent up to
  // rounding, so Attn0 + Attn1 + merge see the same entries as one attention over the row).
  int query_tokens = 1;
  std::uint8_t* flags = nullptr;                 // [batch][slots] scratch (with the split)
  std::int32_t* hit_ids = nullptr;               // [batch][positions] out or nullptr
  std::int32_t* miss_ids = nullptr;              // [batch][positions] out
  std::int32_t* hit_count = nullptr;             // [batch][T] out
  std::int32_t* miss_count = nullptr;            // [batch][T] out
};

// "" when the split kernels accept the arguments, else what is wrong (field and value).
std::string check_args(const SplitArgs& args);

// The same computation on host arrays, written straightforwardly.
struct SplitProblem {
  int batch = 0, positions = 0, query_tokens = 1;
  std::int32_t slots = 0;
  int entry_bytes = 656;
  bool split = true;                     // also the resident / fetched halves
  std::vector<std::int32_t> slot_ids;    // [batch][positions]
  std::vector<std::int32_t> counts;      // [batch][2]
  std::vector<std::int32_t> fill_slots;  // [batch][positions], the first counts[b][1] used
  std::vector<std::uint64_t> fill_host_offsets;  // [batch][positions]
  std::vector<std::uint64_t> kv_offsets;         // [batch]
};
struct SplitResult {
  std::int64_t total = 0;
  std::vector<std::uint64_t> src_offsets, dst_offsets;  // [total]
  std::vector<std::int32_t> hit_ids, miss_ids;          // [batch][positions] (with the split)
  std::vector<std::int32_t> hit_count, miss_count;      // [batch][T]
};
SplitResult split_reference(const SplitProblem& problem);

}  // namespace ess::pipeline
