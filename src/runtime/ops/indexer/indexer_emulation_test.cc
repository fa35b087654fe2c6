// The indexer's two kernels, their own device code, run on the CPU on the cases of
// indexer_cases.h, end to end:
//   - the logits' CTA program (indexer_cta.h) on the warp emulator (warp_emulator.h:
//     cp.async completed as late as allowed, ldmatrix, the FP8 mma.m16n8k32 with exact
//     products, shared memory poisoned), with the grid indexer.cu takes (its pages per CTA for
//     a 132-SM device); cp.async may read only q and the page arena;
//   - the top-k's row program (topk_cta.h) on the CTA emulator (cta_emulator.h: ballots and
//     __match_any_sync as warp collectives, cub's block scan, and cub's
//     BlockRadixSort::SortDescending as a stable block-wide sort of the blocked items), with
//     the launch topk.cu makes (one 1,024-thread block per row, the key cache of
//     min(stride, 32,768) keys after the program's shared state).
// Every output buffer is guarded. Runs without a device; label emulation.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <memory>
#include <vector>

#include "indexer_cases.h"
#include "runtime/ops/indexer/indexer_cta.h"
#include "runtime/ops/indexer/topk_cta.h"
#include "runtime/ops/launch_args.h"
#include "testing/emulator/cta_emulator.h"
#include "testing/emulator/warp_emulator.h"

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
  const int cache_n = tk::cache_keys(stride);
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

// indexer_logits_cuda's launch (indexer::launch_params) for a 132-SM device.
std::vector<float> emulated_logits(const Problem& pr) {
  namespace ix = cuda::indexer;
  emu::Guarded<float> logits(pr.lengths.size() * static_cast<std::size_t>(pr.stride));
  std::fill_n(logits.data(), logits.size(), std::bit_cast<float>(kSentinel));
  cuda::IndexerArgs args;
  args.batch = pr.B;
  args.query_tokens = pr.T;
  args.heads = pr.H;
  args.head_dim = kDim;
  args.q = pr.q.data();
  args.weights = pr.w.data();
  args.pages = pr.arena.data();
  args.page_table = pr.table.data();
  args.max_pages = pr.max_pages;
  args.lengths = pr.lengths.data();
  args.logits = logits.data();
  args.logits_stride = pr.stride;
  EXPECT_EQ(cuda::check_args(args), "");
  if (pr.B == 0 || pr.max_pages == 0) return logits.values();
  const ix::Launch launch = ix::launch_params(args, 132);
  const ix::Params& a = launch.params;
  const std::size_t smem = ix::smem_bytes(pr.T, pr.H);
  emu::Coverage::ran("indexer_logits");
  for (unsigned by = 0; by < launch.grid_y; ++by) {
    for (unsigned bx = 0; bx < launch.grid_x; ++bx) {
      std::unique_ptr<emu::Block> blk;
      emu::Fibers fibers(
          ix::kThreads,
          [&](int tid) {
            emu::Prims prims(*blk, tid);
            ix::indexer_cta(a, bx, by, blk->smem.data(), prims);
          },
          seed++);
      blk = std::make_unique<emu::Block>(ix::kThreads, smem, fibers);
      blk->global = {{pr.q.data(), pr.q.size()}, {pr.arena.data(), pr.arena.size()}};
      fibers.run();
    }
  }
  EXPECT_TRUE(logits.damage().empty()) << "indexer logits: the output " << logits.damage();
  return logits.values();
}

bool always() { return true; }

}  // namespace

const IndexerBackend& indexer_backend() {
  static const IndexerBackend b{{"emulator", always}, emulated_logits, emulated_topk};
  return b;
}

}  // namespace ess::indexer_test
