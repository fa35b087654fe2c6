// Residency (OffloadConfig::residency; docs/architecture.md, "Residency") against an independent
// model, over seeded random admissions, growth, finishes, resets and memory pressure:
// - every step's rows hold exactly the host pool's entries of the ids (lossless), right after
//   every demotion and promotion as at any other step;
// - a whole request's ids map to its own rows (`slots` tokens per pool row it takes, the newest
//   in its reserved rows), with no LRU counts, nothing fetched, and no swap decision launched
//   for a step whose positions are all whole;
// - a sparse request's rows are the naive LRU's, and a demoted request's LRU is LRU-Warmup over
//   the query rows it selected while whole (the model records them independently);
// - the pool rows: each taken by one request, whole requests taking ceil(length / slots);
// - the policy: a demotion only when an admission or a growth finds no free row, promotions
//   only with the headroom left, none of either under a steady load.
// Included by both backends' tests (offload_host_test.cc; offload_test.cc, on the emulated CUDA
// target in CI).
#pragma once

#include <deque>
#include <map>

#include "runtime/offload/offload_cases.h"

namespace ess::offload_test {

// Expects `expr` to throw ess::Error whose message contains `text`.
#define ESS_EXPECT_ERROR(expr, text)                                      \
  do {                                                                    \
    const std::string ess_error_ = test::error_of([&] { (void)(expr); }); \
    EXPECT_NE(ess_error_.find(text), std::string::npos) << ess_error_;    \
  } while (0)

struct ResidencyModel {
  RequestId id = 0;
  std::int32_t row = 0;
  std::int64_t length = 0;
  bool whole = false;
  std::vector<test::NaiveLru> lru;                            // per layer, while sparse
  std::vector<std::deque<std::vector<std::int32_t>>> recorded;  // per layer: the last W query rows while whole
  std::vector<std::vector<std::int32_t>> prev;                 // per layer: the ids' locality state
};

class ResidencyRun {
 public:
  ResidencyRun(Residency residency, std::int32_t rows, std::uint32_t seed) : rng_(seed) {
    c_.layers = kLayers;
    c_.layout = test::small_layout();
    c_.max_requests = rows;
    c_.query_tokens = kT;
    c_.topk = kK;
    c_.slots = kSlots;
    c_.reserve_newest = true;
    c_.max_context = 400;
    c_.warmup_windows = kW;
    c_.demotion_windows = kRecorded;
    c_.residency = residency;
    c_.backend = harness().backend;
    o_ = std::make_unique<Offload>(c_);
  }

  static constexpr int kLayers = 2, kT = 2, kK = 8, kW = 4, kRecorded = 3;
  static constexpr std::int32_t kSlots = 24;

  Offload& offload() { return *o_; }
  std::map<RequestId, ResidencyModel>& requests() { return reqs_; }
  std::mt19937& rng() { return rng_; }

  // Admits `id` with a prompt of `length` tokens (at `row` when given), writes it, warms it up.
  void admit(RequestId id, std::int64_t length, std::int32_t row = -1) {
    const std::size_t E = c_.layout.bytes();
    ResidencyModel m;
    m.id = id;
    m.length = length;
    m.row = o_->admit(id, length, row);
    for (int l = 0; l < kLayers; ++l) {
      for (std::int64_t t = 0; t < length; ++t) {
        const auto e = entry_of(id, l, t, E);
        std::memcpy(o_->host_entry(id, l, t).data(), e.data(), E);
      }
      m.lru.emplace_back(kSlots);
      m.recorded.emplace_back();
      m.prev.emplace_back();
    }
    std::vector<std::int32_t> windows;  // [L][W][K]
    for (int l = 0; l < kLayers; ++l) {
      for (int w = 0; w < kW; ++w) {
        const auto v = test::decode_like_ids(m.prev[static_cast<std::size_t>(l)], 1, kK, length, 2, rng_);
        windows.insert(windows.end(), v.begin(), v.end());
      }
    }
    m.whole = o_->whole(id);
    for (int l = 0; l < kLayers; ++l) {
      for (int w = 0; w < kW; ++w) {
        const std::span<const std::int32_t> v(windows.data() + (static_cast<std::size_t>(l) * kW + w) * kK, kK);
        if (m.whole) {
          remember(m, l, v);
        } else {
          std::vector<std::pair<std::int32_t, std::int32_t>> fills;
          m.lru[static_cast<std::size_t>(l)].step(v, fills);
        }
      }
    }
    reqs_.emplace(id, std::move(m));
    o_->warmup(id, windows, kW);
    follow();
  }

