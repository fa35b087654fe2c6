#include "ess/sim/planner.h"

#include <algorithm>
#include <vector>

#include "ess/core/error.h"
#include "ess/sim/memory_model.h"

namespace ess::sim {
namespace {

constexpr int kMaxBatchesPerKind = 4096;

// What happened to one batch of a kind's search, with the figures its limit would name.
enum class Outcome { kRuns, kHostDram, kHostBandwidth, kTooSlow };
struct Tried {
  int batch = 0;
  Outcome outcome = Outcome::kRuns;
  double host_pool_gb_per_node = 0, h2d_gbps_per_node = 0, otps = 0, throughput_tokens_per_s = 0;
};

struct Search {
  PlanOption option;
  std::vector<Tried> tried;  // in batch order
  const StepModel* model = nullptr;  // the deployment it ran in
  double best_otps_seen = 0;
  long count(Outcome o) const {
    return std::count_if(tried.begin(), tried.end(), [o](const Tried& t) { return t.outcome == o; });
  }
};

// The chosen configuration's pool under a light load, requests whole while the pool's rows hold
// them (Residency::kAdaptive): the largest batch with every request whole (whole-ness falls with
// the batch: a binary search), and batch 1 with and without residency beside all-on-GPU.
LowLoad low_load(const StepModel& model, const PlanRequest& req, const StepResult& chosen) {
  LowLoad out;
  if (!chosen.offload) return out;
  out.found = true;
  Workload w;
  w.context = req.context;
  w.offload = true;
  w.overlap = chosen.overlap;
  w.slots = chosen.slots;
  w.misses = req.misses;
  w.prefix_share = req.prefix_share;
  w.residency = Residency::kAdaptive;
  auto all_whole = [&](int batch) {
    w.batch = batch;
    return model.run(w).whole_requests == batch;
  };
  int lo = 0, hi = chosen.batch;  // all_whole(lo) holds (vacuously at 0); find the largest
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (all_whole(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  out.all_whole_up_to = lo;
  Workload resident;
  resident.context = req.context;
  resident.batch = 1;
  resident.offload = false;
  resident.misses = req.misses;
  const MemoryModel mem(model.model(), model.hardware(), model.deployment(), req.context);
  if (mem.max_batch(double(mem.context_entries())) < 1) return out;  // no all-on-GPU step to compare with
  const double base = model.run(resident).throughput_tokens_per_s;
  w.batch = 1;
  out.batch1_adaptive = model.run(w).throughput_tokens_per_s / base;
  w.residency = Residency::kSparse;
  out.batch1_sparse = model.run(w).throughput_tokens_per_s / base;
  return out;
}

// Why a kind's best batch is its largest: the first batch tried past it, or memory when none is.
void binding_limit(Search& s, const MemoryModel& mem, const HardwareProfile& hw, const PlanRequest& req, int max_b) {
  PlanOption& o = s.option;
  const StepResult& b = o.best;
  o.cache_budget_gb = mem.cache_budget() / 1e9;
  o.indexer_gb = b.batch * mem.resident_bytes_per_request() / 1e9;
  if (mem.resident_bytes_per_request() > mem.indexer_bytes_per_request()) o.resident_what = "resident caches";
  o.latent_gb = b.batch * mem.latent_bytes_per_request(double(b.slots)) / 1e9;
  o.host_dram_usable_gb = hw.host_dram_usable_gb();
  const Tried* next = nullptr;
  for (const Tried& t : s.tried) {
    if (t.batch > b.batch) {
      next = &t;
      break;
    }
  }
  if (next == nullptr || b.batch >= max_b) {
    const bool indexer = mem.resident_bytes_per_request() > mem.latent_bytes_per_request(double(b.slots));
    o.limit = fmt::format(
        "GPU memory: batch {} takes {:.1f} of the {:.1f} GB for the caches per GPU, {} the larger part ({:.1f} GB "
        "{}, {:.1f} GB latent{})",
        b.batch, o.indexer_gb + o.latent_gb, o.cache_budget_gb, indexer ? "the " + o.resident_what : "the latent cache",
        o.indexer_gb, o.resident_what, o.latent_gb,
        b.offload ? fmt::format(" at {} slots per request-layer", b.slots) : std::string(" for the whole context"));
    return;
  }
  const Tried& n = *next;
  switch (n.outcome) {
    case Outcome::kHostDram:
      o.limit = fmt::format("host DRAM: batch {} needs a {:.0f} GB host pool per node, more than the {:.0f} GB it may use",
                            n.batch, n.host_pool_gb_per_node, hw.host_dram_usable_gb());
      break;
    case Outcome::kHostBandwidth:
      o.limit = fmt::format("host-memory bandwidth: batch {} needs {:.0f} GB/s of H2D per node, more than {} GB/s", n.batch,
                            n.h2d_gbps_per_node, hw.host_dram_bandwidth_gbps);
      break;
    case Outcome::kTooSlow:
      o.limit = fmt::format("OTPS: batch {} runs at {:.2f} tokens/s per request, below {:.2f}", n.batch, n.otps, req.min_otps);
      break;
    case Outcome::kRuns:
      o.limit = fmt::format("throughput: the larger batches tried give less (batch {}: {:.0f} tok/s/node)", n.batch,
                            n.throughput_tokens_per_s);
      break;
  }
}

}  // namespace

PlanResult plan(const StepModel& model, const PlanRequest& req) { return plan({&model}, {""}, req); }

PlanResult plan(const std::vector<const StepModel*>& models, const std::vector<std::string>& suffixes,
                const PlanRequest& req) {
  ESS_CHECK(req.min_otps >= 0, "plan: minimum OTPS = {} must be >= 0", req.min_otps);
  ESS_CHECK(req.batch_step >= 1, "plan: batch step = {} must be >= 1", req.batch_step);
  ESS_CHECK(!req.modes.empty(), "plan: no overlap mode to try");
  ESS_CHECK(!models.empty() && models.size() == suffixes.size(), "plan: {} deployments with {} labels", models.size(),
            suffixes.size());
  PlanResult out;
  out.context = req.context;
  out.min_otps = req.min_otps;

  std::vector<Search> searches;
  for (std::size_t k = 0; k < models.size(); ++k) {
    const StepModel& model = *models[k];
    const HardwareProfile& hw = model.hardware();
    const MemoryModel mem(model.model(), hw, model.deployment(), req.context, model.pool_floor(req.misses, req.context));
    auto run_kind = [&](const std::string& kind, bool offload, OverlapMode mode) {
      const std::string label = kind + suffixes[k];
      Search s;
      s.option.label = label;
      s.option.two_batch_overlap = model.deployment().two_batch_overlap;
      s.option.shared_index_prefetch = model.deployment().shared_index_prefetch;
      s.model = &model;
      const double slots = offload ? mem.min_slots() : double(mem.context_entries());
      const int max_b = mem.max_batch(slots);
      // Short contexts fit batches in the hundreds of thousands: the search is bounded by
      // widening the step (said in the result), the largest batch always tried.
      int step = req.batch_step;
      if ((max_b - 1) / step + 1 > kMaxBatchesPerKind) {
        step = (max_b + kMaxBatchesPerKind - 1) / kMaxBatchesPerKind;
        out.notes.push_back(fmt::format("{}: up to batch {} fits; batches tried every {} (not every {}) to bound the search "
                                        "at {} per kind", label, max_b, step, req.batch_step, kMaxBatchesPerKind));
      }
      for (int b = 1; b <= max_b; b = (b < max_b && b + step > max_b) ? max_b : b + step) {
        Workload w;
        w.context = req.context;
        w.batch = b;
        w.offload = offload;
        w.overlap = mode;
        w.misses = req.misses;
        w.prefix_share = req.prefix_share;
        const StepResult r = model.run(w);
        ++out.evaluated;
        s.best_otps_seen = std::max(s.best_otps_seen, r.otps);
        Tried t{r.batch, Outcome::kRuns, r.host_pool_gb_per_node, r.h2d_gbps_per_node, r.otps, r.throughput_tokens_per_s};
        if (offload && r.host_pool_gb_per_node > hw.host_dram_usable_gb()) {
          t.outcome = Outcome::kHostDram;
        } else if (offload && r.h2d_gbps_per_node > hw.host_dram_bandwidth_gbps) {
          t.outcome = Outcome::kHostBandwidth;
        } else if (r.otps < req.min_otps) {
          t.outcome = Outcome::kTooSlow;
        }
        s.tried.push_back(t);
        if (t.outcome != Outcome::kRuns) continue;
        if (!s.option.found || r.throughput_tokens_per_s > s.option.best.throughput_tokens_per_s) {
          s.option.found = true;
          s.option.best = r;
        }
      }
      if (const long host_dram = s.count(Outcome::kHostDram); host_dram > 0) {
        out.refusals.push_back(fmt::format(
            "{}: {} batch sizes refused: the node's Total Memory Pool exceeds the host DRAM it may use ({:.0f} of {} "
            "GB, {:.0f} % reserved)",
            label, host_dram, hw.host_dram_usable_gb(), hw.host_dram_gb, 100 * hw.host_dram_reserve));
      }
      if (const long host_bandwidth = s.count(Outcome::kHostBandwidth); host_bandwidth > 0) {
        out.refusals.push_back(fmt::format(
            "{}: {} batch sizes refused: aggregate H2D traffic exceeds the node's host-memory bandwidth ({} GB/s)",
            label, host_bandwidth, hw.host_dram_bandwidth_gbps));
      }
      if (s.option.found) binding_limit(s, mem, hw, req, max_b);
      if (!s.option.found) {
        s.option.why = max_b < 1 ? "no batch fits in GPU memory"
                                 : fmt::format("no batch meets {:.2f} tokens/s per request (best {:.2f})",
                                               req.min_otps, s.best_otps_seen);
      }
      searches.push_back(std::move(s));
    };
    run_kind("all-on-GPU", false, OverlapMode::kNone);
    for (OverlapMode m : req.modes) run_kind(fmt::format("ESS {}", to_string(m)), true, m);
  }

  std::sort(searches.begin(), searches.end(), [](const Search& a, const Search& b) {
    if (a.option.found != b.option.found) return a.option.found;
    return a.option.best.throughput_tokens_per_s > b.option.best.throughput_tokens_per_s;
  });
  if (searches.front().option.found) {
    out.found = true;
    out.chosen = searches.front().option;
    out.low_load = low_load(*searches.front().model, req, out.chosen.best);
    const StepResult& c = out.chosen.best;
    for (std::size_t i = 1; i < searches.size(); ++i) {
      PlanOption& o = searches[i].option;
      if (!o.found) continue;
      const StepResult& r = o.best;
      const double gap = 100.0 * (1.0 - r.throughput_tokens_per_s / c.throughput_tokens_per_s);
      if (gap < 0.05) {
        o.why = fmt::format("ties with the chosen configuration (within 0.05%: batch {}, step {:.2f} ms)", r.batch,
                            r.step_us / 1e3);
      } else if (r.batch < c.batch) {
        o.why = fmt::format("{:.1f}% less throughput: at most batch {} ({})", gap, r.batch, o.limit);
      } else if (r.exposed_transfer_us > c.exposed_transfer_us) {
        o.why = fmt::format("{:.1f}% less throughput: {:.2f} ms of exposed H2D transfer per step", gap,
                            r.exposed_transfer_us / 1e3);
      } else {
        o.why = fmt::format("{:.1f}% less throughput: step {:.2f} ms vs {:.2f} ms", gap, r.step_us / 1e3,
                            c.step_us / 1e3);
      }
    }
    for (std::size_t i = 1; i < searches.size(); ++i) out.alternatives.push_back(searches[i].option);
  } else {
    for (auto& s : searches) out.alternatives.push_back(s.option);
  }
  return out;
}

}  // namespace ess::sim
