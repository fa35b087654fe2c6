// FlashTrans and the Sparse Memory Pool's device backend against the CPU, byte for byte, over
// seeded awkward shapes, on a backend (backend.h): the device in flashtrans_test.cc, the
// reference copy (ref::copy_entries) standing in for it in flashtrans_host_test.cc. Include
// in exactly one source file per binary.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "ess/cache/sparse_pool.h"
#include "ess/cache/total_pool.h"
#include "ess/ops/row_layout.h"
#include "testing/backend.h"

namespace ess::flashtrans_test {

// One FlashTrans launch: dst + dst_offsets[i] <- src + src_offsets[i] for i < count (or
// min(count, device_count) when the count is left on the device).
struct CopyProblem {
  std::vector<std::uint8_t> src, dst;  // dst: its contents before the copy
  std::vector<std::uint64_t> src_offsets, dst_offsets;
  std::int64_t count = 0;
  int entry_bytes = 656;
  std::int64_t device_count = -1;      // >= 0: passed through device memory
  bool host_to_device = true;          // src in pinned host memory (else dst is)
  int blocks = 0;                      // FlashTrans's grid (0 = its default)
  RowTail src_tail, dst_tail;          // a side that keeps entries in two parts (EntryCopy's)
};

struct FlashTransBackend {
  test::BackendInfo info;
  HostMemoryKind pool_memory;  // what the Total Memory Pool of a test uses
  // The destination after the copy.
  std::vector<std::uint8_t> (*copy)(const CopyProblem& p);
  // The Sparse Memory Pool's slots after the plan is filled: rows x layers x slots entries in
  // DeviceSlotStorage's order (rows admitted in order 0, 1, ...).
  std::vector<std::uint8_t> (*fill)(const SparsePoolConfig& config, int rows, const MissPlan& plan, const TotalPool& total);
};
const FlashTransBackend& flashtrans_backend();  // defined by the including binary

inline constexpr std::int32_t kSlots = 64;

inline SparsePoolConfig pool_config(int rows) {
  SparsePoolConfig c;
  c.num_layers = 2;
  c.max_requests = rows;
  c.slots = kSlots;
  c.query_tokens = 1;
  c.topk = 8;
  return c;
}

// (batch, misses per request; -1 = every slot)
class FlashTransShapes : public testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(FlashTransShapes, DeviceSlotsEqualTheCpuBackend) {
  ESS_REQUIRE_BACKEND(flashtrans_backend().info);
  const auto [batch, misses_arg] = GetParam();
  const int misses = misses_arg < 0 ? kSlots : misses_arg;
  const std::int64_t len = 300;
  TotalPool total(2, LatentLayout{}, static_cast<std::uint64_t>(batch) * 2 * 5 * 64 * 656, flashtrans_backend().pool_memory);
  ASSERT_EQ(total.memory_kind(), flashtrans_backend().pool_memory);
  SparsePool cpu(pool_config(batch));
  std::mt19937 rng(static_cast<std::uint32_t>(batch * 1000 + misses));
  std::vector<std::uint8_t> e(656);
  MissPlan plan;
  plan.layer = 1;
  for (int b = 0; b < batch; ++b) {
    total.admit(b, len);
    for (int l = 0; l < 2; ++l) {
      for (std::int64_t t = 0; t < len; ++t) {
        for (auto& x : e) x = static_cast<std::uint8_t>(rng());
        total.write(b, l, t, e);
      }
    }
    const std::int32_t row = cpu.admit(b);
    ASSERT_EQ(row, b);
    std::set<std::int32_t> toks, slots;
    while (static_cast<int>(toks.size()) < misses) toks.insert(static_cast<std::int32_t>(rng() % len));
    while (static_cast<int>(slots.size()) < misses) slots.insert(static_cast<std::int32_t>(rng() % kSlots));
    auto ti = toks.begin();
    auto si = slots.begin();
    for (int m = 0; m < misses; ++m, ++ti, ++si) plan.entries.push_back({b, row, *ti, *si, total.offset(b, 1, *ti)});
  }
  const std::vector<std::uint8_t> slots = flashtrans_backend().fill(pool_config(batch), batch, plan, total);
  cpu.storage().fill(plan, total);
  ASSERT_EQ(slots.size(), static_cast<std::size_t>(batch) * 2 * kSlots * 656);
  std::vector<std::uint8_t> c(656);
  for (int b = 0; b < batch; ++b) {
    for (int l = 0; l < 2; ++l) {
      for (std::int32_t s = 0; s < kSlots; ++s) {
        cpu.storage().read(cpu.row(b), l, s, c);
        const std::size_t at = ((static_cast<std::size_t>(b) * 2 + static_cast<std::size_t>(l)) * kSlots + static_cast<std::size_t>(s)) * 656;
        ASSERT_EQ(0, std::memcmp(slots.data() + at, c.data(), 656)) << "request " << b << " layer " << l << " slot " << s;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Awkward, FlashTransShapes,
                         testing::Combine(testing::Values(1, 3, 127), testing::Values(0, 1, 41, -1)));

TEST(FlashTrans, ScatterWritesDeviceEntriesBackToPinnedHostMemory) {
  ESS_REQUIRE_BACKEND(flashtrans_backend().info);
  const int n = 1000;
  const std::size_t E = 656;
  CopyProblem p;
  p.host_to_device = false;
  p.count = n;
  p.entry_bytes = static_cast<int>(E);
  p.src.resize(n * E);
  std::mt19937 rng(3);
  for (auto& x : p.src) x = static_cast<std::uint8_t>(rng());
  p.dst.assign(2 * n * E, 0);
  for (int i = 0; i < n; ++i) {
    p.src_offsets.push_back(static_cast<std::uint64_t>(i) * E);                  // from device entry i
    p.dst_offsets.push_back(static_cast<std::uint64_t>(2 * n - 1 - 2 * i) * E);  // to host entry 2n-1-2i
  }
  const std::vector<std::uint8_t> host = flashtrans_backend().copy(p);
  ASSERT_EQ(host.size(), p.dst.size());
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(std::memcmp(host.data() + p.dst_offsets[static_cast<std::size_t>(i)], p.src.data() + p.src_offsets[static_cast<std::size_t>(i)], E), 0)
        << "entry " << i;
    ASSERT_EQ(host[(2 * n - 2 - 2 * i) * E], 0) << "wrote between entries";
  }
}

// The executor sizes a launch for the largest list and lets an earlier kernel write the real
// count: exactly min(*device_count, count) entries move, the rest stay untouched; and a grid
// capped to a few blocks (so that compute can run beside the copy) still moves everything.
TEST(FlashTrans, DeviceCountAndGridBoundTheCopy) {
  ESS_REQUIRE_BACKEND(flashtrans_backend().info);
  const int n = 300;
  const std::size_t E = 656;
  CopyProblem p;
  p.count = n;
  p.entry_bytes = static_cast<int>(E);
  p.src.resize(n * E);
  std::mt19937 rng(5);
  for (auto& x : p.src) x = static_cast<std::uint8_t>(rng() | 1u);  // never zero
  for (int i = 0; i < n; ++i) p.src_offsets.push_back(static_cast<std::uint64_t>(i) * E);
  p.dst_offsets = p.src_offsets;
  p.dst.assign(n * E, 0);
  for (const int blocks : {0, 1, 3}) {
    p.blocks = blocks;
    for (const std::int64_t k : {std::int64_t{0}, std::int64_t{1}, std::int64_t{41}, std::int64_t{n}, std::int64_t{n + 50}}) {
      p.device_count = k;
      const std::vector<std::uint8_t> got = flashtrans_backend().copy(p);
      const std::size_t moved = static_cast<std::size_t>(std::min<std::int64_t>(k, n)) * E;
      EXPECT_EQ(std::memcmp(got.data(), p.src.data(), moved), 0) << "count " << k << ", blocks " << blocks;
      EXPECT_TRUE(std::all_of(got.begin() + static_cast<std::ptrdiff_t>(moved), got.end(), [](std::uint8_t x) { return x == 0; }))
          << "count " << k << ", blocks " << blocks << ": copied past the device count";
    }
  }
}

// DeepSeek-V4's C4 pages as SGLang's kvcacheio.cuh lays them out, written here from its constants:
// a page of 64 tokens holds their 576-byte values, then their 8-byte scales, padded to a
// multiple of 576 bytes. ESS's whole entry: value, scale, 8 bytes of padding (592).
inline constexpr std::uint64_t kV4Value = 576, kV4Scale = 8, kV4Page = 37440, kV4ScaleAt = 576 * 64;
inline constexpr int kV4Entry = 592;

inline RowTail v4_pages() {
  RowTail t;
  t.head_bytes = static_cast<int>(kV4Value);
  t.bytes = static_cast<int>(kV4Scale);
  t.delta = static_cast<std::int64_t>(kV4ScaleAt);
  t.head = RowLayout{kV4Value, 64, kV4Page};
  t.rows = RowLayout{kV4Scale, 64, kV4Page};
  return t;
}
inline std::uint64_t v4_value_at(std::int64_t row) {
  return static_cast<std::uint64_t>(row / 64) * kV4Page + static_cast<std::uint64_t>(row % 64) * kV4Value;
}
inline std::uint64_t v4_scale_at(std::int64_t row) {
  return static_cast<std::uint64_t>(row / 64) * kV4Page + kV4ScaleAt + static_cast<std::uint64_t>(row % 64) * kV4Scale;
}

// Whole entries into scattered rows of C4 pages and back, and from rows to rows: every value and
// scale lands where the page layout puts it, and no other byte of either side changes (the
// padding of a whole entry is not copied; a neighbour's scale is not overwritten).
TEST(FlashTrans, SplitEntriesMoveIntoAndOutOfDeepSeekV4Pages) {
  ESS_REQUIRE_BACKEND(flashtrans_backend().info);
  const int pages = 5, n = 150;
  std::mt19937 rng(11);
  std::vector<std::int64_t> rows(static_cast<std::size_t>(pages) * 64);
  for (std::size_t r = 0; r < rows.size(); ++r) rows[r] = static_cast<std::int64_t>(r);
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(n);
  std::vector<std::uint8_t> host(static_cast<std::size_t>(n) * kV4Entry);
  for (auto& x : host) x = static_cast<std::uint8_t>(rng() | 1u);
  std::vector<std::uint8_t> device(static_cast<std::size_t>(pages) * kV4Page, 0);

  CopyProblem in;
  in.count = n;
  in.entry_bytes = kV4Entry;
  in.src = host;
  in.dst = device;
  in.dst_tail = v4_pages();
  for (int i = 0; i < n; ++i) {
    in.src_offsets.push_back(static_cast<std::uint64_t>(i) * kV4Entry);
    in.dst_offsets.push_back(v4_value_at(rows[static_cast<std::size_t>(i)]));
  }
  std::vector<std::uint8_t> want = device;
  for (int i = 0; i < n; ++i) {
    const std::uint8_t* e = host.data() + static_cast<std::size_t>(i) * kV4Entry;
    std::memcpy(want.data() + v4_value_at(rows[static_cast<std::size_t>(i)]), e, kV4Value);
    std::memcpy(want.data() + v4_scale_at(rows[static_cast<std::size_t>(i)]), e + kV4Value, kV4Scale);
  }
  const std::vector<std::uint8_t> got = flashtrans_backend().copy(in);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t b = 0; b < want.size(); ++b) ASSERT_EQ(got[b], want[b]) << "gather: byte " << b << " of the pages";

  CopyProblem out;  // the rows back into fresh whole entries, in reverse order
  out.host_to_device = false;
  out.count = n;
  out.entry_bytes = kV4Entry;
  out.src = got;
  out.dst.assign(static_cast<std::size_t>(n) * kV4Entry, 0xEE);
  out.src_tail = v4_pages();
  for (int i = 0; i < n; ++i) {
    out.src_offsets.push_back(v4_value_at(rows[static_cast<std::size_t>(i)]));
    out.dst_offsets.push_back(static_cast<std::uint64_t>(n - 1 - i) * kV4Entry);
  }
  const std::vector<std::uint8_t> back = flashtrans_backend().copy(out);
  for (int i = 0; i < n; ++i) {
    const std::uint8_t* e = back.data() + static_cast<std::size_t>(n - 1 - i) * kV4Entry;
    ASSERT_EQ(0, std::memcmp(e, host.data() + static_cast<std::size_t>(i) * kV4Entry, kV4Value + kV4Scale)) << "scatter: entry " << i;
    for (int pad = static_cast<int>(kV4Value + kV4Scale); pad < kV4Entry; ++pad) ASSERT_EQ(e[pad], 0xEE) << "scatter wrote padding";
  }

  CopyProblem move;  // rows to rows of the same pages (both sides split), a device count below the list
  move.count = n;
  move.device_count = n - 7;
  move.entry_bytes = kV4Entry;
  move.src = got;
  move.dst = got;
  move.src_tail = move.dst_tail = v4_pages();
  const std::int64_t free_row = static_cast<std::int64_t>(pages) * 64;  // rows >= n of a 2x larger buffer
  move.dst.resize(static_cast<std::size_t>(2 * pages) * kV4Page, 0);
  for (int i = 0; i < n; ++i) {
    move.src_offsets.push_back(v4_value_at(rows[static_cast<std::size_t>(i)]));
    move.dst_offsets.push_back(v4_value_at(free_row + 2 * i));
  }
  const std::vector<std::uint8_t> moved = flashtrans_backend().copy(move);
  for (int i = 0; i < n; ++i) {
    const std::int64_t to = free_row + 2 * i, from = rows[static_cast<std::size_t>(i)];
    const bool copied = i < n - 7;
    const std::uint8_t* e = host.data() + static_cast<std::size_t>(i) * kV4Entry;
    EXPECT_EQ(copied, 0 == std::memcmp(moved.data() + v4_value_at(to), e, kV4Value)) << "move: value " << i;
    EXPECT_EQ(copied, 0 == std::memcmp(moved.data() + v4_scale_at(to), e + kV4Value, kV4Scale)) << "move: scale " << i;
    ASSERT_EQ(0, std::memcmp(moved.data() + v4_value_at(from), e, kV4Value)) << "move changed its source";
  }
}

// Tails in a region of their own after the heads' (K and V as two tensors), each row's tail at
// its own stride.
TEST(FlashTrans, SplitEntriesWithTheirTailsInAnotherRegion) {
  ESS_REQUIRE_BACKEND(flashtrans_backend().info);
  const int n = 64, E = 512, head = 256;
  const std::uint64_t heads = static_cast<std::uint64_t>(n) * head;  // heads [0, heads), tails after
  std::mt19937 rng(13);
  CopyProblem p;
  p.count = n;
  p.entry_bytes = E;
  p.src.resize(static_cast<std::size_t>(n) * E);
  for (auto& x : p.src) x = static_cast<std::uint8_t>(rng());
  p.dst.assign(2 * heads, 0);
  p.dst_tail.head_bytes = head;
  p.dst_tail.bytes = E - head;
  p.dst_tail.delta = static_cast<std::int64_t>(heads);
  p.dst_tail.head = RowLayout{static_cast<std::uint64_t>(head), 0, 0};
  p.dst_tail.rows = RowLayout{static_cast<std::uint64_t>(E - head), 0, 0};
  for (int i = 0; i < n; ++i) {
    p.src_offsets.push_back(static_cast<std::uint64_t>(i) * E);
    p.dst_offsets.push_back(static_cast<std::uint64_t>(n - 1 - i) * head);
  }
  const std::vector<std::uint8_t> got = flashtrans_backend().copy(p);
  for (int i = 0; i < n; ++i) {
    const std::size_t row = static_cast<std::size_t>(n - 1 - i);
    ASSERT_EQ(0, std::memcmp(got.data() + row * head, p.src.data() + static_cast<std::size_t>(i) * E, head)) << "K of " << i;
    ASSERT_EQ(0, std::memcmp(got.data() + heads + row * (E - head), p.src.data() + static_cast<std::size_t>(i) * E + head, E - head))
        << "V of " << i;
  }
}

}  // namespace ess::flashtrans_test
