// The host run of the split cases (split_cases.h): the CPU reference stands in for the split
// kernels, after the launch arguments pass their check, and is held to the contract the cases
// state independently of it.
#include <gtest/gtest.h>

#include "split_cases.h"

namespace ess::split_test {
namespace {

SplitResult reference_split(const SplitProblem& p) {
  SplitArgs a;
  a.batch = p.batch;
  a.positions = p.positions;
  a.pool = PoolRows{p.rows_per_request, p.region.empty() ? nullptr : p.region.data(), p.region_blocks, p.block_rows};
  a.buffer = p.buffer;
  a.rows = a.slot_ids = a.counts = a.fill_slots = test::device_pointer<const std::int32_t>();
  a.fill_host_offsets = test::device_pointer<const std::uint64_t>();
  a.miss_offsets = a.total = test::device_pointer<std::int64_t>();
  a.src_offsets = a.dst_offsets = test::device_pointer<std::uint64_t>();
  a.query_tokens = p.query_tokens;
  if (p.split) {
    a.flags = test::device_pointer<std::uint8_t>();
    a.resident = a.fetched = a.resident_count = a.fetched_count = test::device_pointer<std::int32_t>();
  }
  EXPECT_EQ(check_args(a), "");
  return split_reference(p);
}

bool always() { return true; }

}  // namespace

const SplitBackend& split_backend() {
  static const SplitBackend b{{"cpu-reference", always}, reference_split};
  return b;
}

}  // namespace ess::split_test
