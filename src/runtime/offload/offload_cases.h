// The per-layer step (ess/runtime/offload.h) against an independent model, over seeded random
// MTP batches with padded positions: the physical rows bit for bit (the cache tests' naive
// LRU per request-layer, plus the reserved newest rows), the LRU's counts, the DA split, and
// losslessness (every selected row holds exactly the host pool's entry of its token); the
// write-back; reset; an engine's own buffer with strides and blocks. Written once against a
// harness (testing/backend.h) and driven through testing/offload_io.h: the
// CUDA backend in offload_test.cc, the CPU backend in offload_host_test.cc. Include in
// exactly one source file per binary.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "ess/runtime/offload.h"
#include "testing/backend.h"
#include "testing/cache_fixtures.h"
#include "testing/offload_io.h"
#include "testing/testing.h"

namespace ess::offload_test {

using StepIn = ess::test::OffloadStepIn;
using StepOut = ess::test::OffloadStepOut;

struct OffloadHarness {
  test::BackendInfo info;
  Backend backend;
  // `bytes` of the backend's memory, zeroed or not, 16-byte aligned, kept alive by the harness
  // until the program ends: an engine's own layer buffers.
  std::uint8_t* (*allocate)(std::size_t bytes);
};
const OffloadHarness& harness();  // defined by the including binary

// An engine-owned buffer for `layers` layers of `rows` rows in blocks of `block_rows`.
inline LatentBuffer engine_buffer(int layers, std::int64_t rows, std::uint64_t row_stride, std::int64_t block_rows,
                                  std::uint64_t block_stride) {
  LatentBuffer b;
  b.rows.row_stride = row_stride;
  b.rows.block_rows = block_rows;
  b.rows.block_stride = block_stride;
  const std::uint64_t bytes = static_cast<std::uint64_t>((rows + block_rows - 1) / block_rows) * block_stride;
  for (int l = 0; l < layers; ++l) b.layer_base.push_back(harness().allocate(bytes));
  return b;
}
// Host arrays in and out, on the harness's backend (testing/offload_io.h).
inline const ess::test::OffloadIo& io() { return ess::test::offload_io(harness().backend); }

// The entry of (request, layer, token): bytes no other token shares.
inline std::vector<std::uint8_t> entry_of(RequestId id, int layer, std::int64_t token, std::size_t bytes) {
  std::vector<std::uint8_t> e(bytes);
  for (std::size_t i = 0; i < bytes; ++i) {
    e[i] = static_cast<std::uint8_t>((id * 131 + layer * 31 + token * 7 + static_cast<std::int64_t>(i) * 13) & 0xff);
  }
  e[0] = static_cast<std::uint8_t>(token & 0xff);
  e[1] = static_cast<std::uint8_t>((token >> 8) & 0xff);
  e[2] = static_cast<std::uint8_t>(id & 0xff);
  e[3] = static_cast<std::uint8_t>(layer & 0xff);
  return e;
}

// The host pool entries of request `id`, tokens [from, to) of every layer, as entry_of gives them.
inline void write_entries(Offload& o, RequestId id, std::int64_t from, std::int64_t to) {
  const std::size_t E = o.config().layout.bytes();
  for (int l = 0; l < o.config().layers; ++l) {
    for (std::int64_t t = from; t < to; ++t) {
      const auto e = entry_of(id, l, t, E);
      std::memcpy(o.host_entry(id, l, t).data(), e.data(), E);
    }
  }
}

// Position bz's DA halves as the step returned them: each query row's rows that `fetched(row)` says
// the step copied, and the others (resident), each compacted to the front in order, -1 after.
template <class Fetched>
void expect_halves(const ess::test::OffloadStepOut& got, std::size_t bz, int T, int K, std::span<const std::int32_t> phys,
                   Fetched fetched) {
  for (int t = 0; t < T; ++t) {
    std::vector<std::int32_t> res, fet;
    for (int k = 0; k < K; ++k) {
      const std::int32_t p = phys[static_cast<std::size_t>(t) * K + k];
      if (p >= 0) (fetched(p) ? fet : res).push_back(p);
    }
    const std::size_t row0 = (bz * T + t) * static_cast<std::size_t>(K);
    ASSERT_EQ(got.resident_count[bz * T + t], static_cast<std::int32_t>(res.size())) << "query row " << t;
    ASSERT_EQ(got.fetched_count[bz * T + t], static_cast<std::int32_t>(fet.size())) << "query row " << t;
    res.resize(static_cast<std::size_t>(K), -1);
    fet.resize(static_cast<std::size_t>(K), -1);
    ASSERT_TRUE(std::equal(res.begin(), res.end(), got.resident.begin() + static_cast<std::ptrdiff_t>(row0)));
    ASSERT_TRUE(std::equal(fet.begin(), fet.end(), got.fetched.begin() + static_cast<std::ptrdiff_t>(row0)));
  }
}

// The model of one request: a naive LRU per layer over the LRU slots.
struct ModelRequest {
  RequestId id = 0;
  std::int32_t row = 0;
  std::vector<std::int32_t> region;  // with regions: the blocks it was placed on
  std::int64_t length = 0;
  std::vector<test::NaiveLru> lru;             // per layer
  std::vector<std::vector<std::int32_t>> prev;  // per layer: the ids' locality state
};

// (real positions, padded positions, T, K, extra slots, reserve_newest, in regions)
using Shape = std::tuple<int, int, int, int, int, bool, bool>;

// With regions: blocks of this many rows, a region one block larger than a request's rows.
inline constexpr std::int32_t kRegionBlockRows = 16;

class OffloadShapes : public testing::TestWithParam<Shape> {};

TEST_P(OffloadShapes, MatchesTheModelAndIsLossless) {
  ESS_REQUIRE_BACKEND(harness().info);
  const auto [R, pads, T, K, extra, reserve, regions] = GetParam();
  const int L = 2;
  const std::int32_t S = T * K + extra;
  const std::int64_t prompt = std::max<std::int64_t>(4 * S, 200);
  const int steps = 10;
  OffloadConfig c;
  c.layers = L;
  c.layout = test::small_layout();
  c.max_requests = R + pads + 2;  // the padded batch fits; rows nobody uses stay untouched
  c.query_tokens = T;
  c.topk = K;
  c.slots = S;
  c.reserve_newest = reserve;
  c.max_context = prompt + steps * T;
  c.backend = harness().backend;
  const std::size_t E = c.layout.bytes();
  // In regions: a paged buffer of twice the blocks the requests need (blocks padded apart), each
  // request placed on blocks drawn in a shuffled order; its buffer rows computed here from them.
  LatentBuffer buffer;
  std::vector<std::int32_t> spare_blocks;
  if (regions) {  // a region group per layer (as vLLM's hot cache groups)
    c.region_blocks = (c.rows_per_request() + kRegionBlockRows - 1) / kRegionBlockRows + 1;
    c.region_group = {0, 1};
    const std::int64_t blocks = 2 * static_cast<std::int64_t>(c.max_requests) * L * c.region_blocks;
    buffer = engine_buffer(L, blocks * kRegionBlockRows, E, kRegionBlockRows, kRegionBlockRows * E + 64);
    buffer.blocks = blocks;
    spare_blocks.resize(static_cast<std::size_t>(blocks));
    std::iota(spare_blocks.begin(), spare_blocks.end(), 0);
  }
  Offload o(c, buffer);
  const std::int32_t rpr = c.rows_per_request();
  // In regions, the bytes of every layer's buffer before anything runs: blocks never placed and the
  // padding between blocks must keep them.
  std::vector<std::vector<std::uint8_t>> untouched;
  std::set<std::int32_t> ever_placed;
  for (int l = 0; l < L && regions; ++l) untouched.push_back(io().dump(o, l));
  std::mt19937 rng(static_cast<std::uint32_t>(R * 7919 + pads * 131 + T * 31 + K + extra + reserve + 5 * regions));
  std::shuffle(spare_blocks.begin(), spare_blocks.end(), rng);
  const auto place = [&](ModelRequest& m) {  // onto the next spare blocks (a region per layer); its old ones spare again
    spare_blocks.insert(spare_blocks.begin(), m.region.begin(), m.region.end());
    m.region.assign(spare_blocks.end() - L * c.region_blocks, spare_blocks.end());
    spare_blocks.resize(spare_blocks.size() - static_cast<std::size_t>(L * c.region_blocks));
    o.place(m.id, m.region);
    ever_placed.insert(m.region.begin(), m.region.end());
  };
  // Row s of a request's rows in the buffer of `layer`.
  const auto row_of = [&](const ModelRequest& m, std::int32_t s, int layer) {
    if (!regions) return m.row * rpr + s;
    return m.region[static_cast<std::size_t>(layer * c.region_blocks + s / kRegionBlockRows)] * kRegionBlockRows +
           s % kRegionBlockRows;
  };
  std::vector<ModelRequest> reqs(static_cast<std::size_t>(R));
  const int W = 4;
  for (int i = 0; i < R; ++i) {
    ModelRequest& m = reqs[static_cast<std::size_t>(i)];
    m.id = 1000 + 17 * i;
    m.length = prompt;
    m.row = o.admit(m.id, prompt);
    if (regions) place(m);
    for (int l = 0; l < L; ++l) {
      for (std::int64_t t = 0; t < prompt; ++t) {
        const auto e = entry_of(m.id, l, t, E);
        std::memcpy(o.host_entry(m.id, l, t).data(), e.data(), E);
      }
      m.lru.emplace_back(S);
      m.prev.emplace_back();
    }
    // LRU-Warmup from W prefill windows per layer (T = 1 each), on both sides.
    std::vector<std::int32_t> windows;
    for (int l = 0; l < L; ++l) {
      for (int w = 0; w < W; ++w) {
        const auto v = test::decode_like_ids(m.prev[static_cast<std::size_t>(l)], 1, K, prompt, std::max(1, K / 4), rng);
        std::vector<std::pair<std::int32_t, std::int32_t>> fills;
        m.lru[static_cast<std::size_t>(l)].step(v, fills);
        windows.insert(windows.end(), v.begin(), v.end());
      }
    }
    o.warmup(m.id, windows, W);
  }
  for (int step = 0; step < steps; ++step) {
    // In regions, the first request moves to other blocks mid-run: its LRU starts empty there.
    if (regions && step == steps / 2) {
      place(reqs[0]);
      for (auto& lru : reqs[0].lru) lru = test::NaiveLru(S);
    }
    // Decode appends T tokens to every request; the model writes their entries to the host
    // pool (the write-back, tested below) and, with reserve_newest, into the reserved rows.
    for (ModelRequest& m : reqs) {
      o.extend(m.id, T);
      for (int l = 0; l < L; ++l) {
        for (int t = 0; t < T; ++t) {
          const std::int64_t p = m.length + t;
          const auto e = entry_of(m.id, l, p, E);
          std::memcpy(o.host_entry(m.id, l, p).data(), e.data(), E);
          if (reserve) io().write_row(o, l, row_of(m, S + t, l), e);
        }
      }
      m.length += T;
    }
    // The batch: every request once, in a random order, padded positions among them.
    std::vector<int> order(static_cast<std::size_t>(R + pads), -1);
    for (int i = 0; i < R; ++i) order[static_cast<std::size_t>(i)] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (int layer = 0; layer < L; ++layer) {
      SCOPED_TRACE(fmt::format("step {} layer {}", step, layer));
      const auto lz = static_cast<std::size_t>(layer);
      const int fresh = (step / 3) % 2 == 0 ? std::max(1, K / 10) : K;
      StepIn in;
      in.layer = layer;
      in.batch = R + pads;
      in.split = true;
      in.copy_stream = step % 2 == 1;  // DA's fetch on its own stream, read after its event
      const std::size_t P = static_cast<std::size_t>(T) * K;
      for (const int i : order) {
        if (i < 0) {
          in.rows.push_back(-1);
          in.lengths.push_back(0);
          in.topk.insert(in.topk.end(), P, static_cast<std::int32_t>(rng() % 7));  // garbage, never read
          continue;
        }
        ModelRequest& m = reqs[static_cast<std::size_t>(i)];
        in.rows.push_back(m.row);
        in.lengths.push_back(static_cast<std::int32_t>(m.length));
        // With reserve_newest the older tokens, and a few newest ones below; else any token.
        auto ids = test::decode_like_ids(m.prev[lz], T, K, reserve ? m.length - T : m.length, fresh, rng);
        if (reserve && K > 1) {  // some query rows also select newest tokens
          for (int t = 0; t < T; ++t) {
            if (rng() % 2 == 0) ids[static_cast<std::size_t>(t) * K + 1] = static_cast<std::int32_t>(m.length - 1 - (rng() % T));
          }
        }
        in.topk.insert(in.topk.end(), ids.begin(), ids.end());
      }
      const StepOut got = io().step(o, in);
      // With the fetch on its own stream, the rows as the step's stream reads them after its wait.
      const std::vector<std::uint8_t> buf = got.seen.empty() ? io().dump(o, layer) : got.seen;
      ASSERT_EQ(got.physical.size(), in.topk.size());
      for (int b = 0; b < in.batch; ++b) {
        const auto bz = static_cast<std::size_t>(b);
        const std::span<const std::int32_t> ids(in.topk.data() + bz * P, P);
        const std::span<const std::int32_t> phys(got.physical.data() + bz * P, P);
        if (in.rows[bz] < 0) {
          EXPECT_TRUE(std::all_of(phys.begin(), phys.end(), [](std::int32_t p) { return p == -1; })) << "padded position " << b;
          EXPECT_EQ(got.counts[2 * bz], 0);
          EXPECT_EQ(got.counts[2 * bz + 1], 0);
          continue;
        }
        ModelRequest& m = *std::find_if(reqs.begin(), reqs.end(), [&](const ModelRequest& r) { return r.row == in.rows[bz]; });
        // The model: reserved newest tokens out of the LRU, the rest through the naive LRU.
        std::vector<std::int32_t> masked(ids.begin(), ids.end());
        std::vector<std::int32_t> want(P, -1);
        const std::int64_t newest = m.length - T;
        for (std::size_t i = 0; i < P; ++i) {
          if (reserve && ids[i] >= newest) {
            want[i] = row_of(m, S + static_cast<std::int32_t>(ids[i] - newest), layer);
            masked[i] = -1;
          }
        }
        std::vector<std::pair<std::int32_t, std::int32_t>> fills;
        const std::vector<std::int32_t> slots = m.lru[lz].step(masked, fills);
        std::set<std::int32_t> distinct;
        for (std::size_t i = 0; i < P; ++i) {
          if (masked[i] >= 0) {
            want[i] = row_of(m, slots[i], layer);
            distinct.insert(masked[i]);
          }
        }
        ASSERT_TRUE(std::equal(phys.begin(), phys.end(), want.begin())) << "position " << b << " (request " << m.id << ")";
        EXPECT_EQ(got.counts[2 * bz], static_cast<std::int32_t>(distinct.size() - fills.size())) << "position " << b;
        EXPECT_EQ(got.counts[2 * bz + 1], static_cast<std::int32_t>(fills.size())) << "position " << b;
        // Lossless: every selected row holds the host pool's entry of its token.
        for (std::size_t i = 0; i < P; ++i) {
          if (ids[i] < 0) continue;
          const auto e = entry_of(m.id, layer, ids[i], E);
          const std::uint64_t at = o.buffer().rows.offset(phys[i]);
          ASSERT_EQ(0, std::memcmp(buf.data() + at, e.data(), E)) << "position " << b << " token " << ids[i] << " row " << phys[i];
        }
        // The DA split: each query row's resident rows, then its fetched ones, in order.
        std::set<std::int32_t> fetched_rows;
        for (const auto& f : fills) fetched_rows.insert(row_of(m, f.second, layer));
        expect_halves(got, bz, T, K, phys, [&](std::int32_t p) { return fetched_rows.contains(p); });
        if (HasFatalFailure()) return;
      }
    }
  }
  // In regions: no byte of a block never placed, and none of the padding between blocks, was written.
  for (int l = 0; l < L && regions; ++l) {
    const std::vector<std::uint8_t> now = io().dump(o, l);
    ASSERT_EQ(now.size(), untouched[static_cast<std::size_t>(l)].size());
    const std::uint64_t stride = o.buffer().rows.block_stride, rows_bytes = kRegionBlockRows * E;
    for (std::int64_t k = 0; k < o.buffer().blocks; ++k) {
      const std::uint64_t at = static_cast<std::uint64_t>(k) * stride;
      const std::uint64_t from = ever_placed.contains(static_cast<std::int32_t>(k)) ? at + rows_bytes : at;
      const std::uint64_t to = std::min<std::uint64_t>(at + stride, now.size());
      for (std::uint64_t i = from; i < to; ++i) {
        ASSERT_EQ(now[i], untouched[static_cast<std::size_t>(l)][i]) << "layer " << l << " block " << k << " byte " << i - at;
      }
    }
  }
}

// (The untouched-bytes check of the regions variant runs at the end of MatchesTheModelAndIsLossless.)
INSTANTIATE_TEST_SUITE_P(Random, OffloadShapes,
                         testing::Values(Shape{1, 0, 1, 1, 0, false, false}, Shape{3, 2, 2, 41, 7, true, false},
                                         Shape{5, 3, 2, 64, 30, false, false}, Shape{4, 1, 3, 128, 50, true, false},
                                         Shape{6, 2, 2, 2048, 2458, true, false}, Shape{2, 5, 1, 256, 0, false, false},
                                         Shape{3, 2, 2, 41, 7, true, true}, Shape{4, 1, 3, 128, 50, true, true},
                                         Shape{2, 5, 1, 256, 0, false, true}));

// MTP query rows that overlap by `keep` of K ids with the previous row (the rest fresh, each
// row's ids distinct, some -1), over [0, limit).
inline std::vector<std::int32_t> overlapping_rows(int T, int K, std::int64_t limit, int keep, std::mt19937& rng) {
  std::vector<std::int32_t> out;
  std::vector<std::int32_t> prev;
  for (int t = 0; t < T; ++t) {
    std::set<std::int32_t> row;
    std::shuffle(prev.begin(), prev.end(), rng);
    for (std::size_t i = 0; i < prev.size() && static_cast<int>(row.size()) < keep; ++i) row.insert(prev[i]);
    while (static_cast<std::int64_t>(row.size()) < std::min<std::int64_t>(K, limit)) {
      row.insert(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(limit)));
    }
    prev.assign(row.begin(), row.end());
    std::vector<std::int32_t> r(prev);
    std::shuffle(r.begin(), r.end(), rng);
    r.resize(static_cast<std::size_t>(K), -1);
    if (rng() % 3 == 0) r[static_cast<std::size_t>(rng() % static_cast<std::uint64_t>(K))] = -1;
    out.insert(out.end(), r.begin(), r.end());
  }
  return out;
}

