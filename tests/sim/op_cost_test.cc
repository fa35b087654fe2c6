#include <gtest/gtest.h>

#include <vector>

#include "ess/core/error.h"
#include "ess/sim/op_cost.h"
#include "sim/sim_test_util.h"

namespace ess::sim {
namespace {

HardwareProfile round_hw() {
  HardwareProfile hw = testing::paper_hw();
  hw.hbm_bandwidth_gbps = 1000;  // 1e6 bytes per us at efficiency 1
  hw.memory_efficiency = 0.5;
  hw.bf16_tflops = 100;
  hw.fp8_tflops = 200;
  hw.gemm_efficiency = 0.5;
  hw.attention_efficiency = 0.25;
  hw.indexer_efficiency = 0.1;
  hw.kernel_launch_us = 2;
  hw.rdma_gbps = 10;
  hw.rdma_latency_us = 7;
  hw.nvlink_gbps = 100;
  hw.nvlink_latency_us = 3;
  hw.h2d_scattered_gbps = 40;
  hw.d2h_scattered_gbps = 20;
  hw.transfer_launch_us = 5;
  return hw;
}

TEST(sim_op_cost, RooflinePerKind) {
  const OpCostModel c(round_hw());
  // FP8 GEMM, compute bound: 1e9 flops / (200 x 0.5 TFLOPS = 1e8 flop/us) = 10 us + 2 launches x 2 us.
  EXPECT_DOUBLE_EQ(c.analytical_us({"g", OpKind::kGemmFp8, 1e9, 1e3, 0, 0, 0, 0, 2}), 14.0);
  // Same op, memory bound: 1e8 bytes / (1000 x 0.5 GB/s = 5e5 B/us) = 200 us + 2.
  EXPECT_DOUBLE_EQ(c.analytical_us({"g", OpKind::kGemmFp8, 1e6, 1e8, 0, 0, 0, 0, 1}), 202.0);
  EXPECT_DOUBLE_EQ(c.analytical_us({"b", OpKind::kGemmBf16, 1e9, 0, 0, 0, 0, 0, 1}), 20.0 + 2.0);
  EXPECT_DOUBLE_EQ(c.analytical_us({"a", OpKind::kAttention, 1e9, 0, 0, 0, 0, 0, 1}), 40.0 + 2.0);
  EXPECT_DOUBLE_EQ(c.analytical_us({"i", OpKind::kIndexer, 1e9, 0, 0, 0, 0, 0, 1}), 50.0 + 2.0);
  EXPECT_DOUBLE_EQ(c.analytical_us({"m", OpKind::kMemory, 0, 5e5, 0, 0, 0, 0, 3}), 1.0 + 6.0);
}

// Tiles and waves: 10 SMs at 200 x 0.5 / 10 = 1e7 flop/us each; a 64 x 128 tile of K = 1000
// takes 2 x 64 x 128 x 1000 / 1e7 = 1.6384 us.
TEST(sim_op_cost, GemmTilesAndWaves) {
  HardwareProfile hw = round_hw();
  hw.sm_count = 10;
  hw.gemm_tile_overhead_k = 0;
  hw.gemm_memory_efficiency = 0.5;
  const OpCostModel c(hw);
  auto gemm = [&](double m, double n, double k, double groups = 1) {
    Op op("g", OpKind::kGemmFp8, 2 * m * n * k * groups, 1e3, m, 0, 0, 0, 1);
    op.gemm = {m, n, k, groups, false};
    return c.analytical_us(op);
  };
  // 64 rows x 2560 columns: 20 tiles, 2 waves, + one launch of 2 us.
  EXPECT_DOUBLE_EQ(gemm(64, 2560, 1000), 2 * 1.6384 + 2);
  EXPECT_DOUBLE_EQ(gemm(1, 2560, 1000), 2 * 1.6384 + 2);   // a row costs a whole tile
  EXPECT_DOUBLE_EQ(gemm(65, 2560, 1000), 4 * 1.6384 + 2);  // a second row tile: 4 waves (or 2 of 128 rows)
  EXPECT_DOUBLE_EQ(gemm(64, 128, 1000, 10), 1.6384 + 2);   // 10 groups of one tile: one wave
  // The per-tile overhead counts as more K.
  hw.gemm_tile_overhead_k = 1000;
  EXPECT_DOUBLE_EQ(OpCostModel(hw).analytical_us([&] {
    Op op("g", OpKind::kGemmFp8, 0, 1e3, 64, 0, 0, 0, 1);
    op.gemm = {64, 128, 1000, 1, false};
    return op;
  }()), 2 * 1.6384 + 2);
  // Bound by its weights: 1e8 bytes at 1000 GB/s x 0.5 = 200 us.
  Op heavy("g", OpKind::kGemmFp8, 2 * 64.0 * 128 * 1000, 1e8, 64, 0, 0, 0, 1);
  heavy.gemm = {64, 128, 1000, 1, false};
  EXPECT_DOUBLE_EQ(c.analytical_us(heavy), 200 + 2);
}

// Top-k: one CTA per row at its SM's share of 1000 GB/s x 0.5 (5e4 B/us each on 10 SMs).
TEST(sim_op_cost, TopkRowsRunOnePerSm) {
  HardwareProfile hw = round_hw();
  hw.sm_count = 10;
  const OpCostModel c(hw);
  Op op("t", OpKind::kTopk, 0, 25 * 1e5, 25, 0, 0, 0, 1);
  op.rows = 25;
  EXPECT_DOUBLE_EQ(c.analytical_us(op), 3 * 2.0 + 2);  // 3 waves of 2 us rows
  op.rows = 5;
  op.bytes = 5 * 1e5;
  EXPECT_DOUBLE_EQ(c.analytical_us(op), 2.0 + 2);  // 5 rows use 5 SMs: no faster than one row
}

TEST(sim_op_cost, CommAndTransfers) {
  const OpCostModel c(round_hw());
  // RDMA 1e5 B at 10 GB/s = 10 us, NVLink 1e5 B at 100 GB/s = 1 us: the slower + RDMA latency.
  EXPECT_DOUBLE_EQ(c.analytical_us({"c", OpKind::kComm, 0, 0, 0, 0, 1e5, 1e5, 1}), 17.0);
  EXPECT_DOUBLE_EQ(c.analytical_us({"c", OpKind::kComm, 0, 0, 0, 0, 0, 1e5, 1}), 4.0);
  EXPECT_DOUBLE_EQ(c.analytical_us({"c", OpKind::kComm, 0, 0, 0, 0, 0, 0, 1}), 0.0);
  // 656 misses x 1000 = 656,000 B at 40 GB/s = 16.4 us + 5.
  EXPECT_DOUBLE_EQ(c.analytical_us({"h", OpKind::kH2D, 0, 656000, 0, 0, 0, 0, 1}), 16.4 + 5.0);
  EXPECT_DOUBLE_EQ(c.analytical_us({"d", OpKind::kD2H, 0, 656000, 0, 0, 0, 0, 1}), 32.8 + 5.0);
  EXPECT_DOUBLE_EQ(c.analytical_us({"h", OpKind::kH2D, 0, 0, 0, 0, 0, 0, 1}), 0.0);
}

TEST(sim_interpolation, InsideEdgesOutside) {
  const std::vector<Point> p = {{10, 100}, {20, 300}, {40, 500}};
  EXPECT_DOUBLE_EQ(*interpolate(p, 15), 200);
  EXPECT_DOUBLE_EQ(*interpolate(p, 30), 400);
  EXPECT_DOUBLE_EQ(*interpolate(p, 10), 100);  // edges are grid points
  EXPECT_DOUBLE_EQ(*interpolate(p, 40), 500);
  EXPECT_DOUBLE_EQ(*interpolate(p, 20), 300);
  EXPECT_FALSE(interpolate(p, 9.999).has_value());  // outside: no extrapolation
  EXPECT_FALSE(interpolate(p, 40.001).has_value());
  const std::vector<Point> one = {{5, 7}};
  EXPECT_DOUBLE_EQ(*interpolate(one, 5), 7);
  EXPECT_FALSE(interpolate(one, 6).has_value());
  EXPECT_FALSE(interpolate(std::vector<Point>{}, 1).has_value());
}

TEST(sim_interpolation, MeasuredTablesRecordTheirSource) {
  const MeasuredTables t = MeasuredTables::from_csv_text(
      "op,context,tokens,time_us\n"
      "# comment\n"
      "attn.sparse_mla,0,64,100\n"
      "attn.sparse_mla,0,128,180\n"
      "indexer.logits,32768,64,50\n"
      "indexer.logits,32768,128,90\n",
      "test.csv");
  const OpCostModel c(round_hw(), &t);
  const Op attn{"attn.sparse_mla", OpKind::kAttention, 1e9, 0, 96, 32768, 0, 0, 1};
  const OpTime in = c.time(attn);
  EXPECT_EQ(in.source, CostSource::kMeasured);
  EXPECT_DOUBLE_EQ(in.us, 140);
  Op outside = attn;
  outside.tokens = 256;
  const OpTime out = c.time(outside);
  EXPECT_EQ(out.source, CostSource::kAnalyticalOutsideGrid);
  EXPECT_DOUBLE_EQ(out.us, c.analytical_us(outside));
  // Context-specific table: another context has no table -> analytical outside grid.
  const Op idx{"indexer.logits", OpKind::kIndexer, 1e9, 0, 128, 32768, 0, 0, 1};
  EXPECT_EQ(c.time(idx).source, CostSource::kMeasured);
  EXPECT_DOUBLE_EQ(c.time(idx).us, 90);
  Op idx128k = idx;
  idx128k.context = 131072;
  EXPECT_EQ(c.time(idx128k).source, CostSource::kAnalytical);
  const Op other{"moe.routed_experts", OpKind::kGemmFp8, 1e9, 0, 64, 0, 0, 0, 1};
  EXPECT_EQ(c.time(other).source, CostSource::kAnalytical);
}

TEST(sim_interpolation, MalformedTablesAreRefused) {
  EXPECT_THROW(MeasuredTables::from_csv_text("op,tokens,time_us\n", "t.csv"), Error);
  EXPECT_THROW(MeasuredTables::from_csv_text("", "t.csv"), Error);
  EXPECT_THROW(MeasuredTables::from_csv_text("op,context,tokens,time_us\na,0,x,1\n", "t.csv"), Error);
  EXPECT_THROW(MeasuredTables::from_csv_text("op,context,tokens,time_us\na,0,1,-1\n", "t.csv"), Error);
  EXPECT_THROW(MeasuredTables::from_csv_text("op,context,tokens,time_us\na,0,1,1\na,0,1,2\n", "t.csv"), Error);
  EXPECT_THROW(MeasuredTables::from_csv_text("op,context,tokens,time_us\na,0,1\n", "t.csv"), Error);
  EXPECT_THROW(MeasuredTables::from_csv("/nonexistent/ops.csv"), Error);
}

}  // namespace
}  // namespace ess::sim