  void release(RequestId id) {
    o_->release(id);
    reqs_.erase(id);
    follow();
  }

  void reset(RequestId id) {
    o_->reset(id);
    ResidencyModel& m = reqs_.at(id);
    for (auto& lru : m.lru) lru = test::NaiveLru(kSlots);
    for (auto& r : m.recorded) r.clear();
    follow();
  }

  // One decode step of every request: extend by T, the model's entries into the reserved rows,
  // each layer's step checked, then its write-back.
  void step() {
    const std::size_t E = c_.layout.bytes();
    const std::int32_t rpr = c_.rows_per_request();
    for (auto& [id, m] : reqs_) {
      o_->extend(id, kT);
      m.length += kT;
      follow();
    }
    for (auto& [id, m] : reqs_) {
      for (int l = 0; l < kLayers; ++l) {
        for (int t = 0; t < kT; ++t) io().write_row(*o_, l, m.row * rpr + kSlots + t, entry_of(id, l, m.length - kT + t, E));
      }
    }
    const std::int64_t launches = o_->stats().swap_launches;
    bool any_sparse = false;
    for (int l = 0; l < kLayers; ++l) {
      StepIn in;
      in.layer = l;
      in.split = true;
      for (auto& [id, m] : reqs_) {
        in.rows.push_back(m.row);
        in.lengths.push_back(static_cast<std::int32_t>(m.length));
        auto ids = test::decode_like_ids(m.prev[static_cast<std::size_t>(l)], kT, kK, m.length - kT, 3, rng_);
        if (rng_() % 2 == 0) ids[1] = static_cast<std::int32_t>(m.length - 1);  // a newest token too
        in.topk.insert(in.topk.end(), ids.begin(), ids.end());
        any_sparse |= !m.whole;
      }
      if (std::ssize(in.rows) < c_.max_requests) {  // a padded position
        in.rows.push_back(-1);
        in.lengths.push_back(0);
        in.topk.insert(in.topk.end(), static_cast<std::size_t>(kT) * kK, 5);
      }
      in.batch = static_cast<int>(in.rows.size());
      const StepOut got = io().step(*o_, in);
      check_step(l, in, got);
      io().write_back(*o_, l, in.rows, in.lengths, {});
    }
    EXPECT_EQ(o_->stats().swap_launches - launches, any_sparse ? kLayers : 0) << "swap decisions launched";
  }

  // The model follows the engine's residency changes (checked for the policy by the callers):
  // a request made whole forgets its LRU; a demoted one replays what it recorded.
  void follow() {
    std::set<std::int32_t> taken;
    for (auto& [id, m] : reqs_) {
      const bool whole = o_->whole(id);
      if (whole && !m.whole) {
        for (auto& r : m.recorded) r.clear();
      } else if (!whole && m.whole) {
        for (int l = 0; l < kLayers; ++l) {
          auto& lru = m.lru[static_cast<std::size_t>(l)];
          lru = test::NaiveLru(kSlots);
          std::vector<std::pair<std::int32_t, std::int32_t>> fills;
          for (const auto& w : m.recorded[static_cast<std::size_t>(l)]) lru.step(w, fills);
        }
      }
      m.whole = whole;
      const std::vector<std::int32_t> units = o_->whole_units(id);
      ASSERT_EQ(units.front(), m.row) << "request " << id;
      ASSERT_EQ(units.size(), whole ? static_cast<std::size_t>(c_.whole_rows(m.length)) : 1u) << "request " << id;
      for (const std::int32_t u : units) {
        ASSERT_TRUE(u >= 0 && u < c_.max_requests) << "request " << id << " row " << u;
        ASSERT_TRUE(taken.insert(u).second) << "row " << u << " taken twice";
      }
    }
    const OffloadStats st = o_->stats();
    ASSERT_EQ(st.requests, static_cast<std::int32_t>(reqs_.size()));
    ASSERT_EQ(st.whole_requests, std::count_if(reqs_.begin(), reqs_.end(), [](const auto& r) { return r.second.whole; }));
  }

