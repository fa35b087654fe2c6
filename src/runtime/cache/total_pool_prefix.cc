// The Total Memory Pool's shared prefixes: admission on a live request's prefix or on the
// prefix cache, publishing, retention and eviction, and the accounting (total_pool.h).
#include <algorithm>
#include <cstring>

#include "ess/cache/total_pool.h"
#include "ess/core/error.h"

namespace ess {
namespace {

std::uint64_t mix(std::uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

std::vector<std::uint64_t> prefix_page_hashes(std::span<const std::int32_t> token_ids) {
  std::vector<std::uint64_t> out;
  std::uint64_t h = 0x6a09e667f3bcc908ull;  // the chain's seed
  for (std::size_t page = 0; (page + 1) * kPageTokens <= token_ids.size(); ++page) {
    for (std::size_t i = page * kPageTokens; i < (page + 1) * kPageTokens; ++i) {
      h = mix(h ^ static_cast<std::uint32_t>(token_ids[i]));
    }
    out.push_back(h);
  }
  return out;
}

void TotalPool::update_evictable(std::uint64_t hash) {
  CacheEntry& e = cache_.at(hash);
  evictable_.erase({e.last_use, hash});
  if (e.users == 0 && e.children == 0) evictable_.insert({e.last_use, hash});
}

void TotalPool::use_entry(std::uint64_t hash) {
  CacheEntry& e = cache_.at(hash);
  evictable_.erase({e.last_use, hash});
  ++e.users;
  e.last_use = ++clock_;
}

void TotalPool::unuse_entry(std::uint64_t hash) {
  CacheEntry& e = cache_.at(hash);
  evictable_.erase({e.last_use, hash});
  --e.users;
  e.last_use = ++clock_;
  update_evictable(hash);
}

std::int64_t TotalPool::evictable_pages(std::span<const std::uint64_t> keep) const {
  // Entries without users form subtrees (a request uses a whole chain from its root), so every
  // one of them outside `keep` can be evicted, leaves first; a page frees when the cache was
  // its last holder.
  std::int64_t n = 0;
  for (const auto& [h, e] : cache_) {
    if (e.users > 0 || std::find(keep.begin(), keep.end(), h) != keep.end()) continue;
    for (const std::int32_t p : e.pages) n += page_refs(p) == 1 ? 1 : 0;
  }
  return n;
}

void TotalPool::make_room(std::int64_t need, std::span<const std::uint64_t> keep, const char* what, RequestId id) {
  if (need <= free_pages()) return;
  if (!evict_when_full_) {
    throw PoolFull(fmt::format(
        "total pool full: {} of request {} needs {} pages ({} B) but only {} of {} pages are free (eviction held off)",
        what, id, need, static_cast<std::uint64_t>(need) * page_bytes_, free_pages(), capacity_pages_));
  }
  const std::int64_t evictable = evictable_pages(keep);
  if (need > free_pages() + evictable) {
    throw PoolFull(fmt::format(
        "total pool full: {} of request {} needs {} pages ({} B) but only {} of {} pages are free and {} retained pages "
        "could be evicted",
        what, id, need, static_cast<std::uint64_t>(need) * page_bytes_, free_pages(), capacity_pages_, evictable));
  }
  while (free_pages() < need) {
    auto it = evictable_.begin();
    while (it != evictable_.end() && std::find(keep.begin(), keep.end(), it->second) != keep.end()) ++it;
    ESS_ASSERT(it != evictable_.end(), "total pool: {} evictable pages counted, none left to evict", evictable);
    const std::uint64_t hash = it->second;
    evictable_.erase(it);
    const CacheEntry e = std::move(cache_.at(hash));  // no allocation between the erases
    cache_.erase(hash);
    for (const std::int32_t p : e.pages) drop_page(p);
    if (e.has_parent) {
      --cache_.at(e.parent).children;
      update_evictable(e.parent);
    }
  }
}

std::int64_t TotalPool::evict(std::int64_t pages) {
  ESS_CHECK(pages >= 0 && pages <= capacity_pages_, "total pool: evict {} pages: must be in [0, {}]", pages,
            capacity_pages_);
  const std::int64_t before = free_pages();
  const std::int64_t want = std::min(free_pages() + pages, free_pages() + evictable_pages({}));
  make_room(want, {}, "eviction", -1);
  return free_pages() - before;
}

void TotalPool::admit_shared(RequestId id, std::int64_t length, RequestId source, std::int64_t prefix,
                             std::int64_t share_limit) {
  require_own_pages("shared admission", id);
  ESS_CHECK(!requests_.contains(id), "total pool: request {} is already admitted", id);
  const Request& src = find(source, "shared admission's source");
  ESS_CHECK(length >= 0 && length <= std::numeric_limits<std::int32_t>::max(),
            "total pool: request {}: length {} out of range [0, {}]", id, length, std::numeric_limits<std::int32_t>::max());
  ESS_CHECK(prefix >= 0 && prefix <= src.length && prefix <= length,
            "total pool: request {} on the prefix of request {}: prefix {} tokens must be within both lengths ({} and {})",
            id, source, prefix, src.length, length);
  const std::int64_t full = (share_limit < 0 ? prefix : std::min(prefix, share_limit)) / kPageTokens;
  const std::int64_t need = pages_for(length) - full * num_layers_;
  make_room(need, {}, "shared admission", id);
  Request r;
  r.length = length;
  r.pages.resize(static_cast<std::size_t>(num_layers_));
  const auto per_layer = static_cast<std::size_t>(pages_for(length) / num_layers_);
  for (auto& table : r.pages) table.reserve(per_layer);
  r.cached.assign(src.cached.begin(), src.cached.begin() + std::min<std::ptrdiff_t>(full, std::ssize(src.cached)));
  auto [it, inserted] = requests_.emplace(id, std::move(r));  // may throw: nothing taken yet
  (void)inserted;
  const Request& s = requests_.at(source);
  Request& r_new = it->second;
  for (int l = 0; l < num_layers_; ++l) {
    auto& table = r_new.pages[static_cast<std::size_t>(l)];
    const auto& from = s.pages[static_cast<std::size_t>(l)];
    for (std::int64_t i = 0; i < full; ++i) {
      table.push_back(from[static_cast<std::size_t>(i)]);
      ++refs_[static_cast<std::size_t>(table.back())];
    }
  }
  for (std::int64_t i = full; i * kPageTokens < prefix; ++i) {  // the rest of the prefix: copies
    grow_tables(r_new, static_cast<std::size_t>(i + 1));
    const auto bytes = static_cast<std::size_t>(std::min<std::int64_t>(kPageTokens, prefix - i * kPageTokens)) * entry_bytes_;
    for (int l = 0; l < num_layers_; ++l) {
      std::memcpy(arena_.data() + static_cast<std::size_t>(r_new.pages[static_cast<std::size_t>(l)].back()) * page_bytes_,
                  arena_.data() + static_cast<std::size_t>(s.pages[static_cast<std::size_t>(l)][static_cast<std::size_t>(i)]) * page_bytes_,
                  bytes);
    }
  }
  grow_tables(r_new, per_layer);
  for (const std::uint64_t h : it->second.cached) use_entry(h);
}

std::int64_t TotalPool::admit_cached(RequestId id, std::int64_t length, std::span<const std::uint64_t> page_hashes,
                                     std::int64_t share_limit) {
  require_own_pages("shared admission", id);
  ESS_CHECK(!requests_.contains(id), "total pool: request {} is already admitted", id);
  ESS_CHECK(length >= 0 && length <= std::numeric_limits<std::int32_t>::max(),
            "total pool: request {}: length {} out of range [0, {}]", id, length, std::numeric_limits<std::int32_t>::max());
  // The longest chain of cached pages, each within the length.
  std::vector<std::uint64_t> chain;
  const auto usable = std::min<std::int64_t>(std::ssize(page_hashes),
                                             (share_limit < 0 ? length : std::min(length, share_limit)) / kPageTokens);
  for (std::int64_t i = 0; i < usable; ++i) {
    const auto it = cache_.find(page_hashes[static_cast<std::size_t>(i)]);
    if (it == cache_.end() || it->second.has_parent != (i > 0) || (i > 0 && it->second.parent != chain.back())) break;
    chain.push_back(it->first);
  }
  const auto m = std::ssize(chain);
  make_room(pages_for(length) - m * num_layers_, chain, "cached admission", id);
  Request r;
  r.length = length;
  r.pages.resize(static_cast<std::size_t>(num_layers_));
  const auto per_layer = static_cast<std::size_t>(pages_for(length) / num_layers_);
  for (auto& table : r.pages) table.reserve(per_layer);
  r.cached = chain;
  auto [it, inserted] = requests_.emplace(id, std::move(r));  // may throw: nothing taken yet
  (void)inserted;
  for (int l = 0; l < num_layers_; ++l) {
    auto& table = it->second.pages[static_cast<std::size_t>(l)];
    for (const std::uint64_t h : chain) {
      table.push_back(cache_.at(h).pages[static_cast<std::size_t>(l)]);
      ++refs_[static_cast<std::size_t>(table.back())];
    }
  }
  grow_tables(it->second, per_layer);
  for (const std::uint64_t h : chain) use_entry(h);
  return m * kPageTokens;
}

std::int64_t TotalPool::publish(RequestId id, std::span<const std::uint64_t> page_hashes) {
  const Request& found = find(id, "publish");
  require_own_pages("publish", id);
  ESS_CHECK(std::ssize(page_hashes) * kPageTokens <= found.length,
            "total pool: publish of request {}: {} pages of 64 tokens, but it holds {} tokens", id, page_hashes.size(),
            found.length);
  const auto have = std::ssize(found.cached);
  for (std::int64_t i = 0; i < std::min(have, std::ssize(page_hashes)); ++i) {
    ESS_CHECK(found.cached[static_cast<std::size_t>(i)] == page_hashes[static_cast<std::size_t>(i)],
              "total pool: publish of request {}: page {} is cached under another hash (its prompt differs)", id, i);
  }
  Request& r = requests_.at(id);
  cache_.reserve(cache_.size() + page_hashes.size());
  r.cached.reserve(page_hashes.size());
  std::int64_t added = 0;
  for (auto i = have; i < std::ssize(page_hashes); ++i) {
    const std::uint64_t h = page_hashes[static_cast<std::size_t>(i)];
    if (cache_.contains(h)) break;  // another request's pages hold this content: its chain goes on
    // Everything that allocates first (the entry, its place in the map); then the counts.
    CacheEntry e;
    e.has_parent = i > 0;
    e.parent = i > 0 ? page_hashes[static_cast<std::size_t>(i - 1)] : 0;
    e.pages.reserve(r.pages.size());
    for (const auto& table : r.pages) e.pages.push_back(table[static_cast<std::size_t>(i)]);
    e.users = 1;
    e.last_use = ++clock_;
    const CacheEntry& added_entry = cache_.emplace(h, std::move(e)).first->second;
    for (const std::int32_t p : added_entry.pages) ++refs_[static_cast<std::size_t>(p)];
    if (added_entry.has_parent) {
      CacheEntry& parent = cache_.at(added_entry.parent);
      ++parent.children;
      evictable_.erase({parent.last_use, added_entry.parent});  // it has a child now
    }
    r.cached.push_back(h);  // capacity reserved above
    ++added;
  }
  return added;
}

TotalPoolAccount TotalPool::account() const {
  std::vector<std::uint8_t> cached(refs_.size(), 0);
  for (const auto& [h, e] : cache_) {
    for (const std::int32_t p : e.pages) cached[static_cast<std::size_t>(p)] = 1;
  }
  TotalPoolAccount a;
  for (std::size_t p = 0; p < refs_.size(); ++p) {
    const std::int32_t live_holders = refs_[p] - cached[p];
    if (live_holders > 0) {
      a.live_bytes += page_bytes_;
      if (refs_[p] > 1) a.shared_bytes += page_bytes_;
    } else if (cached[p] != 0) {
      a.retained_bytes += page_bytes_;
    }
  }
  a.free_bytes = static_cast<std::uint64_t>(free_pages()) * page_bytes_;
  for (const auto& [id, r] : requests_) a.unshared_bytes += static_cast<std::uint64_t>(pages_for(r.length)) * page_bytes_;
  a.cached_pages = std::ssize(cache_);
  return a;
}

void TotalPool::check_invariants() const {
  std::vector<std::int32_t> holders(refs_.size(), 0);
  std::unordered_map<std::uint64_t, std::int32_t> users, children;
  for (const auto& [id, r] : requests_) {
    ESS_ASSERT(std::ssize(r.pages) == num_layers_, "request {} has {} page tables", id, r.pages.size());
    for (const auto& table : r.pages) {
      ESS_ASSERT(std::ssize(table) == pages_for(r.length) / num_layers_, "request {}: {} pages for {} tokens", id,
                 table.size(), r.length);
      for (const std::int32_t p : table) ++holders[static_cast<std::size_t>(p)];
    }
    for (std::size_t i = 0; i < r.cached.size(); ++i) {
      const auto it = cache_.find(r.cached[i]);
      ESS_ASSERT(it != cache_.end(), "request {} uses a cache entry that is gone", id);
      for (int l = 0; l < num_layers_; ++l) {
        ESS_ASSERT(it->second.pages[static_cast<std::size_t>(l)] == r.pages[static_cast<std::size_t>(l)][i],
                   "request {} page {} layer {} is not its cache entry's page", id, i, l);
      }
      ESS_ASSERT(it->second.has_parent == (i > 0) && (i == 0 || it->second.parent == r.cached[i - 1]),
                 "request {}: its cache chain is broken at page {}", id, i);
      ++users[r.cached[i]];
    }
  }
  for (const auto& [h, e] : cache_) {
    for (const std::int32_t p : e.pages) ++holders[static_cast<std::size_t>(p)];
    if (e.has_parent) {
      ESS_ASSERT(cache_.contains(e.parent), "cache entry {} outlives its parent", h);
      ++children[e.parent];
    }
  }
  for (const auto& [h, e] : cache_) {
    ESS_ASSERT(e.users == users[h] && e.children == children[h], "cache entry {}: users {} / {}, children {} / {}", h,
               e.users, users[h], e.children, children[h]);
    ESS_ASSERT(!e.has_parent || cache_.at(e.parent).users >= e.users, "cache entry {} has more users than its parent", h);
    ESS_ASSERT(evictable_.contains({e.last_use, h}) == (e.users == 0 && e.children == 0),
               "cache entry {}: evictable set out of date", h);
  }
  ESS_ASSERT(evictable_.size() <= cache_.size(), "evictable set holds entries that are gone");
  if (foreign_) {  // no free list: every page's references are its requests
    for (std::size_t p = 0; p < refs_.size(); ++p) {
      ESS_ASSERT(refs_[p] == holders[p], "page {}: {} references, {} holders", p, refs_[p], holders[p]);
    }
  } else {
    std::vector<std::uint8_t> is_free(static_cast<std::size_t>(groups_), 0);
    for (const std::int32_t g : free_) {
      ESS_ASSERT(g >= 0 && g < groups_ && is_free[static_cast<std::size_t>(g)] == 0, "page group {} is free twice", g);
      is_free[static_cast<std::size_t>(g)] = 1;
    }
    for (std::size_t p = 0; p < refs_.size(); ++p) {
      const std::size_t g = p % static_cast<std::size_t>(groups_);
      ESS_ASSERT(refs_[p] == holders[p], "page {}: {} references, {} holders", p, refs_[p], holders[p]);
      ESS_ASSERT((refs_[p] == 0) == (is_free[g] != 0), "page {}: {} references but its group is {}free", p, refs_[p],
                 is_free[g] != 0 ? "" : "not ");
      ESS_ASSERT(refs_[p] == refs_[g], "page {} (layer {}): {} references; its group's layer-0 page has {}", p,
                 p / static_cast<std::size_t>(groups_), refs_[p], refs_[g]);
    }
  }
  for (const auto& [id, r] : requests_) {
    for (std::size_t i = 0; i < r.pages.front().size(); ++i) {
      for (int l = 0; l < num_layers_; ++l) {
        const auto group = static_cast<std::int32_t>(r.pages.front()[i] - layer_first_.front());
        ESS_ASSERT(r.pages[static_cast<std::size_t>(l)][i] == page_of(l, group),
                   "request {}: page {} of layer {} is not in its group {}", id, i, l, group);
      }
    }
  }
}

}  // namespace ess
