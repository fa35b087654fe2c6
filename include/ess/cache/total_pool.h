// Total Memory Pool: every layer's latent entries of every request, in host memory.
//
// Memory is one arena (pinned when a CUDA device is present, see host_memory.h) cut into
// pages of 64 tokens of one layer (64 x 656 B = 41,984 B for DeepSeek-V3.2). Each request has
// one page table per layer; it grows as decode appends tokens. Admission and growth are
// all-or-nothing: when the pages do not fit, nothing is allocated and nothing changes.
//
// Layer-major, in lockstep: the arena is one region per layer, G pages each, and a request's
// page i is the same index g in every layer's region (layer_base(l) + g x page_bytes). Another
// engine's transfer backend can therefore write a request's pages of every layer from one list
// of page indices (page_indices), as SGLang's PD transfer addresses its host pool.
//
// Shared prefixes. Pages are reference-counted. A request admitted on a prefix shares the
// full pages of that prefix in every layer (of a live request: admit_shared; of the prefix
// cache: admit_cached) and copies only the rest of the prefix (its partial last page). A shared page is read-only: a
// page is only ever shared while it is full, so decode appends never reach one, and a write
// into one is refused by name. The prefix cache indexes full pages by a chain of per-page
// hashes of the prompt's token ids (prefix_page_hashes, as vLLM hashes its blocks): publish
// registers a request's written prompt pages; after release they stay retained, found again
// by admit_cached, and are evicted least recently used first, chain leaves first, when an
// admission or growth would otherwise not fit (a refusal evicts nothing; an allocation
// failure after the eviction may leave it done). See docs/architecture.md, "Shared prefixes".
//
// Foreign pages. The pool may instead sit on another engine's host block pool (vLLM's HiSparse
// host pool): that engine hands out the pages and ESS addresses them. Then the arena is that
// engine's memory, layer l's page g is arena page layer_first_page[l] + g (page_stride bytes
// each), requests get their pages by adopt and repage (the caller's block tables), and the
// pool never takes, zeroes, frees, evicts or caches a page. See docs/architecture.md,
// "Foreign pages".
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ess/cache/host_memory.h"
#include "ess/cache/types.h"
#include "ess/model/entry_layout.h"

namespace ess {

struct TotalPoolUsage {
  std::int64_t length = 0;        // tokens
  std::int64_t pages = 0;         // pages over all layers
  std::uint64_t bytes = 0;        // pages * page_bytes (what the request holds)
  std::uint64_t entry_bytes = 0;  // length * layers * entry_bytes (what it uses)
  std::int64_t shared_pages = 0;  // of `pages`, those another request or the prefix cache holds too
  std::uint64_t shared_bytes = 0;
};

// The whole pool's bytes by who holds them; live + retained + free = capacity.
struct TotalPoolAccount {
  std::uint64_t live_bytes = 0;      // pages some live request holds
  std::uint64_t shared_bytes = 0;    // of those, pages more than one holder (requests, the cache) holds
  std::uint64_t retained_bytes = 0;  // pages only the prefix cache holds (finished requests' prefixes)
  std::uint64_t free_bytes = 0;
  std::uint64_t unshared_bytes = 0;  // what the live requests would hold without sharing
  std::int64_t cached_pages = 0;     // prefix cache entries (one per page index: every layer's page)
};

// Another engine's host block pool as the pool's pages (see the top of this file).
struct ForeignPages {
  std::int64_t pages_per_layer = 0;              // 0: the pool hands out its own pages
  std::uint64_t page_stride = 0;                 // bytes from one page to the next; >= 64 entries
  std::vector<std::int64_t> layer_first_page;    // per layer: its page 0, in pages from the arena's start
  bool enabled() const { return pages_per_layer > 0; }
};

// Chained hashes of the full 64-token pages of a prompt: hash i covers token ids [0, 64 (i + 1)).
std::vector<std::uint64_t> prefix_page_hashes(std::span<const std::int32_t> token_ids);

class TotalPool {
 public:
  // capacity_bytes is rounded down to whole pages of every layer (a multiple of num_layers
  // pages); it must hold at least one page of each layer. The arena
  // comes from `allocator` (an engine's own pinned buffer, say); it must outlive the pool.
  TotalPool(int num_layers, LatentLayout layout, std::uint64_t capacity_bytes,
            HostMemoryKind prefer = HostMemoryKind::kPinned, HostAllocator& allocator = default_host_allocator());
  // On foreign pages: the arena, (max layer_first_page + pages_per_layer) x page_stride bytes,
  // comes from `allocator` (the other engine's pool, typically); the layers' regions must not
  // overlap. Throws naming the field otherwise.
  TotalPool(int num_layers, LatentLayout layout, const ForeignPages& foreign,
            HostMemoryKind prefer = HostMemoryKind::kPinned, HostAllocator& allocator = default_host_allocator());

