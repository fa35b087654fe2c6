// `ess sim`'s question and formats (ess/sim/report.h): the rows beside the memory wall, the
// batch lists the command line takes, the paper's columns only for its own setup.
#include "ess/sim/report.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fmt/format.h>

#include "ess/sim/memory_model.h"

#include "testing/testing.h"

namespace ess::sim {
namespace {

TEST(sim_report, BatchListsTakeNumbersRangesAndMax) {
  EXPECT_EQ(parse_batches({"52", "3-5", "max"}), (std::vector<int>{52, 3, 4, 5, 0}));
  EXPECT_NE(test::error_of([] { parse_batches({"12x"}); }).find("'12x'"), std::string::npos);
  EXPECT_NE(test::error_of([] { parse_batches({"9-3"}); }).find("'9-3' is empty"), std::string::npos);
  EXPECT_NE(test::error_of([] { parse_batches({}); }).find("no batch size"), std::string::npos);
}

TEST(sim_report, RowsStandBesideTheMemoryWall) {
  const StepModel sm(ModelSpec::deepseek_v32_exp(), HardwareProfile::shipped("paper-table1"),
                     Deployment::shipped("paper-table1"));
  Workload base;
  const Simulation s = simulate(sm, base, {52, 128});
  ASSERT_TRUE(s.wall_fits);
  ASSERT_EQ(s.rows.size(), 2u);
  EXPECT_TRUE(s.rows[0].baseline_fits);   // 52 requests fit without offload
  EXPECT_FALSE(s.rows[1].baseline_fits);  // 128 do not
  ASSERT_NE(s.rows[1].paper, nullptr);    // the paper's own setup: its row is there
  EXPECT_EQ(s.rows[1].paper->batch, 128);
  EXPECT_GT(s.gain(s.rows[1].ess), 0.0);
  const nlohmann::json j = to_json(s);
  EXPECT_EQ(j["rows"].size(), 2u);
  EXPECT_EQ(j["rows"][1]["all_on_gpu_at_batch"], nullptr);
  EXPECT_EQ(to_csv(s).substr(0, 6), "batch,");
  EXPECT_NE(to_table(s).find("OOM"), std::string::npos);
  base.context = 65536;  // not the paper's setup: no paper columns
  EXPECT_EQ(simulate(sm, base, {64}).rows[0].paper, nullptr);
}

// A load sweep (`ess sim --concurrency`): from one request past the memory wall at one pool; with
// adaptive residency the rows below the wall cost only the write-back, and the summary names
// where offload starts to pay.
TEST(sim_report, ALoadSweepRisesPastTheMemoryWallAndSaysWhereOffloadPays) {
  const StepModel sm(ModelSpec::deepseek_v32_exp(), HardwareProfile::shipped("h200"), Deployment::shipped("paper-table1"));
  Workload base;
  base.slots = 4096;  // T x top-k: the floor without a measured working set
  base.residency = Residency::kAdaptive;
  const MemoryModel mem(sm.model(), sm.hardware(), sm.deployment(), base.context);
  const int wall = mem.max_batch(double(base.context));
  const int top = mem.max_batch(4096.0);
  const std::vector<int> batches = load_batches(sm, base);
  ASSERT_GE(batches.size(), 4u);
  EXPECT_EQ(batches.front(), 1);
  EXPECT_EQ(batches.back(), top);
  EXPECT_TRUE(std::is_sorted(batches.begin(), batches.end()));
  EXPECT_EQ(std::adjacent_find(batches.begin(), batches.end()), batches.end());  // no batch twice
  EXPECT_NE(std::find(batches.begin(), batches.end(), wall), batches.end());
  EXPECT_NE(std::find(batches.begin(), batches.end(), wall + 1), batches.end());
  EXPECT_NE(std::find(batches.begin(), batches.end(), 2), batches.end());

  const Simulation s = simulate(sm, base, batches);
  for (const SimulationRow& r : s.rows) {
    ASSERT_TRUE(r.refused.empty()) << r.refused;
    EXPECT_EQ(r.baseline_fits, r.ess.batch <= wall) << "batch " << r.ess.batch;
    if (r.ess.whole_requests == r.ess.batch) {
      // Every request whole: the step is all-on-GPU's plus the write-back's SM time, nothing else.
      EXPECT_EQ(r.ess.h2d_bytes, 0) << "batch " << r.ess.batch;
      EXPECT_GT(r.ess.transfer_sm_us, 0) << "batch " << r.ess.batch;
      EXPECT_NEAR(r.ess.step_us - r.baseline.step_us, r.ess.transfer_sm_us, 1e-6 * r.baseline.step_us)
          << "batch " << r.ess.batch;
      EXPECT_GE(Simulation::same_batch(r), 0.995) << "batch " << r.ess.batch;
    }
  }
  EXPECT_EQ(s.rows[0].ess.whole_requests, 1);
  const int pays = s.offload_pays_from();
  ASSERT_GT(pays, wall);
  for (const SimulationRow& r : s.rows) {
    if (r.ess.batch > wall && r.ess.batch < pays) {
      EXPECT_LE(s.gain(r.ess), 0) << "batch " << r.ess.batch;
    }
  }
  const std::string table = to_table(s);
  EXPECT_NE(table.find("vs same"), std::string::npos) << table;
  EXPECT_NE(table.find("low load: with every request whole, ESS runs at >= 0.99"), std::string::npos) << table;
  EXPECT_NE(table.find(fmt::format("offload pays from batch {} (the all-on-GPU memory wall is batch {})", pays, wall)),
            std::string::npos)
      << table;
  const nlohmann::json j = to_json(s);
  EXPECT_EQ(j["offload_pays_from_batch"], pays);
  EXPECT_DOUBLE_EQ(j["rows"][0]["vs_all_on_gpu_at_batch"].get<double>(), Simulation::same_batch(s.rows[0]));
  EXPECT_EQ(j["rows"].back()["vs_all_on_gpu_at_batch"], nullptr);

  base.slots = 0;  // the engine's pool is fixed at launch: a sweep needs one
  EXPECT_NE(test::error_of([&] { load_batches(sm, base); }).find("needs the engine's pool"), std::string::npos);
}

TEST(sim_report, ABatchThatCannotRunIsARowSayingWhyAndTheOthersRun) {
  const StepModel sm(ModelSpec::deepseek_v32_exp(), HardwareProfile::shipped("paper-table1"),
                     Deployment::shipped("paper-table1"));
  Workload base;
  const Simulation s = simulate(sm, base, {52, 4000});
  ASSERT_EQ(s.rows.size(), 2u);
  EXPECT_TRUE(s.rows[0].refused.empty());
  EXPECT_GT(s.rows[0].ess.throughput_tokens_per_s, 0);
  EXPECT_NE(s.rows[1].refused.find("batch 4000 cannot fit"), std::string::npos) << s.rows[1].refused;
  EXPECT_NE(to_table(s).find(" 4000 does not run: batch 4000 cannot fit"), std::string::npos);
  EXPECT_EQ(to_json(s)["rows"][1]["refused"], s.rows[1].refused);
  EXPECT_NE(to_csv(s).find("4000,,,,,,,,,,,,,,,\"batch 4000 cannot fit"), std::string::npos);
  // None runs: the reason is the error.
  EXPECT_NE(test::error_of([&] { simulate(sm, base, {4000}); }).find("batch 4000 cannot fit"), std::string::npos);
}

// The table's step columns add up to the step (compute + x-comm + x-h2d + host, + idle when a row
// has any), in every deployment shape; the header names the GPU.
TEST(sim_report, TheStepColumnsAddUpAndTheHeaderNamesTheGpu) {
  for (const char* hw : {"paper-table1", "h200", "h20-141gb"}) {
    for (const bool tbo : {true, false}) {
      for (const OverlapMode mode : {OverlapMode::kNone, OverlapMode::kDualAttention, OverlapMode::kDualBatchAttention, OverlapMode::kLayerWise}) {
        Deployment d = Deployment::shipped("paper-table1");
        d.two_batch_overlap = tbo;
        const StepModel sm(ModelSpec::deepseek_v32_exp(), HardwareProfile::shipped(hw), d);
        Workload base;
        base.overlap = mode;
        const Simulation s = simulate(sm, base, {32, 96, 160});
        const nlohmann::json j = to_json(s);
        for (const auto& row : j["rows"]) {
          if (row.contains("refused")) continue;
          const double sum = row["compute_ms"].get<double>() + row["exposed_comm_ms"].get<double>() +
                             row["exposed_transfer_ms"].get<double>() + row["host_ms"].get<double>() +
                             row["other_idle_ms"].get<double>();
          EXPECT_NEAR(sum, row["step_ms"].get<double>(), 1e-6 * row["step_ms"].get<double>())
              << hw << " tbo " << tbo << " " << to_string(mode) << " batch " << row["batch"];
          EXPECT_GE(row["other_idle_ms"].get<double>(), 0.0);
        }
        EXPECT_NE(to_table(s).find(fmt::format("on {} ({})", hw, HardwareProfile::shipped(hw).gpu)), std::string::npos);
        EXPECT_NE(to_table(s).find("    host"), std::string::npos);
      }
    }
  }
}

// --batch max: the largest batch at the given pool; without one, ESS's largest (every
// request-layer at the pool floor), not the all-on-GPU memory wall.
TEST(sim_report, BatchMaxIsTheLargestEssBatch) {
  const StepModel sm(ModelSpec::deepseek_v32_exp(), HardwareProfile::shipped("h200"), Deployment::shipped("paper-table1"));
  Workload base;
  const Simulation s = simulate(sm, base, {0});
  ASSERT_EQ(s.rows.size(), 1u);
  const StepResult& r = s.rows[0].ess;
  EXPECT_EQ(r.slots, static_cast<std::int32_t>(std::ceil(s.pool_floor)));
  EXPECT_GT(r.batch, s.wall.batch);
  const MemoryModel mem(sm.model(), sm.hardware(), sm.deployment(), base.context);
  EXPECT_EQ(r.batch, mem.max_batch(r.slots));
  EXPECT_LT(mem.max_batch(r.slots + 64), r.batch + 1);  // a larger pool fits no larger batch
  base.ratio = 0.5;
  EXPECT_EQ(simulate(sm, base, {0}).rows[0].ess.slots, 16384);
}

}  // namespace
}  // namespace ess::sim
