// Properties the step model must have whatever its calibration: more requests never make a
// step faster; a GEMM, the sparse MLA and the step never cost more per token as they grow;
// more query tokens at most scale the sparse MLA; a GPU changes it by its SMs and clocks only;
// Two-Batch Overlap adds no fixed cost per kernel; and the GEMM and sparse MLA models against
// DeepGEMM's and FlashMLA's published figures.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "ess/core/error.h"
#include "ess/io/lists.h"
#include "ess/sim/op_cost.h"
#include "ess/sim/step_model.h"
#include "sim/sim_test_util.h"

namespace ess::sim {
namespace {

using testing::dsv32;
using testing::paper_dep;
using testing::paper_hw;

Deployment dep_with(int mtp, bool tbo) {
  Deployment d = paper_dep();
  d.mtp_tokens = mtp;
  d.accept_ratio = 1.0 + 0.7 * (mtp - 1);
  d.two_batch_overlap = tbo;
  return d;
}

// Step time is non-decreasing in batch at a fixed ratio, and the step's cost per token never
// rises when the batch doubles: for MTP 1, 2 and 4, with and without TBO, at 32K and 128K,
// with the copy serial (None) and layer-wise. (Between doublings a GEMM whose rows just
// passed a tile boundary may cost slightly more per token: tiles are whole.)
TEST(sim_properties, StepTimeNonDecreasingAndCostPerTokenNonIncreasingInBatch) {
  for (const std::int64_t context : {32768LL, 131072LL}) {
    for (const int mtp : {1, 2, 4}) {
      for (const bool tbo : {true, false}) {
        const StepModel sm(dsv32(), paper_hw(), dep_with(mtp, tbo));
        for (const OverlapMode mode : {OverlapMode::kNone, OverlapMode::kLayerWise}) {
          if (mode == OverlapMode::kNone && mtp != 2) continue;  // the serial copy once is enough
          std::vector<double> step(1, 0.0);  // step[b]: batch b's step time
          for (int batch = 1; batch <= 200; ++batch) {
            Workload w;
            w.context = context;
            w.batch = batch;
            w.ratio = 0.3;
            w.overlap = mode;
            try {
              step.push_back(sm.run(w).step_us);
            } catch (const Error&) {
              break;  // past the memory wall
            }
            const std::string at = fmt::format("context {} MTP {} TBO {} {} batch {}", context, mtp, tbo,
                                               to_string(mode), batch);
            EXPECT_GE(step[std::size_t(batch)], step[std::size_t(batch) - 1] * (1 - 1e-12)) << at;
            if (batch % 2 == 0) {
              EXPECT_LE(step[std::size_t(batch)] / batch, step[std::size_t(batch / 2)] / (batch / 2) * (1 + 1e-12)) << at;
            }
          }
          EXPECT_GT(step.size(), 8u) << "context " << context << " MTP " << mtp;
        }
      }
    }
  }
}

// Every GEMM of the layer costs no more per row as its rows double (the cost model's
// efficiency never falls with M; what a roofline with a memory floor and one efficiency also
// satisfies, but now with tiles and waves).
TEST(sim_properties, GemmCostPerRowNeverRisesWithM) {
  const OpCostModel cost(paper_hw());
  const ModelSpec& m = dsv32();
  struct Shape {
    const char* name;
    double n, k, groups;
    bool random;
  };
  const Shape shapes[] = {
      {"proj0", 2368, double(m.hidden_size), 1, false},
      {"q_b", 24576, 1536, 1, false},
      {"o_proj", double(m.hidden_size), 16384, 1, false},
      {"absorb bmm", 512, 128, 128, false},
      {"experts up", 4096, double(m.hidden_size), 8, true},
      {"experts down", double(m.hidden_size), 2048, 8, true},
      {"lm_head", double(m.vocab_size), double(m.hidden_size), 1, false},
  };
  for (const Shape& s : shapes) {
    double prev = 1e300;
    for (double rows = 1; rows <= 16384; rows *= 2) {
      Op op("g", OpKind::kGemmFp8, 2 * rows * s.n * s.k * s.groups, s.n * s.k * s.groups + rows * (s.k + 2 * s.n), rows);
      op.gemm = {rows, s.n, s.k, s.groups, s.random};
      const double per_row = cost.analytical_us(op) / rows;
      EXPECT_LE(per_row, prev * (1 + 1e-12)) << s.name << " at " << rows << " rows";
      prev = per_row;
    }
  }
}

// The expected row tiles of Poisson rows: exact at the edges, between the floor and the
// ceiling of its mean, and E[ceil(X/B)] = sum P(X > jB) checked by a direct sum.
TEST(sim_properties, ExpectedRowTilesOfPoissonRows) {
  EXPECT_EQ(expected_row_tiles(0, 64), 0);
  EXPECT_NEAR(expected_row_tiles(1e-9, 64), 1e-9, 1e-12);  // P(X > 0) = 1 - e^-mean
  for (const double mean : {0.5, 3.0, 40.0, 64.0, 100.0, 500.0, 3000.0}) {
    double direct = 0, cdf = 0;
    for (int x = 0; x <= 6000; ++x) {
      cdf += std::exp(x * std::log(mean) - mean - std::lgamma(x + 1.0));
      if (x % 64 == 0) direct += 1 - cdf;
    }
    EXPECT_NEAR(expected_row_tiles(mean, 64), direct, 1e-6) << mean;
    EXPECT_GE(expected_row_tiles(mean, 64), mean / 64) << mean;  // Jensen: never below the mean
  }
  EXPECT_NEAR(expected_row_tiles(1e7, 64), 1e7 / 64 + 0.5 - 0.5 / 64, 1e-9);
  // The wide-distribution shortcut joins the summed value where it takes over.
  EXPECT_NEAR(expected_row_tiles(64 * 64 - 1e-6, 64), expected_row_tiles(64 * 64 + 1e-6, 64), 1e-6);
}

// Turning TBO on changes how many kernels run, never what one costs: with the all-to-all made
// free and the whole cache on the GPU (nothing to wait for), raising the launch gap by 1 us
// raises the step by exactly 1 us per kernel, with TBO as without; the per-step cost is the
// same; and TBO at most doubles the kernels (each micro-batch runs every MoE layer's once).
TEST(sim_properties, TwoBatchOverlapAddsNoFixedCostPerKernel) {
  HardwareProfile free_comm = paper_hw();
  free_comm.rdma_gbps = 1e5;
  free_comm.nvlink_gbps = 1e5;
  free_comm.rdma_latency_us = 0;
  free_comm.nvlink_latency_us = 0;
  HardwareProfile slower_launch = free_comm;
  slower_launch.kernel_launch_us += 1;
  for (const int batch : {2, 16, 52}) {
    Workload w;
    w.batch = batch;
    w.offload = false;
    StepResult r[2][2];  // [tbo][slower launch]
    for (const bool tbo : {false, true}) {
      r[tbo][0] = StepModel(dsv32(), free_comm, dep_with(2, tbo)).run(w);
      r[tbo][1] = StepModel(dsv32(), slower_launch, dep_with(2, tbo)).run(w);
      EXPECT_NEAR(r[tbo][1].step_us - r[tbo][0].step_us, r[tbo][0].kernels, 1e-6 * r[tbo][0].step_us)
          << "batch " << batch << " TBO " << tbo;
      EXPECT_DOUBLE_EQ(r[tbo][0].launch_us, r[tbo][0].kernels * free_comm.kernel_launch_us);
    }
    EXPECT_DOUBLE_EQ(r[1][0].step_overhead_us, r[0][0].step_overhead_us);
    EXPECT_GT(r[1][0].kernels, r[0][0].kernels) << batch;
    EXPECT_LE(r[1][0].kernels, 2 * r[0][0].kernels) << batch;
  }
}

struct DeepGemmRow {
  double groups, m, n, k, tflops;
};

std::vector<DeepGemmRow> deepgemm_table() {
  std::ifstream in(std::string(ESS_SOURCE_DIR) + "/tests/sim/data/deepgemm_h800.csv");
  std::vector<DeepGemmRow> rows;
  std::string line;
  bool header = false;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (!header) {
      header = true;
      continue;
    }
    const std::vector<std::string> cells = split_list(line);
    EXPECT_EQ(cells.size(), 6u) << line;
    if (cells.size() != 6) continue;
    rows.push_back({std::stod(cells[0]), std::stod(cells[1]), std::stod(cells[2]), std::stod(cells[3]), std::stod(cells[4])});
  }
  return rows;
}

// The tile / wave model with the shipped GEMM numbers reproduces DeepGEMM's published H800
// table (dense, contiguous and masked grouped FP8 GEMMs from 64 to 8192 rows): rms error
// within 12 %, no shape off by more than 25 %, and no systematic bias.
TEST(sim_properties, GemmModelReproducesDeepGemmOnH800) {
  const HardwareProfile hw = HardwareProfile::shipped("h800");
  const OpCostModel cost(hw);
  const std::vector<DeepGemmRow> rows = deepgemm_table();
  ASSERT_EQ(rows.size(), 28u);
  double sq = 0, sum = 0, worst = 0;
  for (const DeepGemmRow& r : rows) {
    const double flops = 2 * r.groups * r.m * r.n * r.k;
    Op op("g", OpKind::kGemmFp8, flops, r.groups * (r.n * r.k + r.m * r.k + 2 * r.m * r.n), r.m, 0, 0, 0, 0);
    op.gemm = {r.m, r.n, r.k, r.groups, false};
    const double predicted = cost.analytical_us(op);
    const double measured = flops / (r.tflops * 1e6);
    const double err = predicted / measured - 1;
    sq += err * err;
    sum += err;
    worst = std::max(worst, std::abs(err));
  }
  const double n = double(rows.size());
  EXPECT_LT(std::sqrt(sq / n), 0.12);
  EXPECT_LT(worst, 0.25);
  EXPECT_LT(std::abs(sum / n), 0.05);
}

// ---- sparse MLA ----------------------------------------------------------------------------

Op mla_op(double query_tokens, double entries, double s_q = 1) {
  const ModelSpec& m = dsv32();
  const double heads = m.num_attention_heads, d_qk = m.mla_head_dim(), d_v = m.kv_lora_rank;
  Op op("attn", OpKind::kAttention, 2 * query_tokens * heads * entries * (d_qk + d_v), 0, query_tokens, 0, 0, 0, 0);
  op.attention = {query_tokens / s_q, s_q, entries, heads, d_qk, d_v, double(m.latent_entry_bytes())};
  return op;
}

// FlashMLA's published sparse decode figures on H800 (tests/sim/data/flashmla_sparse_decode_h800.csv):
// the kernel model with the shipped attention_efficiency (the one number fitted to them)
// reproduces each within 2 %.
TEST(sim_properties, SparseMlaModelReproducesFlashMlaOnH800) {
  const OpCostModel cost(HardwareProfile::shipped("h800"));
  std::ifstream in(std::string(ESS_SOURCE_DIR) + "/tests/sim/data/flashmla_sparse_decode_h800.csv");
  ASSERT_TRUE(in.good());
  std::string line;
  bool header = false;
  double sq = 0, worst = 0;
  int n = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> cells = split_list(line);
    if (!header) {
      ASSERT_EQ(line, "batch,s_q,heads,topk,tflops");
      header = true;
      continue;
    }
    ASSERT_EQ(cells.size(), 5u) << line;
    const double batch = std::stod(cells[0]), s_q = std::stod(cells[1]), heads = std::stod(cells[2]);
    const double topk = std::stod(cells[3]), tflops = std::stod(cells[4]);
    ASSERT_EQ(heads, dsv32().num_attention_heads) << line;
    const Op op = mla_op(batch * s_q, topk, s_q);
    const double predicted = op.flops / cost.analytical_us(op) / 1e6;
    const double err = predicted / tflops - 1;
    sq += err * err;
    worst = std::max(worst, std::abs(err));
    ++n;
  }
  ASSERT_EQ(n, 2);
  EXPECT_LT(std::sqrt(sq / n), 0.02);
  EXPECT_LT(worst, 0.02);
}

