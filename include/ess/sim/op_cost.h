// Op cost model: the time of one operation, from an analytical roofline with achievable
// efficiencies (HardwareProfile) or from measured tables (CSV, linear interpolation in the
// token count). Every OpTime records which of the two produced it.
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
  kMemory,     // bandwidth-bound elementwise / top-k / merge
  kComm,       // expert-parallel all-to-all
  kH2D,        // FlashTrans host -> device (scattered 656-byte entries)
  kD2H,        // FlashTrans device -> host
};

enum class CostSource { kAnalytical, kMeasured, kAnalyticalOutsideGrid };
std::string_view to_string(CostSource s);

struct Op {
  std::string_view name;
  OpKind kind = OpKind::kMemory;
  double flops = 0;
  double bytes = 0;         // HBM bytes (compute ops) or link bytes (transfers)
  double tokens = 0;        // table key
  std::int64_t context = 0; // table key
  double rdma_bytes = 0;    // comm ops: bytes leaving the node
  double nvlink_bytes = 0;  // comm ops: bytes to other GPUs of the node
  double kernels = 1;       // launches the op takes (an expectation for ops that may not run)
};

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
  const HardwareProfile& hardware() const { return hw_; }

 private:
  HardwareProfile hw_;
  const MeasuredTables* tables_;
};

}  // namespace ess::sim
