// The GPU benchmarks' reports (harness/report/report.h) over made-up results: they run without
// a device here, so a report that drops or mislabels a measured number fails on the CPU.
#include "harness/report/report.h"

#include <gtest/gtest.h>

namespace ess::harness {
namespace {

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(report, TransferKeepsEveryMethodAndTheSweep) {
  cuda::FlashTransBenchConfig c;
  cuda::FlashTransBenchResult r;
  r.device = "Test GPU";
  r.date = "2026-11-22T00:00:00Z";
  r.verified = true;
  r.default_blocks = 32;
  r.stats = {{"flashtrans", "h2d", 51.5, 50.0, 52.0, 100.0, true, ""},
             {"memcpy_batch", "h2d", 0, 0, 0, 0, false, "needs CUDA 12.8"}};
  r.sweep = {{16, "h2d", 40.0, 39.0, 41.0, 30.0, 210.0, 1.05}};
  r.recommended_blocks_h2d = 16;
  const nlohmann::json j = to_json(c, r);
  EXPECT_EQ(j["methods"]["flashtrans"]["h2d"]["gbps"], 51.5);
  EXPECT_EQ(j["methods"]["memcpy_batch"]["h2d"]["available"], false);
  EXPECT_EQ(j["grid_sweep"]["points"][0]["attention_slowdown"], 1.05);
  EXPECT_EQ(j["grid_sweep"]["recommended_blocks"]["h2d"], 16);
  const std::string t = to_table(c, r);
  EXPECT_TRUE(has(t, "Test GPU")) << t;
  EXPECT_TRUE(has(t, "51.50")) << t;
  EXPECT_TRUE(has(t, "needs CUDA 12.8")) << t;
  EXPECT_TRUE(has(t, "h2d 16")) << t;
}

TEST(report, AttentionHeadlinesTheConfiguredBatch) {
  cuda::SparseMlaBenchConfig c;
  c.batch = 64;
  cuda::SparseMlaBenchResult r;
  r.verified = true;
  r.points = {{32, {10, 9, 11}, 100, 110, 1e6, 100}, {64, {20, 19, 21}, 160, 170, 2e6, 100}, {128, {40, 39, 41}, 150, 155, 4e6, 100}};
  const nlohmann::json j = to_json(c, r);
  EXPECT_EQ(j["headline_batch"], 64);
  EXPECT_EQ(j["tflops"], 160);
  EXPECT_EQ(j["batches"].size(), 3u);
  EXPECT_TRUE(has(to_table(c, r), "160.0")) << to_table(c, r);
}

TEST(report, IndexerStatesTheShareOfHbmPeak) {
  cuda::IndexerBenchConfig c;
  cuda::IndexerBenchResult r;
  r.verified = false;
  r.verify_note = "logit 7 off";
  r.logits_gbps = 1500;
  r.hbm_peak_gbps = 3000;
  const nlohmann::json j = to_json(c, r);
  EXPECT_DOUBLE_EQ(j["results"]["logits_fraction_of_hbm_peak"].get<double>(), 0.5);
  EXPECT_EQ(j["verify_note"], "logit 7 off");
  const std::string t = to_table(c, r);
  EXPECT_TRUE(has(t, "50 % of the 3000 GB/s")) << t;
  EXPECT_TRUE(has(t, "NO (logit 7 off)")) << t;
}

TEST(report, VerifySaysWhereTheFirstMismatchIs) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  VerifyConfig c;
  VerifyReport r;
  r.bitwise_equal = false;
  r.compared_outputs = 10;
  r.mismatched_outputs = 1;
  r.first_mismatch = "step 3 layer 1 request 0 query token 1";
  r.per_layer = {{0, 5, 2}};
  EXPECT_TRUE(has(to_table(m, c, r), "NOT LOSSLESS: 1 of 10")) << to_table(m, c, r);
  EXPECT_EQ(to_json(m, c, r)["first_mismatch"], r.first_mismatch);
  EXPECT_EQ(to_csv(r), "layer,hits,misses,bitwise_equal\n0,5,2,false\n");
}

}  // namespace
}  // namespace ess::harness
