// Total Memory Pool: every layer's latent entries of every request, in host memory.
//
// Memory is one arena (pinned when a CUDA device is present, see host_memory.h) cut into
// pages of 64 tokens of one layer (64 x 656 B = 41,984 B for DeepSeek-V3.2). Each request has
// one page table per layer; it grows as decode appends tokens. Admission and growth are
// all-or-nothing: when the pages do not fit, nothing is allocated and nothing changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_map>
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
};

class TotalPool {
 public:
  // capacity_bytes is rounded down to whole pages; it must hold at least one page. The arena
  // comes from `allocator` (an engine's own pinned buffer, say); it must outlive the pool.
  TotalPool(int num_layers, LatentLayout layout, std::uint64_t capacity_bytes,
            HostMemoryKind prefer = HostMemoryKind::kPinned, HostAllocator& allocator = default_host_allocator());

  // Admits a request with `length` tokens (entries zeroed). Throws when the id is already
  // admitted or the pages do not fit; then nothing changes.
  void admit(RequestId id, std::int64_t length);
  // Appends `n` tokens (entries zeroed) to every layer of the request: the D2H write-back
  // target of the tokens a decode step produces. All-or-nothing.
  void extend(RequestId id, std::int64_t n);
  // Frees the request's pages.
  void release(RequestId id);

  bool contains(RequestId id) const { return requests_.contains(id); }
  std::int64_t length(RequestId id) const;
  TotalPoolUsage usage(RequestId id) const;
  std::vector<RequestId> requests() const;  // sorted

  // The entry of (request, layer, token): byte offset from base(), and pointers.
  std::uint64_t offset(RequestId id, int layer, std::int64_t token) const;
  std::span<const std::uint8_t> entry(RequestId id, int layer, std::int64_t token) const;
  void write(RequestId id, int layer, std::int64_t token, std::span<const std::uint8_t> bytes);

  const std::uint8_t* base() const { return arena_.data(); }
  HostMemoryKind memory_kind() const { return arena_.kind(); }
  int num_layers() const { return num_layers_; }
  const LatentLayout& layout() const { return layout_; }
  std::size_t entry_bytes() const { return entry_bytes_; }
  std::size_t page_bytes() const { return page_bytes_; }
  std::int64_t capacity_pages() const { return capacity_pages_; }
  std::int64_t free_pages() const { return static_cast<std::int64_t>(free_.size()); }
  std::uint64_t capacity_bytes() const { return capacity_pages_ * page_bytes_; }
  std::uint64_t used_bytes() const { return (capacity_pages_ - free_pages()) * page_bytes_; }

  // Pages needed to hold `length` tokens of every layer.
  std::int64_t pages_for(std::int64_t length) const;
  // Digest of the bookkeeping (lengths, page tables, free list) and of every stored entry.
  std::uint64_t digest() const;

 private:
  struct Request {
    std::int64_t length = 0;
    std::vector<std::vector<std::int32_t>> pages;  // [layer][page index] -> arena page
  };
  const Request& find(RequestId id, const char* what) const;
  void check_token(RequestId id, const Request& r, int layer, std::int64_t token,
                   const char* what) const;
  std::int32_t take_page();

  int num_layers_;
  LatentLayout layout_;
  std::size_t entry_bytes_;
  std::size_t page_bytes_;
  std::int64_t capacity_pages_;
  HostBuffer arena_;
  std::vector<std::int32_t> free_;  // stack; back() is handed out next
  std::unordered_map<RequestId, Request> requests_;
};

}  // namespace ess
