// The executor's split kernels on the device (split_cases.h; the host run of the same cases
// is split_host_test.cc). Skipped without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "ess/runtime/backend.h"
#include "harness/rig/kernels.h"
#include "harness/support/device_io.h"
#include "split_cases.h"

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
  auto hit_ids = upload(std::vector<std::int32_t>(n, -9)), miss_ids = upload(std::vector<std::int32_t>(n, -9));
  const std::size_t query_rows = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.query_tokens);
  auto hit_count = upload(std::vector<std::int32_t>(query_rows, -9));
  auto miss_count = upload(std::vector<std::int32_t>(query_rows, -9));
  cuda::DeviceBuffer<std::uint8_t> flags(static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.rows_per_request));
  SplitArgs a;
  a.batch = p.batch;
  a.positions = p.positions;
  a.rows_per_request = p.rows_per_request;
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
    a.hit_ids = hit_ids.get();
    a.miss_ids = miss_ids.get();
    a.hit_count = hit_count.get();
    a.miss_count = miss_count.get();
  }
  EXPECT_EQ(split_misses(a, nullptr), 0);
  test::sync("split");
  SplitResult r;
  r.total = download(total)[0];
  const auto listed = static_cast<std::size_t>(std::max<std::int64_t>(0, std::min<std::int64_t>(r.total, static_cast<std::int64_t>(n))));
  r.src_offsets = download(src, listed);
  r.dst_offsets = download(dst, listed);
  if (p.split) {
    r.hit_ids = download(hit_ids);
    r.miss_ids = download(miss_ids);
    r.hit_count = download(hit_count);
    r.miss_count = download(miss_count);
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
