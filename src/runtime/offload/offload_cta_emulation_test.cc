// The CUDA backend's own step kernels (offload_cta.h: mask, finalize, the write-back list)
// run on the CPU by the CTA emulator (cta_emulator.h) with the launches offload.cu makes,
// against references written here from their contract (offload_launch.h), over seeded
// shapes: MTP batches with padded positions, invalid ids, the T newest tokens, query groups,
// reserved rows or accepted-path source rows, a paged buffer. Every buffer is guarded. Runs
// without a device; label emulation.
#include <gtest/gtest.h>

#include <random>
#include <tuple>
#include <vector>

#include "runtime/offload/offload_cta.h"
#include "testing/emulator/cta_emulator.h"

namespace ess {
namespace {

struct Batch {
  int B, T, K;
  std::int32_t slots;
  bool reserve_newest;
  int q0, q1;
  std::vector<std::int32_t> rows, lengths, ids, lru;
};

Batch make_batch(int B, int T, int K, bool reserve, int q0, int q1, std::uint32_t seed) {
  std::mt19937 rng(seed);
  Batch x{B, T, K, 2 * T * K + 5, reserve, q0, q1, {}, {}, {}, {}};
  for (int b = 0; b < B; ++b) {
    x.rows.push_back(b % 4 == 3 ? -1 : (B - 1 - b));  // every 4th position padded, rows reversed
    x.lengths.push_back(static_cast<std::int32_t>(T + rng() % 500));
  }
  for (int b = 0; b < B; ++b) {
    const std::int32_t len = x.lengths[static_cast<std::size_t>(b)];
    for (int i = 0; i < T * K; ++i) {
      const auto r = rng() % 10;
      std::int32_t id = static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(len));
      if (r == 0) id = -1;
      if (r == 1) id = len + static_cast<std::int32_t>(rng() % 5);          // invalid: past the length
      if (r == 2) id = -2 - static_cast<std::int32_t>(rng() % 5);           // invalid: below -1
      if (r == 3) id = len - 1 - static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(T));  // a newest token
      x.ids.push_back(id);
      x.lru.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(x.slots)));
    }
  }
  return x;
}

// The contract of offload_launch.h, written out.
bool in_range(std::int32_t id, std::int32_t len) { return id >= -1 && id < len; }
int newest(const Batch& x, std::int32_t id, std::int32_t len) {
  return x.reserve_newest && id >= 0 && id >= len - x.T && id < len ? id - (len - x.T) : -1;
}

class OffloadKernels : public testing::TestWithParam<std::tuple<int, int, int, bool, int, int>> {};