// A pool of fewer than T x K slots: a step whose query tokens select more distinct ids than it
// holds runs in the groups Offload::query_groups gives (greedy: each fits every position, and
// would not fit with the next query token at some position), each group one LRU step that
// matches the model bit for bit, its rows lossless, the other query tokens padding. Small
// pools, and MTP 3 and 4 at production size (top-2048, 15 % and 20 % of a 32K context).
struct GroupShape {
  int T, K;
  std::int32_t S;
  int steps;
};
class OffloadQueryGroups : public testing::TestWithParam<GroupShape> {};

TEST_P(OffloadQueryGroups, AStepLargerThanThePoolRunsGroupByGroupLosslessly) {
  ESS_REQUIRE_BACKEND(harness().info);
  for (const bool reserve : {false, true}) {
    SCOPED_TRACE(fmt::format("reserve_newest {}", reserve));
    const auto [T, K, S, steps] = GetParam();
    const int R = 3;
    const std::int64_t prompt = std::max<std::int64_t>(500, 16 * K);  // 32K at top-2048
    OffloadConfig c;
    c.layers = 1;
    c.layout = test::small_layout();
    c.max_requests = R + 1;
    c.query_tokens = T;
    c.topk = K;
    c.slots = S;
    c.reserve_newest = reserve;
    c.max_context = prompt + steps * T;
    c.backend = harness().backend;
    Offload o(c);
    const std::size_t E = c.layout.bytes();
    const std::int32_t rpr = c.rows_per_request();
    std::mt19937 rng(reserve ? 11u : 5u);
    std::vector<ModelRequest> reqs(static_cast<std::size_t>(R));
    for (int i = 0; i < R; ++i) {
      ModelRequest& m = reqs[static_cast<std::size_t>(i)];
      m.id = 40 + i;
      m.length = prompt;
      m.row = o.admit(m.id, prompt);
      for (std::int64_t t = 0; t < prompt; ++t) {
        const auto e = entry_of(m.id, 0, t, E);
        std::memcpy(o.host_entry(m.id, 0, t).data(), e.data(), E);
      }
      m.lru.emplace_back(S);
    }
    int split_steps = 0, whole_steps = 0;
    for (int step = 0; step < steps; ++step) {
      SCOPED_TRACE(fmt::format("step {}", step));
      StepIn in;
      in.batch = R + 1;
      in.split = true;
      const std::size_t P = static_cast<std::size_t>(T) * K;
      for (ModelRequest& m : reqs) {
        o.extend(m.id, T);
        for (int t = 0; t < T; ++t) {
          const auto e = entry_of(m.id, 0, m.length + t, E);
          std::memcpy(o.host_entry(m.id, 0, m.length + t).data(), e.data(), E);
          if (reserve) io().write_row(o, 0, m.row * rpr + S + t, e);
        }
        m.length += T;
        // Mostly overlapping rows on even steps (the step fits whole), little overlap on odd ones.
        auto ids = overlapping_rows(T, K, reserve ? m.length - T : m.length, step % 2 == 0 ? K - 4 : K / 8, rng);
        if (reserve) ids[1] = static_cast<std::int32_t>(m.length - 1);  // a newest token, outside the LRU
        in.rows.push_back(m.row);
        in.lengths.push_back(static_cast<std::int32_t>(m.length));
        in.topk.insert(in.topk.end(), ids.begin(), ids.end());
      }
      in.rows.insert(in.rows.begin() + 1, -1);  // a padded position
      in.lengths.insert(in.lengths.begin() + 1, 0);
      in.topk.insert(in.topk.begin() + static_cast<std::ptrdiff_t>(P), P, 3);
      const std::vector<int> bounds = o.query_groups(in.batch, in.rows.data(), in.topk.data(), in.lengths.data());
      ASSERT_GE(bounds.size(), 2u);
      ASSERT_EQ(bounds.front(), 0);
      ASSERT_EQ(bounds.back(), T);
      (bounds.size() > 2 ? split_steps : whole_steps) += 1;
      // Each position's ids the LRU sees in query rows [first, last).
      auto lru_ids = [&](int b, int first, int last) {
        std::vector<std::int32_t> v(P, -1);
        const std::int64_t newest = in.lengths[static_cast<std::size_t>(b)] - T;
        for (std::size_t i = static_cast<std::size_t>(first) * K; i < static_cast<std::size_t>(last) * K; ++i) {
          const std::int32_t id = in.topk[static_cast<std::size_t>(b) * P + i];
          v[i] = reserve && id >= newest ? -1 : id;
        }
        return v;
      };
      auto distinct = [](const std::vector<std::int32_t>& v) {
        std::set<std::int32_t> d(v.begin(), v.end());
        d.erase(-1);
        return d.size();
      };
      for (std::size_t g = 0; g + 1 < bounds.size(); ++g) {
        const int first = bounds[g], last = bounds[g + 1];
        SCOPED_TRACE(fmt::format("query group [{}, {})", first, last));
        bool next_fits_everywhere = true;
        for (int b = 0; b < in.batch; ++b) {
          if (in.rows[static_cast<std::size_t>(b)] < 0) continue;
          EXPECT_LE(distinct(lru_ids(b, first, last)), static_cast<std::size_t>(S)) << "position " << b;
          if (last < T && distinct(lru_ids(b, first, last + 1)) > static_cast<std::size_t>(S)) next_fits_everywhere = false;
        }
        EXPECT_FALSE(last < T && next_fits_everywhere) << "the group could have taken query token " << last;
        in.query_begin = first;
        in.query_end = last;
        const StepOut got = io().step(o, in);
        const std::vector<std::uint8_t> buf = io().dump(o, 0);
        for (int b = 0; b < in.batch; ++b) {
          const auto bz = static_cast<std::size_t>(b);
          const std::span<const std::int32_t> phys(got.physical.data() + bz * P, P);
          if (in.rows[bz] < 0) {
            EXPECT_TRUE(std::all_of(phys.begin(), phys.end(), [](std::int32_t p) { return p == -1; }));
            continue;
          }
          ModelRequest& m = *std::find_if(reqs.begin(), reqs.end(), [&](const ModelRequest& r) { return r.row == in.rows[bz]; });
          const std::vector<std::int32_t> masked = lru_ids(b, first, last);
          std::vector<std::pair<std::int32_t, std::int32_t>> fills;
          const std::vector<std::int32_t> slots = m.lru[0].step(masked, fills);
          for (std::size_t i = 0; i < P; ++i) {
            const std::int32_t id = in.topk[bz * P + i];
            const bool mine = i >= static_cast<std::size_t>(first) * K && i < static_cast<std::size_t>(last) * K;
            std::int32_t want = -1;
            if (mine && masked[i] >= 0) want = m.row * rpr + slots[i];
            if (mine && id >= 0 && masked[i] < 0) want = m.row * rpr + S + static_cast<std::int32_t>(id - (m.length - T));  // reserved newest
            ASSERT_EQ(phys[i], want) << "position " << b << " index " << i << " token " << id;
            if (want < 0) continue;
            const auto e = entry_of(m.id, 0, id, E);
            ASSERT_EQ(0, std::memcmp(buf.data() + o.buffer().rows.offset(want), e.data(), E))
                << "position " << b << " token " << id << " row " << want;
          }
          EXPECT_EQ(got.counts[2 * bz + 1], static_cast<std::int32_t>(fills.size())) << "position " << b;
          EXPECT_EQ(got.counts[2 * bz], static_cast<std::int32_t>(distinct(masked) - fills.size())) << "position " << b;
        }
      }
    }
    EXPECT_GT(split_steps, 0);
    EXPECT_GT(whole_steps, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Pools, OffloadQueryGroups,
                         testing::Values(GroupShape{4, 48, 48 + 20, 8}, GroupShape{3, 2048, 4915, 2},
                                         GroupShape{4, 2048, 6554, 2}),
                         [](const testing::TestParamInfo<GroupShape>& i) {
                           return fmt::format("T{}_K{}_S{}", i.param.T, i.param.K, i.param.S);
                         });

// The harness's backend beside the CPU backend on the same requests and steps, at production
// size: MTP 4 at top-2048 over 6,554 slots per request-layer (20 % of a 32K context), reserved
// newest rows, LRU-Warmup, steps larger than the pool run in query groups with the DA split,
// the write-back. Every output of every call and every byte of every layer buffer identical.
struct BackendRun {
  std::vector<StepOut> steps;
  std::vector<std::vector<std::uint8_t>> buffers;
  std::vector<std::uint8_t> host;
  std::int64_t warmup_fills = 0;
  int groups = 0;
};

inline BackendRun run_production_mtp(Backend backend) {
  const int L = 2, T = 4, K = 2048, R = 2, steps = 3, W = 2;
  const std::int64_t prompt = 32768;
  OffloadConfig c;
  c.layers = L;
  c.layout = test::small_layout();
  c.max_requests = R + 1;
  c.query_tokens = T;
  c.topk = K;
  c.slots = 6554;
  c.reserve_newest = true;
  c.max_context = prompt + steps * T;
  c.backend = backend;
  Offload o(c);
  const auto& io = ess::test::offload_io(backend);
  const std::size_t E = c.layout.bytes();
  const std::int32_t rpr = c.rows_per_request();
  std::mt19937 rng(2048);
  std::vector<RequestId> ids;
  std::vector<std::vector<std::int32_t>> prev(static_cast<std::size_t>(R * L));
  for (int i = 0; i < R; ++i) {
    const RequestId id = 7 + i;
    ids.push_back(id);
    o.admit(id, prompt);
    std::vector<std::int32_t> windows;
    for (int l = 0; l < L; ++l) {
      for (std::int64_t t = 0; t < prompt; ++t) {
        const auto e = entry_of(id, l, t, E);
        std::memcpy(o.host_entry(id, l, t).data(), e.data(), E);
      }
      for (int w = 0; w < W; ++w) {
        const auto v = test::decode_like_ids(prev[static_cast<std::size_t>(i * L + l)], 1, K, prompt, K / 4, rng);
        windows.insert(windows.end(), v.begin(), v.end());
      }
    }
    o.warmup(id, windows, W);
  }
  BackendRun run;
  for (int step = 0; step < steps; ++step) {
    std::vector<std::int32_t> rows, lengths;
    for (const RequestId id : ids) {
      o.extend(id, T);
      rows.push_back(o.row(id));
      lengths.push_back(static_cast<std::int32_t>(o.length(id)));
    }
    rows.insert(rows.begin() + 1, -1);  // a padded position
    lengths.insert(lengths.begin() + 1, 0);
    for (int l = 0; l < L; ++l) {
      StepIn in;
      in.layer = l;
      in.batch = R + 1;
      in.rows = rows;
      in.lengths = lengths;
      in.split = true;
      for (int b = 0; b < in.batch; ++b) {
        if (rows[static_cast<std::size_t>(b)] < 0) {
          in.topk.insert(in.topk.end(), static_cast<std::size_t>(T) * K, -1);
          continue;
        }
        const int i = b == 0 ? 0 : b - 1;
        const RequestId id = ids[static_cast<std::size_t>(i)];
        const std::int64_t len = o.length(id);
        for (int t = 0; t < T; ++t) {  // the model's KV write of this step's tokens
          io.write_row(o, l, rows[static_cast<std::size_t>(b)] * rpr + c.slots + t, entry_of(id, l, len - T + t, E));
        }
        // The first step's query rows each draw their own ids (about 7,400 distinct: it runs in
        // query groups); later steps have decode-like locality.
        auto& p = prev[static_cast<std::size_t>(i * L + l)];
        const auto v = step == 0 ? overlapping_rows(T, K, len, 0, rng) : test::decode_like_ids(p, T, K, len, K / 8, rng);
        in.topk.insert(in.topk.end(), v.begin(), v.end());
      }
      const std::vector<int> bounds = o.query_groups(in.batch, in.rows.data(), in.topk.data(), in.lengths.data());
      for (std::size_t g = 0; g + 1 < bounds.size(); ++g) {
        in.query_begin = bounds[g];
        in.query_end = bounds[g + 1];
        run.steps.push_back(io.step(o, in));
        run.buffers.push_back(io.dump(o, l));
        ++run.groups;
      }
      io.write_back(o, l, rows, lengths, {});
    }
  }
  for (const RequestId id : ids) {
    for (int l = 0; l < L; ++l) {
      for (std::int64_t t = 0; t < o.length(id); t += 97) {
        const auto e = o.host_entry(id, l, t);
        run.host.insert(run.host.end(), e.begin(), e.end());
      }
    }
  }
  run.warmup_fills = o.stats().warmup_fills;
  return run;
}

TEST(OffloadBackends, MtpFourAtTopk2048MatchesTheCpuBackendByteForByte) {
  ESS_REQUIRE_BACKEND(harness().info);
  const BackendRun want = run_production_mtp(Backend::kCpu);
  const BackendRun got = run_production_mtp(harness().backend);
  EXPECT_GT(want.groups, 2 * 3) << "no step ran in query groups";
  ASSERT_EQ(got.steps.size(), want.steps.size());
  for (std::size_t i = 0; i < want.steps.size(); ++i) {
    SCOPED_TRACE(fmt::format("call {}", i));
    EXPECT_EQ(got.steps[i].physical, want.steps[i].physical);
    EXPECT_EQ(got.steps[i].counts, want.steps[i].counts);
    EXPECT_EQ(got.steps[i].resident, want.steps[i].resident);
    EXPECT_EQ(got.steps[i].fetched, want.steps[i].fetched);
    EXPECT_EQ(got.steps[i].resident_count, want.steps[i].resident_count);
    EXPECT_EQ(got.steps[i].fetched_count, want.steps[i].fetched_count);
    EXPECT_TRUE(got.buffers[i] == want.buffers[i]) << "the layer buffer differs";
  }
  EXPECT_TRUE(got.host == want.host) << "the host pool differs after the write-backs";
  EXPECT_EQ(got.warmup_fills, want.warmup_fills);
}

// Requests on a shared prompt prefix: one admitted on a live request's prefix, one on the
// prefix cache after the first published its prompt. Their steps fetch the shared host pages'
// entries (lossless), the shared pages are read-only, the accounting counts them once, and
// they outlive the request that wrote them.
TEST(OffloadPrefix, RequestsOnASharedPrefixReadItsEntries) {
  ESS_REQUIRE_BACKEND(harness().info);
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 4;
  c.topk = 16;
  c.slots = 32;
  c.max_context = 512;
  c.backend = harness().backend;
  Offload o(c);
  const std::size_t E = c.layout.bytes();
  std::vector<std::int32_t> prompt(300);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(i % 97);
  // The prefix's entries are request 1's (written by it); each request's own tokens its own.
  auto entry = [&](RequestId id, int layer, std::int64_t t) { return entry_of(t < 256 ? 1 : id, layer, t, E); };
  auto write = [&](RequestId id, std::int64_t from, std::int64_t to) {
    for (int l = 0; l < c.layers; ++l) {
      for (std::int64_t t = from; t < to; ++t) {
        const auto e = entry(id, l, t);
        std::memcpy(o.host_entry(id, l, t).data(), e.data(), E);
      }
    }
  };
  o.admit(1, 300);
  write(1, 0, 300);
  EXPECT_EQ(o.publish(1, std::span(prompt).first(256)), 4);  // 4 pages per layer
  o.admit_shared(2, 300, 1, 256);
  write(2, 256, 300);
  const Offload::Admitted a = o.admit_cached(3, prompt);
  EXPECT_EQ(a.reused_tokens, 256);
  write(3, 256, 300);
  EXPECT_NE(test::error_of([&] { (void)o.host_entry(2, 0, 10); }).find("read-only"), std::string::npos);
  const OffloadStats st = o.stats();
  EXPECT_EQ(st.host_bytes_unshared, 3ull * 2 * 5 * 64 * E);
  EXPECT_EQ(st.host_bytes_used, (4 + 3 * 1) * 2ull * 64 * E);  // the shared 4 pages once, 1 own page each
  EXPECT_EQ(st.host_bytes_shared, 4 * 2ull * 64 * E);
  o.release(1);  // its published prefix stays for the others
  for (const RequestId id : {RequestId{2}, RequestId{3}}) {
    for (int l = 0; l < c.layers; ++l) {
      StepIn in;
      in.layer = l;
      in.batch = 1;
      in.rows = {o.row(id)};
      in.lengths = {300};
      for (int k = 0; k < 16; ++k) in.topk.push_back(static_cast<std::int32_t>(k * 18 + 3));  // shared and own tokens
      const StepOut got = io().step(o, in);
      const std::vector<std::uint8_t> buf = io().dump(o, l);
      for (int k = 0; k < 16; ++k) {
        const auto want = entry(id, l, in.topk[static_cast<std::size_t>(k)]);
        ASSERT_EQ(0, std::memcmp(buf.data() + o.buffer().rows.offset(got.physical[static_cast<std::size_t>(k)]), want.data(), E))
            << "request " << id << " layer " << l << " token " << in.topk[static_cast<std::size_t>(k)];
      }
    }
  }
}

// Another engine's host block pool as the Total Memory Pool (foreign pages: padded pages,
// layer regions out of order): every fetched row holds the entry that engine wrote on the page
// its block table names, through growth, a page moved to a copy, a draft taken back, a count that
// runs ahead of the steps (pages of tokens not confirmed yet) and a
// shared prefix page; ESS writes none of that engine's bytes.
TEST(OffloadForeignPages, StepsReadTheOtherEnginesPagesLosslessly) {
  ESS_REQUIRE_BACKEND(harness().info);
  const int L = 2, K = 16;
  OffloadConfig c;
  c.layers = L;
  c.layout = test::small_layout();
  c.max_requests = 3;
  c.topk = K;
  c.slots = 24;
  c.reserve_newest = true;
  c.max_context = 512;
  c.backend = harness().backend;
  const std::size_t E = c.layout.bytes();
  const std::int64_t G = 12;
  c.foreign.pages_per_layer = G;
  c.foreign.page_stride = 64 * E + 256;
  c.foreign.layer_first_page = {G + 3, 0};
  const std::size_t arena = static_cast<std::size_t>(2 * G + 3) * c.foreign.page_stride;
  // The other engine's region: pinned and mapped where the CUDA backend reads it.
  const HostBlock block = default_host_allocator().allocate((arena + 4095) / 4096 * 4096, HostMemoryKind::kPinned);
  ASSERT_NE(block.data, nullptr);
  struct Given final : HostAllocator {
    HostBlock b;
    HostBlock allocate(std::size_t bytes, HostMemoryKind) override { return bytes <= b.bytes ? b : HostBlock{}; }
    void deallocate(const HostBlock&) noexcept override {}
  } given;
  given.b = block;
  std::mt19937 rng(77);
  for (std::size_t i = 0; i < block.bytes; ++i) block.data[i] = static_cast<std::uint8_t>(rng());
  std::vector<std::uint8_t> shadow(block.data, block.data + block.bytes);  // what the other engine wrote
  // Its block tables and writes: the prefix's first page is request 1's (shared by request 2).
  std::unordered_map<RequestId, std::vector<std::int32_t>> table = {{1, {7, 2, 9}}, {2, {7, 4}}};
  auto entry = [&](RequestId id, int layer, std::int64_t t) { return entry_of(t < 64 ? 1 : id, layer, t, E); };
  auto where = [&](RequestId id, int layer, std::int64_t t) {
    const auto page = c.foreign.layer_first_page[static_cast<std::size_t>(layer)] + table.at(id)[static_cast<std::size_t>(t / 64)];
    return block.data + static_cast<std::size_t>(page) * c.foreign.page_stride + static_cast<std::size_t>(t % 64) * E;
  };
  auto write = [&](RequestId id, std::int64_t from, std::int64_t to) {
    for (int l = 0; l < L; ++l) {
      for (std::int64_t t = from; t < to; ++t) {
        std::memcpy(where(id, l, t), entry(id, l, t).data(), E);
        std::memcpy(shadow.data() + (where(id, l, t) - block.data), entry(id, l, t).data(), E);
      }
    }
  };
  std::unordered_map<RequestId, std::int64_t> length = {{1, 150}, {2, 100}};
  write(1, 0, 150);
  write(2, 64, 100);
  Offload o(c, {}, given);
  ASSERT_EQ(o.host_pool().base(), block.data);
  o.adopt(1, 150, table.at(1));
  o.adopt(2, 100, table.at(2), 2);
  auto check_steps = [&](int round) {
    for (const RequestId id : {RequestId{1}, RequestId{2}}) {
      for (int l = 0; l < L; ++l) {
        StepIn in;
        in.layer = l;
        in.batch = 1;
        in.rows = {o.row(id)};
        in.lengths = {static_cast<std::int32_t>(length.at(id))};
        std::vector<std::int32_t> ids(static_cast<std::size_t>(length.at(id)) - 1);  // the newest is reserved
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        ids.resize(K);
        in.topk = ids;
        const StepOut got = io().step(o, in);
        const std::vector<std::uint8_t> buf = io().dump(o, l);
        for (int k = 0; k < K; ++k) {
          const std::int32_t t = ids[static_cast<std::size_t>(k)];
          const auto want = entry(id, l, t);
          ASSERT_EQ(0, std::memcmp(buf.data() + o.buffer().rows.offset(got.physical[static_cast<std::size_t>(k)]), want.data(), E))
              << "round " << round << " request " << id << " layer " << l << " token " << t;
        }
      }
    }
  };
  check_steps(0);
  // Growth within its last page, then onto a new one.
  write(1, 150, 151);
  length[1] = 151;
  o.repage(1, 151, 3, {});
  check_steps(1);
  table[1].push_back(11);
  write(1, 151, 200);
  length[1] = 200;
  o.repage(1, 200, 3, std::vector<std::int32_t>{11});
  check_steps(2);
  // The other engine moves page 2 of request 1 to a copy (9 -> 10) and reuses page 9.
  for (int l = 0; l < L; ++l) {
    std::memcpy(where(1, l, 128) + (10 - 9) * c.foreign.page_stride, where(1, l, 128), 64 * E);
    std::memset(where(1, l, 128), 0x5a, 64 * E);
  }
  shadow.assign(block.data, block.data + block.bytes);
  table[1][2] = 10;
  o.repage(1, 200, 0, table.at(1));
  // A draft taken back (T = 1): 199 tokens.
  length[1] = 199;
  o.repage(1, 199, 4, {});
  check_steps(3);
  // Refused, changing nothing.
  EXPECT_NE(test::error_of([&] { o.admit(3, 10); }).find("foreign pages"), std::string::npos);
  EXPECT_NE(test::error_of([&] { o.repage(1, 260, 4, {}); }).find("5 expected"), std::string::npos);
  EXPECT_NE(test::error_of([&] { o.repage(1, 100, 2, {}); }).find("takes back more than T"), std::string::npos);
  EXPECT_NE(test::error_of([&] { o.adopt(3, 10, std::vector<std::int32_t>{static_cast<std::int32_t>(G)}); }).find("outside [0, 12)"), std::string::npos);
  EXPECT_EQ(o.length(1), 199);
  check_steps(4);
  // The other engine's count runs ahead of its device's (vLLM's async scheduling with drafts): it gives the
  // page of a token not confirmed yet, and the steps serve the first 199 tokens, as before.
  o.repage(1, 200, 4, {});
  EXPECT_EQ(o.length(1), 200);
  check_steps(5);
  {  // but never past what it holds, nor below 1
    const std::vector<std::int32_t> rows = {o.row(1)}, ids(static_cast<std::size_t>(K), 0);
    for (const std::int32_t bad : {201, 0}) {
      const std::vector<std::int32_t> lengths = {bad};
      EXPECT_NE(test::error_of([&] { (void)o.query_groups(1, rows.data(), ids.data(), lengths.data()); })
                    .find(fmt::format("has length {}; on foreign pages from 1 to the 200 tokens", bad)),
                std::string::npos);
    }
  }
  EXPECT_TRUE(std::equal(shadow.begin(), shadow.end(), block.data)) << "the steps wrote into the other engine's pool";
  o.release(1);
  o.release(2);
  default_host_allocator().deallocate(block);
}

// The write-back copies each position's T newest entries from the reserved rows (or from the
// rows the engine names) into the host pool; padded positions are skipped.
TEST(OffloadWriteBack, CopiesTheNewestEntriesToTheHostPool) {
  ESS_REQUIRE_BACKEND(harness().info);
  for (const bool reserve : {true, false}) {
    OffloadConfig c;
    c.layers = 3;
    c.layout = test::small_layout();
    c.max_requests = 4;
    c.query_tokens = 2;
    c.topk = 8;
    c.slots = 16;
    c.reserve_newest = reserve;
    c.max_context = 400;
    c.backend = harness().backend;
    Offload o(c);
    const std::size_t E = c.layout.bytes();
    o.admit(7, 100);
    o.admit(9, 63);
    o.extend(7, 2);
    o.extend(9, 2);  // crosses a page boundary
    const std::vector<std::int32_t> rows = {o.row(9), -1, o.row(7)};
    const std::vector<std::int32_t> lengths = {65, 0, 102};
    std::vector<std::int32_t> sources;
    for (int l = 0; l < c.layers; ++l) {
      for (std::size_t b = 0; b < rows.size(); ++b) {
        if (rows[b] < 0) continue;
        const RequestId id = b == 0 ? 9 : 7;
        for (int t = 0; t < 2; ++t) {
          const std::int32_t p = reserve ? rows[b] * o.rows_per_request() + c.slots + t : rows[b] * o.rows_per_request() + 5 + t;
          io().write_row(o, l, p, entry_of(id, l, lengths[b] - 2 + t, E));
        }
      }
      if (!reserve) sources = {o.row(9) * o.rows_per_request() + 5, o.row(9) * o.rows_per_request() + 6, 0, 0,
                               o.row(7) * o.rows_per_request() + 5, o.row(7) * o.rows_per_request() + 6};
      io().write_back(o, l, rows, lengths, sources);
    }
    for (int l = 0; l < c.layers; ++l) {
      for (const auto& [id, len] : {std::pair<RequestId, std::int64_t>{9, 65}, {7, 102}}) {
        for (std::int64_t p = len - 2; p < len; ++p) {
          const auto want = entry_of(id, l, p, E);
          const auto got = o.host_entry(id, l, p);
          EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin())) << "request " << id << " layer " << l << " token " << p;
        }
      }
    }
  }
}

