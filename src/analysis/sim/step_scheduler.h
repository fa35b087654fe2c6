// The step model's schedule (step_model.cc): four in-order streams (compute, EP comm, H2D,
// D2H) onto which the ops of a step are issued, and a micro-batch's progress through a layer.
// Internal to the simulator.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ess/sim/op_cost.h"
#include "ess/sim/step_model.h"
#include "ess/sim/timeline.h"

namespace ess::sim {

enum class Wait { kNone, kComm, kTransfer };
enum class Category { kAttention, kMoe, kOther, kMtpDraft };

// Four in-order streams; each op starts when its stream is free and its inputs are ready.
// Idle time of the compute stream is charged to what it waited for. While a FlashTrans copy
// runs (H2D or D2H stream) it holds `transfer_sms` of the SMs, so compute issued beside it
// runs on the rest.
class Scheduler {
 public:
  Scheduler(const OpCostModel& cost, StepResult& result, Timeline* timeline)
      : cost_(&cost), r_(&result), timeline_(timeline) {
    const HardwareProfile& hw = cost.hardware();
    share_ = hw.sm_count > 0 ? std::clamp(hw.transfer_sms / hw.sm_count, 0.0, 0.95) : 0.0;
  }

  void set_label(int layer, char micro_batch) {
    layer_ = layer;
    mb_ = micro_batch;
  }
  void set_category(Category c) { category_ = c; }
  // Everything issued while drafting is charged to the MTP draft.
  void set_drafting(bool on) { drafting_ = on; }

  double issue(Stream s, const Op& op, double ready, Wait wait = Wait::kNone) {
    const OpTime t = cost_->time(op);
    double& lane = lanes_[static_cast<int>(s)];
    const double start = std::max(lane, ready);
    double dur = t.us;
    if (s == Stream::kCompute) {
      const double gap = start - lane;
      if (gap > 0) charge_wait(gap, wait);
      dur = beside_transfers(start, t.us);
      r_->compute_us += dur;
      r_->transfer_sm_us += dur - t.us;
      r_->kernels += op.kernels;
      // A measured time holds its own launch; the analytical one adds it.
      if (t.source != CostSource::kMeasured) r_->launch_us += op.kernels * cost_->hardware().kernel_launch_us;
      switch (drafting_ ? Category::kMtpDraft : category_) {
        case Category::kAttention: r_->attention_us += dur; break;
        case Category::kMoe: r_->moe_us += dur; break;
        case Category::kOther: r_->other_us += dur; break;
        case Category::kMtpDraft: r_->mtp_draft_us += dur; break;
      }
    } else if (s == Stream::kComm) {
      r_->comm_us += dur;
      if (dur > 0) r_->comm_latency_us += op.rdma_bytes > 0 ? cost_->hardware().rdma_latency_us : cost_->hardware().nvlink_latency_us;
    } else {
      if (s == Stream::kH2D) {
        r_->h2d_us += dur;
        r_->h2d_bytes += op.bytes;
      } else {
        r_->d2h_bytes += op.bytes;
      }
      if (dur > 0 && share_ > 0) transfers_.push_back({start, start + dur});
    }
    switch (t.source) {
      case CostSource::kMeasured: ++r_->ops_measured; break;
      case CostSource::kAnalytical: ++r_->ops_analytical; break;
      case CostSource::kAnalyticalOutsideGrid: ++r_->ops_outside_grid; break;
    }
    lane = start + dur;
    if (timeline_ != nullptr && dur > 0) {
      timeline_->events.push_back(
          {s, layer_ < 0 ? std::string(op.name) : fmt::format("L{}{} {}", layer_, mb_, op.name), start, dur, t.source});
    }
    return lane;
  }
  // The compute stream blocks until `t` (a receive kernel spinning on the all-to-all).
  void block_compute_until(double t, Wait wait) {
    double& lane = lanes_[0];
    if (t > lane) {
      charge_wait(t - lane, wait);
      lane = t;
    }
  }
  // Host time between steps: nothing runs on the GPU.
  void host_gap(double us) {
    const double t = end();
    for (double& l : lanes_) l = t + us;
  }
  double end() const { return *std::max_element(lanes_, lanes_ + 4); }
  double compute_end() const { return lanes_[0]; }
  // A copy that records nothing visible: for trying a schedule.
  Scheduler trial(StepResult& scratch) const {
    Scheduler s = *this;
    s.r_ = &scratch;
    s.timeline_ = nullptr;
    return s;
  }

 private:
  void charge_wait(double gap, Wait wait) {
    if (wait == Wait::kComm) r_->exposed_comm_us += gap;
    if (wait == Wait::kTransfer) r_->exposed_transfer_us += gap;
  }
  // When a compute op of `work` us (on every SM) that starts at `start` ends, running on
  // 1 - share of the SMs wherever copies are in flight (two copies hold two grids).
  double beside_transfers(double start, double work) {
    std::erase_if(transfers_, [&](const std::pair<double, double>& iv) { return iv.second <= start; });
    if (transfers_.empty() || work <= 0) return work;
    double t = start, left = work;
    for (int guard = 0; guard < 64; ++guard) {
      int depth = 0;
      double next = std::numeric_limits<double>::infinity();
      for (const auto& [b, e] : transfers_) {
        if (b <= t && t < e) ++depth;
        if (b > t) next = std::min(next, b);
        if (e > t) next = std::min(next, e);
      }
      const double rate = std::max(0.05, 1 - depth * share_);
      if (!std::isfinite(next) || (next - t) * rate >= left) return t + left / rate - start;
      left -= (next - t) * rate;
      t = next;
    }
    return t + left - start;
  }

  const OpCostModel* cost_;
  StepResult* r_;
  Timeline* timeline_;
  double lanes_[4] = {0, 0, 0, 0};
  double share_ = 0;
  std::vector<std::pair<double, double>> transfers_;  // FlashTrans copies in flight [start, end)
  int layer_ = -1;
  char mb_ = ' ';
  Category category_ = Category::kOther;
  bool drafting_ = false;
};

struct MicroBatch {
  double requests = 0;   // b
  double tokens = 0;     // n = b x query tokens
  double misses = 0;     // entries to fetch in this layer, whole micro-batch
  // Expected step calls past the first in this layer: query groups of steps whose working
  // set exceeds the pool (the batch shares one grouping, so one split position splits all).
  double split_calls = 0;
  OverlapMode mode = OverlapMode::kNone;  // this layer's placement of the copy
  double ready = 0;          // when its previous layer finished
  double fetched = 0;        // when this layer's misses are on the GPU
  double dispatched = 0;     // when the dispatch all-to-all delivered its tokens
  double combined = 0;       // when the combine all-to-all returned them
  char label = 'A';
  // Index sharing (ModelSpec::shared_index). index_shared: this layer runs no indexer (it attends
  // over its leader's top-k). prefetched: its swap decision and copy were issued at its leader's
  // layer; its copy ends at prefetch_end[layer]. followers: at a leader with the prefetch, each
  // follower layer and its misses (the micro-batch's), whose decision and copy its prepare issues.
  bool index_shared = false;
  bool prefetched = false;
  int layer = 0;
  std::vector<std::pair<int, double>> followers;
  std::vector<double> prefetch_end;
};

}  // namespace ess::sim
