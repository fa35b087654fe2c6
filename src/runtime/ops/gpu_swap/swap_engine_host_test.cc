// The host run of the GPU swap engine's cases (swap_engine_cases.h): the cache tests'
// independent naive LRU model (tests/cache/fixtures.h) stands in for the device, one per
// request-layer, behind the GPU engine's host interface; each step's launch arguments go
// through the engine's own check (launch_args.h). So the problems, pools and expectations of
// the GPU test run on a CPU machine, and the CPU engine is held to a second model there.
#include <gtest/gtest.h>

#include <memory>
#include <unordered_set>

#include "swap_engine_cases.h"

namespace ess::swap_test {
namespace {

class ModelEngine final : public EngineUnderTest {
 public:
  explicit ModelEngine(const cuda::GpuSwapConfig& c) : config_(c) {
    EXPECT_EQ(cuda::check_args(c), "");
    for (int i = 0; i < c.rows * c.layers; ++i) lru_.emplace_back(c.slots);
  }

  cuda::GpuSwapEngine::HostResult step(int layer, const std::vector<std::int32_t>& rows, int T, int K,
                                       const std::vector<std::int32_t>& ids) override {
    cuda::GpuSwapStep s;
    s.layer = layer;
    s.batch = static_cast<int>(rows.size());
    s.query_tokens = T;
    s.topk = K;
    s.rows = s.ids = test::device_pointer<const std::int32_t>();
    s.slot_ids = s.fill_tokens = s.fill_slots = s.counts = test::device_pointer<std::int32_t>();
    EXPECT_EQ(cuda::check_args(config_, s), "");
    const std::size_t P = static_cast<std::size_t>(T) * static_cast<std::size_t>(K);
    cuda::GpuSwapEngine::HostResult r;
    for (std::size_t b = 0; b < rows.size(); ++b) {
      const std::span<const std::int32_t> row_ids(ids.data() + b * P, P);
      std::vector<std::pair<std::int32_t, std::int32_t>> fills;
      const std::vector<std::int32_t> slots = lru(rows[b], layer).step(row_ids, fills);
      r.slot_ids.insert(r.slot_ids.end(), slots.begin(), slots.end());
      std::unordered_set<std::int32_t> ws;
      for (const std::int32_t t : row_ids) {
        if (t >= 0) ws.insert(t);
      }
      r.counts.push_back(StepCounts{static_cast<std::int64_t>(ws.size() - fills.size()), static_cast<std::int64_t>(fills.size())});
      r.fills.emplace_back();
      for (const auto& [token, slot] : fills) r.fills.back().push_back(MissEntry{static_cast<std::int32_t>(b), rows[b], token, slot, 0});
    }
    return r;
  }

  // As the device does it: the windows replayed as steps with T = 1, then one fill per slot
  // whose token changed, in slot order.
  std::vector<MissEntry> warmup(int row, int layer, int K, const std::vector<std::int32_t>& windows) override {
    test::NaiveLru& m = lru(row, layer);
    const std::vector<std::int32_t> before = m.tokens();
    std::vector<std::pair<std::int32_t, std::int32_t>> fills;
    for (std::size_t w = 0; w + static_cast<std::size_t>(K) <= windows.size(); w += static_cast<std::size_t>(K)) {
      m.step({windows.data() + w, static_cast<std::size_t>(K)}, fills);
    }
    std::vector<MissEntry> out;
    for (std::size_t s = 0; s < before.size(); ++s) {
      const std::int32_t now = m.tokens()[s];
      if (now >= 0 && now != before[s]) out.push_back(MissEntry{0, row, now, static_cast<std::int32_t>(s), 0});
    }
    return out;
  }

  cuda::GpuSwapEngine::HostState download(int row, int layer) override {
    const test::NaiveLru& m = lru(row, layer);
    cuda::GpuSwapEngine::HostState h;
    h.token_of_slot = m.tokens();
    h.recency = m.stamps();
    return h;
  }

 private:
  test::NaiveLru& lru(int row, int layer) {
    return lru_[static_cast<std::size_t>(row) * static_cast<std::size_t>(config_.layers) + static_cast<std::size_t>(layer)];
  }
  cuda::GpuSwapConfig config_;
  std::vector<test::NaiveLru> lru_;
};

std::unique_ptr<EngineUnderTest> make_model(const cuda::GpuSwapConfig& c) { return std::make_unique<ModelEngine>(c); }
bool always() { return true; }

}  // namespace

const SwapBackend& swap_backend() {
  static const SwapBackend b{{"cpu-model", always}, make_model};
  return b;
}

}  // namespace ess::swap_test
