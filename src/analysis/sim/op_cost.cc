#include "ess/sim/op_cost.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "ess/core/error.h"
#include "ess/core/files.h"
#include "ess/core/op_names.h"
#include "ess/core/lists.h"

namespace ess::sim {

std::string_view to_string(CostSource s) {
  switch (s) {
    case CostSource::kAnalytical: return "analytical";
    case CostSource::kMeasured: return "measured";
    case CostSource::kAnalyticalOutsideGrid: return "analytical (outside measured grid)";
  }
  return "?";
}

std::optional<double> interpolate(std::span<const Point> p, double x) {
  if (p.empty() || !std::isfinite(x) || x < p.front().x || x > p.back().x) return std::nullopt;
  const auto it = std::lower_bound(p.begin(), p.end(), x, [](const Point& a, double v) { return a.x < v; });
  if (it->x == x) return it->y;
  const Point& hi = *it;
  const Point& lo = *(it - 1);
  const double t = (x - lo.x) / (hi.x - lo.x);
  return lo.y + t * (hi.y - lo.y);
}

MeasuredTables MeasuredTables::from_csv(const std::string& path) {
  return from_csv_text(read_text_file(path, "op table"), path);
}

MeasuredTables MeasuredTables::from_csv_text(std::string_view text, const std::string& source) {
  MeasuredTables t;
  std::istringstream in{std::string(text)};
  std::string line;
  int line_no = 0;
  bool header = false;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> cells = split_list(line);
    if (!header) {
      ESS_CHECK(cells.size() == 4 && cells[0] == "op" && cells[1] == "context" && cells[2] == "tokens" &&
                    cells[3] == "time_us",
                "{}:{}: header must be 'op,context,tokens,time_us', got '{}'", source, line_no, line);
      header = true;
      continue;
    }
    ESS_CHECK(cells.size() == 4, "{}:{}: expected 4 cells, got {} in '{}'", source, line_no, cells.size(), line);
    ESS_CHECK(is_op_name(cells[0]), "{}:{}: unknown op '{}' (the ops: {})", source, line_no, cells[0], op_names_list());
    double v[3];
    for (int i = 0; i < 3; ++i) {
      std::size_t used = 0;
      try {
        v[i] = std::stod(cells[static_cast<std::size_t>(i) + 1], &used);
      } catch (const std::exception&) {
        used = 0;
      }
      ESS_CHECK(used == cells[static_cast<std::size_t>(i) + 1].size() && used > 0 && std::isfinite(v[i]),
                "{}:{}: '{}' is not a number", source, line_no, cells[static_cast<std::size_t>(i) + 1]);
    }
    ESS_CHECK(v[0] >= 0 && v[0] == std::floor(v[0]), "{}:{}: context = {} must be a non-negative integer",
              source, line_no, v[0]);
    ESS_CHECK(v[1] >= 0, "{}:{}: tokens = {} must be >= 0", source, line_no, v[1]);
    ESS_CHECK(v[2] >= 0 && v[2] <= 1e9, "{}:{}: time_us = {} must be in [0, 1e9] (1000 s)", source, line_no, v[2]);
    ESS_CHECK(v[0] <= (1LL << 30), "{}:{}: context = {} exceeds 2^30 tokens", source, line_no, v[0]);
    ESS_CHECK(v[1] <= 1e9, "{}:{}: tokens = {} exceeds 1e9", source, line_no, v[1]);
    auto& pts = t.tables_[{cells[0], static_cast<std::int64_t>(v[0])}];
    for (const Point& p : pts) {
      ESS_CHECK(p.x != v[1], "{}:{}: op '{}' context {} has tokens = {} twice", source, line_no, cells[0], v[0], v[1]);
    }
    pts.push_back({v[1], v[2]});
  }
  ESS_CHECK(header, "{}: empty op table (no header)", source);
  ESS_CHECK(!t.tables_.empty(), "{}: the op table has a header but no rows", source);
  for (auto& [k, pts] : t.tables_) {
    std::sort(pts.begin(), pts.end(), [](const Point& a, const Point& b) { return a.x < b.x; });
  }
  return t;
}

std::optional<double> MeasuredTables::lookup(std::string_view op, std::int64_t context, double tokens,
                                             bool* has_table) const {
  auto it = tables_.find(std::pair<std::string, std::int64_t>(std::string(op), context));
  if (it == tables_.end()) it = tables_.find(std::pair<std::string, std::int64_t>(std::string(op), 0));
  if (has_table) *has_table = it != tables_.end();
  if (it == tables_.end()) return std::nullopt;
  return interpolate(it->second, tokens);
}

double OpCostModel::analytical_us(const Op& op) const {
  const double hbm = hw_.hbm_bandwidth_gbps * hw_.memory_efficiency * 1e3;  // bytes per us
  const double launch = hw_.kernel_launch_us * op.kernels;
  auto roofline = [&](double tflops) { return std::max(op.flops / (tflops * 1e6), op.bytes / hbm) + launch; };
  switch (op.kind) {
    case OpKind::kGemmFp8: return roofline(hw_.fp8_tflops * hw_.gemm_efficiency);
    case OpKind::kGemmBf16: return roofline(hw_.bf16_tflops * hw_.gemm_efficiency);
    case OpKind::kAttention: return roofline(hw_.bf16_tflops * hw_.attention_efficiency);
    case OpKind::kIndexer: return roofline(hw_.fp8_tflops * hw_.indexer_efficiency);
    case OpKind::kMemory: return op.bytes / hbm + launch;
    case OpKind::kComm: {
      if (op.rdma_bytes <= 0 && op.nvlink_bytes <= 0) return 0.0;
      const double rdma = op.rdma_bytes / (hw_.rdma_gbps * 1e3);
      const double nvl = op.nvlink_bytes / (hw_.nvlink_gbps * 1e3);
      const double latency = op.rdma_bytes > 0 ? hw_.rdma_latency_us : hw_.nvlink_latency_us;
      return std::max(rdma, nvl) + latency;
    }
    case OpKind::kH2D:
      return op.bytes > 0 ? op.bytes / (hw_.h2d_scattered_gbps * 1e3) + hw_.transfer_launch_us : 0.0;
    case OpKind::kD2H:
      return op.bytes > 0 ? op.bytes / (hw_.d2h_scattered_gbps * 1e3) + hw_.transfer_launch_us : 0.0;
  }
  return 0.0;
}

OpTime OpCostModel::time(const Op& op) const {
  if (tables_ != nullptr && !tables_->empty()) {
    bool has_table = false;
    if (const auto us = tables_->lookup(op.name, op.context, op.tokens, &has_table)) {
      return {*us, CostSource::kMeasured};
    }
    if (has_table) return {analytical_us(op), CostSource::kAnalyticalOutsideGrid};
  }
  return {analytical_us(op), CostSource::kAnalytical};
}

}  // namespace ess::sim