  std::int32_t free_rows() const {
    std::int32_t used = 0;
    for (const auto& [id, m] : reqs_) used += static_cast<std::int32_t>(o_->whole_units(id).size());
    return c_.max_requests - used;
  }

 private:
  void remember(ResidencyModel& m, int layer, std::span<const std::int32_t> window) {
    auto& r = m.recorded[static_cast<std::size_t>(layer)];
    r.emplace_back(window.begin(), window.end());
    if (std::ssize(r) > kRecorded) r.pop_front();
  }

  void check_step(int layer, const StepIn& in, const StepOut& got) {
    const std::size_t E = c_.layout.bytes();
    const std::size_t P = static_cast<std::size_t>(kT) * kK;
    const std::int32_t rpr = c_.rows_per_request();
    const std::vector<std::uint8_t> buf = io().dump(*o_, layer);
    for (int b = 0; b < in.batch; ++b) {
      const auto bz = static_cast<std::size_t>(b);
      const std::span<const std::int32_t> ids(in.topk.data() + bz * P, P);
      const std::span<const std::int32_t> phys(got.physical.data() + bz * P, P);
      if (in.rows[bz] < 0) {
        ASSERT_TRUE(std::all_of(phys.begin(), phys.end(), [](std::int32_t p) { return p == -1; }));
        continue;
      }
      ResidencyModel& m =
          std::find_if(reqs_.begin(), reqs_.end(), [&](const auto& r) { return r.second.row == in.rows[bz]; })->second;
      SCOPED_TRACE(fmt::format("layer {} request {} ({})", layer, m.id, m.whole ? "whole" : "sparse"));
      const std::int64_t newest = m.length - kT;
      std::vector<std::int32_t> masked(ids.begin(), ids.end()), want(P, -1);
      for (std::size_t i = 0; i < P; ++i) {
        if (ids[i] >= newest) {
          want[i] = m.row * rpr + kSlots + static_cast<std::int32_t>(ids[i] - newest);
          masked[i] = -1;
        }
      }
      std::set<std::int32_t> fetched_slots;
      if (m.whole) {
        const std::vector<std::int32_t> units = o_->whole_units(m.id);
        for (std::size_t i = 0; i < P; ++i) {
          if (masked[i] >= 0) want[i] = units[static_cast<std::size_t>(masked[i] / kSlots)] * rpr + masked[i] % kSlots;
        }
        for (int t = 0; t < kT; ++t) remember(m, layer, std::span<const std::int32_t>(masked).subspan(static_cast<std::size_t>(t) * kK, kK));
        EXPECT_EQ(got.counts[2 * bz], 0);
        EXPECT_EQ(got.counts[2 * bz + 1], 0);
      } else {
        std::vector<std::pair<std::int32_t, std::int32_t>> fills;
        const std::vector<std::int32_t> slots = m.lru[static_cast<std::size_t>(layer)].step(masked, fills);
        std::set<std::int32_t> distinct;
        for (std::size_t i = 0; i < P; ++i) {
          if (masked[i] < 0) continue;
          want[i] = m.row * rpr + slots[i];
          distinct.insert(masked[i]);
        }
        for (const auto& f : fills) fetched_slots.insert(f.second);
        EXPECT_EQ(got.counts[2 * bz], static_cast<std::int32_t>(distinct.size() - fills.size()));
        EXPECT_EQ(got.counts[2 * bz + 1], static_cast<std::int32_t>(fills.size()));
      }
      ASSERT_TRUE(std::equal(phys.begin(), phys.end(), want.begin())) << "position " << b;
      for (std::size_t i = 0; i < P; ++i) {  // lossless
        if (ids[i] < 0) continue;
        const auto e = entry_of(m.id, layer, ids[i], E);
        ASSERT_EQ(0, std::memcmp(buf.data() + o_->buffer().rows.offset(phys[i]), e.data(), E))
            << "token " << ids[i] << " row " << phys[i];
      }
      // The DA halves: a whole request reads every row in place.
      expect_halves(got, bz, kT, kK, phys, [&](std::int32_t p) { return !m.whole && fetched_slots.contains(p - m.row * rpr); });
    }
  }

