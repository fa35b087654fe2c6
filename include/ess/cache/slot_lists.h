// Intrusive doubly linked lists over slot indices, for replacement policies: slots 0..n-1 are
// nodes, and list i has the sentinel node n + i (an empty list's sentinel links to itself).
// O(1) unlink and insertion, no allocation after construction (links(), for digests, copies).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ess {

class SlotLists {
 public:
  SlotLists(std::int32_t slots, int lists)
      : n_(slots), link_(static_cast<std::size_t>(slots < 0 ? 0 : slots) + static_cast<std::size_t>(lists)) {
    for (int i = 0; i < lists; ++i) link_[head(i)] = {head(i), head(i)};
  }

  std::int32_t head(int list) const { return n_ + list; }  // the sentinel node
  std::int32_t first(int list) const { return link_[head(list)].next; }
  std::int32_t last(int list) const { return link_[head(list)].prev; }
  std::int32_t next(std::int32_t node) const { return link_[node].next; }
  std::int32_t prev(std::int32_t node) const { return link_[node].prev; }

  void unlink(std::int32_t s) {
    const Link l = link_[s];
    link_[l.prev].next = l.next;
    link_[l.next].prev = l.prev;
  }
  void push_back(int list, std::int32_t s) { link(link_[head(list)].prev, s, head(list)); }
  void push_front(int list, std::int32_t s) { link(head(list), s, link_[head(list)].next); }
  // push_back of each of `nodes` in turn (unlinked, distinct), in one pass.
  void push_back_all(int list, std::span<const std::int32_t> nodes) {
    std::int32_t a = link_[head(list)].prev;
    for (const std::int32_t s : nodes) {
      link_[a].next = s;
      link_[s].prev = a;
      a = s;
    }
    link_[a].next = head(list);
    link_[head(list)].prev = a;
  }
  // A hint that node s is about to be unlinked: its links start loading now.
  void prefetch(std::int32_t s) const { __builtin_prefetch(link_.data() + s, 1); }

  // The forward link of every node (slots, then sentinels): what a digest of the order hashes.
  std::vector<std::int32_t> links() const {
    std::vector<std::int32_t> next(link_.size());
    for (std::size_t i = 0; i < link_.size(); ++i) next[i] = link_[i].next;
    return next;
  }

 private:
  // A node's two links side by side: an unlink reads one cache line for them.
  struct Link {
    std::int32_t prev;
    std::int32_t next;
  };
  // Puts s between the adjacent nodes a and b.
  void link(std::int32_t a, std::int32_t s, std::int32_t b) {
    link_[a].next = s;
    link_[s] = {a, b};
    link_[b].prev = s;
  }

  std::int32_t n_;
  std::vector<Link> link_;
};

}  // namespace ess
