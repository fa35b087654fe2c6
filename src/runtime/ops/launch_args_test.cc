// The CUDA launchers' argument checks and launch geometry (launch_args.h), on
// the CPU: every launcher's valid arguments pass, and each invalid field is refused with a
// message naming it and its value. The launchers run exactly these checks before any CUDA
// call (their device tests confirm that the launcher refuses what the check refuses).
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>

#include "runtime/ops/launch_args.h"
#include "runtime/ops/split/split.h"
#include "testing/backend.h"

namespace ess::cuda {
namespace {

using test::device_pointer;

// `change` applied to a copy of `ok` is refused with a message containing `needle`.
template <typename Args>
void expect_refused(const Args& ok, const std::function<void(Args&)>& change, const std::string& needle) {
  Args a = ok;
  change(a);
  const std::string e = check_args(a);
  EXPECT_NE(e.find(needle), std::string::npos) << "message: '" << e << "', expected it to name '" << needle << "'";
}

TEST(LaunchArgs, FlashTrans) {
  EntryCopy ok;
  ok.src_base = device_pointer<const std::uint8_t>();
  ok.dst_base = device_pointer<std::uint8_t>();
  ok.src_offsets = ok.dst_offsets = device_pointer<const std::uint64_t>();
  ok.count = 10;
  EXPECT_EQ(check_args(ok), "");
  expect_refused<EntryCopy>(ok, [](auto& a) { a.count = -1; }, "count = -1");
  expect_refused<EntryCopy>(ok, [](auto& a) { a.entry_bytes = 650; }, "entry_bytes = 650");
  expect_refused<EntryCopy>(ok, [](auto& a) { a.src_base = nullptr; }, "src_base is null");
  expect_refused<EntryCopy>(ok, [](auto& a) { a.dst_offsets = nullptr; }, "dst_offsets is null");
  expect_refused<EntryCopy>(ok, [](auto& a) { a.dst_base += 8; }, "dst_base");
  expect_refused<EntryCopy>(ok, [](auto& a) { a.blocks = -2; }, "blocks = -2");
  expect_refused<EntryCopy>(ok, [](auto& a) { a.threads = 48; }, "threads = 48");
  expect_refused<EntryCopy>(ok, [](auto& a) { a.threads = 512; }, "threads = 512");
  EntryCopy empty;  // nothing to copy: no pointers needed
  EXPECT_EQ(check_args(empty), "");
}

TEST(LaunchArgs, FlashTransGridIsCappedAndSizedByTheWork) {
  EntryCopy c;
  c.entry_bytes = 656;  // 41 chunks
  c.count = 1;
  EXPECT_EQ(flashtrans_grid(c).blocks, 1);
  EXPECT_EQ(flashtrans_grid(c).threads, kFlashTransDefaultThreads);
  c.count = 1000000;
  EXPECT_EQ(flashtrans_grid(c).blocks, kFlashTransDefaultBlocks);
  c.blocks = 3;
  EXPECT_EQ(flashtrans_grid(c).blocks, 3);
  c.blocks = 100000;
  c.threads = 64;
  // 41e6 chunks over 64 x 8 per block: the cap is above the work.
  EXPECT_EQ(flashtrans_grid(c).blocks, 80079);
  EXPECT_EQ(flashtrans_grid(c).threads, 64);
  c.count = 0;
  EXPECT_EQ(flashtrans_grid(c).blocks, 1);
}

TEST(LaunchArgs, SparseMlaAndMerge) {
  SparseMlaArgs ok;
  ok.batch = 2;
  ok.heads = 128;
  ok.topk = 2048;
  ok.softmax_scale = 0.07f;
  ok.q = device_pointer<const std::uint16_t>();
  ok.kv = device_pointer<const std::uint8_t>();
  ok.kv_offsets = device_pointer<const std::uint64_t>();
  ok.indices = device_pointer<const std::int32_t>();
  ok.lse = device_pointer<float>();
  EXPECT_EQ(check_args(ok), "");
  expect_refused<SparseMlaArgs>(ok, [](auto& a) { a.heads = 96; }, "heads = 96");
  expect_refused<SparseMlaArgs>(ok, [](auto& a) { a.heads = 192; }, "heads = 192");
  expect_refused<SparseMlaArgs>(ok, [](auto& a) { a.topk = 0; }, "topk = 0");
  expect_refused<SparseMlaArgs>(ok, [](auto& a) { a.query_tokens = 0; }, "query_tokens = 0");
  expect_refused<SparseMlaArgs>(ok, [](auto& a) { a.softmax_scale = 0.0f; }, "softmax_scale = 0");
  expect_refused<SparseMlaArgs>(ok, [](auto& a) { a.softmax_scale = std::numeric_limits<float>::infinity(); }, "softmax_scale = inf");
  expect_refused<SparseMlaArgs>(ok, [](auto& a) { a.lse = nullptr; }, "lse is null");
  expect_refused<SparseMlaArgs>(ok, [](auto& a) { a.q = reinterpret_cast<const std::uint16_t*>(a.kv + 2); }, "q =");
  expect_refused<SparseMlaArgs>(ok, [](auto& a) { a.batch = -1; }, "batch = -1");
  expect_refused<SparseMlaArgs>(ok, [](auto& a) { a.batch = 1 << 30; }, "exceeds a grid");
  SparseMlaArgs none = ok;
  none.batch = 0;
  EXPECT_EQ(check_args(none), "");

  MergeArgs m;
  m.rows = 10;
  m.o_a = m.o_b = m.lse_a = m.lse_b = device_pointer<const float>();
  EXPECT_EQ(check_args(m), "");
  expect_refused<MergeArgs>(m, [](auto& a) { a.dim = 6; }, "dim = 6");
  expect_refused<MergeArgs>(m, [](auto& a) { a.lse_b = nullptr; }, "lse_b is null");
  expect_refused<MergeArgs>(m, [](auto& a) { a.out = device_pointer<std::uint16_t>() + 1; }, "out =");
}

// A batch with no keys (max_pages 0) is still checked: a bad pointer shows on the first call.
TEST(LaunchArgs, IndexerAndTopk) {
  IndexerArgs ok;
  ok.batch = 3;
  ok.query_tokens = 2;
  ok.q = device_pointer<const std::uint8_t>();
  ok.weights = device_pointer<const float>();
  ok.pages = device_pointer<const std::uint8_t>();
  ok.page_table = device_pointer<const std::int32_t>();
  ok.max_pages = 4;
  ok.lengths = device_pointer<const std::int32_t>();
  ok.logits = device_pointer<float>();
  ok.logits_stride = 256;
  EXPECT_EQ(check_args(ok), "");
  IndexerArgs no_keys;
  no_keys.batch = 1;
  no_keys.logits_stride = 64;
  EXPECT_EQ(no_keys.max_pages, 0);
  EXPECT_NE(check_args(no_keys).find("is null"), std::string::npos);
  expect_refused<IndexerArgs>(ok, [](auto& a) { a.heads = 40; }, "heads = 40");
  expect_refused<IndexerArgs>(ok, [](auto& a) { a.head_dim = 64; }, "head_dim = 64");
  expect_refused<IndexerArgs>(ok, [](auto& a) { a.batch = 70000; }, "batch = 70000");
  expect_refused<IndexerArgs>(ok, [](auto& a) { a.logits_stride = 0; }, "logits_stride = 0");
  expect_refused<IndexerArgs>(ok, [](auto& a) { a.page_table = nullptr; }, "page_table is null");
  expect_refused<IndexerArgs>(ok, [](auto& a) { a.pages += 4; }, "pages =");

  TopkArgs t;
  t.rows = 5;
  t.logits = device_pointer<const float>();
  t.lengths = device_pointer<const std::int32_t>();
  t.out = device_pointer<std::int32_t>();
  t.stride = 100;
  EXPECT_EQ(check_args(t), "");
  expect_refused<TopkArgs>(t, [](auto& a) { a.k = 0; }, "k = 0");
  expect_refused<TopkArgs>(t, [](auto& a) { a.k = 2049; }, "k = 2049");
  expect_refused<TopkArgs>(t, [](auto& a) { a.stride = 0; }, "stride = 0");
  expect_refused<TopkArgs>(t, [](auto& a) { a.out = nullptr; }, "out is null");
}

TEST(LaunchArgs, SwapEngineStepsFitTheEngine) {
  GpuSwapConfig c;
  c.rows = 4;
  c.layers = 2;
  c.slots = 6554;
  c.max_positions = 4096;
  EXPECT_EQ(check_args(c), "");
  GpuSwapConfig small = c;  // fewer slots than positions: steps come in query groups
  small.slots = 100;
  EXPECT_EQ(check_args(small), "");
  small.slots = 0;
  EXPECT_NE(check_args(small).find("slots 0"), std::string::npos);
  GpuSwapStep s;
  s.layer = 1;
  s.batch = 4;
  s.query_tokens = 2;
  s.topk = 2048;
  s.rows = s.ids = device_pointer<const std::int32_t>();
  s.slot_ids = s.fill_tokens = s.fill_slots = s.counts = device_pointer<std::int32_t>();
  EXPECT_EQ(check_args(c, s), "");
  auto refused = [&](const std::function<void(GpuSwapStep&)>& change, const std::string& needle) {
    GpuSwapStep x = s;
    change(x);
    EXPECT_NE(check_args(c, x).find(needle), std::string::npos) << check_args(c, x);
  };
  refused([](auto& x) { x.layer = 2; }, "layer 2 out of [0, 2)");
  refused([](auto& x) { x.batch = 5; }, "batch = 5");
  refused([](auto& x) { x.query_tokens = 3; }, "T 3 x K 2048 exceeds the 4096 positions");
  refused([](auto& x) { x.counts = nullptr; }, "counts is null");
  refused([](auto& x) { x.page_table = device_pointer<const std::int32_t>(); }, "fill_host_offsets");
  // The paper's pool (6,554 slots) with T x K = 4,096 fits a Hopper block's shared memory.
  EXPECT_LE(swap_step_smem_bytes(4096, 6554) + kSwapStepStaticSmemBound, kHopperSmemOptin);
  EXPECT_EQ(swap_hash_capacity(4096), 8192);
  EXPECT_EQ(swap_hash_capacity(41), 128);
  // MTP: T up to 4 at K up to 2048 with pools up to 32K slots fits, with the static part.
  for (int T = 1; T <= 4; ++T) {
    for (const int K : {64, 512, 2048}) {
      for (const std::int32_t S : {T * K, 6554, 16384, 32768}) {
        EXPECT_LE(swap_step_smem_bytes(T * K, S) + kSwapStepStaticSmemBound, kHopperSmemOptin)
            << "T " << T << " K " << K << " slots " << S;
      }
    }
  }
  EXPECT_EQ(swap_step_smem_bytes(8192, 6554), (2u * 16384 + 8192) * 4 + 6554);  // (2 H + P) x 4 + S
}

TEST(LaunchArgs, Split) {
  SplitArgs a;
  EXPECT_EQ(check_args(a), "");  // no requests
  a.batch = 2;
  a.positions = 8;
  EXPECT_NE(check_args(a).find("rows_per_request = 0"), std::string::npos);
  a.pool.rows_per_request = 16;
  a.buffer.row_stride = 656;
  a.rows = a.slot_ids = a.counts = a.fill_slots = device_pointer<const std::int32_t>();
  a.fill_host_offsets = device_pointer<const std::uint64_t>();
  a.miss_offsets = a.total = device_pointer<std::int64_t>();
  a.src_offsets = a.dst_offsets = device_pointer<std::uint64_t>();
  EXPECT_EQ(check_args(a), "");
  a.pool.region = device_pointer<const std::int32_t>();  // regions too small for the rows
  a.pool.region_blocks = 3;
  a.pool.block_rows = 5;
  EXPECT_NE(check_args(a).find("regions of 3 blocks of 5 rows cannot hold 16 rows per request"), std::string::npos) << check_args(a);
  a.pool.region_blocks = 4;
  EXPECT_EQ(check_args(a), "");
  a.pool = PoolRows{16};
  a.resident = device_pointer<std::int32_t>();
  EXPECT_NE(check_args(a).find("together"), std::string::npos);
  a.fetched = device_pointer<std::int32_t>();
  EXPECT_NE(check_args(a).find("flags"), std::string::npos);
  a.flags = device_pointer<std::uint8_t>();
  a.resident_count = a.fetched_count = device_pointer<std::int32_t>();
  a.query_tokens = 3;
  EXPECT_NE(check_args(a).find("positions = 8 is not a whole number of rows of query_tokens = 3"), std::string::npos);
  a.query_tokens = 2;
  EXPECT_EQ(check_args(a), "");
}

}  // namespace
}  // namespace ess::cuda
