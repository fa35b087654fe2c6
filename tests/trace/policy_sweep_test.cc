// Every replacement policy over a sweep of pool sizes, on generated traces: from the floor (one
// query token's top-k) to past the longest request, every pool size, no internal error, the
// accounting exact (hits + misses = the distinct ids of each policy step, one fill per miss),
// the analyzer's replay agreeing with an independent drive of the cache, and no policy below
// Belady's MIN. The traces are small (top-k 16 to 32, a few hundred tokens) so that the whole
// sweep takes seconds in the release and the ASan builds.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "ess/cache/layer_cache.h"
#include "ess/cache/policies.h"
#include "ess/cache/query_groups.h"
#include "ess/core/error.h"
#include "ess/trace/analyzer.h"
#include "ess/trace/generator.h"

namespace ess::trace {
namespace {

GeneratorProfile small_profile(int topk, int mtp, double drift) {
  GeneratorProfile p = GeneratorProfile::shipped_default();
  p.name = "sweep";
  p.layers = 2;
  p.topk = topk;
  p.mtp = mtp;
  p.accept_ratio = std::min(1.7, static_cast<double>(mtp));
  p.prefill_windows = 4;
  p.sink_tokens = 2;
  p.recent_window = topk / 4;
  p.candidate_base = 8.0 * topk;
  p.reference_context = 512;
  p.topic_shift_rate = 0.05;
  p.candidate_churn = 0.01;
  p.return_probability = 0.7;
  p.drift = {drift, drift / 3};
  p.validate("sweep profile");
  return p;
}

// A request as a RequestView over its own storage (what a TraceReader would give).
struct Held {
  RequestData data;
  RequestView view;
};
Held hold(RequestData d, const GeneratorProfile& p) {
  Held h{std::move(d), {}};
  RequestView& v = h.view;
  v.layers = p.layers;
  v.mtp = p.mtp;
  v.topk = p.topk;
  v.steps = static_cast<std::int64_t>(h.data.lengths.size());
  v.lengths = h.data.lengths;
  v.context = h.data.lengths.front();
  v.topk_ids = h.data.topk.data();
  v.prefill_windows = h.data.prefill_windows;
  v.prefill_ids = h.data.prefill_windows > 0 ? h.data.prefill.data() : nullptr;
  return h;
}

std::int64_t max_length(const RequestView& r) { return *std::max_element(r.lengths.begin(), r.lengths.end()); }

// The policy steps of one request-layer: the warm-up windows, then each decode step whole or,
// when its ids exceed the pool, in query groups (each row [T'][K] with its T').
struct PolicyStep {
  std::vector<std::int32_t> ids;
  int rows = 1;
  bool decode = false;
};
std::vector<PolicyStep> policy_steps(const RequestView& r, int layer, std::int32_t slots, bool warmup) {
  std::vector<PolicyStep> out;
  const auto K = static_cast<std::size_t>(r.topk);
  if (warmup) {
    const auto pf = r.prefill(layer);
    for (int w = 0; w < r.prefill_windows; ++w) {
      out.push_back({{pf.begin() + static_cast<std::ptrdiff_t>(w * K), pf.begin() + static_cast<std::ptrdiff_t>((w + 1) * K)}, 1, false});
    }
  }
  QueryGrouper grouper;
  for (std::int64_t s = 0; s < r.steps; ++s) {
    const auto ids = r.step(s, layer);
    const GroupStarts starts =
        static_cast<std::int64_t>(r.mtp) * r.topk > slots ? grouper.split(ids, r.mtp, r.topk, slots) : 0;
    const std::vector<int> b = group_bounds(starts, r.mtp);
    for (std::size_t g = 0; g + 1 < b.size(); ++g) {
      const auto first = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(b[g]) * K);
      const auto last = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(b[g + 1]) * K);
      out.push_back({{ids.begin() + first, ids.begin() + last}, b[g + 1] - b[g], true});
    }
  }
  return out;
}

std::vector<std::int32_t> distinct(const std::vector<std::int32_t>& ids) {
  std::vector<std::int32_t> out;
  std::set<std::int32_t> seen;
  for (auto v : ids) {
    if (v >= 0 && seen.insert(v).second) out.push_back(v);
  }
  return out;
}

struct Totals {
  std::int64_t decode_misses = 0;
  std::int64_t all_misses = 0;
};

