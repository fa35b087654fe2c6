// Shared prefixes in the Total Memory Pool (total_pool.h): random sequences of admit /
// admit_shared / admit_cached / publish / extend / write / release / evict with the pool's
// invariants (every page's references equal its holders, nothing freed while referenced,
// the cache's users and children), the byte accounting, and every live entry's content
// checked after every operation. A prompt entry's content is a function of the prompt's
// tokens up to it (as a model's would be), a decode entry's of its request, so a reused
// prefix must read right and a write that reached a shared page would corrupt another
// request.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "ess/cache/total_pool.h"
#include "ess/core/error.h"
#include "testing/cache_fixtures.h"
#include "testing/testing.h"

namespace ess {
namespace {

using test::error_of;

constexpr int kLayers = 2;

struct Live {
  std::vector<std::int32_t> prompt;
  std::int64_t length = 0;
};

// The content of (request, layer, token): the prompt's tokens up to it, or the request.
std::uint64_t tag(const Live& r, RequestId id, int layer, std::int64_t token) {
  std::uint64_t h = 1469598103934665603ull ^ static_cast<std::uint64_t>(layer);
  if (token < std::ssize(r.prompt)) {
    for (std::int64_t i = 0; i <= token; ++i) h = (h ^ static_cast<std::uint32_t>(r.prompt[static_cast<std::size_t>(i)])) * 1099511628211ull;
    return h;
  }
  return (h ^ (static_cast<std::uint64_t>(id) << 32) ^ static_cast<std::uint64_t>(token)) * 0x9e3779b97f4a7c15ull;
}

std::vector<std::uint8_t> entry_for(std::uint64_t t, std::size_t bytes) {
  std::vector<std::uint8_t> e(bytes);
  for (std::size_t i = 0; i < bytes; ++i) e[i] = static_cast<std::uint8_t>(t >> (8 * (i % 8))) ^ static_cast<std::uint8_t>(i);
  return e;
}

class PrefixPoolFixture {
 public:
  explicit PrefixPoolFixture(std::int64_t pages) : pool(kLayers, test::small_layout(), static_cast<std::uint64_t>(pages) * 64 * 144) {}

  void write(RequestId id, std::int64_t from, std::int64_t to) {
    const Live& r = live.at(id);
    for (int l = 0; l < kLayers; ++l) {
      for (std::int64_t t = from; t < to; ++t) pool.write(id, l, t, entry_for(tag(r, id, l, t), pool.entry_bytes()));
    }
  }
  void check_all() {
    pool.check_invariants();
    const TotalPoolAccount a = pool.account();
    ASSERT_EQ(a.live_bytes + a.retained_bytes + a.free_bytes, pool.capacity_bytes());
    ASSERT_LE(a.shared_bytes, a.live_bytes);
    ASSERT_GE(a.unshared_bytes, a.live_bytes);
    std::uint64_t held = 0;
    for (const auto& [id, r] : live) {
      ASSERT_EQ(pool.length(id), r.length);
      const TotalPoolUsage u = pool.usage(id);
      held += u.bytes;
      ASSERT_LE(u.shared_bytes, u.bytes);
      for (int l = 0; l < kLayers; ++l) {
        for (std::int64_t t = 0; t < r.length; ++t) {
          const auto want = entry_for(tag(r, id, l, t), pool.entry_bytes());
          const auto got = pool.entry(id, l, t);
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size())) << "request " << id << " layer " << l << " token " << t;
        }
      }
    }
    ASSERT_EQ(held, a.unshared_bytes);
  }

  TotalPool pool;
  std::map<RequestId, Live> live;
};

