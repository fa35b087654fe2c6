// Where a request's entries live on the device: the vocabulary the per-layer step
// (ess/runtime/offload.h, OffloadConfig::residency) and the simulator (ess/sim) share.
#pragma once

#include <string_view>

namespace ess {

// (docs/architecture.md, "Residency")
//   kSparse: every request in a Sparse Memory Pool of `slots` rows per layer, misses fetched each step.
//   kWhole: every request whole: its entire latent cache in buffer rows, read in place, no swap and
//     no copy; it takes ceil(length / slots) pool rows (its own and others it borrows), and an
//     admission or growth that does not fit is refused.
//   kAdaptive: whole while pool rows are free; when an admission (or a whole request's growth)
//     finds none, whole requests are demoted to a Sparse Memory Pool, and promoted back when a
//     release frees enough rows.
enum class Residency { kSparse, kWhole, kAdaptive };
std::string_view to_string(Residency r);

}  // namespace ess
