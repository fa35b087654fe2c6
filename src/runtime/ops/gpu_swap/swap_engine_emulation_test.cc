// The GPU swap engine's own device code (swap_engine_kernel.h: the step, reset and diff CTA
// programs) run on the CPU by the CTA emulator (cta_emulator.h: one fiber per thread, seeded
// orders, poisoned and guarded shared memory), on the cases of swap_engine_cases.h, against
// the CPU engine bit for bit. The host side does what GpuSwapEngine does around its launches
// (swap_engine_gpu.cc): the same launch shapes, the same shared-memory size, warm-up as steps
// then a diff. Every global buffer is guarded, so a write out of range fails. Runs without a
// device; label emulation.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/ops/cta_emulator.h"
#include "runtime/ops/gpu_swap/swap_engine_kernel.h"
#include "swap_engine_cases.h"

namespace ess::swap_test {
namespace {

using cuda::swap::kResetBlocks;
using cuda::swap::kResetThreads;
using cuda::swap::kStepThreads;

class EmulatedEngine final : public EngineUnderTest {
 public:
  explicit EmulatedEngine(const cuda::GpuSwapConfig& c) : config_(c) {
    EXPECT_EQ(cuda::check_args(c), "");
    const std::size_t n = static_cast<std::size_t>(c.rows) * c.layers * c.slots;
    order_.resize(n);
    stamp_.resize(n);
    token_.resize(n);
    clock_.resize(static_cast<std::size_t>(c.rows) * c.layers);
    for (int r = 0; r < c.rows; ++r) reset_row(r);
  }
  ~EmulatedEngine() override { check_guards("the engine's state"); }

  void reset_row(int row) {
    emu::launch("swap_reset", kResetBlocks, kResetThreads, 0, seed_++, [&](emu::Cta& p, std::uint8_t*) {
      cuda::swap::swap_reset_cta(order_.data(), stamp_.data(), token_.data(), clock_.data(), config_.slots, config_.layers,
                                 row, p);
    });
  }

  cuda::GpuSwapEngine::HostResult step(int layer, const std::vector<std::int32_t>& rows, int T, int K,
                                       const std::vector<std::int32_t>& ids) override {
    const int B = static_cast<int>(rows.size());
    const std::size_t P = static_cast<std::size_t>(T) * static_cast<std::size_t>(K);
    emu::Guarded<std::int32_t> d_rows, d_ids, slots(ids.size()), ft(ids.size()), fs(ids.size()), counts(2 * rows.size());
    d_rows.assign(rows);
    d_ids.assign(ids);
    cuda::GpuSwapStep s;
    s.layer = layer;
    s.batch = B;
    s.query_tokens = T;
    s.topk = K;
    s.rows = d_rows.data();
    s.ids = d_ids.data();
    s.slot_ids = slots.data();
    s.fill_tokens = ft.data();
    s.fill_slots = fs.data();
    s.counts = counts.data();
    launch_step(s);
    for (const auto* g : {&d_rows, &d_ids, &slots, &ft, &fs, &counts}) {
      EXPECT_TRUE(g->damage().empty()) << "swap step: a step buffer " << g->damage();
    }
    check_guards("the engine's state");
    cuda::GpuSwapEngine::HostResult r;
    r.slot_ids = slots.values();
    r.fills.resize(rows.size());
    for (int b = 0; b < B; ++b) {
      const auto hits = counts[2 * static_cast<std::size_t>(b)], misses = counts[2 * static_cast<std::size_t>(b) + 1];
      r.counts.push_back(StepCounts{hits, misses});
      for (std::int32_t m = 0; m < misses; ++m) {
        const std::size_t o = static_cast<std::size_t>(b) * P + static_cast<std::size_t>(m);
        r.fills[static_cast<std::size_t>(b)].push_back(MissEntry{b, rows[static_cast<std::size_t>(b)], ft[o], fs[o], 0});
      }
    }
    return r;
  }

