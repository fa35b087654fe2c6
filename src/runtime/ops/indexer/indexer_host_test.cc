// The host run of the indexer and top-k cases (indexer_cases.h): the CPU references stand in
// for the device, so every problem, launch argument and assertion of the GPU test runs on a
// CPU machine. The stand-ins follow the kernels' contracts: logits written only below each
// query token's length (kSentinel elsewhere); top-k = ref::topk per row, and a row holding a
// NaN logit is reported through nan_row (the smallest such row), its output unspecified.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "indexer_cases.h"
#include "runtime/ops/launch_args.h"

namespace ess::indexer_test {
namespace {

using test::device_pointer;

std::vector<float> reference_logits(const Problem& p) {
  cuda::IndexerArgs a;
  a.batch = p.B;
  a.query_tokens = p.T;
  a.heads = p.H;
  a.head_dim = kDim;
  a.q = device_pointer<const std::uint8_t>();
  a.weights = device_pointer<const float>();
  a.pages = device_pointer<const std::uint8_t>();
  a.page_table = device_pointer<const std::int32_t>();
  a.max_pages = p.max_pages;
  a.lengths = device_pointer<const std::int32_t>();
  a.logits = device_pointer<float>();
  a.logits_stride = p.stride;
  EXPECT_EQ(cuda::check_args(a), "");
  const Reference r = reference(p);
  std::vector<float> out(r.logits.size(), std::bit_cast<float>(kSentinel));
  for (std::size_t row = 0; row < p.lengths.size(); ++row) {
    const std::size_t at = row * static_cast<std::size_t>(p.stride);
    for (std::int32_t j = 0; j < p.lengths[row]; ++j) out[at + static_cast<std::size_t>(j)] = r.logits[at + static_cast<std::size_t>(j)];
  }
  return out;
}

TopkRun reference_topk(const std::vector<float>& logits, std::int64_t stride, const std::vector<std::int32_t>& lengths,
                       int k, bool report_nan) {
  cuda::TopkArgs ta;
  ta.rows = static_cast<std::int64_t>(lengths.size());
  ta.k = k;
  ta.logits = device_pointer<const float>();
  ta.stride = stride;
  ta.lengths = device_pointer<const std::int32_t>();
  ta.out = device_pointer<std::int32_t>();
  ta.nan_row = report_nan ? device_pointer<int>() : nullptr;
  EXPECT_EQ(cuda::check_args(ta), "");
  TopkRun run;
  run.out.assign(lengths.size() * static_cast<std::size_t>(k), -1);
  for (std::size_t row = 0; row < lengths.size(); ++row) {
    const std::span<const float> x(logits.data() + row * static_cast<std::size_t>(stride), static_cast<std::size_t>(lengths[row]));
    if (std::any_of(x.begin(), x.end(), [](float v) { return std::isnan(v); })) {
      if (report_nan && run.nan_row < 0) run.nan_row = static_cast<int>(row);
      continue;
    }
    ref::topk(x, k, {run.out.data() + row * static_cast<std::size_t>(k), static_cast<std::size_t>(k)});
  }
  return run;
}

bool always() { return true; }

}  // namespace

const IndexerBackend& indexer_backend() {
  static const IndexerBackend b{{"cpu-reference", always}, reference_logits, reference_topk};
  return b;
}

}  // namespace ess::indexer_test