// At a fixed shape (entries per query token, T) the sparse MLA's cost per query token never
// rises when the batch doubles, and it falls overall from one request to 256 (the wave fills;
// the fixed prologue spreads). Between doublings a row past a part boundary costs a block.
TEST(sim_properties, SparseMlaCostPerQueryTokenNeverRisesWithBatch) {
  for (const char* gpu : {"paper-table1", "h20-141gb"}) {
    const OpCostModel cost(HardwareProfile::shipped(gpu));
    for (const double entries : {2048.0, 1500.0, 100.0, 7.0}) {
      for (const int T : {1, 2, 3, 4}) {
        for (int batch = 1; batch <= 256; ++batch) {
          const double one = cost.analytical_us(mla_op(batch * T, entries)) / (batch * T);
          const double two = cost.analytical_us(mla_op(2 * batch * T, entries)) / (2 * batch * T);
          EXPECT_LE(two, one * (1 + 1e-12)) << gpu << " entries " << entries << " T " << T << " batch " << batch;
        }
        EXPECT_LT(cost.analytical_us(mla_op(256 * T, entries)) / (256 * T), cost.analytical_us(mla_op(T, entries)) / T);
      }
    }
  }
}

// Doubling the query tokens per request at most doubles the sparse MLA's time (and never
// shortens it), at every batch and at 32K and 128K contexts (the top-k is the same).
TEST(sim_properties, SparseMlaDoublingTAtMostDoublesItsTime) {
  const OpCostModel cost(paper_hw());
  for (const double entries : {2048.0, 600.0}) {
    for (const int T : {1, 2}) {
      for (int batch = 1; batch <= 200; ++batch) {
        const double t1 = cost.analytical_us(mla_op(batch * T, entries));
        const double t2 = cost.analytical_us(mla_op(batch * 2 * T, entries));
        EXPECT_LE(t2, 2 * t1 * (1 + 1e-12)) << "T " << T << " batch " << batch;
        EXPECT_GE(t2, t1) << "T " << T << " batch " << batch;
      }
    }
  }
  // Through the step model: the attention category with MTP 4 at most twice MTP 2's.
  for (const int batch : {8, 26, 52}) {
    Workload w;
    w.batch = batch;
    w.offload = false;
    HardwareProfile hw = paper_hw();
    const StepResult two = StepModel(dsv32(), hw, dep_with(2, false)).run(w);
    const StepResult four = StepModel(dsv32(), hw, dep_with(4, false)).run(w);
    EXPECT_GT(four.attention_us, two.attention_us) << batch;
    EXPECT_LE(four.attention_us, 2 * two.attention_us) << batch;
  }
}

