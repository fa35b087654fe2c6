#include "ess/cache/total_pool.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "ess/core/digest.h"
#include "ess/core/error.h"

namespace ess {

TotalPool::TotalPool(int num_layers, LatentLayout layout, std::uint64_t capacity_bytes,
                     HostMemoryKind prefer, HostAllocator& allocator)
    : num_layers_(num_layers), layout_(layout) {
  ESS_CHECK(num_layers > 0, "total pool: num_layers = {} must be positive", num_layers);
  layout_.validate();
  entry_bytes_ = layout_.bytes();
  page_bytes_ = entry_bytes_ * kPageTokens;
  // Layer-major: layer l's pages are arena pages [l x G, (l + 1) x G), and page i of a request
  // is the same index g in every layer's region (taken and freed for all layers at once).
  groups_ = static_cast<std::int64_t>(capacity_bytes / (page_bytes_ * static_cast<std::uint64_t>(num_layers)));
  ESS_CHECK(groups_ >= 1,
            "total pool: capacity_bytes = {} is smaller than one page of each of the {} layers ({} tokens x {} B x {} "
            "= {} B)",
            capacity_bytes, num_layers, kPageTokens, entry_bytes_, num_layers,
            page_bytes_ * static_cast<std::uint64_t>(num_layers));
  ESS_CHECK(groups_ <= std::numeric_limits<std::int32_t>::max() / num_layers,
            "total pool: capacity_bytes = {} is {} pages, more than the {} a page id can address", capacity_bytes,
            groups_ * num_layers, std::numeric_limits<std::int32_t>::max());
  capacity_pages_ = groups_ * num_layers;
  page_stride_ = page_bytes_;
  for (int l = 0; l < num_layers; ++l) layer_first_.push_back(l * groups_);
  arena_ = HostBuffer::allocate(static_cast<std::size_t>(capacity_pages_) * page_bytes_, prefer, allocator);
  refs_.assign(static_cast<std::size_t>(capacity_pages_), 0);
  free_.resize(static_cast<std::size_t>(groups_));
  for (std::int64_t i = 0; i < groups_; ++i) {
    free_[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(groups_ - 1 - i);
  }
}

std::uint64_t TotalPool::used_bytes() const {
  if (!foreign_) return static_cast<std::uint64_t>(capacity_pages_ - free_pages()) * page_bytes_;
  const auto held = std::count_if(refs_.begin(), refs_.end(), [](std::int32_t r) { return r > 0; });
  return static_cast<std::uint64_t>(held) * page_bytes_;
}

std::int64_t TotalPool::pages_for(std::int64_t length) const {
  return (length + kPageTokens - 1) / kPageTokens * num_layers_;
}

std::int32_t TotalPool::take_group() {
  const std::int32_t g = free_.back();
  free_.pop_back();
  for (int l = 0; l < num_layers_; ++l) {
    const std::int32_t p = page_of(l, g);
    std::memset(arena_.data() + static_cast<std::size_t>(p) * page_bytes_, 0, page_bytes_);
    refs_[static_cast<std::size_t>(p)] = 1;
  }
  return g;
}

void TotalPool::grow_tables(Request& r, std::size_t per_layer) {
  while (r.pages.front().size() < per_layer) {
    const std::int32_t g = take_group();
    for (int l = 0; l < num_layers_; ++l) r.pages[static_cast<std::size_t>(l)].push_back(page_of(l, g));
  }
}

void TotalPool::drop_page(std::int32_t page) {
  // Every layer's page of a group has the same holders (check_invariants); the group is free
  // once its last layer's page is dropped, which every caller drops last.
  if (--refs_[static_cast<std::size_t>(page)] == 0 && !foreign_ && page / groups_ == num_layers_ - 1) {
    free_.push_back(static_cast<std::int32_t>(page % groups_));
  }
}

void TotalPool::admit(RequestId id, std::int64_t length) {
  require_own_pages("admission", id);
  ESS_CHECK(!requests_.contains(id), "total pool: request {} is already admitted", id);
  ESS_CHECK(length >= 0 && length <= std::numeric_limits<std::int32_t>::max(),
            "total pool: request {}: length {} out of range [0, {}]", id, length,
            std::numeric_limits<std::int32_t>::max());
  const std::int64_t need = pages_for(length);
  make_room(need, {}, "admission", id);
  Request r;
  r.length = length;
  r.pages.resize(static_cast<std::size_t>(num_layers_));
  const std::int64_t per_layer = need / num_layers_;
  for (auto& table : r.pages) table.reserve(static_cast<std::size_t>(per_layer));
  auto [it, inserted] = requests_.emplace(id, std::move(r));  // may throw: nothing taken yet
  (void)inserted;
  grow_tables(it->second, static_cast<std::size_t>(per_layer));  // reserved: no throw
}

void TotalPool::extend(RequestId id, std::int64_t n) {
  auto it = requests_.find(id);
  ESS_CHECK(it != requests_.end(), "total pool: extend of unknown request {}", id);
  require_own_pages("growth", id);
  Request& r = it->second;
  ESS_CHECK(n >= 0 && n <= std::numeric_limits<std::int32_t>::max() - r.length,
            "total pool: request {}: cannot extend length {} by {} tokens", id, r.length, n);
  const std::int64_t new_length = r.length + n;
  const std::int64_t need = pages_for(new_length) - pages_for(r.length);
  make_room(need, {}, "growth", id);
  const std::size_t per_layer = static_cast<std::size_t>(pages_for(new_length) / num_layers_);
  for (auto& table : r.pages) table.reserve(per_layer);  // may throw: nothing changed yet
  grow_tables(r, per_layer);
  r.length = new_length;
}

void TotalPool::truncate(RequestId id, std::int64_t length) {
  auto it = requests_.find(id);
  ESS_CHECK(it != requests_.end(), "total pool: truncate of unknown request {}", id);
  Request& r = it->second;
  ESS_CHECK(length >= 0 && length <= r.length, "total pool: request {}: truncate to {} tokens, outside [0, {}]", id,
            length, r.length);
  if (length == r.length) return;
  const std::int64_t first_page = length / kPageTokens;
  for (const auto& table : r.pages) {
    for (std::size_t p = static_cast<std::size_t>(first_page); p < table.size() && !foreign_; ++p) {
      ESS_CHECK(refs_[static_cast<std::size_t>(table[p])] == 1,
                "total pool: request {}: truncate to {} tokens reaches page {}, which it shares", id, length, p);
    }
  }
  const auto keep = static_cast<std::size_t>(pages_for(length) / num_layers_);
  const std::size_t from = static_cast<std::size_t>(length % kPageTokens) * entry_bytes_;
  for (auto& table : r.pages) {
    if (keep > 0 && from > 0 && !foreign_) {  // the kept last page: its entries past the length
      std::memset(arena_.data() + static_cast<std::size_t>(table[keep - 1]) * page_stride_ + from, 0, page_bytes_ - from);
    }
    while (table.size() > keep) {
      drop_page(table.back());
      table.pop_back();
    }
  }
  r.length = length;
}

void TotalPool::release(RequestId id) {
  auto it = requests_.find(id);
  ESS_CHECK(it != requests_.end(), "total pool: release of unknown request {}", id);
  free_.reserve(static_cast<std::size_t>(groups_));
  for (const auto& table : it->second.pages) {
    for (auto p = table.rbegin(); p != table.rend(); ++p) drop_page(*p);
  }
  for (auto h = it->second.cached.rbegin(); h != it->second.cached.rend(); ++h) unuse_entry(*h);
  requests_.erase(it);
}

const TotalPool::Request& TotalPool::find(RequestId id, const char* what) const {
  auto it = requests_.find(id);
  ESS_CHECK(it != requests_.end(), "total pool: {} of unknown request {}", what, id);
  return it->second;
}

std::int64_t TotalPool::length(RequestId id) const { return find(id, "length").length; }

TotalPoolUsage TotalPool::usage(RequestId id) const {
  const Request& r = find(id, "usage");
  TotalPoolUsage u;
  u.length = r.length;
  u.pages = pages_for(r.length);
  u.bytes = static_cast<std::uint64_t>(u.pages) * page_bytes_;
  u.entry_bytes = static_cast<std::uint64_t>(r.length) * num_layers_ * entry_bytes_;
  for (const auto& table : r.pages) {
    for (const std::int32_t p : table) u.shared_pages += page_refs(p) > 1 ? 1 : 0;
  }
  u.shared_bytes = static_cast<std::uint64_t>(u.shared_pages) * page_bytes_;
  return u;
}

std::vector<RequestId> TotalPool::requests() const {
  std::vector<RequestId> ids;
  ids.reserve(requests_.size());
  for (const auto& [id, r] : requests_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

void TotalPool::check_token(RequestId id, const Request& r, int layer, std::int64_t token,
                            const char* what) const {
  ESS_CHECK(layer >= 0 && layer < num_layers_, "total pool: {} of request {}: layer {} out of [0, {})",
            what, id, layer, num_layers_);
  ESS_CHECK(token >= 0 && token < r.length,
            "total pool: {} of request {} layer {}: token {} out of [0, {})", what, id, layer, token,
            r.length);
}

void TotalPool::retire(RequestId from, RequestId to) {
  ESS_CHECK(!requests_.contains(to), "total pool: retire of request {} as {}: {} is already admitted", from, to, to);
  auto it = requests_.find(from);
  ESS_CHECK(it != requests_.end(), "total pool: retire of unknown request {}", from);
  auto node = requests_.extract(it);  // no allocation: the node moves
  node.key() = to;
  std::vector<std::uint64_t> cached = std::move(node.mapped().cached);
  node.mapped().cached.clear();
  requests_.insert(std::move(node));
  for (auto h = cached.rbegin(); h != cached.rend(); ++h) unuse_entry(*h);
}

std::uint64_t TotalPool::offset(RequestId id, int layer, std::int64_t token) const {
  const Request& r = find(id, "offset");
  check_token(id, r, layer, token, "offset");
  return entry_offset(r.pages[static_cast<std::size_t>(layer)], token);
}

std::span<const std::int32_t> TotalPool::page_table(RequestId id, int layer) const {
  const Request& r = find(id, "page table");
  ESS_CHECK(layer >= 0 && layer < num_layers_, "total pool: page table of request {}: layer {} out of [0, {})", id,
            layer, num_layers_);
  return r.pages[static_cast<std::size_t>(layer)];
}

const std::uint8_t* TotalPool::layer_base(int layer) const {
  ESS_CHECK(layer >= 0 && layer < num_layers_, "total pool: layer {} out of [0, {})", layer, num_layers_);
  return arena_.data() + static_cast<std::size_t>(page_of(layer, 0)) * page_stride_;
}

std::vector<std::int32_t> TotalPool::page_indices(RequestId id) const {
  std::vector<std::int32_t> pages = find(id, "page indices").pages.front();
  for (std::int32_t& p : pages) p = static_cast<std::int32_t>(p - layer_first_.front());
  return pages;
}

std::span<const std::uint8_t> TotalPool::entry(RequestId id, int layer, std::int64_t token) const {
  return {arena_.data() + offset(id, layer, token), entry_bytes_};
}

void TotalPool::write(RequestId id, int layer, std::int64_t token, std::span<const std::uint8_t> bytes) {
  ESS_CHECK(bytes.size() == entry_bytes_, "total pool: write of request {} layer {} token {}: {} bytes, expected {}",
            id, layer, token, bytes.size(), entry_bytes_);
  const auto e = writable_entry(id, layer, token);
  std::memcpy(e.data(), bytes.data(), entry_bytes_);
}

std::span<std::uint8_t> TotalPool::writable_entry(RequestId id, int layer, std::int64_t token) {
  const std::uint64_t off = offset(id, layer, token);
  const auto page = static_cast<std::int32_t>(off / page_stride_);
  ESS_CHECK(page_refs(page) == 1,
            "total pool: write of request {} layer {} token {}: its page is shared ({} holders: requests on the same "
            "prefix, or the prefix cache); shared prefix entries are read-only",
            id, layer, token, page_refs(page));
  return {arena_.data() + off, entry_bytes_};
}

std::uint64_t TotalPool::digest() const {
  Digest d;
  d.value(capacity_pages_);
  d.values(std::span<const std::int32_t>(free_));
  d.values(std::span<const std::int32_t>(refs_));
  d.value(clock_);
  std::vector<std::uint64_t> hashes;
  for (const auto& [h, e] : cache_) hashes.push_back(h);
  std::sort(hashes.begin(), hashes.end());
  for (const std::uint64_t h : hashes) {
    const CacheEntry& e = cache_.at(h);
    d.value(h);
    d.value(e.parent);
    d.value(e.has_parent);
    d.values(std::span<const std::int32_t>(e.pages));
    d.value(e.users);
    d.value(e.children);
    d.value(e.last_use);
  }
  for (RequestId id : requests()) {
    const Request& r = requests_.at(id);
    d.value(id);
    d.value(r.length);
    d.values(std::span<const std::uint64_t>(r.cached));
    for (const auto& table : r.pages) {
      d.values(std::span<const std::int32_t>(table));
      for (std::int32_t p : table) d.bytes(arena_.data() + static_cast<std::size_t>(p) * page_stride_, page_bytes_);
    }
  }
  return d.get();
}

}  // namespace ess
