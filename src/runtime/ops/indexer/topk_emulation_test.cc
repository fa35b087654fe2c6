// The top-k kernel's own row program (topk_kernel.h) run on the CPU by the CTA emulator
// (cta_emulator.h: ballots and __match_any_sync as warp collectives, cub's block scan, and
// cub's BlockRadixSort::SortDescending as a stable block-wide sort of the blocked items), on
// the cases of indexer_cases.h, with the launch topk.cu makes (one 1,024-thread block per
// row, the key cache of min(stride, 32,768) keys after the program's shared state). The
// logits kernel is not emulated yet (docs/gpu-validation.md): the logits these cases feed the
// top-k come from the CPU reference, so the end-to-end cases check the top-k half only. Every
// buffer is guarded. Runs without a device; label emulation.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <numeric>
#include <vector>

#include "indexer_cases.h"
#include "runtime/ops/cta_emulator.h"
#include "runtime/ops/indexer/topk_kernel.h"
#include "runtime/ops/launch_args.h"

namespace ess::indexer_test {
namespace {

namespace tk = cuda::topk_row;

class Prims {
 public:
  Prims(emu::Cta& c, std::vector<std::pair<std::uint32_t, std::int32_t>>& sort) : c_(c), sort_(sort) {}
  int tid() const { return c_.tid(); }
  unsigned block() const { return c_.block(); }
  void sync() const { c_.sync(); }
  unsigned ballot(bool v) const { return c_.ballot(v); }
  unsigned match_any(unsigned mask, std::uint32_t v) const { return c_.match_any(mask, v); }
  void atomic_add_shared(int* p, int v) const { *p += v; }  // fibers never run concurrently
  void atomic_min_global(unsigned* p, unsigned v) const { *p = std::min(*p, v); }
  void exclusive_sum(int v, int& before, int& total) const { c_.exclusive_sum(v, before, total); }
  // Stable descending sort of every thread's blocked items; thread t gets ranks t x kItems ...
  // (the sort shares the scan's storage in topk.cu: the emulator's reuse check covers it).
  void sort_descending(std::uint32_t (&keys)[tk::kItems], std::int32_t (&idx)[tk::kItems]) const {
    std::int64_t in[tk::kItems], ignored[tk::kItems], total = 0;
    for (int i = 0; i < tk::kItems; ++i) {
      sort_[static_cast<std::size_t>(tid() * tk::kItems + i)] = {keys[i], idx[i]};
      in[i] = 0;
    }
    c_.exclusive_sum(in, ignored, total);  // a barrier after every deposit (and the storage rule)
    if (tid() == 0) {
      std::stable_sort(sort_.begin(), sort_.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    }
    c_.sync();
    for (int i = 0; i < tk::kItems; ++i) {
      keys[i] = sort_[static_cast<std::size_t>(tid() * tk::kItems + i)].first;
      idx[i] = sort_[static_cast<std::size_t>(tid() * tk::kItems + i)].second;
    }
    c_.sync();
  }

 private:
  emu::Cta& c_;
  std::vector<std::pair<std::uint32_t, std::int32_t>>& sort_;
};

std::uint64_t seed = 1;

TopkRun emulated_topk(const std::vector<float>& logits, std::int64_t stride, const std::vector<std::int32_t>& lengths, int k,
                      bool report_nan) {
  emu::Guarded<float> x;
  x.assign(logits);
  emu::Guarded<std::int32_t> len, out(lengths.size() * static_cast<std::size_t>(k), 0x77);
  len.assign(lengths);
  emu::Guarded<int> nan_row;
  nan_row.assign({-1});
  cuda::TopkArgs ta;
  ta.rows = static_cast<std::int64_t>(lengths.size());
  ta.k = k;
  ta.logits = x.data();
  ta.stride = stride;
  ta.lengths = len.data();
  ta.out = out.data();
  ta.nan_row = report_nan ? nan_row.data() : nullptr;
  EXPECT_EQ(cuda::check_args(ta), "");
  const int cache_n = static_cast<int>(stride < tk::kCacheKeys ? stride : tk::kCacheKeys);
  const std::size_t fixed = (sizeof(tk::Shared) + 15) / 16 * 16;
  std::vector<std::pair<std::uint32_t, std::int32_t>> sort(static_cast<std::size_t>(tk::kThreads * tk::kItems));
  if (ta.rows > 0) {
    emu::launch("topk", static_cast<unsigned>(ta.rows), tk::kThreads, fixed + static_cast<std::size_t>(cache_n) * 4, seed++,
                [&](emu::Cta& c, std::uint8_t* smem) {
                  Prims p(c, sort);
                  tk::topk_cta(ta.logits, ta.stride, ta.lengths, ta.k, ta.out, ta.nan_row, cache_n,
                               *reinterpret_cast<tk::Shared*>(smem), reinterpret_cast<std::uint32_t*>(smem + fixed), p);
                });
  }
  for (const std::string& d : {x.damage(), len.damage(), out.damage(), nan_row.damage()}) {
    EXPECT_TRUE(d.empty()) << "top-k: a buffer " << d;
  }
  TopkRun run;
  run.out = out.values();
  run.nan_row = report_nan ? nan_row[0] : -1;
  return run;
}

// The logits the end-to-end cases hand to the top-k: the CPU reference's (the logits kernel is
// not emulated), written only below each query token's length, as the kernel writes them.
std::vector<float> reference_logits(const Problem& p) {
  const Reference r = reference(p);
  std::vector<float> out(r.logits.size(), std::bit_cast<float>(kSentinel));
  for (std::size_t row = 0; row < p.lengths.size(); ++row) {
    const std::size_t at = row * static_cast<std::size_t>(p.stride);
    for (std::int32_t j = 0; j < p.lengths[row]; ++j) out[at + static_cast<std::size_t>(j)] = r.logits[at + static_cast<std::size_t>(j)];
  }
  return out;
}

bool always() { return true; }

}  // namespace

const IndexerBackend& indexer_backend() {
  static const IndexerBackend b{{"emulator (top-k; logits from the reference)", always}, reference_logits, emulated_topk};
  return b;
}

}  // namespace ess::indexer_test
