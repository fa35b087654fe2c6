// Op cost model: the time of one operation, from an analytical model of the GPU
// (HardwareProfile) or from measured tables (CSV, linear interpolation in the token count).
// Every OpTime records which of the two produced it.
//
// Analytical model. A GEMM with a shape is timed by tiles and waves: its output is cut into
// tiles of 64 or 128 rows (the one that wastes less) x kGemmTileN columns, the
// tiles run in waves over the SMs, and a wave takes one tile's FLOPs at the SM's share of the
// peak x gemm_efficiency; the kernel is never faster than streaming its bytes from HBM. Grouped
// GEMMs whose rows per group are random (the routed experts: tokens per expert are Poisson)
// count the expected tiles. Top-k runs one CTA per row, each at its SM's share of the HBM
// bandwidth, so few rows cannot use the whole GPU. Sparse MLA decode with a shape runs as
// FlashMLA's SM90 FP8 sparse decode kernel does (see AttentionShape). Everything else is a
// roofline: the slower of FLOPs at peak x efficiency and bytes at HBM bandwidth x
// memory_efficiency. Every kernel adds kernel_launch_us (the gap between kernels of a
// CUDA-graph replay).
//
// Measured tables. CSV with a header `op,context,tokens,time_us`; one row per measured point;
// `context` 0 means "any context". For an op, the points of the same context (else of context
// 0) are interpolated linearly in `tokens`. A query exactly on a grid point or between two
// points is "measured"; outside the grid the simulator does not extrapolate the table: it
// falls back to the analytical model and records kAnalyticalOutsideGrid.
#pragma once

#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ess/sim/hardware.h"

