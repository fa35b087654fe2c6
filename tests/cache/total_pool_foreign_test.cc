// The Total Memory Pool on foreign pages (another engine's host block pool): addressing by the
// given layer regions and stride, adopt / repage, shared pages read-only, nothing written or
// zeroed, refusals that change nothing.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ess/cache/total_pool.h"
#include "ess/core/error.h"
#include "testing/cache_fixtures.h"
#include "testing/testing.h"

namespace ess {
namespace {

using test::error_of;

// The other engine's region: plain memory this test owns, handed out once.
class Region final : public HostAllocator {
 public:
  explicit Region(std::size_t bytes) : bytes_((bytes + 4095) / 4096 * 4096) {
    data_ = static_cast<std::uint8_t*>(std::aligned_alloc(4096, bytes_));
    for (std::size_t i = 0; i < bytes_; ++i) data_[i] = static_cast<std::uint8_t>((i * 2654435761u) >> 13);
  }
  ~Region() override { std::free(data_); }
  HostBlock allocate(std::size_t bytes, HostMemoryKind) override {
    if (bytes > bytes_) return {};
    return {data_, bytes, HostMemoryKind::kAligned};
  }
  void deallocate(const HostBlock&) noexcept override {}
  std::uint8_t* data() { return data_; }
  std::size_t size() const { return bytes_; }