// In regions, the write-back reads each request's reserved rows in its own blocks.
TEST(OffloadWriteBack, ReadsTheReservedRowsOfEachRequestsRegion) {
  ESS_REQUIRE_BACKEND(harness().info);
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 3;
  c.query_tokens = 2;
  c.topk = 8;
  c.slots = 15;  // the reserved rows straddle a block: rows 15 and 16 of blocks of 8 rows
  c.reserve_newest = true;
  c.max_context = 400;
  c.region_blocks = 3;
  c.backend = harness().backend;
  const std::size_t E = c.layout.bytes();
  LatentBuffer buffer = engine_buffer(c.layers, 10 * 8, E, 8, 8 * E + 48);
  buffer.blocks = 10;
  Offload o(c, buffer);
  const std::vector<std::vector<std::int32_t>> regions = {{6, 1, 8}, {3, 9, 0}};
  const std::vector<RequestId> ids = {7, 9};
  const std::vector<std::int64_t> lengths = {102, 65};
  for (std::size_t i = 0; i < ids.size(); ++i) {
    o.admit(ids[i], lengths[i] - 2);
    o.place(ids[i], regions[i]);
    o.extend(ids[i], 2);
  }
  const std::vector<std::int32_t> rows = {o.row(9), -1, o.row(7)};
  const std::vector<std::int32_t> step_lengths = {65, 0, 102};
  for (int l = 0; l < c.layers; ++l) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      for (int t = 0; t < 2; ++t) {
        const std::int32_t slot = c.slots + t;  // row slot of the region: block slot / 8, row slot % 8
        const std::int32_t p = regions[i][static_cast<std::size_t>(slot / 8)] * 8 + slot % 8;
        io().write_row(o, l, p, entry_of(ids[i], l, lengths[i] - 2 + t, E));
      }
    }
    io().write_back(o, l, rows, step_lengths, {});
  }
  for (int l = 0; l < c.layers; ++l) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      for (std::int64_t p = lengths[i] - 2; p < lengths[i]; ++p) {
        const auto want = entry_of(ids[i], l, p, E);
        const auto got = o.host_entry(ids[i], l, p);
        EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin())) << "request " << ids[i] << " layer " << l << " token " << p;
      }
    }
  }
}

