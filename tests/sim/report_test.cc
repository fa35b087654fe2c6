// `ess sim`'s question and formats (ess/sim/report.h): the rows beside the memory wall, the
// batch lists the command line takes, the paper's columns only for its own setup.
#include "ess/sim/report.h"

#include <gtest/gtest.h>

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
  EXPECT_NE(to_csv(s).find("4000,,,,,,,,,,,,,\"batch 4000 cannot fit"), std::string::npos);
  // None runs: the reason is the error.
  EXPECT_NE(test::error_of([&] { simulate(sm, base, {4000}); }).find("batch 4000 cannot fit"), std::string::npos);
}

}  // namespace
}  // namespace ess::sim