TEST(TotalPoolPrefix, RandomOperationsKeepEveryInvariant) {
  int shared_admissions = 0, cache_hits = 0, refused = 0, evicted = 0, writes_refused = 0;
  for (const std::uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    PrefixPoolFixture f(48);
    TotalPool& pool = f.pool;
    // Three system prompts the requests start with.
    std::vector<std::vector<std::int32_t>> bases(3);
    for (auto& b : bases) {
      b.resize(64 + rng() % 200);
      for (auto& x : b) x = static_cast<std::int32_t>(rng() % 50);
    }
    auto prompt_from = [&](const std::vector<std::int32_t>& base, std::int64_t keep) {
      std::vector<std::int32_t> p(base.begin(), base.begin() + keep);
      const auto extra = static_cast<std::int64_t>(rng() % 90);
      for (std::int64_t i = 0; i < extra; ++i) p.push_back(static_cast<std::int32_t>(rng() % 50));
      if (p.empty()) p.push_back(1);
      return p;
    };
    RequestId next = 1;
    for (int op = 0; op < 400; ++op) {
      const int kind = static_cast<int>(rng() % 8);
      const std::uint64_t before = pool.digest();
      auto pick = [&]() {
        auto it = f.live.begin();
        std::advance(it, static_cast<std::ptrdiff_t>(rng() % f.live.size()));
        return it->first;
      };
      try {
        if (kind <= 1 || f.live.empty()) {  // fresh, or on the prefix cache
          Live r;
          const auto& base = bases[rng() % bases.size()];
          r.prompt = prompt_from(base, static_cast<std::int64_t>(rng() % (base.size() + 1)));
          r.length = std::ssize(r.prompt);
          const RequestId id = next++;
          std::int64_t reused = 0;
          if (kind == 0) {
            pool.admit(id, r.length);
          } else {
            reused = pool.admit_cached(id, r.length, prefix_page_hashes(r.prompt));
            ASSERT_EQ(reused % 64, 0);
            ASSERT_LE(reused, r.length);
            cache_hits += reused > 0;
          }
          f.live.emplace(id, r);
          f.write(id, reused, r.length);
        } else if (kind == 2) {  // on a live request's prefix
          const RequestId src = pick();
          const Live& s = f.live.at(src);
          const auto prefix = static_cast<std::int64_t>(rng() % (s.prompt.size() + 1));
          Live r;
          r.prompt = prompt_from(s.prompt, prefix);
          r.length = std::ssize(r.prompt);
          const RequestId id = next++;
          pool.admit_shared(id, r.length, src, prefix);
          f.live.emplace(id, r);
          ++shared_admissions;
          f.write(id, prefix / 64 * 64, r.length);  // the copied partial page is its own
        } else if (kind == 3) {
          const RequestId id = pick();
          const Live& r = f.live.at(id);
          const auto hashes = prefix_page_hashes(r.prompt);
          const auto n = std::min<std::int64_t>(std::ssize(hashes), r.length / 64);
          pool.publish(id, std::span(hashes).first(static_cast<std::size_t>(rng() % (n + 1))));
        } else if (kind == 4) {
          const RequestId id = pick();
          const auto n = static_cast<std::int64_t>(1 + rng() % 70);
          pool.extend(id, n);
          f.live.at(id).length += n;
          f.write(id, f.live.at(id).length - n, f.live.at(id).length);
        } else if (kind == 5) {  // a write into a shared page is refused, changing nothing
          const RequestId id = pick();
          for (std::int64_t t = 0; t < f.live.at(id).length; t += 64) {
            const auto page = static_cast<std::int32_t>(pool.offset(id, 0, t) / pool.page_bytes());
            if (pool.page_refs(page) < 2) continue;
            const std::string e = error_of([&] { pool.write(id, 0, t, std::vector<std::uint8_t>(pool.entry_bytes(), 0xEE)); });
            ASSERT_NE(e.find("shared prefix entries are read-only"), std::string::npos) << e;
            ASSERT_EQ(pool.digest(), before);
            ++writes_refused;
            break;
          }
        } else if (kind == 6) {
          const RequestId id = pick();
          pool.release(id);
          f.live.erase(id);
        } else {
          evicted += pool.evict(static_cast<std::int64_t>(rng() % 6)) > 0;
        }
      } catch (const Error& e) {
        ASSERT_NE(std::string(e.what()).find("total pool full"), std::string::npos) << e.what();
        ASSERT_EQ(pool.digest(), before) << "a refused operation changed the pool";
        ++refused;
      }
      ASSERT_NO_FATAL_FAILURE(f.check_all()) << "after operation " << op << " (kind " << kind << ")";
    }
    for (auto it = f.live.begin(); it != f.live.end(); it = f.live.erase(it)) pool.release(it->first);
    pool.evict(pool.capacity_pages());
    EXPECT_EQ(pool.free_pages(), pool.capacity_pages());
    pool.check_invariants();
  }
  // The draws exercised every path.
  EXPECT_GT(shared_admissions, 30);
  EXPECT_GT(cache_hits, 5);
  EXPECT_GT(refused, 3);
  EXPECT_GT(writes_refused, 15);
  EXPECT_GT(evicted, 3);
}