// Drives a LayerCache through the policy steps, checking the accounting of every step.
Totals drive(const RequestView& r, const std::vector<PolicyStep>& steps, std::int32_t slots,
             std::unique_ptr<ReplacementPolicy> policy, const std::string& what) {
  LayerCache cache(slots, std::move(policy));
  cache.reserve_tokens(max_length(r));
  Totals t;
  std::vector<std::int32_t> slot_ids;
  std::vector<Fill> fills;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto& st = steps[i];
    slot_ids.assign(st.ids.size(), -2);
    fills.clear();
    const StepCounts c = cache.access(st.ids, st.rows, r.topk, slot_ids, fills);
    const auto accesses = static_cast<std::int64_t>(distinct(st.ids).size());
    if (c.hits + c.misses != accesses || c.hits < 0 || static_cast<std::int64_t>(fills.size()) != c.misses) {
      ADD_FAILURE() << what << ", policy step " << i << ": hits " << c.hits << " + misses " << c.misses << " != "
                    << accesses << " accesses, or " << fills.size() << " fills";
      return t;
    }
    for (std::size_t k = 0; k < st.ids.size(); ++k) {
      if (st.ids[k] >= 0 && cache.token_in(slot_ids[k]) != st.ids[k]) {
        ADD_FAILURE() << what << ", policy step " << i << ": position " << k << " maps to a slot without its id";
        return t;
      }
    }
    t.all_misses += c.misses;
    if (st.decode) t.decode_misses += c.misses;
  }
  cache.check_invariants();
  return t;
}

std::unique_ptr<ReplacementPolicy> online(const std::string& name, std::int32_t slots) {
  return make_policy_factory(name, {.lfu_aging_period = 8})(0, 0, slots);
}

void sweep(const GeneratorProfile& p, std::int64_t context, std::int64_t steps, std::uint64_t seed, int stride) {
  const Held h = hold(generate_request(p, context, steps, seed, 0), p);
  const RequestView& r = h.view;
  const std::int32_t longest = static_cast<std::int32_t>(max_length(r));
  const std::int32_t floor = std::min<std::int32_t>(p.topk, longest);
  // Every pool size from the floor to past the longest request (`stride` 1 in the first
  // window above the floor, where the steps split and the pools are tightest).
  std::vector<std::int32_t> sizes;
  for (std::int32_t s = floor; s <= longest + 2; s += s < floor + 2 * p.mtp * p.topk ? 1 : stride) sizes.push_back(s);
  int failures = 0;
  for (const std::int32_t slots : sizes) {
    for (const bool warm : {false, true}) {
      const std::string base = "context " + std::to_string(context) + ", slots " + std::to_string(slots) +
                               (warm ? ", warm" : ", cold");
      for (int layer = 0; layer < r.layers; ++layer) {
        const std::string where = base + ", layer " + std::to_string(layer);
        const auto steps_of = policy_steps(r, layer, slots, warm);
        std::vector<std::vector<std::int32_t>> future;
        for (const auto& st : steps_of) future.push_back(distinct(st.ids));
        Totals belady;
        ASSERT_NO_THROW(belady = drive(r, steps_of, slots, std::make_unique<BeladyPolicy>(slots, future), where + ", belady"))
            << where;
        LayerReplay replay;
        ASSERT_NO_THROW(replay = replay_layer_belady(r, layer, slots, warm)) << where << ", belady";
        EXPECT_EQ(std::accumulate(replay.misses.begin(), replay.misses.end(), std::int64_t{0}), belady.decode_misses)
            << where << ", belady: the analyzer's replay disagrees";
        for (const char* name : {"lru", "fifo", "clock", "lfu", "s3fifo"}) {
          const std::string what = where + ", " + std::string(name);
          Totals t;
          try {
            t = drive(r, steps_of, slots, online(name, slots), what);
            replay = replay_layer(r, layer, slots, online(name, slots), warm);
          } catch (const Error& e) {
            ADD_FAILURE() << what << ": " << e.what();
            if (++failures > 20) FAIL() << "too many failures";
            continue;
          }
          EXPECT_EQ(std::accumulate(replay.misses.begin(), replay.misses.end(), std::int64_t{0}), t.decode_misses)
              << what << ": the analyzer's replay disagrees";
          // Belady's MIN minimises the misses of every policy step, warm-up windows included.
          if (t.all_misses < belady.all_misses) {
            ADD_FAILURE() << what << ": " << t.all_misses << " misses, fewer than Belady's " << belady.all_misses;
            if (++failures > 20) FAIL() << "too many failures";
          }
        }
      }
    }
  }
}

TEST(PolicySweep, EveryPoolSizeTopk32Mtp2) { sweep(small_profile(32, 2, 0.25), 256, 32, 5, 2); }
TEST(PolicySweep, EveryPoolSizeTopk16Mtp3) { sweep(small_profile(16, 3, 0.4), 128, 32, 11, 1); }
TEST(PolicySweep, EveryPoolSizeTopk24NoMtp) { sweep(small_profile(24, 1, 0.15), 160, 32, 3, 1); }

}  // namespace
}  // namespace ess::trace
