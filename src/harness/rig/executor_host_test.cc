// The host half of the executor's device test (executor_test.cc): every configuration it runs
// is valid and replays ids with misses in every layer (so the copies are exercised), and the
// CPU reference of every token it checks is finite and non-trivial on the rig's data, so a
// comparison with it can fail. Needs no device.
#include <gtest/gtest.h>

#include <cmath>

#include "ess/ops/reference.h"
#include "executor_problem.h"

namespace ess::executor_test {
namespace {

TEST(executor_host, DeviceTestProblemsAreValidWithMissesAndNonTrivialReferences) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  for (const ExecutorConfig& c : device_test_configs()) {
    SCOPED_TRACE(fmt::format("batch {}, steps {}, {}", c.batch, c.steps, c.offload ? "offloaded" : "resident"));
    ASSERT_NO_THROW(c.validate(m));
    const StepInputs in = load_inputs(c, m);
    ASSERT_EQ(in.profile_misses.size(), static_cast<std::size_t>(c.layers));
    if (c.offload) {
      for (const double misses : in.profile_misses) EXPECT_GT(misses, 0.0);
    }
    const rig::RigData rig(m, c.batch, in.mtp, c.seed);
    for (const TokenAt& at : checked_tokens(in)) {
      const rig::TokenProblem tp = rig::token_problem(rig, in, at.step, at.layer, at.b, at.t);
      EXPECT_GT(tp.valid, 0);
      std::vector<float> o(static_cast<std::size_t>(rig.heads()) * static_cast<std::size_t>(rig.layout().nope_dim));
      std::vector<float> lse(static_cast<std::size_t>(rig.heads()));
      ref::sparse_mla_decode_f32(tp.params, tp.q, tp.entries, o, lse);
      std::size_t nonzero = 0;
      for (const float v : o) {
        ASSERT_TRUE(std::isfinite(v));
        nonzero += v != 0.0f ? 1 : 0;
      }
      for (const float v : lse) ASSERT_TRUE(std::isfinite(v));
      EXPECT_GT(nonzero, o.size() / 2);
      // The reference passes its own contract (the check a GPU output is held to).
      std::vector<std::uint16_t> o16(o.size());
      for (std::size_t i = 0; i < o.size(); ++i) o16[i] = bf16_from_float(o[i]);
      std::vector<float> all_lse(static_cast<std::size_t>(in.batch * in.mtp) * lse.size());
      std::vector<std::uint16_t> all_out(static_cast<std::size_t>(in.batch * in.mtp) * o.size());
      const std::size_t token = static_cast<std::size_t>(at.b * in.mtp + at.t);
      std::copy(o16.begin(), o16.end(), all_out.begin() + static_cast<std::ptrdiff_t>(token * o.size()));
      std::copy(lse.begin(), lse.end(), all_lse.begin() + static_cast<std::ptrdiff_t>(token * lse.size()));
      const test::DecodeCheck chk = check_token(rig, in, at, all_out, all_lse, false);
      EXPECT_TRUE(chk.ok()) << chk.structural << " worst " << chk.worst << " at " << chk.worst_at;
    }
  }
}

// The rig's data is a function of the seed: the host pool, the device caches and the
// reference agree because they read the same table through the same index.
TEST(executor_host, RigDataIsAFunctionOfTheSeed) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const rig::RigData a(m, 2, 2, 7), b(m, 2, 2, 7), c(m, 2, 2, 8);
  EXPECT_EQ(a.table(), b.table());
  EXPECT_EQ(a.queries(), b.queries());
  EXPECT_NE(a.table(), c.table());
  EXPECT_NE(a.queries(), c.queries());
  EXPECT_EQ(a.entry(1, 3, 1000).data(), a.table().data() + rig::RigData::entry_index(1, 3, 1000) * a.layout().bytes());
  EXPECT_NE(rig::RigData::entry_index(0, 0, 5), rig::RigData::entry_index(0, 1, 5));
  std::size_t nonzero = 0;
  for (const std::uint16_t q : a.queries()) nonzero += bf16_to_float(q) != 0.0f ? 1 : 0;
  EXPECT_GT(nonzero, a.queries().size() * 9 / 10);
}

}  // namespace
}  // namespace ess::executor_test