// Host bytes per request at 0 %, 50 % and 90 % of a 32-page prompt shared by 8 requests.
TEST(TotalPoolPrefix, SharingDividesTheHostBytes) {
  for (const int percent : {0, 50, 90}) {
    TotalPool pool(kLayers, test::small_layout(), 600ull * 64 * 144);
    const std::int64_t len = 32 * 64, prefix = len * percent / 100;
    pool.admit(0, len);
    for (RequestId id = 1; id < 8; ++id) pool.admit_shared(id, len, 0, prefix);
    const TotalPoolAccount a = pool.account();
    const std::int64_t shared_pages = prefix / 64;  // per layer
    EXPECT_EQ(a.live_bytes, static_cast<std::uint64_t>(kLayers * (8 * (32 - shared_pages) + shared_pages)) * pool.page_bytes())
        << percent;
    EXPECT_EQ(a.unshared_bytes, 8ull * kLayers * 32 * pool.page_bytes());
    EXPECT_EQ(pool.usage(3).shared_pages, kLayers * shared_pages);
  }
}

// A share limit below the prefix: only the full pages below it are shared; the rest of the
// prefix is copied, entry for entry.
TEST(TotalPoolPrefix, AShareLimitCopiesThePrefixPastIt) {
  TotalPool pool(kLayers, test::small_layout(), 20ull * 64 * 144);
  pool.admit(1, 300);
  for (int l = 0; l < kLayers; ++l) {
    for (std::int64_t t = 0; t < 300; ++t) pool.write(1, l, t, entry_for(static_cast<std::uint64_t>(t * 31 + l), 144));
  }
  pool.admit_shared(2, 300, 1, 290, 130);  // pages 0 and 1 shared; tokens 128..289 copied
  EXPECT_EQ(pool.usage(2).shared_pages, 2 * kLayers);
  for (int l = 0; l < kLayers; ++l) {
    for (std::int64_t t = 0; t < 290; ++t) {
      const auto a = pool.entry(1, l, t), b = pool.entry(2, l, t);
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size())) << "layer " << l << " token " << t;
    }
    EXPECT_EQ(pool.entry(2, l, 295)[0], 0);  // past the prefix: zeroed
  }
  pool.write(2, 0, 200, entry_for(7, 144));  // a copied page is its own
  EXPECT_NE(pool.entry(1, 0, 200)[0], pool.entry(2, 0, 200)[0]);
  EXPECT_NE(error_of([&] { pool.evict(-1); }).find("evict -1 pages"), std::string::npos);
  EXPECT_NE(error_of([&] { pool.evict(21); }).find("must be in [0, 20]"), std::string::npos);
  pool.check_invariants();
}

// Bad input: a prefix longer than its source, an unknown source, an id taken, a publish past
// the length, a capacity that even eviction cannot make: refused by name, nothing changed.
TEST(TotalPoolPrefix, BadInputIsRefusedByNameAndChangesNothing) {
  TotalPool pool(kLayers, test::small_layout(), 10ull * 64 * 144);
  pool.admit(1, 130);
  const std::uint64_t before = pool.digest();
  const auto refused = [&](const std::function<void()>& f, const std::string& needle) {
    const std::string e = error_of(f);
    EXPECT_NE(e.find(needle), std::string::npos) << e;
    EXPECT_EQ(pool.digest(), before) << e;
  };
  refused([&] { pool.admit_shared(2, 200, 1, 131); }, "prefix 131 tokens must be within both lengths (130 and 200)");
  refused([&] { pool.admit_shared(2, 100, 1, 120); }, "within both lengths (130 and 100)");
  refused([&] { pool.admit_shared(2, 100, 9, 10); }, "unknown request 9");
  refused([&] { pool.admit_shared(1, 100, 1, 10); }, "request 1 is already admitted");
  refused([&] { pool.admit_shared(2, 64 * 9, 1, 64); }, "total pool full");
  const std::vector<std::uint64_t> three = {1, 2, 3};
  refused([&] { pool.publish(1, three); }, "3 pages of 64 tokens, but it holds 130 tokens");
  refused([&] { pool.admit_cached(2, 64 * 9, three); }, "total pool full");
}

