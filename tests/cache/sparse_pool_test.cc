#include "ess/cache/sparse_pool.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "ess/core/error.h"
#include "testing/cache_fixtures.h"
#include "testing/testing.h"

namespace ess {
namespace {

using test::error_of;

SparsePoolConfig config(std::int32_t slots, int T, int K, std::int64_t max_context = 0) {
  SparsePoolConfig c;
  c.num_layers = 2;
  c.layout = test::small_layout();
  c.max_requests = 3;
  c.slots = slots;
  c.query_tokens = T;
  c.topk = K;
  c.max_context = max_context;
  return c;
}

TEST(SparseMemoryRatio, SlotsAreTheCeilingOfRatioTimesContext) {
  EXPECT_EQ(slots_for_ratio(0.2, 32768), 6554);  // the paper's 6.4K slots
  EXPECT_EQ(slots_for_ratio(1.0, 32768), 32768);
  EXPECT_EQ(slots_for_ratio(0.5, 3), 2);
  EXPECT_EQ(slots_for_ratio(0.5, 100), 50);
  EXPECT_NE(error_of([] { slots_for_ratio(1.5, 100); }).find("1.5"), std::string::npos);
  EXPECT_THROW(slots_for_ratio(0.0, 100), Error);
  EXPECT_THROW(slots_for_ratio(-0.1, 100), Error);
  EXPECT_THROW(slots_for_ratio(NAN, 100), Error);
  EXPECT_THROW(slots_for_ratio(0.5, 0), Error);
}

TEST(SparsePool, APoolSmallerThanOneQueryTokensTopkIsAConfigurationError) {
  const std::string msg = error_of([] { SparsePool p(config(2047, 2, 2048)); });
  EXPECT_NE(msg.find("2047 slots"), std::string::npos) << msg;
  EXPECT_NE(msg.find("use at least 2048 slots"), std::string::npos) << msg;
  // Below T x K: a step that selects more runs in query groups.
  EXPECT_NO_THROW(SparsePool p(config(2048, 2, 2048)));
  // Requests never longer than 1000 tokens cannot select more than 1000 entries.
  EXPECT_NO_THROW(SparsePool p(config(1000, 2, 2048, 1000)));
  EXPECT_THROW(SparsePool p(config(999, 2, 2048, 1000)), Error);
  EXPECT_THROW(SparsePool p(config(0, 1, 1)), Error);
  EXPECT_THROW(SparsePool p(config(8, 0, 1)), Error);
  SparsePoolConfig bad = config(8, 1, 4);
  bad.max_requests = 0;
  EXPECT_NE(error_of([&] { SparsePool p(bad); }).find("max_requests"), std::string::npos);
}

TEST(SparsePool, RowsAreAdmittedAndReleased) {
  SparsePool pool(config(16, 2, 4));
  EXPECT_EQ(pool.bytes(), 3u * 2u * 16u * 144u);
  const std::int32_t a = pool.admit(10);
  const std::int32_t b = pool.admit(11);
  const std::int32_t c = pool.admit(12);
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 1);
  EXPECT_EQ(c, 2);
  const std::uint64_t before = pool.digest();
  EXPECT_NE(error_of([&] { pool.admit(13); }).find("sparse pool full"), std::string::npos);
  EXPECT_NE(error_of([&] { pool.admit(10); }).find("already admitted"), std::string::npos);
  EXPECT_EQ(pool.digest(), before);
  pool.release(11);
  EXPECT_EQ(pool.admit(13), 1);
  EXPECT_NE(error_of([&] { (void)pool.row(11); }).find("unknown request 11"), std::string::npos);
  EXPECT_THROW(pool.release(11), Error);
}

TEST(CpuSlotStorage, FillCopiesEachMissFromTheTotalPool) {
  TotalPool total(2, test::small_layout(), 4 * 64 * 144);
  total.admit(4, 20);
  for (int l = 0; l < 2; ++l) test::write_pattern(total, 4, l, 0, 20);
  SparsePool pool(config(16, 1, 4));
  const std::int32_t row = pool.admit(4);
  MissPlan plan;
  plan.layer = 1;
  plan.entries.push_back({0, row, 3, 9, total.offset(4, 1, 3)});
  plan.entries.push_back({0, row, 17, 0, total.offset(4, 1, 17)});
  pool.storage().fill(plan, total);
  std::vector<std::uint8_t> out(144);
  pool.storage().read(row, 1, 9, out);
  EXPECT_TRUE(std::equal(out.begin(), out.end(), total.entry(4, 1, 3).begin()));
  pool.storage().read(row, 1, 0, out);
  EXPECT_TRUE(std::equal(out.begin(), out.end(), total.entry(4, 1, 17).begin()));
  pool.storage().read(row, 0, 9, out);  // layer 0 untouched
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](std::uint8_t b) { return b == 0; }));
}

}  // namespace
}  // namespace ess
