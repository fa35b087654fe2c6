// The per-layer step on the CPU backend: the cases of offload_cases.h (the same the CUDA
// backend runs in offload_test.cc), and what only the CPU backend promises: invalid input is
// refused by name with every state unchanged.
#include <gtest/gtest.h>

#include <cstring>
#include <deque>

#include "ess/core/digest.h"
#include "offload_cases.h"
#include "offload_residency_cases.h"
#include "testing/testing.h"

namespace ess::offload_test {
namespace {

std::uint8_t* cpu_allocate(std::size_t bytes) {
  static std::deque<std::vector<std::uint8_t>> keep;
  keep.emplace_back(bytes + 16, std::uint8_t{0});
  auto* p = keep.back().data();
  return p + (16 - reinterpret_cast<std::uintptr_t>(p) % 16) % 16;
}

bool always() { return true; }

// Every state of an Offload that a refused call must leave alone: the rows of every layer's
// buffer, the host pool's entries of the admitted requests, lengths and rows.
std::uint64_t digest(const Offload& o, const std::vector<RequestId>& ids) {
  // The host pool digest covers reference counts and the prefix cache.
  const std::uint64_t pool = o.host_pool().digest();
  Digest d;
  for (int l = 0; l < o.config().layers; ++l) {
    const auto buf = io().dump(o, l);
    d.bytes(buf.data(), buf.size());
  }
  for (const RequestId id : ids) {
    d.value(o.row(id));
    d.value(o.length(id));
    for (int l = 0; l < o.config().layers; ++l) {
      for (std::int64_t t = 0; t < o.length(id); ++t) {
        const auto e = o.host_pool().entry(id, l, t);
        d.bytes(e.data(), e.size());
      }
    }
  }
  const OffloadStats st = o.stats();
  d.value(st.steps);
  d.value(st.hits);
  d.value(st.misses);
  d.value(pool);
  return d.get();
}

// Two layers of the small layout, 3 rows, MTP 2 of top-4 into 8 slots and the reserved rows.
OffloadConfig mtp2_config(std::int64_t max_context) {
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 3;
  c.query_tokens = 2;
  c.topk = 4;
  c.slots = 8;
  c.reserve_newest = true;
  c.max_context = max_context;
  return c;
}

TEST(OffloadCpu, BadInputIsRefusedByNameAndChangesNothing) {
  const OffloadConfig c = mtp2_config(300);
  Offload o(c);
  const std::vector<RequestId> ids = {5, 6};
  for (const RequestId id : ids) {
    o.admit(id, 100);
    write_entries(o, id, 0, 100);
  }
  std::vector<std::int32_t> phys(16);
  const auto step_with = [&](std::vector<std::int32_t> rows, std::vector<std::int32_t> topk, std::vector<std::int32_t> lengths,
                             int layer = 0) {
    LayerStep s;
    s.layer = layer;
    s.batch = static_cast<int>(rows.size());
    s.rows = rows.data();
    s.topk = topk.data();
    s.lengths = lengths.data();
    s.physical = phys.data();
    o.step(s);
  };
  const std::vector<std::int32_t> good = {1, 2, 3, 4, 5, 6, 7, 99};
  step_with({o.row(5)}, good, {100});  // a valid step first, so the LRU has state
  const std::uint64_t before = digest(o, ids);
  const auto refused = [&](const std::function<void()>& f, const std::string& needle) {
    const std::string e = test::error_of(f);
    EXPECT_NE(e.find(needle), std::string::npos) << e;
    EXPECT_EQ(digest(o, ids), before) << "after: " << e;
  };
  refused([&] { step_with({o.row(5)}, {1, 2, 3, 4, 5, 6, 7, 100}, {100}); }, "100");            // past the length
  refused([&] { step_with({o.row(5)}, {1, 1, 3, 4, 5, 6, 7, 8}, {100}); }, "twice");            // a duplicate
  refused([&] { step_with({o.row(5)}, {1, 2, 3, 4, 99, 99, 7, 8}, {100}); }, "twice");          // a duplicate newest
  refused([&] { step_with({o.row(5)}, good, {101}); }, "length 101");                            // a stale length
  refused([&] { step_with({2}, good, {100}); }, "row 2, which holds no request");                 // an empty row
  refused([&] { step_with({7}, good, {100}); }, "row 7, outside [0, 3)");                       // no such row
  refused([&] { step_with({o.row(5), o.row(5)}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, {100, 100}); },
          "5");                                                                                   // a request twice
  refused([&] { step_with({o.row(5)}, good, {100}, 2); }, "layer 2 outside [0, 2)");
  refused([&] { LayerStep s; s.batch = 1; o.step(s); }, "rows, topk, lengths and physical are required");
  refused(
      [&] {
        std::vector<std::int32_t> rows = {o.row(5)}, topk = good, lengths = {100};
        LayerStep s;
        s.batch = 1;
        s.rows = rows.data();
        s.topk = topk.data();
        s.lengths = lengths.data();
        s.physical = phys.data();
        s.copy_stream = reinterpret_cast<cuda::Stream>(std::uintptr_t{1});
        o.step(s);
      },
      "copy_stream and copy_done go together");
  refused(
      [&] {
        std::vector<std::int32_t> rows = {o.row(5)}, topk = good, lengths = {100};
        LayerStep s;
        s.batch = 1;
        s.rows = rows.data();
        s.topk = topk.data();
        s.lengths = lengths.data();
        s.physical = phys.data();
        s.query_begin = 1;
        s.query_end = 1;
        o.step(s);
      },
      "query group [1, 1) is not a non-empty range of the 2 query tokens");
  refused([&] {
    const std::vector<std::int32_t> rows = {o.row(5)}, topk = {1, 2, 3, 4, 5, 6, 7, 100}, lengths = {100};
    (void)o.query_groups(1, rows.data(), topk.data(), lengths.data());
  }, "position 0 query token 1 selects token 100, outside [0, 100)");
  refused([&] { o.admit(5, 10); }, "already admitted");
  refused([&] { o.admit(8, 301); }, "prompt length 301");
  refused([&] { o.admit(8, 10, o.row(5)); }, "holds request 5");                                 // a taken row
  refused([&] { o.admit(8, 10, 3); }, "row 3 outside [0, 3)");
  refused([&] { o.admit(8, 10, -2); }, "row -2 must be -1");
  refused([&] { o.extend(6, 201); }, "exceeds max_context");
  refused([&] { o.extend(6, std::numeric_limits<std::int64_t>::max()); }, "exceeds max_context");  // no overflow
  refused([&] { o.truncate(6, 97); }, "to 97 tokens: outside [98, 100]");
  refused([&] { o.truncate(6, 101); }, "outside [98, 100]");
  refused([&] { o.truncate(42, 1); }, "not admitted");
  refused([&] { o.release(99); }, "not admitted");
  refused([&] { o.warmup(5, std::vector<std::int32_t>(7), 1); }, "7 ids");
  refused([&] { (void)o.read_row(0, 3 * o.rows_per_request()); }, "outside");
  std::vector<std::int32_t> wb_rows = {o.row(6)}, wb_len = {99};
  refused([&] { WriteBack w; w.batch = 1; w.rows = wb_rows.data(); w.lengths = wb_len.data(); o.write_back(w); },
          "has length 99");
  // A third request fits, a fourth does not; releasing frees the row.
  o.admit(8, 10);
  EXPECT_NE(test::error_of([&] { o.admit(9, 10); }).find("all 3 rows are taken"), std::string::npos);
  const std::int32_t freed = o.row(8);
  o.release(8);
  EXPECT_EQ(o.admit(9, 10), freed);
  // The engine's own row numbers: a chosen free row is the request's.
  o.release(9);
  EXPECT_EQ(o.admit(10, 10, freed), freed);
  EXPECT_EQ(o.row(10), freed);
}

// Regions: the engine and its placements refused by name, changing nothing (the rows each
// request's slots lie in included); a released request's blocks serve the next one.
TEST(OffloadCpu, RegionsRefuseBadPlacementsByNameAndChangeNothing) {
  OffloadConfig c = mtp2_config(300);  // 8 slots + 2 reserved rows: a region of 3 blocks of 4 rows
  c.region_blocks = 3;
  const std::size_t E = c.layout.bytes();
  const auto paged = [&](std::int64_t blocks, std::int64_t block_rows) {
    LatentBuffer b;
    b.rows = RowLayout{E, block_rows, static_cast<std::uint64_t>(block_rows) * E + 32};
    b.blocks = blocks;
    for (int l = 0; l < c.layers; ++l) b.layer_base.push_back(cpu_allocate(static_cast<std::size_t>(blocks) * b.rows.block_stride));
    return b;
  };
  const auto made = [&](OffloadConfig cc, LatentBuffer b) { return test::error_of([&] { Offload o(cc, std::move(b)); }); };
  EXPECT_NE(made(c, {}).find("regions (region_blocks = 3) need the caller's paged buffer"), std::string::npos);
  EXPECT_NE(made(c, paged(12, 3)).find("10 rows per request (slots 8 + reserved 2) do not fit a region of 3 blocks of 3 rows"),
            std::string::npos);
  EXPECT_NE(made(c, paged(0, 4)).find("block_rows = 4 and blocks = 0 must be positive"), std::string::npos);
  OffloadConfig gaps = c;
  gaps.region_group = {1, 1};
  EXPECT_NE(made(gaps, paged(12, 4)).find("region_group has no layer in group 0"), std::string::npos);
  gaps.region_group = {0};
  EXPECT_NE(made(gaps, paged(12, 4)).find("region_group has 1 values: one per layer (2)"), std::string::npos);
  OffloadConfig whole = c;
  whole.residency = Residency::kAdaptive;
  EXPECT_NE(made(whole, paged(12, 4)).find("residency adaptive with regions"), std::string::npos) << made(whole, paged(12, 4));

  Offload o(c, paged(12, 4));
  const std::vector<RequestId> ids = {5, 6};
  for (const RequestId id : ids) {
    o.admit(id, 100);
    write_entries(o, id, 0, 100);
  }
  // Before its placement a request has no rows: warmup and steps refuse it by name.
  EXPECT_EQ(o.buffer_row(0, o.row(5), 0), -1);
  EXPECT_NE(test::error_of([&] { o.warmup(5, {}, 0); }).find("warmup of request 5 (row 0): it has no region yet"), std::string::npos);
  std::vector<std::int32_t> phys(8), rows = {o.row(5)}, topk = {1, 2, 3, 4, 5, 6, 7, 99}, lengths = {100};
  LayerStep s;
  s.batch = 1;
  s.rows = rows.data();
  s.topk = topk.data();
  s.lengths = lengths.data();
  s.physical = phys.data();
  EXPECT_NE(test::error_of([&] { o.step(s); }).find("position 0 (request 5) has no region (place it first)"), std::string::npos);
  o.place(5, std::vector<std::int32_t>{7, 2, 9});
  o.place(6, std::vector<std::int32_t>{0, 11, 4});
  o.warmup(5, {}, 0);
  o.warmup(6, {}, 0);
  EXPECT_EQ(o.buffer_row(0, o.row(5), 0), 28);      // block 7, row 0
  EXPECT_EQ(o.buffer_row(0, o.row(5), 9), 9 * 4 + 1);  // the second reserved row: the third block (9), row 1
  o.step(s);
  EXPECT_EQ(phys[0], 28);      // token 1, the first selected: slot 0, block 7 row 0
  EXPECT_EQ(phys[4], 2 * 4);   // token 5: slot 4, the second block (2), row 0
  EXPECT_EQ(phys[7], 37);      // token 99, the newest: the second reserved row
  const auto placements = [&] {
    std::vector<std::int32_t> v;
    for (const RequestId id : ids) {
      for (std::int32_t k = 0; k < o.rows_per_request(); ++k) v.push_back(o.buffer_row(0, o.row(id), k));
    }
    return v;
  };
  const std::uint64_t before = digest(o, ids);
  const std::vector<std::int32_t> rows_before = placements();
  const auto refused = [&](std::vector<std::int32_t> blocks, RequestId id, const std::string& needle) {
    const std::string e = test::error_of([&] { o.place(id, blocks); });
    EXPECT_NE(e.find(needle), std::string::npos) << e;
    EXPECT_EQ(digest(o, ids), before) << "after: " << e;
    EXPECT_EQ(placements(), rows_before) << "after: " << e;
  };
  refused({1, 3}, 5, "2 blocks for 1 region group(s) of 3");
  refused({1, 3, 12}, 5, "block 2 of its region is 12, outside [0, 12)");
  refused({1, -1, 3}, 5, "block 1 of its region is -1");
  refused({1, 3, 1}, 5, "block 1 is named twice (0 and 2 of its region)");
  refused({1, 11, 3}, 5, "block 11 (1 of its region) lies in the region of request 6 (row 1)");
  refused({1, 3, 5}, 8, "place of request 8: not admitted");
  // Its own blocks again, in another order: a new region, the LRU forgotten.
  o.place(5, std::vector<std::int32_t>{9, 7, 2});
  EXPECT_EQ(o.buffer_row(0, o.row(5), 0), 36);
  // A released request's blocks are free: the next request is placed on them.
  o.release(6);
  o.admit(8, 50);
  o.place(8, std::vector<std::int32_t>{4, 0, 11});
  EXPECT_EQ(o.buffer_row(0, o.row(8), 4), 0);
  OffloadConfig flat = mtp2_config(300);
  Offload unpaged(flat);
  unpaged.admit(1, 10);
  EXPECT_NE(test::error_of([&] { unpaged.place(1, std::vector<std::int32_t>{0}); }).find("the engine has no regions"),
            std::string::npos);
}

// A step whose query tokens select more distinct ids than the slots is refused whole, changing
// nothing; its query groups run.
TEST(OffloadCpu, AWholeStepLargerThanThePoolIsRefusedItsGroupsRun) {
  OffloadConfig c;
  c.layers = 1;
  c.layout = test::small_layout();
  c.max_requests = 2;
  c.query_tokens = 2;
  c.topk = 4;
  c.slots = 5;
  c.max_context = 100;
  Offload o(c);
  o.admit(3, 50);
  const std::vector<std::int32_t> rows = {o.row(3)}, lengths = {50};
  const std::vector<std::int32_t> topk = {0, 1, 2, 3, 3, 4, 5, 6};  // 7 distinct ids
  std::vector<std::int32_t> phys(8, -7);
  LayerStep s;
  s.batch = 1;
  s.rows = rows.data();
  s.topk = topk.data();
  s.lengths = lengths.data();
  s.physical = phys.data();
  const std::uint64_t before = digest(o, {3});
  const std::string e = test::error_of([&] { o.step(s); });
  EXPECT_NE(e.find("its 2 query tokens select 7 distinct ids, more than its 5 slots"), std::string::npos) << e;
  EXPECT_EQ(digest(o, {3}), before);
  EXPECT_EQ(o.query_groups(1, rows.data(), topk.data(), lengths.data()), (std::vector<int>{0, 1, 2}));
  s.query_begin = 0;
  s.query_end = 1;
  o.step(s);
  EXPECT_EQ(phys[4], -1);  // outside the group: padding
  s.query_begin = 1;
  s.query_end = 2;
  o.step(s);
  EXPECT_EQ(phys[0], -1);
  for (int k = 4; k < 8; ++k) EXPECT_GE(phys[static_cast<std::size_t>(k)], 0);
  EXPECT_EQ(o.stats().misses, 4 + 3);  // token 3 stayed resident across the groups
}

// The pages holding a request's last T tokens are never shared, so the write-back of a fully
// shared prompt's last tokens lands in the request's own pages; a stale length is refused.
TEST(OffloadCpu, TheLastQueryTokensPagesAreNeverShared) {
  const OffloadConfig c = mtp2_config(400);
  Offload o(c);
  std::vector<std::int32_t> prompt(128);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(i);
  o.admit(1, 128);
  EXPECT_EQ(o.publish(1, prompt), 1);  // page 1 holds tokens 126, 127: not published
  o.admit_shared(2, 128, 1, 128);
  EXPECT_EQ(o.host_pool().usage(2).shared_pages, 2);  // page 0 of each layer
  EXPECT_EQ(o.admit_cached(3, prompt).reused_tokens, 64);
  const std::vector<std::int32_t> rows = {o.row(2)}, lengths = {128};
  WriteBack w;
  w.batch = 1;
  w.rows = rows.data();
  w.lengths = lengths.data();
  o.write_back(w);  // tokens 126, 127 from the reserved rows: the request's own page
  const std::vector<std::int32_t> ids = {0, 1, 2, 3, 4, 5, 6, 7}, stale = {129};
  const std::uint64_t before = digest(o, {1, 2, 3});
  EXPECT_NE(test::error_of([&] { (void)o.query_groups(1, rows.data(), ids.data(), stale.data()); })
                .find("has length 129, the request holds 128"),
            std::string::npos);
  EXPECT_EQ(digest(o, {1, 2, 3}), before);
}

// An engine's own host memory: the allocator hands out one region of a buffer the engine
// owns; the host pool lives there and goes back to it when the Offload goes.
class EngineArena final : public HostAllocator {
 public:
  explicit EngineArena(std::size_t bytes) : storage_(bytes + 4096) {}
  HostBlock allocate(std::size_t bytes, HostMemoryKind) override {
    auto* p = storage_.data() + (4096 - reinterpret_cast<std::uintptr_t>(storage_.data()) % 4096) % 4096;
    if (given_ || bytes > storage_.size() - 4096) return {};
    given_ = true;
    ++allocations;
    return {p, give_less ? bytes - 4096 : bytes, HostMemoryKind::kAligned};
  }
  void deallocate(const HostBlock&) noexcept override {
    given_ = false;
    ++deallocations;
  }
  bool contains(const std::uint8_t* p) const { return p >= storage_.data() && p < storage_.data() + storage_.size(); }
  int allocations = 0, deallocations = 0;
  bool give_less = false;