 private:
  std::size_t bytes_;
  std::uint8_t* data_ = nullptr;
};

struct Foreign {
  LatentLayout layout = test::small_layout();
  ForeignPages pages;
  Foreign() {
    pages.pages_per_layer = 8;
    pages.page_stride = layout.bytes() * 64 + 256;  // padded pages, as a pool with aligned blocks has
    pages.layer_first_page = {8 + 3, 0, 2 * 8 + 5};  // out of order, with gaps
  }
  std::size_t arena_bytes() const { return (2 * 8 + 5 + 8) * pages.page_stride; }
};

TEST(TotalPoolForeign, EntriesAreTheOtherEnginesBytesWhereItsLayoutPutsThem) {
  Foreign f;
  Region region(f.arena_bytes());
  const std::vector<std::uint8_t> before(region.data(), region.data() + region.size());
  TotalPool pool(3, f.layout, f.pages, HostMemoryKind::kPinned, region);
  EXPECT_TRUE(pool.foreign());
  EXPECT_EQ(pool.page_stride(), f.pages.page_stride);
  EXPECT_EQ(pool.pages_per_layer(), 8);
  EXPECT_EQ(pool.capacity_pages(), 24);
  EXPECT_EQ(pool.base(), region.data());
  EXPECT_EQ(0, std::memcmp(region.data(), before.data(), before.size())) << "building the pool wrote the region";
  const std::vector<std::int32_t> pages = {5, 2, 7};
  pool.adopt(9, 130, pages);
  EXPECT_EQ(pool.page_indices(9), pages);
  EXPECT_EQ(pool.length(9), 130);
  const std::size_t E = f.layout.bytes();
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(pool.layer_base(l), region.data() + f.pages.layer_first_page[static_cast<std::size_t>(l)] * f.pages.page_stride);
    for (const std::int64_t t : {0, 63, 64, 100, 129}) {
      const std::uint8_t* want = region.data() +
                                 (f.pages.layer_first_page[static_cast<std::size_t>(l)] + pages[static_cast<std::size_t>(t / 64)]) *
                                     f.pages.page_stride +
                                 static_cast<std::size_t>(t % 64) * E;
      EXPECT_EQ(pool.entry(9, l, t).data(), want) << "layer " << l << " token " << t;
    }
  }
  EXPECT_EQ(0, std::memcmp(region.data(), before.data(), before.size())) << "adoption wrote the region";
  EXPECT_EQ(pool.used_bytes(), 9 * E * 64);
  pool.check_invariants();
  pool.release(9);
  EXPECT_EQ(pool.used_bytes(), 0u);
  pool.check_invariants();
}

TEST(TotalPoolForeign, RepageGrowsShrinksAndMovesPagesAndSharedPagesAreReadOnly) {
  Foreign f;
  Region region(f.arena_bytes());
  TotalPool pool(3, f.layout, f.pages, HostMemoryKind::kPinned, region);
  pool.adopt(1, 100, std::vector<std::int32_t>{4, 1});
  pool.adopt(2, 64, std::vector<std::int32_t>{4});  // the other engine shares page 4 (a common prefix)
  const std::vector<std::uint8_t> bytes(f.layout.bytes(), 0xab);
  EXPECT_NE(error_of([&] { pool.write(2, 0, 10, bytes); }).find("shared"), std::string::npos);
  pool.write(1, 2, 70, bytes);  // page 1 is request 1's alone
  EXPECT_EQ(pool.entry(1, 2, 70)[0], 0xab);
  pool.repage(1, 200, 2, std::vector<std::int32_t>{6, 0});
  EXPECT_EQ(pool.length(1), 200);
  pool.repage(1, 199, 1, std::vector<std::int32_t>{3, 6, 0});  // a draft taken back, page 1 moved to 3
  EXPECT_EQ(pool.page_indices(1), (std::vector<std::int32_t>{4, 3, 6, 0}));
  EXPECT_EQ(pool.page_refs(pool.page_table(1, 0)[1]), 1);
  EXPECT_EQ(pool.page_refs(static_cast<std::int32_t>(f.pages.layer_first_page[0] + 1)), 0);
  pool.truncate(1, 128);  // allowed: nothing is zeroed, the pages past it are dropped
  EXPECT_EQ(pool.page_indices(1), (std::vector<std::int32_t>{4, 3}));
  pool.check_invariants();
  pool.release(2);
  EXPECT_EQ(pool.page_refs(static_cast<std::int32_t>(f.pages.layer_first_page[1] + 4)), 1);
  pool.check_invariants();
}

TEST(TotalPoolForeign, BadInputIsRefusedByNameAndChangesNothing) {
  Foreign f;
  Region region(f.arena_bytes());
  TotalPool pool(3, f.layout, f.pages, HostMemoryKind::kPinned, region);
  pool.adopt(1, 100, std::vector<std::int32_t>{4, 1});
  const std::uint64_t digest = pool.digest();
  const std::vector<std::pair<std::function<void()>, std::string>> cases = {
      {[&] { pool.admit(2, 10); }, "foreign pages"},
      {[&] { pool.extend(1, 10); }, "foreign pages"},
      {[&] { pool.admit_shared(2, 100, 1, 64); }, "foreign pages"},
      {[&] { (void)pool.admit_cached(2, 100, std::vector<std::uint64_t>{1}); }, "foreign pages"},
      {[&] { (void)pool.publish(1, std::vector<std::uint64_t>{1}); }, "foreign pages"},
      {[&] { pool.adopt(1, 10, std::vector<std::int32_t>{0}); }, "already admitted"},
      {[&] { pool.adopt(2, 100, std::vector<std::int32_t>{0}); }, "1 pages for 100 tokens; 2 expected"},
      {[&] { pool.adopt(2, 10, std::vector<std::int32_t>{8}); }, "page 0 is 8, outside [0, 8)"},
      {[&] { pool.adopt(2, 10, std::vector<std::int32_t>{-1}); }, "outside [0, 8)"},
      {[&] { pool.adopt(2, 0, std::vector<std::int32_t>{}); }, "length 0 outside"},
      {[&] { pool.repage(1, 200, 0, std::vector<std::int32_t>{4, 1}); }, "2 pages for 200 tokens; 4 expected"},
      {[&] { pool.repage(1, 130, 2, std::vector<std::int32_t>{9}); }, "page 2 is 9"},
      {[&] { pool.repage(1, 130, 3, std::vector<std::int32_t>{}); }, "first_page 3 outside [0, 2]"},
      {[&] { pool.repage(3, 10, 0, std::vector<std::int32_t>{0}); }, "unknown request 3"},
  };
  for (const auto& [call, expect] : cases) {
    const std::string e = error_of(call);
    EXPECT_NE(e.find(expect), std::string::npos) << "got: " << e << "\nexpected: " << expect;
    EXPECT_EQ(pool.digest(), digest) << expect;
  }
  pool.check_invariants();
}

TEST(TotalPoolForeign, ALayoutThatCannotBeAddressedIsRefused) {
  const Foreign good;
  Region region(good.arena_bytes() * 2);
  auto error_for = [&](const std::function<void(ForeignPages&)>& change) {
    ForeignPages p = good.pages;
    change(p);
    return error_of([&] { TotalPool pool(3, good.layout, p, HostMemoryKind::kPinned, region); });
  };
  EXPECT_NE(error_for([](ForeignPages& p) { p.layer_first_page[2] = 4; }).find("overlap"), std::string::npos);
  EXPECT_NE(error_for([&](ForeignPages& p) { p.page_stride = good.layout.bytes() * 64 - 16; }).find("page_stride"),
            std::string::npos);
  EXPECT_NE(error_for([](ForeignPages& p) { p.layer_first_page.pop_back(); }).find("2 foreign layer_first_page values for 3"),
            std::string::npos);
  EXPECT_NE(error_for([](ForeignPages& p) { p.pages_per_layer = 0; }).find("pages_per_layer = 0"), std::string::npos);
  EXPECT_NE(error_for([](ForeignPages& p) { p.layer_first_page[0] = -1; }).find("layer_first_page[0] = -1"),
            std::string::npos);
  EXPECT_NE(error_for([](ForeignPages& p) { p.layer_first_page[1] = 1000; }).find("cannot allocate"), std::string::npos)
      << "a layout past the region is refused by its allocator";
}

}  // namespace
}  // namespace ess