// A retained prefix is found again, reused without a copy, and evicted, leaves first, only
// when an admission needs its pages.
TEST(TotalPoolPrefix, RetainedPrefixesAreReusedThenEvictedWhenSpaceIsNeeded) {
  TotalPool pool(kLayers, test::small_layout(), 16ull * 64 * 144);
  std::vector<std::int32_t> prompt(200);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(i * 7 % 31);
  const auto hashes = prefix_page_hashes(prompt);
  ASSERT_EQ(hashes.size(), 3u);
  pool.admit(1, 200);  // 4 pages per layer
  EXPECT_EQ(pool.publish(1, hashes), 3);
  pool.release(1);
  TotalPoolAccount a = pool.account();
  EXPECT_EQ(a.retained_bytes, 6 * pool.page_bytes());  // 3 pages x 2 layers
  EXPECT_EQ(a.live_bytes, 0u);
  EXPECT_EQ(pool.admit_cached(2, 200, hashes), 192);
  EXPECT_EQ(pool.usage(2).shared_pages, 6);
  EXPECT_EQ(pool.free_pages(), 16 - 6 - 2);
  // Another prompt differing in the second page reuses only the first.
  std::vector<std::int32_t> other = prompt;
  other[100] = 30000;
  EXPECT_EQ(pool.admit_cached(3, 200, prefix_page_hashes(other)), 64);
  pool.release(2);
  pool.release(3);
  pool.check_invariants();
  // 10 pages free, 6 retained: a 7-page-per-layer admission evicts the chain's last two pages
  // (leaves first, only what it needs); the first stays and is found again.
  EXPECT_EQ(pool.free_pages(), 10);
  pool.admit(4, 7 * 64);
  EXPECT_EQ(pool.account().retained_bytes, 2 * pool.page_bytes());
  EXPECT_EQ(pool.free_pages(), 0);
  EXPECT_EQ(pool.admit_cached(5, 64, hashes), 64);
  // The pool is full and the one retained page is in use: nothing to evict, refused.
  EXPECT_NE(error_of([&] { pool.admit_cached(6, 10, hashes); }).find("total pool full"), std::string::npos);
  pool.check_invariants();
}

// retire(): the first half of a release. The prefix-cache holds end at once (the entries become
// evictable in the order a release would make them), the pages stay held under the new id until
// release(new id), and the old id is free for another admission at once. With eviction held off, an
// admission short of pages is refused and evicts nothing.
TEST(TotalPoolPrefix, RetireEndsTheCacheHoldsNowAndFreesThePagesAtRelease) {
  TotalPool pool(kLayers, test::small_layout(), 10ull * 64 * 144);  // 5 pages per layer
  std::vector<std::int32_t> prompt(200);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(i * 5 % 29);
  const auto hashes = prefix_page_hashes(prompt);
  pool.admit(1, 200);  // 4 pages per layer
  EXPECT_EQ(pool.publish(1, hashes), 3);
  pool.retire(1, -1);
  pool.check_invariants();
  EXPECT_FALSE(pool.contains(1));
  EXPECT_EQ(pool.length(-1), 200);
  EXPECT_EQ(pool.free_pages(), 2);
  EXPECT_EQ(pool.account().retained_bytes, 0u);  // the retiring request still holds the cached pages
  // Its pages are not freed by eviction while retiring: 3 pages per layer do not fit.
  EXPECT_NE(error_of([&] { pool.admit(2, 3 * 64); }).find("total pool full"), std::string::npos);
  EXPECT_FALSE(pool.contains(2));
  EXPECT_NE(error_of([&] { pool.retire(-1, -1); }).find("already admitted"), std::string::npos);
  pool.admit(1, 10);  // the id is free again
  pool.release(1);
  pool.release(-1);
  pool.check_invariants();
  EXPECT_EQ(pool.account().retained_bytes, 6 * pool.page_bytes());
  EXPECT_EQ(pool.free_pages(), 4);
  // Held off, an admission that would need eviction is refused, changing nothing; allowed, it evicts.
  pool.evict_when_full(false);
  EXPECT_NE(error_of([&] { pool.admit(3, 3 * 64); }).find("eviction held off"), std::string::npos);
  EXPECT_EQ(pool.account().retained_bytes, 6 * pool.page_bytes());
  pool.evict_when_full(true);
  pool.admit(3, 3 * 64);  // 6 pages, 4 free: the chain's leaf (a page in each layer) is evicted
  EXPECT_EQ(pool.account().retained_bytes, 4 * pool.page_bytes());
  pool.check_invariants();
}

}  // namespace
}  // namespace ess