 private:
  std::vector<std::uint8_t> storage_;
  bool given_ = false;
};

TEST(OffloadCpu, HostPoolLivesInTheEnginesMemory) {
  OffloadConfig c;
  c.layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 2;
  c.topk = 8;
  c.slots = 16;
  c.max_context = 256;
  EngineArena arena(2u << 20);
  {
    Offload o(c, {}, arena);
    EXPECT_EQ(arena.allocations, 1);
    o.admit(3, 100);
    EXPECT_TRUE(arena.contains(o.host_entry(3, 1, 99).data()));
    EXPECT_EQ(o.host_pool().memory_kind(), HostMemoryKind::kAligned);
  }
  EXPECT_EQ(arena.deallocations, 1);
  // Too small a pool for the configuration, or a short block: refused by name, nothing kept.
  EngineArena small(4096);
  EXPECT_NE(test::error_of([&] { Offload o(c, {}, small); }).find("cannot allocate"), std::string::npos);
  arena.give_less = true;
  EXPECT_NE(test::error_of([&] { Offload o(c, {}, arena); }).find("host allocator: asked for"), std::string::npos);
  EXPECT_EQ(arena.deallocations, 2);  // the short block went back
  // The CUDA backend reads the pool zero-copy: ordinary memory is refused by name.
  c.backend = Backend::kCuda;
  arena.give_less = false;
  if (cuda_backend_built() && cuda_device_present()) {
    EXPECT_NE(test::error_of([&] { Offload o(c, {}, arena); }).find("needs it pinned and mapped"), std::string::npos);
  }
}

TEST(OffloadCpu, ConfigurationErrorsNameTheField) {
  OffloadConfig c;
  c.layers = 2;
  c.max_requests = 2;
  c.query_tokens = 2;
  c.topk = 2048;
  c.slots = 2000;
  c.max_context = 32768;
  EXPECT_NE(test::error_of([&] { Offload o(c); }).find("2000 slots per request-layer cannot hold one query token's top-k"),
            std::string::npos);
  c.slots = 2048;  // below T x K: steps that select more run in query groups
  c.backend = Backend::kCuda;
  if (!cuda_backend_built()) {
    EXPECT_NE(test::error_of([&] { Offload o(c); }).find("CUDA backend is not part of this build"), std::string::npos);
  } else {
    // A device that is not there is the machine's failure (the CLI's exit status 3), not a bad argument.
    c.device = 99;
    EXPECT_THROW({ Offload o(c); }, DeviceError);
    c.device = 0;
  }
  c.backend = Backend::kCpu;
  LatentBuffer b;
  b.layer_base = {nullptr};
  EXPECT_NE(test::error_of([&] { Offload o(c, b); }).find("1 layer buffers for 2 layers"), std::string::npos);
  b.rows.row_stride = 100;
  b.layer_base = {};
  EXPECT_NE(test::error_of([&] { Offload o(c, b); }).find("row_stride = 100"), std::string::npos);
  c.max_requests = 1 << 14;  // the default pool: 2^25 pages x 2^14 requests x 2^10 layers x 41,984 B > 2^64
  c.layers = 1 << 10;
  c.max_context = std::numeric_limits<std::int32_t>::max();
  const std::string huge = test::error_of([&] { Offload o(c); });
  EXPECT_NE(huge.find("beyond 64 bits of bytes; pass host_bytes"), std::string::npos) << huge;
}

TEST(OffloadCpu, TruncateNeedsTheNewestOutsideTheLru) {
  OffloadConfig c = mtp2_config(300);
  c.reserve_newest = false;
  Offload o(c);
  o.admit(1, 50);
  o.extend(1, 2);
  EXPECT_NE(test::error_of([&] { o.truncate(1, 51); }).find("needs reserve_newest"), std::string::npos);
  EXPECT_EQ(o.length(1), 52);
  Offload r(mtp2_config(300));
  r.admit(1, 50);
  r.extend(1, 2);
  r.truncate(1, 51);  // one of the two accepted
  EXPECT_EQ(r.length(1), 51);
  r.extend(1, 2);
  EXPECT_EQ(r.length(1), 53);
}

}  // namespace

const OffloadHarness& harness() {
  static const OffloadHarness h{{"cpu", always}, Backend::kCpu, cpu_allocate};
  return h;
}

}  // namespace ess::offload_test