TEST_P(OffloadKernels, MaskAndFinalizeKeepTheirContract) {
  const auto [B, T, K, reserve, q0, q1] = GetParam();
  const Batch x = make_batch(B, T, K, reserve, q0, q1, static_cast<std::uint32_t>(B * 131 + T * 7 + K));
  emu::Guarded<std::int32_t> rows, lengths, ids, lru, lru_ids(x.ids.size()), slot_ids(x.ids.size()), physical(x.ids.size());
  rows.assign(x.rows);
  lengths.assign(x.lengths);
  ids.assign(x.ids);
  lru.assign(x.lru);
  cuda::StepShape s;
  s.batch = B;
  s.query_tokens = T;
  s.topk = K;
  s.slots = x.slots;
  s.rows_per_request = x.slots + (reserve ? T : 0);
  s.reserve_newest = reserve;
  s.query_begin = q0;
  s.query_end = q1;
  s.rows = rows.data();
  s.topk_ids = ids.data();
  s.lengths = lengths.data();
  emu::launch("offload_mask", static_cast<unsigned>(B), cuda::offload::kThreads, 0, 3,
              [&](emu::Cta& c, std::uint8_t*) { cuda::offload::mask_cta(s, lru_ids.data(), c); });
  emu::launch("offload_finalize", static_cast<unsigned>(B), cuda::offload::kThreads, 0, 4,
              [&](emu::Cta& c, std::uint8_t*) { cuda::offload::finalize_cta(s, lru.data(), slot_ids.data(), physical.data(), c); });
  for (const std::string& d : {rows.damage(), lengths.damage(), ids.damage(), lru.damage(), lru_ids.damage(), slot_ids.damage(),
                               physical.damage()}) {
    EXPECT_TRUE(d.empty()) << d;
  }
  for (int b = 0; b < B; ++b) {
    const std::int32_t row = x.rows[static_cast<std::size_t>(b)], len = x.lengths[static_cast<std::size_t>(b)];
    for (int i = 0; i < T * K; ++i) {
      const std::size_t at = static_cast<std::size_t>(b) * static_cast<std::size_t>(T * K) + static_cast<std::size_t>(i);
      const std::int32_t id = x.ids[at];
      const int t = i / K;
      const bool served = row >= 0 && t >= q0 && t < q1 && in_range(id, len);
      // The LRU sees every served id that is not among the T newest.
      ASSERT_EQ(lru_ids[at], served && newest(x, id, len) < 0 ? id : -1) << "b " << b << " i " << i << " id " << id;
      std::int32_t slot = -1;
      if (served && id >= 0) slot = newest(x, id, len) >= 0 ? x.slots + newest(x, id, len) : x.lru[at];
      ASSERT_EQ(slot_ids[at], slot) << "b " << b << " i " << i;
      ASSERT_EQ(physical[at], slot >= 0 ? row * s.rows_per_request + slot : -1) << "b " << b << " i " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, OffloadKernels,
                         testing::Values(std::make_tuple(1, 1, 1, false, 0, 1), std::make_tuple(5, 2, 41, true, 0, 2),
                                         std::make_tuple(9, 4, 300, true, 1, 3), std::make_tuple(130, 1, 64, true, 0, 1),
                                         std::make_tuple(7, 3, 2048, false, 2, 3)));

// (batch, T, accepted-path source rows, paged buffer)
class WriteBackListShapes : public testing::TestWithParam<std::tuple<int, int, bool, bool>> {};

TEST_P(WriteBackListShapes, ListsEachPositionsNewestTokensInOrder) {
  const auto [B, T, sources, paged] = GetParam();
  std::mt19937 rng(static_cast<std::uint32_t>(B * 17 + T));
  const int layers = 3, layer = 1, max_pages = 40;
  const std::int32_t slots = 100, rpr = slots + T;
  std::vector<std::int32_t> rows, lengths, source, table(static_cast<std::size_t>(B) * max_pages * layers);
  for (auto& p : table) p = static_cast<std::int32_t>(rng() % 100000);
  for (int b = 0; b < B; ++b) {
    rows.push_back(b % 5 == 2 ? -1 : (b * 7) % B);
    lengths.push_back(static_cast<std::int32_t>(T + rng() % (max_pages * 64 - T)));
    for (int t = 0; t < T; ++t) source.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(B * rpr)));
  }
  emu::Guarded<std::int32_t> g_rows, g_len, g_src, g_table;
  g_rows.assign(rows);
  g_len.assign(lengths);
  g_src.assign(source);
  g_table.assign(table);
  emu::Guarded<std::uint64_t> src_off(static_cast<std::size_t>(B * T)), dst_off(static_cast<std::size_t>(B * T));
  emu::Guarded<std::int64_t> total(1);
  cuda::WriteBackList w;
  w.batch = B;
  w.query_tokens = T;
  w.layers = layers;
  w.layer = layer;
  w.max_pages = max_pages;
  w.slots = slots;
  w.rows_per_request = rpr;
  w.rows = g_rows.data();
  w.lengths = g_len.data();
  w.source_rows = sources ? g_src.data() : nullptr;
  w.page_table = g_table.data();
  w.page_bytes = 64 * 656;
  w.entry_bytes = 656;
  w.buffer.row_stride = 656;
  if (paged) {
    w.buffer.block_rows = 64;
    w.buffer.block_stride = 64 * 656 + 4096;
  }
  w.src_offsets = src_off.data();
  w.dst_offsets = dst_off.data();
  w.total = total.data();
  emu::launch("offload_write_back_list", 1, cuda::offload::kListThreads, 0, 9,
              [&](emu::Cta& c, std::uint8_t*) { cuda::offload::write_back_list_cta(w, c); });
  for (const std::string& d : {g_rows.damage(), g_len.damage(), g_src.damage(), g_table.damage(), src_off.damage(),
                               dst_off.damage(), total.damage()}) {
    EXPECT_TRUE(d.empty()) << d;
  }
  std::size_t at = 0;
  for (int b = 0; b < B; ++b) {
    const std::int32_t row = rows[static_cast<std::size_t>(b)];
    if (row < 0) continue;
    for (int t = 0; t < T; ++t, ++at) {
      const std::int64_t token = lengths[static_cast<std::size_t>(b)] - T + t;
      const std::int64_t from = sources ? source[static_cast<std::size_t>(b * T + t)] : std::int64_t{row} * rpr + slots + t;
      const std::int32_t page = table[static_cast<std::size_t>((std::int64_t{row} * max_pages + token / 64) * layers + layer)];
      ASSERT_EQ(src_off[at], w.buffer.offset(from)) << "b " << b << " t " << t;
      ASSERT_EQ(dst_off[at], static_cast<std::uint64_t>(page) * 64 * 656 + static_cast<std::uint64_t>(token % 64) * 656);
    }
  }
  EXPECT_EQ(total[0], static_cast<std::int64_t>(at));
}

INSTANTIATE_TEST_SUITE_P(Shapes, WriteBackListShapes,
                         testing::Values(std::make_tuple(1, 1, false, false), std::make_tuple(7, 2, true, false),
                                         std::make_tuple(1500, 1, false, true), std::make_tuple(2100, 4, true, true)));

}  // namespace
}  // namespace ess