  std::vector<MissEntry> warmup(int row, int layer, int K, const std::vector<std::int32_t>& windows) override {
    const std::size_t S = static_cast<std::size_t>(config_.slots);
    std::int32_t* after = token_.data() + (static_cast<std::size_t>(row) * config_.layers + static_cast<std::size_t>(layer)) * S;
    emu::Guarded<std::int32_t> before, out_t(S), out_s(S), count(1), d_row, d_ids, d_slots(static_cast<std::size_t>(K)),
        d_ft(static_cast<std::size_t>(K)), d_fs(static_cast<std::size_t>(K)), d_counts(2);
    before.assign(std::vector<std::int32_t>(after, after + S));
    d_row.assign({row});
    d_ids.assign(windows);
    for (std::size_t w = 0; w * static_cast<std::size_t>(K) < windows.size(); ++w) {
      cuda::GpuSwapStep s;
      s.layer = layer;
      s.batch = 1;
      s.query_tokens = 1;
      s.topk = K;
      s.rows = d_row.data();
      s.ids = d_ids.data() + w * static_cast<std::size_t>(K);
      s.slot_ids = d_slots.data();
      s.fill_tokens = d_ft.data();
      s.fill_slots = d_fs.data();
      s.counts = d_counts.data();
      launch_step(s);
    }
    emu::launch("swap_diff", 1, kStepThreads, 0, seed_++, [&](emu::Cta& p, std::uint8_t*) {
      cuda::swap::swap_diff_cta(before.data(), after, config_.slots, out_t.data(), out_s.data(), count.data(), p);
    });
    for (const auto* g : {&before, &out_t, &out_s, &count, &d_slots, &d_ft, &d_fs, &d_counts}) {
      EXPECT_TRUE(g->damage().empty()) << "warm-up: a buffer " << g->damage();
    }
    std::vector<MissEntry> fills;
    for (std::int32_t i = 0; i < count[0]; ++i) fills.push_back(MissEntry{0, row, out_t[static_cast<std::size_t>(i)], out_s[static_cast<std::size_t>(i)], 0});
    return fills;
  }

  cuda::GpuSwapEngine::HostState download(int row, int layer) override {
    const std::size_t S = static_cast<std::size_t>(config_.slots);
    const std::size_t base = (static_cast<std::size_t>(row) * config_.layers + static_cast<std::size_t>(layer)) * S;
    cuda::GpuSwapEngine::HostState h;
    h.order.assign(order_.data() + base, order_.data() + base + S);
    h.token_of_slot.assign(token_.data() + base, token_.data() + base + S);
    h.recency.assign(stamp_.data() + base, stamp_.data() + base + S);
    h.clock = clock_[base / S];
    return h;
  }

 private:
  // As launch_swap_step: one block of kStepThreads per batch position, swap_step_smem_bytes.
  void launch_step(const cuda::GpuSwapStep& s) {
    EXPECT_EQ(cuda::check_args(config_, s), "");
    const int positions = s.query_tokens * s.topk;
    const int hash_cap = cuda::swap_hash_capacity(positions);
    emu::launch("swap_step", static_cast<unsigned>(s.batch), kStepThreads, cuda::swap_step_smem_bytes(positions, config_.slots),
                seed_++, [&](emu::Cta& p, std::uint8_t* smem) {
                  cuda::swap::swap_step_cta(s, config_.slots, config_.layers, hash_cap, order_.data(), stamp_.data(),
                                            token_.data(), clock_.data(), smem, p);
                });
  }
  void check_guards(const char* what) const {
    for (const auto* g : {&order_, &stamp_, &token_, &clock_}) {
      EXPECT_TRUE(g->damage().empty()) << what << ": " << g->damage();
    }
  }

  cuda::GpuSwapConfig config_;
  emu::Guarded<std::int32_t> order_, stamp_, token_, clock_;
  std::uint64_t seed_ = 1;
};

std::unique_ptr<EngineUnderTest> make_emulated(const cuda::GpuSwapConfig& c) { return std::make_unique<EmulatedEngine>(c); }
bool always() { return true; }

// Every kernel of swap_engine_gpu.cu runs in emulation (each ctest case is its own process,
// so this test drives them itself).
TEST(SwapEngineEmulation, EveryKernelRuns) {
  cuda::GpuSwapConfig c;
  c.rows = 1;
  c.layers = 1;
  c.slots = 8;
  c.max_positions = 4;
  EmulatedEngine e(c);
  (void)e.step(0, {0}, 1, 4, {3, 1, -1, 3});
  (void)e.warmup(0, 0, 4, {5, 6, 7, 8});
  for (const char* k : {"swap_step", "swap_reset", "swap_diff"}) {
    EXPECT_TRUE(emu::Coverage::has(k)) << k << " never ran in emulation";
  }
}

}  // namespace

const SwapBackend& swap_backend() {
  static const SwapBackend b{{"emulator", always}, make_emulated};
  return b;
}

}  // namespace ess::swap_test