// A request shorter than T tokens (a one-token prompt, one token decoded, MTP 4): its tokens
// are all among the T newest, in reserved rows T - length .. T - 1; the step maps them there
// and ignores the padding ids; the write-back copies exactly the tokens that exist.
TEST(OffloadWriteBack, ARequestShorterThanTHasOnlyItsTokensWrittenBack) {
  ESS_REQUIRE_BACKEND(harness().info);
  const int T = 4, K = 8;
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 2;
  c.query_tokens = T;
  c.topk = K;
  c.slots = 8;
  c.reserve_newest = true;
  c.max_context = 64;
  c.backend = harness().backend;
  Offload o(c);
  const std::size_t E = c.layout.bytes();
  const RequestId id = 3;
  o.admit(id, 1);
  o.extend(id, 1);  // length 2 < T
  const std::int32_t row = o.row(id), rpr = o.rows_per_request();
  const std::vector<std::int32_t> rows = {row}, lengths = {2};
  for (int l = 0; l < c.layers; ++l) {
    for (std::int64_t t = 0; t < 2; ++t) io().write_row(o, l, row * rpr + c.slots + (T - 2) + static_cast<std::int32_t>(t), entry_of(id, l, t, E));
  }
  StepIn in;
  in.layer = 1;
  in.batch = 1;
  in.rows = rows;
  in.lengths = lengths;
  in.split = true;
  for (int t = 0; t < T; ++t) {
    const std::vector<std::int32_t> q = {1, -1, 0, -1, -1, -1, -1, -1};
    in.topk.insert(in.topk.end(), q.begin(), q.end());
  }
  const StepOut got = io().step(o, in);
  for (int t = 0; t < T; ++t) {
    EXPECT_EQ(got.physical[static_cast<std::size_t>(t * K)], row * rpr + c.slots + 3) << "token 1, query token " << t;
    EXPECT_EQ(got.physical[static_cast<std::size_t>(t * K + 1)], -1);
    EXPECT_EQ(got.physical[static_cast<std::size_t>(t * K + 2)], row * rpr + c.slots + 2) << "token 0, query token " << t;
  }
  EXPECT_EQ(got.counts, (std::vector<std::int32_t>{0, 0})) << "the newest tokens are outside the LRU";
  for (int l = 0; l < c.layers; ++l) {
    for (std::int64_t t = 0; t < 2; ++t) std::memset(o.host_entry(id, l, t).data(), 0, E);
    io().write_back(o, l, rows, lengths, {});
    for (std::int64_t t = 0; t < 2; ++t) {
      const auto want = entry_of(id, l, t, E);
      const auto e = o.host_entry(id, l, t);
      EXPECT_TRUE(std::equal(e.begin(), e.end(), want.begin())) << "layer " << l << " token " << t;
    }
  }
}

