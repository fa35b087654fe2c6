#include "ess/cache/total_pool.h"

#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>

#include "ess/core/error.h"
#include "ess/runtime/backend.h"
#include "testing/cache_fixtures.h"
#include "testing/testing.h"

namespace ess {
namespace {

using test::error_of;

TEST(TotalPool, PagesAndAccounting) {
  const LatentLayout layout;  // 656 B
  const std::uint64_t page = 64 * 656;
  TotalPool pool(3, layout, 10 * page + 100);  // whole pages of every layer: 9
  EXPECT_EQ(pool.page_bytes(), page);
  EXPECT_EQ(pool.capacity_pages(), 9);
  EXPECT_EQ(pool.pages_per_layer(), 3);
  EXPECT_EQ(pool.capacity_bytes(), 9 * page);
  EXPECT_EQ(pool.free_pages(), 9);
  EXPECT_EQ(pool.memory_kind() == HostMemoryKind::kPinned, cuda_device_present());

  pool.admit(7, 65);  // 2 pages per layer
  const TotalPoolUsage u = pool.usage(7);
  EXPECT_EQ(u.length, 65);
  EXPECT_EQ(u.pages, 6);
  EXPECT_EQ(u.bytes, 6 * page);
  EXPECT_EQ(u.entry_bytes, 65u * 3u * 656u);
  EXPECT_EQ(pool.free_pages(), 3);
  EXPECT_EQ(pool.used_bytes(), 6 * page);

  pool.extend(7, 63);  // 128 tokens: still 2 pages per layer
  EXPECT_EQ(pool.free_pages(), 3);
  EXPECT_EQ(pool.length(7), 128);
  pool.extend(7, 1);  // 129: a third page per layer
  EXPECT_EQ(pool.free_pages(), 0);
  pool.release(7);
  EXPECT_EQ(pool.free_pages(), 9);
  EXPECT_FALSE(pool.contains(7));
}

TEST(TotalPool, EntriesLiveInTheirPagesAndStartZeroed) {
  TotalPool pool(2, test::small_layout(), 8 * 64 * 144);
  pool.admit(1, 100);
  pool.admit(2, 10);
  for (int l = 0; l < 2; ++l) {
    for (std::int64_t t = 0; t < 100; ++t) {
      for (std::uint8_t b : pool.entry(1, l, t)) ASSERT_EQ(b, 0);
    }
  }
  test::write_pattern(pool, 1, 0, 0, 100);
  test::write_pattern(pool, 1, 1, 0, 100);
  test::write_pattern(pool, 2, 0, 0, 10);
  // Offsets: distinct, entry-aligned, inside the arena, consistent with entry().
  std::set<std::uint64_t> seen;
  for (int l = 0; l < 2; ++l) {
    for (std::int64_t t = 0; t < 100; ++t) {
      const std::uint64_t off = pool.offset(1, l, t);
      EXPECT_EQ(off % pool.entry_bytes(), 0u);
      EXPECT_LT(off + pool.entry_bytes(), pool.capacity_bytes() + 1);
      EXPECT_TRUE(seen.insert(off).second);
      EXPECT_EQ(pool.entry(1, l, t).data(), pool.base() + off);
      // Tokens of one page are contiguous.
      if (t % 64 != 0) {
        EXPECT_EQ(off, pool.offset(1, l, t - 1) + pool.entry_bytes());
      }
    }
  }
  // A released page is zeroed before it is handed out again.
  pool.release(1);
  pool.admit(3, 128);
  for (int l = 0; l < 2; ++l) {
    for (std::int64_t t = 0; t < 128; ++t) {
      for (std::uint8_t b : pool.entry(3, l, t)) ASSERT_EQ(b, 0) << "stale byte in a reused page";
    }
  }
}

TEST(TotalPool, AdmissionThatDoesNotFitChangesNothing) {
  TotalPool pool(4, test::small_layout(), 10 * 64 * 144);  // 8 pages: 2 per layer
  pool.admit(1, 64);                                       // 4 pages
  test::write_pattern(pool, 1, 2, 0, 64);
  const std::uint64_t before = pool.digest();
  const std::string msg = error_of([&] { pool.admit(2, 65); });  // needs 8 pages, 4 free
  EXPECT_NE(msg.find("total pool full"), std::string::npos) << msg;
  EXPECT_NE(msg.find("request 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("8 pages"), std::string::npos) << msg;
  EXPECT_EQ(pool.digest(), before);
  EXPECT_FALSE(pool.contains(2));
  EXPECT_EQ(pool.free_pages(), 4);

  // Growth that does not fit is all-or-nothing too.
  pool.admit(3, 64);  // 4 more pages: none free
  const std::uint64_t before_grow = pool.digest();
  EXPECT_THROW(pool.extend(3, 1), Error);  // needs 4
  EXPECT_EQ(pool.digest(), before_grow);
  EXPECT_EQ(pool.length(3), 64);
}

TEST(TotalPool, BadInputIsRefusedWithContext) {
  TotalPool pool(2, test::small_layout(), 4 * 64 * 144);
  pool.admit(5, 10);
  const std::uint64_t before = pool.digest();
  EXPECT_NE(error_of([&] { pool.admit(5, 1); }).find("already admitted"), std::string::npos);
  EXPECT_NE(error_of([&] { pool.admit(6, -1); }).find("-1"), std::string::npos);
  EXPECT_NE(error_of([&] { pool.extend(9, 1); }).find("unknown request 9"), std::string::npos);
  EXPECT_NE(error_of([&] { pool.extend(5, -3); }).find("-3"), std::string::npos);
  EXPECT_NE(error_of([&] { pool.release(9); }).find("unknown request 9"), std::string::npos);
  const std::string tok = error_of([&] { (void)pool.offset(5, 1, 10); });
  EXPECT_NE(tok.find("token 10"), std::string::npos) << tok;
  EXPECT_NE(tok.find("layer 1"), std::string::npos) << tok;
  EXPECT_NE(error_of([&] { (void)pool.offset(5, 2, 0); }).find("layer 2"), std::string::npos);
  std::vector<std::uint8_t> short_entry(10);
  EXPECT_NE(error_of([&] { pool.write(5, 0, 0, short_entry); }).find("10 bytes"), std::string::npos);
  EXPECT_EQ(pool.digest(), before);
  EXPECT_THROW(TotalPool(2, test::small_layout(), 100), Error);  // smaller than a page
  const std::string one_layer = error_of([] { TotalPool(2, test::small_layout(), 64 * 144 + 10); });
  EXPECT_NE(one_layer.find("one page of each of the 2 layers"), std::string::npos) << one_layer;
  EXPECT_THROW(TotalPool(0, test::small_layout(), 1 << 20), Error);
}

TEST(TotalPool, TruncateZeroesTheTailAndFreesItsPages) {
  TotalPool pool(2, test::small_layout(), 8 * 64 * 144);
  pool.admit(1, 60);
  for (int l = 0; l < 2; ++l) test::write_pattern(pool, 1, l, 0, 60);
  pool.extend(1, 8);  // 68 tokens: a second page per layer
  for (int l = 0; l < 2; ++l) test::write_pattern(pool, 1, l, 60, 68);
  EXPECT_EQ(pool.free_pages(), 4);
  pool.truncate(1, 62);  // back to one page per layer; tokens 62.. zeroed
  EXPECT_EQ(pool.length(1), 62);
  EXPECT_EQ(pool.free_pages(), 6);
  pool.check_invariants();
  pool.extend(1, 6);     // what a later extend appends is zeroed, the kept entries are intact
  for (int l = 0; l < 2; ++l) {
    for (std::int64_t t = 62; t < 68; ++t) {
      for (std::uint8_t b : pool.entry(1, l, t)) ASSERT_EQ(b, 0) << "layer " << l << " token " << t;
    }
  }
  TotalPool expect(2, test::small_layout(), 8 * 64 * 144);
  expect.admit(1, 62);
  for (int l = 0; l < 2; ++l) test::write_pattern(expect, 1, l, 0, 62);
  for (int l = 0; l < 2; ++l) {
    for (std::int64_t t = 0; t < 62; ++t) {
      const auto a = pool.entry(1, l, t);
      const auto b = expect.entry(1, l, t);
      ASSERT_TRUE(std::equal(a.begin(), a.end(), b.begin())) << "layer " << l << " token " << t;
    }
  }
  pool.truncate(1, 68);  // no change
  EXPECT_EQ(pool.length(1), 68);
  const std::uint64_t before = pool.digest();
  EXPECT_NE(error_of([&] { pool.truncate(1, 69); }).find("outside [0, 68]"), std::string::npos);
  EXPECT_NE(error_of([&] { pool.truncate(1, -1); }).find("outside [0, 68]"), std::string::npos);
  EXPECT_NE(error_of([&] { pool.truncate(4, 1); }).find("unknown request 4"), std::string::npos);
  // A page another request shares is never cut.
  EXPECT_EQ(pool.digest(), before);
  pool.admit_shared(2, 68, 1, 64);
  const std::uint64_t shared = pool.digest();
  EXPECT_NE(error_of([&] { pool.truncate(1, 10); }).find("page 0, which it shares"), std::string::npos);
  EXPECT_EQ(pool.digest(), shared);
  pool.release(2);
  pool.truncate(1, 0);
  EXPECT_EQ(pool.free_pages(), 8);
  pool.check_invariants();
}

// Layer-major lockstep: page i of a request lies at the same index of every layer's region, so
// one list of page indices addresses the request in every layer (what a PD transfer writes).
TEST(TotalPool, APageIndexAddressesTheRequestInEveryLayer) {
  TotalPool pool(3, test::small_layout(), 15 * 64 * 144 + 100);  // 5 pages per layer
  EXPECT_EQ(pool.pages_per_layer(), 5);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(pool.layer_base(l), pool.base() + static_cast<std::size_t>(l) * 5 * pool.page_bytes());
  }
  EXPECT_NE(error_of([&] { (void)pool.layer_base(3); }).find("layer 3 out of [0, 3)"), std::string::npos);
  pool.admit(1, 70);
  pool.admit(2, 10);
  pool.release(1);      // a hole below request 2's page
  pool.admit(3, 130);   // 3 pages: the hole and above
  pool.admit_shared(4, 64, 2, 0);
  for (const RequestId id : {2, 3, 4}) {
    const auto idx = pool.page_indices(id);
    ASSERT_EQ(std::ssize(idx), (pool.length(id) + 63) / 64);
    for (int l = 0; l < 3; ++l) {
      for (std::int64_t t = 0; t < pool.length(id); ++t) {
        const auto at = pool.layer_base(l) + static_cast<std::size_t>(idx[static_cast<std::size_t>(t / 64)]) *
                                                 pool.page_bytes() + static_cast<std::size_t>(t % 64) * pool.entry_bytes();
        ASSERT_EQ(pool.entry(id, l, t).data(), at) << "request " << id << " layer " << l << " token " << t;
      }
    }
  }
  EXPECT_NE(error_of([&] { (void)pool.page_indices(9); }).find("unknown request 9"), std::string::npos);
  pool.check_invariants();
}

}  // namespace
}  // namespace ess
