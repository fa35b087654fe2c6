#include "ess/sim/op_cost.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <bit>
#include <cstdint>
#include <limits>
#include <sstream>

#include "ess/core/error.h"
#include "ess/core/files.h"
#include "ess/io/lists.h"
#include "ess/sim/op_names.h"

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

double expected_row_tiles(double mean, double tile) {
  if (!(mean > 0) || !(tile >= 1)) return 0.0;
  // A standard deviation past the tile: the remainder modulo the tile is uniform over its
  // tile values (to within about exp(-2 pi^2 var / tile^2) < 1e-8), so E[ceil(X / tile)] =
  // mean / tile + (tile - 1) / (2 tile).
  if (mean > tile * tile) return mean / tile + 0.5 - 0.5 / tile;
  // A step asks for a few (mean, tile) pairs over and over (every layer, both GEMMs).
  struct Cached {
    double mean = -1, tile = -1, value = 0;
  };
  thread_local Cached cache[16];
  thread_local unsigned next = 0;
  for (const Cached& c : cache) {
    if (c.mean == mean && c.tile == tile) return c.value;
  }
  // E[ceil(X / tile)] = sum over j >= 0 of P(X > j x tile), the Poisson pmf walked in log space
  // over mean +- 12 standard deviations (below it P(X > x) is 1, above it 0 at double precision).
  const auto step = static_cast<std::int64_t>(tile);
  const auto lo = static_cast<std::int64_t>(std::max(0.0, std::floor(mean - 12 * std::sqrt(mean) - 30)));
  const auto hi = static_cast<std::int64_t>(std::ceil(mean + 12 * std::sqrt(mean) + 30));
  double value = double((lo + step - 1) / step);  // multiples j x tile < lo: P(X > j x tile) = 1
  double cdf = 0;
  double pmf = std::exp(double(lo) * std::log(mean) - mean - std::lgamma(double(lo) + 1));
  for (std::int64_t x = lo; x <= hi; ++x) {
    cdf += pmf;
    if (x % step == 0) value += std::max(0.0, 1 - cdf);
    pmf *= mean / double(x + 1);
  }
  cache[next++ % 16] = {mean, tile, value};
  return value;
}

double OpCostModel::gemm_compute_us(const GemmShape& g, double tflops) const {
  if (g.n <= 0 || g.k <= 0 || g.m <= 0 || g.groups <= 0) return 0.0;
  // A step prices the same few shapes once per layer and micro-batch: remember them
  // (direct-mapped; the key holds everything the time depends on).
  struct Cached {
    GemmShape g;
    double tflops = -1, sms = 0, overhead = 0, us = 0;
  };
  thread_local Cached cache[256];
  const std::uint64_t key = std::bit_cast<std::uint64_t>(g.m) * 0x9E3779B97F4A7C15ULL ^
                            std::bit_cast<std::uint64_t>(g.n) * 0xC2B2AE3D27D4EB4FULL ^
                            std::bit_cast<std::uint64_t>(g.k) * 0x165667B19E3779F9ULL ^
                            std::bit_cast<std::uint64_t>(g.groups);
  const std::size_t slot = static_cast<std::size_t>((key ^ (key >> 29) ^ (key >> 47)) & 255);
  Cached& c = cache[slot];
  if (c.tflops == tflops && c.sms == hw_.sm_count && c.overhead == hw_.gemm_tile_overhead_k && c.g.m == g.m &&
      c.g.n == g.n && c.g.k == g.k && c.g.groups == g.groups && c.g.random_rows == g.random_rows) {
    return c.us;
  }
  const double sms = hw_.sm_count;
  const double per_sm = tflops * 1e6 / sms;  // flop per us of one SM
  double best = std::numeric_limits<double>::infinity();
  for (const double bm : {64.0, 128.0}) {
    const double row_tiles = g.random_rows ? expected_row_tiles(g.m, bm) : std::ceil(g.m / bm);
    const double tiles = g.groups * row_tiles * std::ceil(g.n / kGemmTileN);
    const double waves = std::ceil(tiles / sms - 1e-9);
    best = std::min(best, waves * 2 * bm * kGemmTileN * (g.k + hw_.gemm_tile_overhead_k) / per_sm);
  }
  c = {g, tflops, hw_.sm_count, hw_.gemm_tile_overhead_k, best};
  return best;
}

