// The Total Memory Pool on another engine's host block pool (total_pool.h, "Foreign pages"): the
// pool over the other engine's memory, and requests adopted and repaged from its block tables.
#include "ess/cache/total_pool.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "ess/core/digest.h"
#include "ess/core/error.h"

namespace ess {

TotalPool::TotalPool(int num_layers, LatentLayout layout, const ForeignPages& foreign, HostMemoryKind prefer,
                     HostAllocator& allocator)
    : num_layers_(num_layers), layout_(layout), foreign_(true) {
  ESS_CHECK(num_layers > 0, "total pool: num_layers = {} must be positive", num_layers);
  layout_.validate();
  entry_bytes_ = layout_.bytes();
  page_bytes_ = entry_bytes_ * kPageTokens;
  const std::int64_t G = foreign.pages_per_layer;
  ESS_CHECK(G >= 1, "total pool: foreign pages_per_layer = {} must be >= 1", G);
  ESS_CHECK(foreign.page_stride >= page_bytes_,
            "total pool: foreign page_stride = {} B is less than a page of {} tokens x {} B = {} B", foreign.page_stride,
            kPageTokens, entry_bytes_, page_bytes_);
  ESS_CHECK(std::ssize(foreign.layer_first_page) == num_layers, "total pool: {} foreign layer_first_page values for {} layers",
            foreign.layer_first_page.size(), num_layers);
  constexpr std::int64_t kMaxPage = std::numeric_limits<std::int32_t>::max();
  ESS_CHECK(G <= kMaxPage, "total pool: foreign pages_per_layer = {} exceeds the {} a page id can address", G, kMaxPage);
  std::vector<std::pair<std::int64_t, int>> regions;  // (first page, layer)
  for (int l = 0; l < num_layers; ++l) {
    const std::int64_t first = foreign.layer_first_page[static_cast<std::size_t>(l)];
    ESS_CHECK(first >= 0 && first <= kMaxPage - G,
              "total pool: foreign layer_first_page[{}] = {}: outside [0, {}] (its {} pages must have int32 ids)", l, first,
              kMaxPage - G, G);
    regions.emplace_back(first, l);
  }
  std::sort(regions.begin(), regions.end());
  for (std::size_t i = 1; i < regions.size(); ++i) {
    ESS_CHECK(regions[i].first >= regions[i - 1].first + G,
              "total pool: foreign layers {} and {} overlap (pages {} and {}, {} pages each)", regions[i - 1].second,
              regions[i].second, regions[i - 1].first, regions[i].first, G);
  }
  const std::int64_t arena_pages = regions.back().first + G;
  std::uint64_t arena_bytes = 0;
  ESS_CHECK(!__builtin_mul_overflow(static_cast<std::uint64_t>(arena_pages), foreign.page_stride, &arena_bytes),
            "total pool: foreign pages: {} pages of {} B overflow 64 bits", arena_pages, foreign.page_stride);
  groups_ = G;
  capacity_pages_ = G * num_layers;
  page_stride_ = foreign.page_stride;
  layer_first_ = foreign.layer_first_page;
  arena_ = HostBuffer::allocate(static_cast<std::size_t>(arena_bytes), prefer, allocator);
  refs_.assign(static_cast<std::size_t>(arena_pages), 0);
}

void TotalPool::require_own_pages(const char* what, RequestId id) const {
  ESS_CHECK(!foreign_,
            "total pool: {} of request {}: the pool is on foreign pages (another engine's host block pool), which only "
            "that engine hands out; adopt and repage take its pages",
            what, id);
}

void TotalPool::check_foreign(RequestId id, std::int64_t length, std::int64_t page_count, std::int64_t first,
                              std::span<const std::int32_t> pages, const char* what) const {
  ESS_CHECK(foreign_, "total pool: {} of request {}: the pool hands out its own pages (no foreign pages)", what, id);
  ESS_CHECK(length >= 1 && length <= std::numeric_limits<std::int32_t>::max(),
            "total pool: {} of request {}: length {} outside [1, {}]", what, id, length,
            std::numeric_limits<std::int32_t>::max());
  const std::int64_t per_layer = pages_for(length) / num_layers_;
  ESS_CHECK(page_count == per_layer, "total pool: {} of request {}: {} pages for {} tokens; {} expected", what, id,
            page_count, length, per_layer);
  for (std::size_t i = 0; i < pages.size(); ++i) {
    ESS_CHECK(pages[i] >= 0 && pages[i] < groups_, "total pool: {} of request {}: page {} is {}, outside [0, {})", what,
              id, first + static_cast<std::int64_t>(i), pages[i], groups_);
  }
}

void TotalPool::adopt(RequestId id, std::int64_t length, std::span<const std::int32_t> pages) {
  ESS_CHECK(!requests_.contains(id), "total pool: request {} is already admitted", id);
  check_foreign(id, length, std::ssize(pages), 0, pages, "adoption");
  Request r;
  r.length = length;
  r.pages.resize(static_cast<std::size_t>(num_layers_));
  for (int l = 0; l < num_layers_; ++l) {
    auto& table = r.pages[static_cast<std::size_t>(l)];
    table.reserve(pages.size());
    for (const std::int32_t g : pages) table.push_back(page_of(l, g));
  }
  auto [it, inserted] = requests_.emplace(id, std::move(r));  // may throw: nothing changed yet
  (void)inserted;
  for (const auto& table : it->second.pages) {
    for (const std::int32_t p : table) ++refs_[static_cast<std::size_t>(p)];
  }
}

void TotalPool::repage(RequestId id, std::int64_t length, std::int64_t first_page, std::span<const std::int32_t> pages) {
  auto it = requests_.find(id);
  ESS_CHECK(it != requests_.end(), "total pool: repage of unknown request {}", id);
  ESS_CHECK(foreign_, "total pool: repage of request {}: the pool hands out its own pages (no foreign pages)", id);
  auto& tables = it->second.pages;
  ESS_CHECK(first_page >= 0 && first_page <= std::ssize(tables.front()),
            "total pool: repage of request {}: first_page {} outside [0, {}] (its pages)", id, first_page,
            tables.front().size());
  check_foreign(id, length, first_page + std::ssize(pages), first_page, pages, "repage");
  const auto count = static_cast<std::size_t>(first_page) + pages.size();
  for (auto& table : tables) table.reserve(count);  // may throw: nothing changed yet
  // Only the pages from first_page on change: the earlier ones keep their references.
  for (int l = 0; l < num_layers_; ++l) {
    auto& table = tables[static_cast<std::size_t>(l)];
    for (auto p = table.begin() + first_page; p != table.end(); ++p) --refs_[static_cast<std::size_t>(*p)];
    table.resize(static_cast<std::size_t>(first_page));
    for (const std::int32_t g : pages) {
      table.push_back(page_of(l, g));
      ++refs_[static_cast<std::size_t>(table.back())];
    }
  }
  it->second.length = length;
}

}  // namespace ess