// An engine's own buffer (a paged cache: blocks of 64 rows, padded rows and blocks): every
// fetched entry lands at the address the engine's layout gives its row.
TEST(OffloadEngineBuffer, RowsLandWhereTheEnginesStridesPutThem) {
  ESS_REQUIRE_BACKEND(harness().info);
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 3;
  c.query_tokens = 1;
  c.topk = 40;
  c.slots = 100;
  c.max_context = 1000;
  c.backend = harness().backend;
  const std::uint64_t row_stride = c.layout.bytes() + 48, block_stride = 64 * row_stride + 4096;
  Offload o(c, engine_buffer(c.layers, c.max_requests * c.rows_per_request(), row_stride, 64, block_stride));
  const std::size_t E = c.layout.bytes();
  std::mt19937 rng(3);
  std::vector<std::int32_t> prev;
  StepIn in;
  in.layer = 1;
  in.batch = 3;
  for (int i = 0; i < 3; ++i) {
    const RequestId id = 40 + i;
    in.rows.push_back(o.admit(id, 900));
    in.lengths.push_back(900);
    for (std::int64_t t = 0; t < 900; ++t) {
      const auto e = entry_of(id, 1, t, E);
      std::memcpy(o.host_entry(id, 1, t).data(), e.data(), E);
    }
    const auto ids = test::decode_like_ids(prev, 1, 40, 900, 40, rng);
    in.topk.insert(in.topk.end(), ids.begin(), ids.end());
  }
  const StepOut got = io().step(o, in);
  const std::vector<std::uint8_t> buf = io().dump(o, 1);
  for (int b = 0; b < 3; ++b) {
    for (int k = 0; k < 40; ++k) {
      const auto i = static_cast<std::size_t>(b * 40 + k);
      if (in.topk[i] < 0) continue;
      const std::int32_t p = got.physical[i];
      ASSERT_GE(p, in.rows[static_cast<std::size_t>(b)] * o.rows_per_request());
      const std::uint64_t at = (static_cast<std::uint64_t>(p) / 64) * block_stride + (static_cast<std::uint64_t>(p) % 64) * row_stride;
      const auto e = entry_of(40 + b, 1, in.topk[i], E);
      ASSERT_EQ(0, std::memcmp(buf.data() + at, e.data(), E)) << "position " << b << " row " << p;
    }
  }
}

