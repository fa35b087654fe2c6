// The executor's split kernels on the device (split_cases.h; the host run of the same cases
// is split_host_test.cc). Skipped without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "ess/runtime/backend.h"
#include "split_cases.h"
#include "testing/device_io.h"

namespace ess::split_test {
namespace {

using test::download;
using test::upload;

SplitResult device_split(const SplitProblem& p) {
  const std::size_t n = p.slot_ids.size();
  const auto slot_ids = upload(p.slot_ids), counts = upload(p.counts), fill_slots = upload(p.fill_slots);
  const auto fill_host = upload(p.fill_host_offsets);
  const auto pool_rows = upload(p.rows);
  cuda::DeviceBuffer<std::int64_t> miss_offsets(static_cast<std::size_t>(p.batch)), total(1);
  auto src = upload(std::vector<std::uint64_t>(n, ~0ull)), dst = upload(std::vector<std::uint64_t>(n, ~0ull));
  auto resident = upload(std::vector<std::int32_t>(n, -9)), fetched = upload(std::vector<std::int32_t>(n, -9));
  const std::size_t query_rows = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.query_tokens);
  auto resident_count = upload(std::vector<std::int32_t>(query_rows, -9));
  auto fetched_count = upload(std::vector<std::int32_t>(query_rows, -9));
  cuda::DeviceBuffer<std::uint8_t> flags(static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.rows_per_request));
  SplitArgs a;
  a.batch = p.batch;
  a.positions = p.positions;
  const auto region = upload(p.region.empty() ? std::vector<std::int32_t>{-1} : p.region);
  a.pool = PoolRows{p.rows_per_request, p.region.empty() ? nullptr : region.get(), p.region_blocks, p.block_rows};
  a.buffer = p.buffer;
  a.rows = pool_rows.get();
  a.slot_ids = slot_ids.get();
  a.counts = counts.get();
  a.fill_slots = fill_slots.get();
  a.fill_host_offsets = fill_host.get();
  a.miss_offsets = miss_offsets.get();
  a.src_offsets = src.get();
  a.dst_offsets = dst.get();
  a.total = total.get();
  a.query_tokens = p.query_tokens;
  if (p.split) {
    a.flags = flags.get();
    a.resident = resident.get();
    a.fetched = fetched.get();
    a.resident_count = resident_count.get();
    a.fetched_count = fetched_count.get();
  }
  EXPECT_EQ(split_misses(a, nullptr), 0);
  test::sync("split");
  SplitResult r;
  r.total = download(total)[0];
  const auto listed = static_cast<std::size_t>(std::max<std::int64_t>(0, std::min<std::int64_t>(r.total, static_cast<std::int64_t>(n))));
  r.src_offsets = download(src, listed);
  r.dst_offsets = download(dst, listed);
  if (p.split) {
    r.resident = download(resident);
    r.fetched = download(fetched);
    r.resident_count = download(resident_count);
    r.fetched_count = download(fetched_count);
  }
  return r;
}

bool device_present() { return cuda_device_present(); }

// The launcher refuses what check_args refuses, before any CUDA call (no device needed).
TEST(SplitLauncher, RefusesWhatCheckArgsRefuses) {
  SplitArgs a;
  EXPECT_EQ(split_misses(a, nullptr), 0);  // no requests: nothing to do
  a.batch = 1;
  a.positions = 4;
  EXPECT_EQ(split_misses(a, nullptr), static_cast<int>(cudaErrorInvalidValue));  // null buffers
}

}  // namespace

const SplitBackend& split_backend() {
  static const SplitBackend b{{"cuda", device_present}, device_split};
  return b;
}

}  // namespace ess::split_test
