// The host run of the FlashTrans cases (flashtrans_cases.h): the reference copy
// (ref::copy_entries) stands in for the kernel, on the same offsets and the same slot layout
// as DeviceSlotStorage, after the launch arguments pass FlashTrans's own check. The Total
// Memory Pool is ordinary aligned memory here (pinning needs a device).
#include <gtest/gtest.h>

#include <vector>

#include "ess/ops/reference.h"
#include "flashtrans_cases.h"
#include "runtime/ops/launch_args.h"

namespace ess::flashtrans_test {
namespace {

void expect_accepted(std::int64_t count, int entry_bytes, bool device_count, int blocks = 0, const RowTail& src_tail = {},
                     const RowTail& dst_tail = {}) {
  cuda::EntryCopy c;
  c.src_base = test::device_pointer<const std::uint8_t>();
  c.dst_base = test::device_pointer<std::uint8_t>();
  c.src_offsets = c.dst_offsets = test::device_pointer<const std::uint64_t>();
  c.count = count;
  c.entry_bytes = entry_bytes;
  c.device_count = device_count ? test::device_pointer<const std::int64_t>() : nullptr;
  c.blocks = blocks;
  c.src_tail = src_tail;
  c.dst_tail = dst_tail;
  EXPECT_EQ(cuda::check_args(c), "");
}

std::vector<std::uint8_t> reference_copy(const CopyProblem& p) {
  expect_accepted(p.count, p.entry_bytes, p.device_count >= 0, p.blocks, p.src_tail, p.dst_tail);
  std::vector<std::uint8_t> dst = p.dst;
  const std::int64_t n = p.device_count >= 0 ? std::min(p.count, p.device_count) : p.count;
  ref::copy_entries(p.src.data(), dst.data(), p.src_offsets, p.dst_offsets, n, p.entry_bytes, p.src_tail, p.dst_tail);
  return dst;
}

std::vector<std::uint8_t> reference_fill(const SparsePoolConfig& config, int rows, const MissPlan& plan, const TotalPool& total) {
  const std::uint64_t E = config.layout.bytes();
  expect_accepted(static_cast<std::int64_t>(plan.entries.size()), static_cast<int>(E), false);
  std::vector<std::uint8_t> slots(static_cast<std::size_t>(rows) * config.num_layers * config.slots * E);
  std::vector<std::uint64_t> src, dst;
  for (const MissEntry& m : plan.entries) {
    src.push_back(m.host_offset);
    dst.push_back(((static_cast<std::uint64_t>(m.row) * config.num_layers + static_cast<std::uint64_t>(plan.layer)) *
                       static_cast<std::uint64_t>(config.slots) + static_cast<std::uint64_t>(m.slot)) * E);
  }
  ref::copy_entries(total.base(), slots.data(), src, dst, static_cast<std::int64_t>(src.size()), static_cast<int>(E));
  return slots;
}

bool always() { return true; }

}  // namespace

const FlashTransBackend& flashtrans_backend() {
  static const FlashTransBackend b{{"cpu-reference", always}, HostMemoryKind::kAligned, reference_copy, reference_fill};
  return b;
}

}  // namespace ess::flashtrans_test