  // Admits a request with `length` tokens (entries zeroed). Throws when the id is already
  // admitted or the pages do not fit; then nothing changes.
  void admit(RequestId id, std::int64_t length);
  // Appends `n` tokens (entries zeroed) to every layer of the request: the D2H write-back
  // target of the tokens a decode step produces. All-or-nothing.
  void extend(RequestId id, std::int64_t n);
  // Shortens the request to `length` tokens (<= its length): the entries past it are zeroed
  // and the pages past it freed, so that a later extend appends zeroed entries again. The
  // tokens removed must lie on pages the request holds alone (not shared, not cached).
  void truncate(RequestId id, std::int64_t length);
  // Admits a request of `length` tokens whose first `prefix` tokens are those of the admitted
  // request `source` (prefix <= both lengths): it shares source's full pages below
  // min(prefix, share_limit) (-1: no limit), gets a copy of the prefix's other entries, and
  // zeroed pages after.
  void admit_shared(RequestId id, std::int64_t length, RequestId source, std::int64_t prefix,
                    std::int64_t share_limit = -1);
  // Admits a request of `length` tokens on the longest chain of cached pages its prompt's page
  // hashes (prefix_page_hashes) find, among the pages below min(length, share_limit) (-1: no
  // limit); returns the tokens reused (a multiple of 64), whose entries are already there.
  std::int64_t admit_cached(RequestId id, std::int64_t length, std::span<const std::uint64_t> page_hashes,
                            std::int64_t share_limit = -1);
  // Registers the request's first full pages (their entries written) in the prefix cache, one
  // per hash, continuing the chain the request already uses. It stops at the first hash that
  // is cached already (another request published that content; the pages after it stay
  // unregistered). Returns the pages added. From then on those pages are read-only.
  std::int64_t publish(RequestId id, std::span<const std::uint64_t> page_hashes);
  // Foreign pages only. Admits a request of `length` tokens on the given pages (page i holds
  // tokens [64 i, 64 i + 64) of every layer: ceil(length / 64) indices in [0, pages_per_layer)),
  // whose entries the other engine has written (nothing is zeroed or copied). A page may be held
  // by several requests (that engine's prefix sharing): it is then read-only here.
  void adopt(RequestId id, std::int64_t length, std::span<const std::int32_t> pages);
  // Foreign pages only. The request's length anew and its pages from page `first_page` on
  // (those before it kept; first_page <= its page count): its engine grew or shortened it, or
  // moved a page to a copy of the same entries. The same rules as adopt for the whole table.
  void repage(RequestId id, std::int64_t length, std::int64_t first_page, std::span<const std::int32_t> pages);
  // Frees the request's pages; the ones the prefix cache holds stay, retained.
  void release(RequestId id);
  // The first half of release(from), for a request whose pages the device may still touch: its
  // prefix-cache holds end now, as release would end them (its cached entries without other users
  // become evictable, in the same order), and its pages stay held, under the id `to` (which must be
  // free: `from` may be admitted again at once), until release(to).
  void retire(RequestId from, RequestId to);
  // Whether an admission or growth that does not fit evicts retained pages (the default) or is
  // refused (ess::PoolFull, as when even eviction would not make room), changing nothing. Off while pages the caller will free soon may make eviction needless.
  void evict_when_full(bool on) { evict_when_full_ = on; }
  // Evicts retained pages, least recently used chain leaves first, until `pages` (in [0,
  // capacity_pages()]) more are free or none is left; returns the pages freed.
  std::int64_t evict(std::int64_t pages);

  bool contains(RequestId id) const { return requests_.contains(id); }
  std::int64_t length(RequestId id) const;
  TotalPoolUsage usage(RequestId id) const;
  TotalPoolAccount account() const;
  std::vector<RequestId> requests() const;  // sorted

  // The entry of (request, layer, token): byte offset from base(), and pointers.
  std::uint64_t offset(RequestId id, int layer, std::int64_t token) const;
  // The request's page table in `layer`: the arena page of each of its pages, valid until the
  // request is next extended, truncated or released. With it, entry_offset is offset()
  // without the look-up, for a token the caller has checked is below length(id).
  std::span<const std::int32_t> page_table(RequestId id, int layer) const;
  std::uint64_t entry_offset(std::span<const std::int32_t> table, std::int64_t token) const {
    return static_cast<std::uint64_t>(table[static_cast<std::size_t>(token / kPageTokens)]) * page_stride_ +
           static_cast<std::uint64_t>(token % kPageTokens) * entry_bytes_;
  }
  std::span<const std::uint8_t> entry(RequestId id, int layer, std::int64_t token) const;
  // Throws naming the page when the entry lies in a shared (read-only) page.
  void write(RequestId id, int layer, std::int64_t token, std::span<const std::uint8_t> bytes);
  // The entry for writing, with write()'s check.
  std::span<std::uint8_t> writable_entry(RequestId id, int layer, std::int64_t token);

