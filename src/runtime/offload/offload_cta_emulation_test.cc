// The CUDA backend's own step kernels (offload_cta.h: mask, finalize, the whole halves, the write-back list,
// the lifecycle's load list)
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
  s.pool.rows_per_request = x.slots + (reserve ? T : 0);
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
      ASSERT_EQ(physical[at], slot >= 0 ? row * s.pool.rows_per_request + slot : -1) << "b " << b << " i " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, OffloadKernels,
                         testing::Values(std::make_tuple(1, 1, 1, false, 0, 1), std::make_tuple(5, 2, 41, true, 0, 2),
                                         std::make_tuple(9, 4, 300, true, 1, 3), std::make_tuple(130, 1, 64, true, 0, 1),
                                         std::make_tuple(7, 3, 2048, false, 2, 3)));

// Residency (offload_launch.h, StepShape::whole_units): over a batch of whole, sparse and padded
// positions, mask hides whole positions from the LRU, finalize maps their ids to their own rows
// (no slot) and records their query rows of the group in the ring, the halves kernel gives whole
// and padded positions their DA halves (every row resident, in order), and the write-back list
// lists whole positions' newest tokens a second time, into their own rows.
TEST(OffloadKernels, WholePositionsReadTheirOwnRowsAndRecordTheirQueryRows) {
  const int B = 11, T = 3, K = 300, q0 = 1, q1 = 3, layers = 2, layer = 1, W = 4;
  Batch x = make_batch(B, T, K, true, q0, q1, 77);
  x.slots = 97;  // lengths up to T + 500: a whole request on up to 6 rows
  const int max_units = 6;
  std::vector<std::int32_t> units(static_cast<std::size_t>(B) * max_units, -1);
  std::vector<bool> whole(static_cast<std::size_t>(B), false);
  for (int b = 0; b < B; ++b) {
    const std::int32_t row = x.rows[static_cast<std::size_t>(b)];
    if (row < 0 || b % 3 == 0) continue;  // padded, or sparse
    whole[static_cast<std::size_t>(b)] = true;
    const int n = 1 + (x.lengths[static_cast<std::size_t>(b)] - 1) / x.slots;
    for (int u = 0; u < n; ++u) units[static_cast<std::size_t>(row) * max_units + u] = u == 0 ? row : B + 7 * row + u;
  }
  std::vector<std::int32_t> head(static_cast<std::size_t>(B) * layers * 2, 0);
  for (std::size_t i = 0; i < head.size(); i += 2) head[i] = static_cast<int>(i / 2) % W;  // rings started anywhere
  emu::Guarded<std::int32_t> rows, lengths, ids, lru, lru_ids(x.ids.size()), slot_ids(x.ids.size()), physical(x.ids.size()),
      g_units, recorded(static_cast<std::size_t>(B) * layers * W * K), g_head, resident(x.ids.size()), fetched(x.ids.size()),
      resident_count(static_cast<std::size_t>(B) * T), fetched_count(static_cast<std::size_t>(B) * T);
  rows.assign(x.rows);
  lengths.assign(x.lengths);
  ids.assign(x.ids);
  lru.assign(x.lru);
  g_units.assign(units);
  g_head.assign(head);
  cuda::StepShape s;
  s.batch = B;
  s.query_tokens = T;
  s.topk = K;
  s.slots = x.slots;
  s.pool.rows_per_request = x.slots + T;
  s.reserve_newest = true;
  s.query_begin = q0;
  s.query_end = q1;
  s.rows = rows.data();
  s.topk_ids = ids.data();
  s.lengths = lengths.data();
  s.whole_units = g_units.data();
  s.max_units = max_units;
  s.recorded = recorded.data();
  s.recorded_head = g_head.data();
  s.windows = W;
  s.layers = layers;
  s.layer = layer;
  emu::launch("offload_mask", static_cast<unsigned>(B), cuda::offload::kThreads, 0, 3,
              [&](emu::Cta& c, std::uint8_t*) { cuda::offload::mask_cta(s, lru_ids.data(), c); });
  emu::launch("offload_finalize", static_cast<unsigned>(B), cuda::offload::kThreads, 0, 4,
              [&](emu::Cta& c, std::uint8_t*) { cuda::offload::finalize_cta(s, lru.data(), slot_ids.data(), physical.data(), c); });
  const cuda::WholeHalves h{physical.data(), resident.data(), fetched.data(), resident_count.data(), fetched_count.data()};
  emu::launch("offload_whole_halves", static_cast<unsigned>(B), cuda::offload::kThreads, 0, 5,
              [&](emu::Cta& c, std::uint8_t*) { cuda::offload::whole_halves_cta(s, h, c); });
  for (const std::string& d : {rows.damage(), lengths.damage(), ids.damage(), lru.damage(), lru_ids.damage(), slot_ids.damage(),
                               physical.damage(), g_units.damage(), recorded.damage(), g_head.damage(), resident.damage(),
                               fetched.damage(), resident_count.damage(), fetched_count.damage()}) {
    EXPECT_TRUE(d.empty()) << d;
  }
  const std::int32_t rpr = s.pool.rows_per_request;
  for (int b = 0; b < B; ++b) {
    const std::int32_t row = x.rows[static_cast<std::size_t>(b)], len = x.lengths[static_cast<std::size_t>(b)];
    const bool is_whole = whole[static_cast<std::size_t>(b)];
    for (int i = 0; i < T * K; ++i) {
      const std::size_t at = static_cast<std::size_t>(b) * static_cast<std::size_t>(T * K) + static_cast<std::size_t>(i);
      const std::int32_t id = x.ids[at];
      const int t = i / K;
      const bool served = row >= 0 && t >= q0 && t < q1 && in_range(id, len);
      ASSERT_EQ(lru_ids[at], served && !is_whole && newest(x, id, len) < 0 ? id : -1) << "b " << b << " i " << i;
      std::int32_t slot = -1, phys = -1;
      if (served && id >= 0) {
        if (newest(x, id, len) >= 0) {
          slot = x.slots + newest(x, id, len);
          phys = row * rpr + slot;
        } else if (is_whole) {
          phys = units[static_cast<std::size_t>(row) * max_units + static_cast<std::size_t>(id / x.slots)] * rpr + id % x.slots;
        } else {
          slot = x.lru[at];
          phys = row * rpr + slot;
        }
      }
      ASSERT_EQ(slot_ids[at], slot) << "b " << b << " i " << i;
      ASSERT_EQ(physical[at], phys) << "b " << b << " i " << i;
    }
    // The ring: whole positions wrote their query rows of the group after the head; the others left it.
    const std::size_t ring = static_cast<std::size_t>(row < 0 ? 0 : row) * layers + layer;
    if (row >= 0) {
      const int next = head[2 * ring], count = head[2 * ring + 1];
      ASSERT_EQ(g_head[2 * ring], is_whole ? (next + (q1 - q0)) % W : next) << "b " << b;
      ASSERT_EQ(g_head[2 * ring + 1], is_whole ? std::min(count + (q1 - q0), W) : count) << "b " << b;
      for (int t = q0; t < q1 && is_whole; ++t) {
        const std::size_t w = (ring * W + static_cast<std::size_t>((next + t - q0) % W)) * K;
        for (int k = 0; k < K; ++k) {
          const std::int32_t id = x.ids[static_cast<std::size_t>(b) * T * K + static_cast<std::size_t>(t) * K + k];
          ASSERT_EQ(recorded[w + k], id >= 0 && in_range(id, len) && newest(x, id, len) < 0 ? id : -1) << "b " << b << " t " << t;
        }
      }
    }
    // The halves of whole and padded positions (sparse ones are the split's: untouched here).
    if (row >= 0 && !is_whole) continue;
    for (int t = 0; t < T; ++t) {
      std::vector<std::int32_t> res;
      for (int k = 0; k < K; ++k) {
        const std::int32_t p = physical[static_cast<std::size_t>(b) * T * K + static_cast<std::size_t>(t) * K + k];
        if (p >= 0) res.push_back(p);
      }
      ASSERT_EQ(resident_count[static_cast<std::size_t>(b) * T + t], static_cast<std::int32_t>(res.size()));
      ASSERT_EQ(fetched_count[static_cast<std::size_t>(b) * T + t], 0);
      res.resize(static_cast<std::size_t>(K), -1);
      for (int k = 0; k < K; ++k) {
        const std::size_t at = static_cast<std::size_t>(b) * T * K + static_cast<std::size_t>(t) * K + k;
        ASSERT_EQ(resident[at], res[static_cast<std::size_t>(k)]) << "b " << b << " t " << t << " k " << k;
        ASSERT_EQ(fetched[at], -1);
      }
    }
  }

  // Without a swap decision (whole_only), a position naming a request that is not whole gets no
  // rows but its newest tokens' reserved rows, and halves as padding; whole ones are unchanged.
  const std::vector<std::int32_t> with_lru(physical.data(), physical.data() + x.ids.size());
  s.whole_only = true;
  emu::launch("offload_finalize", static_cast<unsigned>(B), cuda::offload::kThreads, 0, 4,
              [&](emu::Cta& c, std::uint8_t*) { cuda::offload::finalize_cta(s, lru.data(), slot_ids.data(), physical.data(), c); });
  emu::launch("offload_whole_halves", static_cast<unsigned>(B), cuda::offload::kThreads, 0, 5,
              [&](emu::Cta& c, std::uint8_t*) { cuda::offload::whole_halves_cta(s, h, c); });
  for (int b = 0; b < B; ++b) {
    const std::int32_t row = x.rows[static_cast<std::size_t>(b)], len = x.lengths[static_cast<std::size_t>(b)];
    for (int i = 0; i < T * K; ++i) {
      const std::size_t at = static_cast<std::size_t>(b) * static_cast<std::size_t>(T * K) + static_cast<std::size_t>(i);
      const bool other = row >= 0 && !whole[static_cast<std::size_t>(b)] && newest(x, x.ids[at], len) < 0;
      ASSERT_EQ(physical[at], other ? -1 : with_lru[at]) << "b " << b << " i " << i;
    }
    if (row >= 0 && !whole[static_cast<std::size_t>(b)]) {
      for (int t = 0; t < T; ++t) {
        ASSERT_EQ(resident_count[static_cast<std::size_t>(b) * T + t], 0) << "b " << b;
        ASSERT_EQ(resident[static_cast<std::size_t>(b) * T * K + static_cast<std::size_t>(t) * K], -1) << "b " << b;
      }
    }
  }

  // The write-back list: a whole position's newest tokens also into its own rows.
  std::vector<std::int32_t> table(static_cast<std::size_t>(B) * 40 * layers);
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = static_cast<std::int32_t>(i * 7 % 1000);
  emu::Guarded<std::int32_t> g_table;
  g_table.assign(table);
  emu::Guarded<std::uint64_t> src_off(static_cast<std::size_t>(B * T)), dst_off(static_cast<std::size_t>(B * T)),
      whole_src(static_cast<std::size_t>(B * T)), whole_dst(static_cast<std::size_t>(B * T));
  emu::Guarded<std::int64_t> total(1), whole_total(1);
  cuda::WriteBackList wl;
  wl.batch = B;
  wl.query_tokens = T;
  wl.layers = layers;
  wl.layer = layer;
  wl.max_pages = 40;
  wl.slots = x.slots;
  wl.pool.rows_per_request = rpr;
  wl.rows = rows.data();
  wl.lengths = lengths.data();
  wl.page_table = g_table.data();
  wl.page_bytes = 64 * 656;
  wl.entry_bytes = 656;
  wl.buffer.row_stride = 656;
  wl.src_offsets = src_off.data();
  wl.dst_offsets = dst_off.data();
  wl.total = total.data();
  wl.whole_units = g_units.data();
  wl.max_units = max_units;
  wl.whole_src = whole_src.data();
  wl.whole_dst = whole_dst.data();
  wl.whole_total = whole_total.data();
  emu::launch("offload_write_back_list", 1, cuda::offload::kListThreads, 0, 9,
              [&](emu::Cta& c, std::uint8_t*) { cuda::offload::write_back_list_cta(wl, c); });
  for (const std::string& d : {src_off.damage(), dst_off.damage(), whole_src.damage(), whole_dst.damage(), total.damage(),
                               whole_total.damage()}) {
    EXPECT_TRUE(d.empty()) << d;
  }
  std::size_t n = 0;
  for (int b = 0; b < B; ++b) {
    const std::int32_t row = x.rows[static_cast<std::size_t>(b)];
    if (row < 0 || !whole[static_cast<std::size_t>(b)]) continue;
    for (int t = 0; t < T; ++t, ++n) {
      const std::int64_t token = x.lengths[static_cast<std::size_t>(b)] - T + t;
      const std::int64_t own = std::int64_t{units[static_cast<std::size_t>(row) * max_units + static_cast<std::size_t>(token / x.slots)]} * rpr +
                               token % x.slots;
      ASSERT_EQ(whole_src[n], wl.buffer.offset(std::int64_t{row} * rpr + x.slots + t)) << "b " << b << " t " << t;
      ASSERT_EQ(whole_dst[n], wl.buffer.offset(own)) << "b " << b << " t " << t;
    }
  }
  EXPECT_EQ(whole_total[0], static_cast<std::int64_t>(n));
  EXPECT_GT(n, 0u);
}

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
  w.pool.rows_per_request = rpr;
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