// A buffer that keeps each entry in two parts, as DeepSeek-V4's C4 pages do (SGLang's
// kvcacheio.cuh: per page of 64 rows their 576-byte values, then their 8-byte scales, the page
// padded to 37,440 bytes): over steps with misses and evictions, every selected row holds its
// entry's value and scale exactly where the page layout puts them (offsets computed here from
// those constants, not from ESS's layouts), the reserved rows' new entries reach the host pool by
// the write-back with the padding after them untouched, and a whole request's rows (adaptive
// residency) follow the same layout.
TEST(OffloadSplitBuffer, DeepSeekV4PagesHoldTheSelectedEntriesLosslessly) {
  ESS_REQUIRE_BACKEND(harness().info);
  constexpr std::uint64_t kValue = 576, kScale = 8, kPage = 37440, kScaleAt = 576 * 64;
  for (const Residency residency : {Residency::kSparse, Residency::kAdaptive}) {  // adaptive: the short request whole
    OffloadConfig c;
    c.layers = 2;
    c.layout = LatentLayout{512, 32};  // 592-byte host entries: a 576-byte value, an 8-byte scale, 8 of padding
    c.max_requests = 4;
    c.query_tokens = 2;
    c.topk = 48;
    c.slots = 64;
    c.reserve_newest = true;
    c.residency = residency;
    c.max_context = 1300;
    c.backend = harness().backend;
    const std::size_t E = c.layout.bytes();
    ASSERT_EQ(E, 592u);
    const std::int64_t rows = static_cast<std::int64_t>(c.max_requests) * c.rows_per_request();
    const std::uint64_t pages = static_cast<std::uint64_t>((rows + 63) / 64);
    LatentBuffer b;
    b.rows = RowLayout{kValue, 64, kPage};
    b.tail.head_bytes = static_cast<int>(kValue);
    b.tail.bytes = static_cast<int>(kScale);
    b.tail.rows = RowLayout{kScale, 64, kPage};
    for (int l = 0; l < c.layers; ++l) {
      std::uint8_t* base = harness().allocate(pages * kPage);
      b.layer_base.push_back(base);
      b.tail_base.push_back(base + kScaleAt);
    }
    Offload o(c, b);
    const auto value_at = [](std::int64_t p) { return static_cast<std::uint64_t>(p / 64) * kPage + static_cast<std::uint64_t>(p % 64) * kValue; };
    const auto scale_at = [](std::int64_t p) {
      return static_cast<std::uint64_t>(p / 64) * kPage + kScaleAt + static_cast<std::uint64_t>(p % 64) * kScale;
    };
    const std::vector<RequestId> ids = {5, 6, 7};
    std::vector<std::int64_t> len = {700, 40, 1100};
    StepIn in;
    in.batch = 4;  // three requests and a padded position
    for (std::size_t i = 0; i < ids.size(); ++i) {
      in.rows.push_back(o.admit(ids[i], len[i]));
      for (int l = 0; l < c.layers; ++l) {
        for (std::int64_t t = 0; t < len[i]; ++t) {
          const auto e = entry_of(ids[i], l, t, E);
          std::memcpy(o.host_entry(ids[i], l, t).data(), e.data(), E);
        }
      }
    }
    for (const RequestId id : ids) o.warmup(id, {}, 0);  // the newest entries into the reserved rows
    ASSERT_EQ(o.whole(6), residency == Residency::kAdaptive);
    ASSERT_FALSE(o.whole(5));
    in.rows.push_back(-1);
    std::mt19937 rng(21);
    std::vector<std::vector<std::int32_t>> prev(ids.size());
    for (int step = 0; step < 6; ++step) {
      for (std::size_t i = 0; i < ids.size(); ++i) {  // two new tokens: the model writes them into the reserved rows
        o.extend(ids[i], 2);
        len[i] += 2;
        for (int l = 0; l < c.layers; ++l) {
          for (int t = 0; t < 2; ++t) {
            io().write_row(o, l, in.rows[i] * o.rows_per_request() + c.slots + t, entry_of(ids[i], l, len[i] - 2 + t, E));
          }
        }
      }
      in.lengths = {static_cast<std::int32_t>(len[0]), static_cast<std::int32_t>(len[1]), static_cast<std::int32_t>(len[2]), 0};
      for (int l = 0; l < c.layers; ++l) {
        in.layer = l;
        in.topk.clear();
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const auto k = test::decode_like_ids(prev[i], 2, c.topk, len[i], 12, rng);
          in.topk.insert(in.topk.end(), k.begin(), k.end());
        }
        in.topk.insert(in.topk.end(), static_cast<std::size_t>(2 * c.topk), -1);
        const StepOut got = io().step(o, in);
        const std::vector<std::uint8_t> buf = io().dump(o, l);
        for (std::size_t i = 0; i < ids.size(); ++i) {
          for (int k = 0; k < 2 * c.topk; ++k) {
            const std::size_t at = i * 2 * static_cast<std::size_t>(c.topk) + static_cast<std::size_t>(k);
            const std::int32_t tok = in.topk[at], p = got.physical[at];
            if (tok < 0) continue;
            ASSERT_GE(p, 0);
            const auto e = entry_of(ids[i], l, tok, E);
            ASSERT_EQ(0, std::memcmp(buf.data() + value_at(p), e.data(), kValue))
                << to_string(residency) << ": step " << step << " layer " << l << " request " << ids[i] << " token " << tok;
            ASSERT_EQ(0, std::memcmp(buf.data() + scale_at(p), e.data() + kValue, kScale))
                << to_string(residency) << ": the scale of token " << tok << " in row " << p;
          }
        }
        io().write_back(o, l, in.rows, in.lengths, {});
      }
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {  // the written-back entries; the padding as the host held it (zeros)
      for (int l = 0; l < c.layers; ++l) {
        for (std::int64_t t = len[i] - 12; t < len[i]; ++t) {
          const auto want = entry_of(ids[i], l, t, E);
          const auto held = o.host_entry(ids[i], l, t);
          ASSERT_TRUE(std::equal(held.begin(), held.begin() + static_cast<std::ptrdiff_t>(kValue + kScale), want.begin()))
              << "request " << ids[i] << " layer " << l << " token " << t;
          ASSERT_TRUE(std::all_of(held.begin() + static_cast<std::ptrdiff_t>(kValue + kScale), held.end(),
                                  [](std::uint8_t x) { return x == 0; }))
              << "the write-back copied padding: request " << ids[i] << " layer " << l << " token " << t;
        }
        const auto row = o.read_row(l, o.row(ids[i]) * o.rows_per_request() + c.slots + 1);
        ASSERT_TRUE(std::equal(row.begin(), row.begin() + static_cast<std::ptrdiff_t>(kValue + kScale),
                               entry_of(ids[i], l, len[i] - 1, E).begin()))
            << "read_row of the newest reserved row";
      }
    }
  }
}