  const std::uint8_t* base() const { return arena_.data(); }
  // Layer `layer`'s region: pages_per_layer() pages from layer_base(layer).
  const std::uint8_t* layer_base(int layer) const;
  std::int64_t pages_per_layer() const { return groups_; }
  // Page i of the request, in every layer, is page page_indices(id)[i] of that layer's region.
  // Foreign pages: the indices it was given.
  std::vector<std::int32_t> page_indices(RequestId id) const;
  HostMemoryKind memory_kind() const { return arena_.kind(); }
  int num_layers() const { return num_layers_; }
  const LatentLayout& layout() const { return layout_; }
  std::size_t entry_bytes() const { return entry_bytes_; }
  std::size_t page_bytes() const { return page_bytes_; }
  // Bytes from one arena page to the next: page_bytes(), or the foreign pool's page_stride.
  std::uint64_t page_stride() const { return page_stride_; }
  bool foreign() const { return foreign_; }
  std::int64_t capacity_pages() const { return capacity_pages_; }
  std::int64_t free_pages() const { return static_cast<std::int64_t>(free_.size()) * num_layers_; }
  std::uint64_t capacity_bytes() const { return capacity_pages_ * page_bytes_; }
  // Pages some request or the prefix cache holds (foreign pages: those ESS's requests hold).
  std::uint64_t used_bytes() const;

  // Pages needed to hold `length` tokens of every layer.
  std::int64_t pages_for(std::int64_t length) const;
  // Holders of an arena page: live requests, plus one while the prefix cache indexes it.
  std::int32_t page_refs(std::int32_t page) const { return refs_[static_cast<std::size_t>(page)]; }
  // Digest of the bookkeeping (lengths, page tables, free list, references, the prefix cache)
  // and of every stored entry.
  std::uint64_t digest() const;
  // Throws (internal error) unless every page's references equal its holders, free pages
  // have none, and the prefix cache's users and children are consistent.
  void check_invariants() const;

 private:
  struct Request {
    std::int64_t length = 0;
    std::vector<std::vector<std::int32_t>> pages;  // [layer][page index] -> arena page
    std::vector<std::uint64_t> cached;              // prefix cache entries it uses, in chain order
  };
  struct CacheEntry {
    std::uint64_t parent = 0;          // the previous page's hash (0: the first page)
    bool has_parent = false;
    std::vector<std::int32_t> pages;   // [layer]
    std::int32_t users = 0;            // live requests using it
    std::int32_t children = 0;         // cached entries chained after it
    std::uint64_t last_use = 0;
  };
  const Request& find(RequestId id, const char* what) const;
  void check_token(RequestId id, const Request& r, int layer, std::int64_t token,
                   const char* what) const;
  std::int32_t page_of(int layer, std::int32_t group) const {
    return static_cast<std::int32_t>(layer_first_[static_cast<std::size_t>(layer)] + group);
  }
  // Refuses (naming `what`) on foreign pages, whose pages only the other engine hands out.
  void require_own_pages(const char* what, RequestId id) const;
  // Refuses (naming `what`) unless the pool is on foreign pages, a request of `length` tokens
  // has `page_count` pages, and `pages` (its pages from index `first`) are page indices.
  void check_foreign(RequestId id, std::int64_t length, std::int64_t page_count, std::int64_t first,
                     std::span<const std::int32_t> pages, const char* what) const;
  // A free group: one zeroed page in every layer's region, each with one reference.
  std::int32_t take_group();
  // Appends fresh groups to every layer's table until each has `per_layer` pages (capacity
  // reserved by the caller: no throw).
  void grow_tables(Request& r, std::size_t per_layer);
  void drop_page(std::int32_t page);
  // Pages admissions may free by evicting, keeping the cache entries `keep`.
  std::int64_t evictable_pages(std::span<const std::uint64_t> keep) const;
  // Frees pages by eviction so that `need` are free; refuses (changing nothing) when even
  // evicting every evictable page, `keep` aside, would not be enough.
  void make_room(std::int64_t need, std::span<const std::uint64_t> keep, const char* what, RequestId id);
  void use_entry(std::uint64_t hash);
  void unuse_entry(std::uint64_t hash);
  void update_evictable(std::uint64_t hash);

  int num_layers_;
  LatentLayout layout_;
  std::size_t entry_bytes_;
  std::size_t page_bytes_;
  std::int64_t capacity_pages_;
  std::int64_t groups_;  // pages per layer
  std::uint64_t page_stride_ = 0;
  bool foreign_ = false;
  std::vector<std::int64_t> layer_first_;  // per layer: the arena page of its page 0
  HostBuffer arena_;
  std::vector<std::int32_t> free_;  // free groups, a stack; back() is handed out next
  std::vector<std::int32_t> refs_;  // per arena page
  std::unordered_map<RequestId, Request> requests_;
  std::unordered_map<std::uint64_t, CacheEntry> cache_;
  std::set<std::pair<std::uint64_t, std::uint64_t>> evictable_;  // (last_use, hash): no users, no children
  std::uint64_t clock_ = 0;
  bool evict_when_full_ = true;
};

}  // namespace ess