// (what is listed: a warm-up's changed slots, a whole request's tokens into its own rows, or the
// newest tokens into the reserved rows; entries, paged buffer)
enum class Fill { kSlots, kWhole, kReserved };
class HostFillListShapes : public testing::TestWithParam<std::tuple<Fill, int, bool>> {};

TEST_P(HostFillListShapes, ListsEachTokensHostEntryAndBufferRow) {
  const auto [mode, n, paged] = GetParam();
  const bool whole = mode == Fill::kWhole, reserved = mode == Fill::kReserved;
  std::mt19937 rng(static_cast<std::uint32_t>(n * 3 + static_cast<int>(mode)));
  const int layers = 3, layer = 2, max_pages = 70, max_units = 80;
  const int T = 4;
  const std::int32_t row = 5, slots = 64, rpr = slots + T;
  const std::int64_t length = 900, first = reserved ? length - n : 0;  // reserved: the newest n <= T
  std::vector<std::int32_t> table(static_cast<std::size_t>(8) * max_pages * layers), tokens, token_slots, units;
  for (auto& p : table) p = static_cast<std::int32_t>(rng() % 100000);
  for (int i = 0; i < n; ++i) {
    tokens.push_back(static_cast<std::int32_t>(rng() % (max_pages * 64)));
    token_slots.push_back(static_cast<std::int32_t>(rng() % slots));
  }
  for (int u = 0; u < max_units; ++u) units.push_back(u == 0 ? row : static_cast<std::int32_t>(rng() % 40));
  emu::Guarded<std::int32_t> g_table, g_tokens, g_slots, g_count, g_units;
  g_table.assign(table);
  g_tokens.assign(tokens);
  g_slots.assign(token_slots);
  g_count.assign(std::vector<std::int32_t>{n});
  g_units.assign(units);
  const std::size_t listed = static_cast<std::size_t>(n);
  emu::Guarded<std::uint64_t> src_off(listed), dst_off(listed);
  emu::Guarded<std::int64_t> total(1), tally(1);
  tally[0] = 1000;
  cuda::HostFillList f;
  f.layers = layers;
  f.layer = layer;
  f.max_pages = max_pages;
  f.row = row;
  f.slots = slots;
  f.pool.rows_per_request = rpr;
  f.page_table = g_table.data();
  f.page_bytes = 64 * 656 + 512;
  f.entry_bytes = 656;
  f.buffer.row_stride = 656;
  if (paged) {
    f.buffer.block_rows = 64;
    f.buffer.block_stride = 64 * 656 + 4096;
  }
  if (whole) {
    f.units = g_units.data();
    f.length = n;
  } else if (reserved) {
    f.reserved = true;
    f.query_tokens = T;
    f.first = first;
    f.length = length;
  } else {
    f.tokens = g_tokens.data();
    f.token_slots = g_slots.data();
    f.count = g_count.data();
    f.max_count = n;
  }
  f.src_offsets = src_off.data();
  f.dst_offsets = dst_off.data();
  f.total = total.data();
  f.tally = tally.data();
  emu::launch("offload_host_fill_list", 1, cuda::offload::kListThreads, 0, 5,
              [&](emu::Cta& c, std::uint8_t*) { cuda::offload::host_fill_list_cta(f, c); });
  for (const std::string& d : {g_table.damage(), g_tokens.damage(), g_slots.damage(), g_count.damage(), g_units.damage(),
                               src_off.damage(), dst_off.damage(), total.damage(), tally.damage()}) {
    EXPECT_TRUE(d.empty()) << d;
  }
  for (std::size_t i = 0; i < listed; ++i) {
    const std::int64_t token = whole ? static_cast<std::int64_t>(i) : reserved ? first + static_cast<std::int64_t>(i) : tokens[i];
    std::int64_t dest = std::int64_t{row} * rpr + token_slots[i];
    if (whole) dest = std::int64_t{units[static_cast<std::size_t>(token / slots)]} * rpr + token % slots;
    if (reserved) dest = std::int64_t{row} * rpr + slots + (token - (length - T));
    const std::int32_t page = table[static_cast<std::size_t>((std::int64_t{row} * max_pages + token / 64) * layers + layer)];
    ASSERT_EQ(src_off[i], static_cast<std::uint64_t>(page) * (64 * 656 + 512) + static_cast<std::uint64_t>(token % 64) * 656)
        << "entry " << i;
    ASSERT_EQ(dst_off[i], f.buffer.offset(dest)) << "entry " << i;
  }
  EXPECT_EQ(total[0], n);
  EXPECT_EQ(tally[0], 1000 + n);
}

INSTANTIATE_TEST_SUITE_P(Shapes, HostFillListShapes,
                         testing::Values(std::make_tuple(Fill::kSlots, 1, false), std::make_tuple(Fill::kSlots, 64, true),
                                         std::make_tuple(Fill::kWhole, 1, false), std::make_tuple(Fill::kWhole, 3000, true),
                                         std::make_tuple(Fill::kReserved, 4, false), std::make_tuple(Fill::kReserved, 1, true)));

}  // namespace
}  // namespace ess