  OffloadConfig c_;
  std::unique_ptr<Offload> o_;
  std::mt19937 rng_;
  std::map<RequestId, ResidencyModel> reqs_;
};

TEST(OffloadResidency, RandomLoadsStayLosslessAndFollowTheModel) {
  ESS_REQUIRE_BACKEND(harness().info);
  // (Two seeds on the CUDA backend, which CI runs on the emulated target in three stream orders.)
  const std::vector<std::uint32_t> seeds = harness().backend == Backend::kCpu ? std::vector<std::uint32_t>{1, 2, 3, 4}
                                                                              : std::vector<std::uint32_t>{1, 2};
  for (const std::uint32_t seed : seeds) {
    SCOPED_TRACE(fmt::format("seed {}", seed));
    ResidencyRun run(Residency::kAdaptive, 10, seed);
    std::mt19937& rng = run.rng();
    RequestId next = 0;
    std::int64_t demotions = 0, promotions = 0;
    for (int op = 0; op < 120; ++op) {
      // The load rises and falls by turns: admissions, then finishes, dominate.
      const bool rising = (op / 20) % 2 == 0;
      const auto r = rng() % 20;
      auto& reqs = run.requests();
      const bool room = static_cast<std::int32_t>(reqs.size()) < 10;
      if (r < (rising ? 8u : 1u) && room) {
        run.admit(next++, 10 + static_cast<std::int64_t>(rng() % 90));
      } else if (r < 9 && !reqs.empty()) {
        run.release(std::next(reqs.begin(), static_cast<std::ptrdiff_t>(rng() % reqs.size()))->first);
      } else if (r < 10 && !reqs.empty()) {
        run.reset(std::next(reqs.begin(), static_cast<std::ptrdiff_t>(rng() % reqs.size()))->first);
      } else if (!reqs.empty() && std::all_of(reqs.begin(), reqs.end(), [](const auto& q) { return q.second.length < 380; })) {
        run.step();
      }
      if (HasFatalFailure()) return;
      demotions = run.offload().stats().demotions;
      promotions = run.offload().stats().promotions;
    }
    EXPECT_GT(demotions, 0) << "the load never pressed the rows";
    EXPECT_GT(promotions, 0) << "no release ever made room";
  }
}

TEST(OffloadResidency, AWholeBatchRunsNoSwapAndReadsInPlace) {
  ESS_REQUIRE_BACKEND(harness().info);
  ResidencyRun run(Residency::kWhole, 12, 7);
  run.admit(1, 100);  // 5 rows
  run.admit(2, 30);   // 2 rows
  for (int s = 0; s < 6; ++s) run.step();
  const OffloadStats st = run.offload().stats();
  EXPECT_EQ(st.swap_launches, 0);
  EXPECT_EQ(st.whole_requests, 2);
  EXPECT_EQ(st.warmup_fills, 0);
  if (harness().backend == Backend::kCpu) {  // the CUDA backend counts these on the device only
    EXPECT_EQ(st.misses, 0);
    EXPECT_EQ(st.sparse_steps, 0);
    EXPECT_EQ(st.whole_steps, 6 * ResidencyRun::kLayers * 2);
  }
}

TEST(OffloadResidency, WholeRefusesWhatDoesNotFitAndChangesNothing) {
  ESS_REQUIRE_BACKEND(harness().info);
  ResidencyRun run(Residency::kWhole, 6, 7);
  run.admit(1, 100);  // 5 of the 6 rows
  Offload& o = run.offload();
  const std::uint64_t used = o.host_pool().used_bytes();
  ESS_EXPECT_ERROR(o.admit(2, 30), "whole residency of 30 tokens needs 2 pool rows, 1 are free");
  EXPECT_EQ(o.host_pool().used_bytes(), used);
  EXPECT_EQ(o.stats().requests, 1);
  // Growth past the rows: refused before the host pool grows.
  run.admit(3, 20);  // the last row
  ESS_EXPECT_ERROR(o.extend(3, 10), "extend of request 3 to 30 tokens: whole residency needs 1 more pool rows, 0 are free");
  EXPECT_EQ(o.length(3), 20);
  // A whole position's ids are checked as a sparse one's: refused by name, nothing recorded or counted
  // (the CPU backend's; the CUDA backend, which cannot check without synchronizing, reads them as padding).
  if (harness().backend == Backend::kCpu) {
    std::vector<std::int32_t> rows{o.row(1)}, lengths{100}, ids(static_cast<std::size_t>(ResidencyRun::kT) * ResidencyRun::kK, -1),
        physical(ids.size());
    LayerStep st;
    st.batch = 1;
    st.rows = rows.data();
    st.topk = ids.data();
    st.lengths = lengths.data();
    st.physical = physical.data();
    const std::int64_t whole_steps = o.stats().whole_steps;
    ids[3] = 100;
    ESS_EXPECT_ERROR(o.step(st), "position 0 (request 1) query token 0 selects token 100, outside [0, 100)");
    ids[3] = 7;
    ids[ResidencyRun::kK + 1] = 9;
    ids[ResidencyRun::kK + 2] = 9;
    ESS_EXPECT_ERROR(o.step(st), "position 0 query token 1 selects token 9 twice");
    EXPECT_EQ(o.stats().whole_steps, whole_steps);
  }
  // A row another whole request borrows is not handed out by number.
  const std::int32_t borrowed = o.whole_units(1).back();
  o.release(3);
  ESS_EXPECT_ERROR(o.admit(4, 10, borrowed), fmt::format("row {} is borrowed by the whole request 1", borrowed));
}

TEST(OffloadResidency, ConfigurationNeedsTheReservedRows) {
  ESS_REQUIRE_BACKEND(harness().info);
  OffloadConfig c;
  c.layers = 1;
  c.layout = test::small_layout();
  c.max_requests = 2;
  c.topk = 8;
  c.slots = 8;
  c.max_context = 64;
  c.residency = Residency::kAdaptive;
  c.backend = harness().backend;
  ESS_EXPECT_ERROR(Offload(c), "residency adaptive needs reserve_newest");
  c.reserve_newest = true;
  c.whole_headroom = 3;
  ESS_EXPECT_ERROR(Offload(c), "whole_headroom = 3 must be in [0, max_requests = 2]");
}

// A load that rises from one request past the memory wall and falls back: requests are whole
// until the rows run out, demoted as admissions need rows (the one borrowing most first), and
// whole again once releases leave room beyond the headroom; never a demotion while a row is free.
TEST(OffloadResidency, RiseAndFallDemotesOnlyUnderPressureAndPromotesBack) {
  ESS_REQUIRE_BACKEND(harness().info);
  ResidencyRun run(Residency::kAdaptive, 12, 11);
  Offload& o = run.offload();
  for (RequestId id = 0; id < 8; ++id) {
    const std::int32_t free_before = run.free_rows();
    const std::int64_t demoted = o.stats().demotions;
    run.admit(id, 70);  // 3 rows whole
    if (free_before > 0) {
      EXPECT_EQ(o.stats().demotions, demoted) << "demoted with a free row, admitting " << id;
    }
    run.step();
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(o.stats().requests, 8);
  EXPECT_GT(o.stats().demotions, 0);
  EXPECT_LT(o.stats().whole_requests, 8);
  for (RequestId id = 0; id < 7; ++id) {
    run.release(id);
    run.step();
    if (HasFatalFailure()) return;
  }
  EXPECT_TRUE(o.whole(7)) << "the last request is whole again";
  EXPECT_GT(o.stats().promotions, 0);
}

TEST(OffloadResidency, ASteadyLoadNeitherDemotesNorFlaps) {
  ESS_REQUIRE_BACKEND(harness().info);
  ResidencyRun run(Residency::kAdaptive, 12, 5);
  Offload& o = run.offload();
  RequestId next = 0;
  for (; next < 7; ++next) run.admit(next, 50);  // up to the wall
  const std::int64_t demoted = o.stats().demotions;
  EXPECT_GT(demoted, 0) << "the ramp never reached the wall";
  for (int cycle = 0; cycle < 40; ++cycle) {
    run.release(run.requests().begin()->first);  // the oldest finishes
    run.admit(next++, 50);                       // a new one arrives
    run.step();
    if (HasFatalFailure()) return;
  }
  // No demotion, so no request went whole -> sparse -> whole.
  EXPECT_EQ(o.stats().demotions, demoted) << "demotions under a steady load";
  EXPECT_GT(o.stats().whole_requests, 0);
}

}  // namespace ess::offload_test
