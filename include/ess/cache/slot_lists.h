// Intrusive doubly linked lists over slot indices, for replacement policies: slots 0..n-1 are
// nodes, and list i has the sentinel node n + i (an empty list's sentinel links to itself).
// O(1) unlink and insertion, no allocation after construction.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ess {

class SlotLists {
 public:
  SlotLists(std::int32_t slots, int lists)
      : n_(slots),
        prev_(static_cast<std::size_t>(slots < 0 ? 0 : slots) + static_cast<std::size_t>(lists)),
        next_(prev_.size()) {
    for (int i = 0; i < lists; ++i) prev_[head(i)] = next_[head(i)] = head(i);
  }

  std::int32_t head(int list) const { return n_ + list; }  // the sentinel node
  std::int32_t first(int list) const { return next_[head(list)]; }
  std::int32_t last(int list) const { return prev_[head(list)]; }
  std::int32_t next(std::int32_t node) const { return next_[node]; }
  std::int32_t prev(std::int32_t node) const { return prev_[node]; }

  void unlink(std::int32_t s) {
    next_[prev_[s]] = next_[s];
    prev_[next_[s]] = prev_[s];
  }
  void push_back(int list, std::int32_t s) { link(prev_[head(list)], s, head(list)); }
  void push_front(int list, std::int32_t s) { link(head(list), s, next_[head(list)]); }

  // The forward links of every node (slots, then sentinels): what a digest of the order hashes.
  std::span<const std::int32_t> links() const { return next_; }

 private:
  // Puts s between the adjacent nodes a and b.
  void link(std::int32_t a, std::int32_t s, std::int32_t b) {
    next_[a] = s;
    prev_[s] = a;
    next_[s] = b;
    prev_[b] = s;
  }

  std::int32_t n_;
  std::vector<std::int32_t> prev_;
  std::vector<std::int32_t> next_;
};

}  // namespace ess