namespace ess::sim {

enum class OpKind {
  kGemmFp8,    // FP8 GEMM / grouped GEMM
  kGemmBf16,   // BF16 GEMM / bmm
  kAttention,  // sparse MLA decode (FlashMLA)
  kIndexer,    // FP8 paged MQA logits (DeepGEMM)
  kMemory,     // bandwidth-bound elementwise / merge / sampling
  kTopk,       // top-k over rows of logits, one CTA per row (`rows`)
  kComm,       // expert-parallel all-to-all
  kH2D,        // FlashTrans host -> device (scattered 656-byte entries)
  kD2H,        // FlashTrans device -> host
};

enum class CostSource { kAnalytical, kMeasured, kAnalyticalOutsideGrid };
std::string_view to_string(CostSource s);

// One GEMM of an op: `groups` independent problems of m x n x k (m: rows per group, a mean when
// random_rows). n = 0: no shape (the op is timed by its FLOPs alone).
struct GemmShape {
  double m = 0;
  double n = 0;
  double k = 0;
  double groups = 1;
  bool random_rows = false;  // rows per group ~ Poisson(m) (tokens routed to an expert)
};

inline constexpr double kGemmTileN = 128;  // output columns per tile (DeepGEMM's usual block_n)

// One sparse MLA decode call as FlashMLA's SM90 FP8 sparse decode runs it
// (csrc/api/sparse_decode.h, csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh,
// csrc/smxx/decode/get_decoding_sched_meta): a grid of (head blocks of 64, s_q, sm parts)
// CTAs, num_sm_parts = max(SMs / s_q / head blocks, 1), so one persistent wave. The rows'
// work, in blocks of 64 top-k entries plus each row's prologue and epilogue, is cut evenly
// over the parts; a row cut between two parts is split-KV, merged by the combine kernel that
// always follows. Per block a CTA dequantises the FP8 latent (shared across the cluster's two
// head blocks) and runs the BF16 MMAs for its 64 heads: 64 x 64 x (d_qk + d_v) x 2 FLOPs at
// the SM's share of the BF16 peak x attention_efficiency. Per row it loads its 64 heads' query
// and stores their output at the SM's share of HBM bandwidth x memory_efficiency. The call
// takes the slower of that and streaming every row's entries once from HBM.
struct AttentionShape {
  double rows = 0;         // FlashMLA's batch: SGLang passes every query token as a row (s_q 1)
  double s_q = 1;          // query tokens per row
  double entries = 0;      // top-k entries per query token
  double heads = 0;        // query heads
  double d_qk = 0;         // 576: latent + rope
  double d_v = 0;          // 512: latent
  double entry_bytes = 0;  // 656: FP8 latent + scales + BF16 rope
};
inline constexpr double kMlaHeadBlock = 64;   // heads per CTA (a cluster of two covers 128)
inline constexpr double kMlaTopkBlock = 64;   // top-k entries per main-loop block

struct Op {
  Op() = default;
  Op(std::string_view name_, OpKind kind_, double flops_ = 0, double bytes_ = 0, double tokens_ = 0,
     std::int64_t context_ = 0, double rdma_bytes_ = 0, double nvlink_bytes_ = 0, double kernels_ = 1)
      : name(name_), kind(kind_), flops(flops_), bytes(bytes_), tokens(tokens_), context(context_),
        rdma_bytes(rdma_bytes_), nvlink_bytes(nvlink_bytes_), kernels(kernels_) {}
  std::string_view name;
  OpKind kind = OpKind::kMemory;
  double flops = 0;
  double bytes = 0;         // HBM bytes (compute ops) or link bytes (transfers)
  double tokens = 0;        // table key
  std::int64_t context = 0; // table key
  double rdma_bytes = 0;    // comm ops: bytes leaving the node
  double nvlink_bytes = 0;  // comm ops: bytes to other GPUs of the node
  double kernels = 1;       // launches the op takes (an expectation for ops that may not run)
  GemmShape gemm;           // GEMM ops: the (first) GEMM's shape
  GemmShape gemm2;          // a second GEMM in the same op (an MLP's down projection), n = 0: none
  double rows = 0;          // kTopk: rows, one CTA each
  AttentionShape attention; // kAttention: rows = 0 -> the roofline over flops / bytes
};

// E[ceil(X / tile)] for X ~ Poisson(mean): the expected row tiles of a group with random rows.
double expected_row_tiles(double mean, double tile);

struct OpTime {
  double us = 0;
  CostSource source = CostSource::kAnalytical;
};

struct Point {
  double x = 0;
  double y = 0;
};

// Linear interpolation over points sorted by x: the value, or nullopt when x is outside
// [front.x, back.x]. A single point answers only for its own x.
std::optional<double> interpolate(std::span<const Point> points, double x);

class MeasuredTables {
 public:
  static MeasuredTables from_csv(const std::string& path);
  static MeasuredTables from_csv_text(std::string_view text, const std::string& source);
  // Interpolated time in us, or nullopt when the op has no table or x is outside the grid;
  // `has_table` tells which.
  std::optional<double> lookup(std::string_view op, std::int64_t context, double tokens,
                               bool* has_table = nullptr) const;
  bool empty() const { return tables_.empty(); }
  std::size_t size() const { return tables_.size(); }

 private:
  // (op, context) -> points sorted by tokens.
  std::map<std::pair<std::string, std::int64_t>, std::vector<Point>, std::less<>> tables_;
};

class OpCostModel {
 public:
  explicit OpCostModel(const HardwareProfile& hw, const MeasuredTables* tables = nullptr)
      : hw_(hw), tables_(tables) {}
  OpTime time(const Op& op) const;
  // The roofline alone (what time() falls back to).
  double analytical_us(const Op& op) const;
  // The tensor-core time of one GEMM shape at `tflops` (peak x efficiency): waves x one tile.
  double gemm_compute_us(const GemmShape& g, double tflops) const;
  // Sparse MLA decode with a shape (kernels: the main kernel and the combine), without launch gaps.
  double attention_us(const AttentionShape& a) const;
  const HardwareProfile& hardware() const { return hw_; }

 private:
  HardwareProfile hw_;
  const MeasuredTables* tables_;
};

}  // namespace ess::sim
