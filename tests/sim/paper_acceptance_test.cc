// Acceptance: the five 32K rows of the paper's Table 2 (brief §3) with the one calibration
// profile: throughput and OTPS within +-5 %, the printed ratio within +-0.01. Fails when the
// model, the calibration or the memory accounting drift.
#include <gtest/gtest.h>

#include <cmath>

#include "ess/sim/sweep.h"
#include "sim/sim_test_util.h"

namespace ess::sim {
namespace {

TEST(sim_paper, Table2Rows32K) {
  const StepModel sm(testing::dsv32(), testing::paper_hw(), testing::paper_dep());
  ASSERT_EQ(paper_table2_32k().size(), 5u);
  for (const PaperRow& p : paper_table2_32k()) {
    Workload w;
    w.context = 32768;
    w.batch = p.batch;
    const StepResult r = sm.run(w);
    EXPECT_NEAR(r.ratio, p.ratio, 0.01) << "batch " << p.batch;
    EXPECT_NEAR(r.throughput_tokens_per_s / p.throughput_tokens_per_s, 1.0, 0.05) << "batch " << p.batch;
    EXPECT_NEAR(r.otps / p.otps, 1.0, 0.05) << "batch " << p.batch;
  }
}

TEST(sim_paper, GainOverTheMemoryWall) {
  // The headline: ESS at batch 160 vs all-on-GPU at its largest batch (paper: +69.4 % vs batch 52).
  const StepModel sm(testing::dsv32(), testing::paper_hw(), testing::paper_dep());
  Workload wall;
  wall.offload = false;
  const StepResult base = sm.run(wall);
  EXPECT_GE(base.batch, 52);
  EXPECT_LE(base.batch, 56);
  Workload ess;
  ess.batch = 160;
  const double gain = sm.run(ess).throughput_tokens_per_s / base.throughput_tokens_per_s - 1;
  EXPECT_GT(gain, 0.55);
  EXPECT_LT(gain, 0.80);
}

}  // namespace
}  // namespace ess::sim