// An H20 changes the sparse MLA by its SM count and clocks (its BF16 peak) alone: the kernel's
// efficiency is FlashMLA's, not the GPU's, so an H200 profile given the H20's SMs and peak
// prices every shape exactly as the H20 profile does; and the change is not the peaks' ratio
// (78 SMs make 39 parts of two head blocks, not 66).
TEST(sim_properties, SparseMlaOnH20ChangesBySmCountAndClocksAlone) {
  const HardwareProfile h20 = HardwareProfile::shipped("h20-141gb");
  HardwareProfile as_h20 = HardwareProfile::shipped("h200");
  EXPECT_EQ(h20.attention_efficiency, as_h20.attention_efficiency);
  as_h20.sm_count = h20.sm_count;
  as_h20.bf16_tflops = h20.bf16_tflops;
  as_h20.hbm_bandwidth_gbps = h20.hbm_bandwidth_gbps;  // the same 4.8 TB/s: checked below
  EXPECT_EQ(h20.hbm_bandwidth_gbps, HardwareProfile::shipped("h200").hbm_bandwidth_gbps);
  EXPECT_EQ(h20.memory_efficiency, as_h20.memory_efficiency);
  const OpCostModel a(h20), b(as_h20), h200(HardwareProfile::shipped("h200"));
  bool differs_from_peak_ratio = false;
  for (const double entries : {2048.0, 300.0}) {
    for (const double tokens : {1.0, 2.0, 26.0, 52.0, 78.0, 160.0, 320.0, 640.0}) {
      const Op op = mla_op(tokens, entries);
      EXPECT_DOUBLE_EQ(a.analytical_us(op), b.analytical_us(op)) << tokens << " tokens";
      const double ratio = a.analytical_us(op) / h200.analytical_us(op);
      if (std::abs(ratio - 989.0 / 148.0) > 0.05 * 989.0 / 148.0) differs_from_peak_ratio = true;
    }
  }
  EXPECT_TRUE(differs_from_peak_ratio);
}

}  // namespace
}  // namespace ess::sim