// Tails in allocations of their own, made before the heads' (K and V as two tensors: the tail's
// base may lie below the head's, a negative distance): steps and the write-back stay lossless.
TEST(OffloadSplitBuffer, TailsInTensorsOfTheirOwnAreLossless) {
  ESS_REQUIRE_BACKEND(harness().info);
  OffloadConfig c;
  c.layers = 2;
  c.layout = LatentLayout{512, 32};  // 592 bytes: a 320-byte head, a 272-byte tail
  c.max_requests = 2;
  c.query_tokens = 1;
  c.topk = 24;
  c.slots = 32;
  c.reserve_newest = true;
  c.max_context = 400;
  c.backend = harness().backend;
  const std::size_t E = c.layout.bytes();
  const std::int64_t rows = static_cast<std::int64_t>(c.max_requests) * c.rows_per_request();
  LatentBuffer b;
  b.rows = RowLayout{320, 0, 0};
  b.tail.head_bytes = 320;
  b.tail.bytes = 272;
  b.tail.rows = RowLayout{272, 0, 0};
  for (int l = 0; l < c.layers; ++l) b.tail_base.push_back(harness().allocate(static_cast<std::size_t>(rows) * 272));
  for (int l = 0; l < c.layers; ++l) b.layer_base.push_back(harness().allocate(static_cast<std::size_t>(rows) * 320));
  Offload o(c, b);
  const RequestId id = 3;
  std::int64_t len = 300;
  StepIn in;
  in.batch = 1;
  in.rows = {o.admit(id, len)};
  write_entries(o, id, 0, len);
  o.warmup(id, {}, 0);
  std::mt19937 rng(5);
  std::vector<std::int32_t> prev;
  for (int step = 0; step < 5; ++step) {
    o.extend(id, 1);
    ++len;
    in.lengths = {static_cast<std::int32_t>(len)};
    for (int l = 0; l < c.layers; ++l) {
      io().write_row(o, l, in.rows[0] * o.rows_per_request() + c.slots, entry_of(id, l, len - 1, E));
      in.layer = l;
      in.topk = test::decode_like_ids(prev, 1, c.topk, len, 8, rng);
      const StepOut got = io().step(o, in);
      for (int k = 0; k < c.topk; ++k) {
        if (in.topk[static_cast<std::size_t>(k)] < 0) continue;
        const auto row = o.read_row(l, got.physical[static_cast<std::size_t>(k)]);
        ASSERT_EQ(row, entry_of(id, l, in.topk[static_cast<std::size_t>(k)], E)) << "step " << step << " layer " << l;
      }
      io().write_back(o, l, in.rows, in.lengths, {});
      const auto held = o.host_entry(id, l, len - 1);
      ASSERT_TRUE(std::equal(held.begin(), held.end(), entry_of(id, l, len - 1, E).begin())) << "write-back, layer " << l;
    }
  }
}