double OpCostModel::attention_us(const AttentionShape& a) const {
  if (a.rows <= 0 || a.heads <= 0 || a.s_q <= 0) return 0.0;
  const double sms = hw_.sm_count;
  const double hbm = hw_.hbm_bandwidth_gbps * hw_.memory_efficiency * 1e3;  // bytes per us
  const double head_blocks = std::ceil(a.heads / kMlaHeadBlock);
  const double parts = std::max(std::floor(sms / (a.s_q * head_blocks)), 1.0);
  const double waves = std::ceil(parts * a.s_q * head_blocks / sms - 1e-9);
  // One CTA: a block of 64 entries at its SM's share of the BF16 peak; a row's query in and
  // output out at its SM's share of the bandwidth, in blocks' worth.
  const double per_sm_flops = hw_.bf16_tflops * 1e6 / sms * hw_.attention_efficiency;
  const double block_us = kMlaTopkBlock * kMlaHeadBlock * (a.d_qk + a.d_v) * 2 / per_sm_flops;
  const double row_io_us = kMlaHeadBlock * (a.d_qk + a.d_v) * 2 / (hbm / sms);
  const double row_blocks = std::ceil(a.entries / kMlaTopkBlock - 1e-9) + row_io_us / block_us;
  // The parts share the rows' blocks evenly (a part ends only on a block); the first row a
  // part starts in costs its prologue again.
  const double payload = std::ceil(a.rows * row_blocks / parts - 1e-9) + row_io_us / block_us;
  const double compute = waves * payload * block_us;
  const double memory = a.rows * a.s_q * (a.entries * a.entry_bytes + a.heads * (a.d_qk + a.d_v) * 2) / hbm;
  // The combine reads each split piece's fp32 output and log-sum-exp: at most two pieces per
  // part boundary, or every part when there are fewer rows than parts.
  const double pieces = 2 * std::min(a.rows, parts) * a.s_q * head_blocks;
  const double combine = pieces * kMlaHeadBlock * (a.d_v * 4 + 4) / hbm;
  return std::max(compute, memory) + combine;
}

double OpCostModel::analytical_us(const Op& op) const {
  const double hbm = hw_.hbm_bandwidth_gbps * hw_.memory_efficiency * 1e3;  // bytes per us
  const double launch = hw_.kernel_launch_us * op.kernels;
  auto roofline = [&](double tflops) { return std::max(op.flops / (tflops * 1e6), op.bytes / hbm) + launch; };
  auto gemm = [&](double peak) {
    if (op.gemm.n <= 0) return roofline(peak * hw_.gemm_efficiency);  // no shape: FLOPs at the efficiency
    const double tflops = peak * hw_.gemm_efficiency;
    const double compute = gemm_compute_us(op.gemm, tflops) + gemm_compute_us(op.gemm2, tflops);
    const double memory = op.bytes / (hw_.hbm_bandwidth_gbps * hw_.gemm_memory_efficiency * 1e3);
    return std::max(compute, memory) + launch;
  };
  switch (op.kind) {
    case OpKind::kGemmFp8: return gemm(hw_.fp8_tflops);
    case OpKind::kGemmBf16: return gemm(hw_.bf16_tflops);
    case OpKind::kAttention:
      if (op.attention.rows <= 0) return roofline(hw_.bf16_tflops * hw_.attention_efficiency);
      return attention_us(op.attention) + launch;
    case OpKind::kIndexer: return roofline(hw_.fp8_tflops * hw_.indexer_efficiency);
    case OpKind::kMemory: return op.bytes / hbm + launch;
    case OpKind::kTopk: {
      if (op.rows <= 0 || op.bytes <= 0) return launch;
      // One CTA per row, each streaming its row at its SM's share of the bandwidth.
      const double waves = std::ceil(op.rows / hw_.sm_count - 1e-9);
      return waves * (op.bytes / op.rows) / (hbm / hw_.sm_count) + launch;
    }
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