// The buffer split in two parts is checked when the engine is made, by name.
TEST(OffloadSplitBuffer, RefusesASplitItCannotServe) {
  ESS_REQUIRE_BACKEND(harness().info);
  OffloadConfig c;
  c.layers = 1;
  c.layout = LatentLayout{512, 32};
  c.max_requests = 1;
  c.topk = 8;
  c.slots = 8;
  c.max_context = 64;
  c.backend = harness().backend;
  const auto split = [&](int head, int tail, std::uint64_t tail_stride, std::ptrdiff_t tail_shift) {
    LatentBuffer b;
    b.rows = RowLayout{576, 64, 37440};
    b.tail.head_bytes = head;
    b.tail.bytes = tail;
    b.tail.rows = RowLayout{tail_stride, 64, 37440};
    std::uint8_t* base = harness().allocate(37440);
    b.layer_base.push_back(base);
    b.tail_base.push_back(base + 36864 + tail_shift);
    return b;
  };
  const auto refused = [&](LatentBuffer b, const char* what) {
    try {
      Offload o(c, std::move(b));
      ADD_FAILURE() << "accepted; expected a refusal naming " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused(split(576, 24, 8, 0), "tail of 24");        // past the 592-byte entry
  refused(split(570, 8, 8, 0), "head of 570");        // not a multiple of 16
  refused(split(576, 8, 4, 0), "row_stride = 4");     // tails overlap
  refused(split(576, 8, 8, 4), "not 8-byte aligned");
  LatentBuffer owned;
  owned.tail.head_bytes = 576;
  owned.tail.bytes = 8;
  owned.tail.rows = RowLayout{8, 64, 37440};
  owned.tail_base.push_back(harness().allocate(64));
  refused(owned, "caller's layer buffers");
  EXPECT_NO_THROW(Offload(c, split(576, 8, 8, 0)));
  // Tails that share bytes with the heads: a tail run starting among the page's values, and K / V
  // tensors closer than a tensor apart.
  refused(split(576, 8, 8, -(36864 - 7 * 576)), "row 7's head, bytes [4032, 4608) of the layer's buffer, and row 0's tail");
  const std::int64_t rows = static_cast<std::int64_t>(c.max_requests) * c.rows_per_request();
  const std::int64_t tensor = rows * 320;
  std::uint8_t* kv_memory = harness().allocate(static_cast<std::size_t>(3 * tensor));
  const auto kv = [&](std::int64_t tail_at) {  // K in the middle third, V `tail_at` bytes from it
    LatentBuffer b;
    b.rows = RowLayout{320, 0, 0};
    b.tail.head_bytes = 320;
    b.tail.bytes = 272;
    b.tail.rows = RowLayout{320, 0, 0};
    b.layer_base.push_back(kv_memory + tensor);
    b.tail_base.push_back(kv_memory + tensor + tail_at);
    return b;
  };
  refused(kv(tensor - 320), "row 7's head, bytes [2240, 2560) of the layer's buffer, and row 0's tail");
  refused(kv(-272), "row 0's head, bytes [0, 320) of the layer's buffer, and row 1's tail, bytes [48, 320)");
  EXPECT_NO_THROW(Offload(c, kv(tensor)));    // V right after K
  EXPECT_NO_THROW(Offload(c, kv(-tensor)));   // V right before K
  // Interleaved rows (each row's head, then its tail): apart, though every block meets.
  LatentBuffer interleaved;
  interleaved.rows = RowLayout{592, 0, 0};
  interleaved.tail.head_bytes = 320;
  interleaved.tail.bytes = 272;
  interleaved.tail.rows = RowLayout{592, 0, 0};
  std::uint8_t* base = harness().allocate(static_cast<std::size_t>(rows) * 592);
  interleaved.layer_base.push_back(base);
  interleaved.tail_base.push_back(base + 320);
  EXPECT_NO_THROW(Offload(c, interleaved));
  interleaved.tail_base[0] = base + 312;
  refused(interleaved, "row 0's head, bytes [0, 320) of the layer's buffer, and row 0's tail, bytes [312, 584)");
  // Heads in blocks of 4 rows, tails one run 8 bytes a row closer than the heads, starting in the
  // gap after the first head: only the third row from the end meets its head (tail row k starts at
  // off + 584 k, head row k ends at 592 k + 320), in a block the check reaches late.
  c.max_requests = 3;
  const std::int64_t many = static_cast<std::int64_t>(c.max_requests) * c.rows_per_request();
  ASSERT_LE(many, 33);  // each run starts inside the first gap
  std::uint8_t* memory = harness().allocate(static_cast<std::size_t>(many) * 592);
  const auto drifting = [&](std::int64_t off) {
    LatentBuffer b;
    b.rows = RowLayout{592, 4, 4 * 592};
    b.tail.head_bytes = 320;
    b.tail.bytes = 8;
    b.tail.rows = RowLayout{584, 0, 0};
    b.layer_base.push_back(memory);
    b.tail_base.push_back(memory + off);
    return b;
  };
  const std::int64_t k = many - 3;
  refused(drifting(320 + 8 * (many - 4)), fmt::format("row {}'s head, bytes [{}, {}) of the layer's buffer, and row {}'s tail",
                                                     k, 592 * k, 592 * k + 320, k).c_str());
  EXPECT_NO_THROW(Offload(c, drifting(320 + 8 * many)));  // every tail row in its gap
}

// With reserve_newest, warmup leaves a request's newest entries in its reserved rows (token
// length - T + t in reserved row t), for a prompt of T tokens or more and for a shorter one, a
// whole request as a sparse one, and with no warm-up windows: a step at the prompt's own length
// reads them there.
TEST(OffloadWarmup, LoadsTheNewestEntriesIntoTheReservedRows) {
  ESS_REQUIRE_BACKEND(harness().info);
  for (const Residency residency : {Residency::kSparse, Residency::kAdaptive}) {
    OffloadConfig c;
    c.layers = 2;
    c.layout = test::small_layout();
    c.max_requests = 4;
    c.query_tokens = 3;
    c.topk = 8;
    c.slots = 24;
    c.reserve_newest = true;
    c.max_context = 256;
    c.residency = residency;
    c.backend = harness().backend;
    Offload o(c);
    const std::size_t E = c.layout.bytes();
    const std::int32_t rpr = c.rows_per_request();
    for (const auto& [id, length, W] : {std::tuple<RequestId, std::int64_t, int>{3, 100, 2}, {4, 2, 1}, {5, 40, 0}}) {
      const std::int32_t row = o.admit(id, length);
      write_entries(o, id, 0, length);
      std::vector<std::int32_t> windows(static_cast<std::size_t>(c.layers * W * c.topk), -1);
      for (std::size_t i = 0; i < windows.size(); ++i) {  // distinct within a window, -1 past the prompt
        const auto k = static_cast<std::int64_t>(i % static_cast<std::size_t>(c.topk));
        windows[i] = k < length ? static_cast<std::int32_t>(k) : -1;
      }
      o.warmup(id, windows, W);
      for (int l = 0; l < c.layers; ++l) {
        const auto buf = io().dump(o, l);
        for (std::int64_t t = std::max<std::int64_t>(0, length - c.query_tokens); t < length; ++t) {
          const std::int64_t p = static_cast<std::int64_t>(row) * rpr + c.slots + (t - (length - c.query_tokens));
          const auto want = entry_of(id, l, t, E);
          EXPECT_EQ(0, std::memcmp(buf.data() + o.buffer().rows.offset(p), want.data(), E))
              << "residency " << static_cast<int>(residency) << " request " << id << " layer " << l << " token " << t;
        }
      }
    }
  }
}

// A warm-up id outside the request's tokens is refused by name before anything changes, on both
// backends (the CUDA backend would otherwise look it up in the device page table unchecked).
TEST(OffloadWarmup, RefusesAnIdOutsideTheRequest) {
  ESS_REQUIRE_BACKEND(harness().info);
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 2;
  c.topk = 4;
  c.slots = 8;
  c.max_context = 128;
  c.backend = harness().backend;
  Offload o(c);
  o.admit(1, 40);
  std::vector<std::int32_t> windows = {0, 1, 2, -1, 3, 4, 5, 6};  // [layers 2][W 1][K 4]
  windows[6] = 40;                                                  // layer 1: one past the prompt
  const std::int64_t fills = o.stats().warmup_fills;
  EXPECT_THROW(
      {
        try {
          o.warmup(1, windows, 1);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("layer 1 window 0 position 2 selects token 40"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  EXPECT_EQ(o.stats().warmup_fills, fills);
  windows[6] = 39;
  o.warmup(1, windows, 1);  // the engine is still usable
  EXPECT_GT(o.stats().warmup_fills, fills);
}

// reset forgets the residency, not the host entries: the same ids miss again and still read
// exactly their tokens' entries.
TEST(OffloadReset, ForgetsResidencyKeepsHostEntries) {
  ESS_REQUIRE_BACKEND(harness().info);
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 2;
  c.topk = 32;
  c.slots = 64;
  c.max_context = 500;
  c.backend = harness().backend;
  Offload o(c);
  const std::size_t E = c.layout.bytes();
  StepIn in;
  in.layer = 1;
  in.batch = 1;
  in.rows = {o.admit(5, 300)};
  in.lengths = {300};
  for (std::int64_t t = 0; t < 300; ++t) {
    const auto e = entry_of(5, 1, t, E);
    std::memcpy(o.host_entry(5, 1, t).data(), e.data(), E);
  }
  for (int k = 0; k < 32; ++k) in.topk.push_back(9 * k + 1);
  const auto misses = [&] {
    const StepOut got = io().step(o, in);
    const std::vector<std::uint8_t> buf = io().dump(o, 1);
    for (int k = 0; k < 32; ++k) {
      const auto e = entry_of(5, 1, in.topk[static_cast<std::size_t>(k)], E);
      EXPECT_EQ(0, std::memcmp(buf.data() + o.buffer().rows.offset(got.physical[static_cast<std::size_t>(k)]), e.data(), E));
    }
    return got.counts[1];
  };
  EXPECT_EQ(misses(), 32);
  EXPECT_EQ(misses(), 0);
  o.reset(5);
  EXPECT_EQ(misses(), 32);
  EXPECT_EQ(o.length(5), 300);
  EXPECT_THROW(o.reset(6), Error);
}

}  // namespace ess::offload_test
