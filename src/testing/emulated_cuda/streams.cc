#include "streams.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

#include "device.h"

namespace ess::emu {
namespace {

struct Op {
  cudaStream_t stream = nullptr;
  std::string what;
  Work work;                       // empty for records and waits
  std::vector<std::uint64_t> after;  // operations that must have run first
};

bool is_legacy(cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy; }

class Streams {
 public:
  static Streams& get() {
    static Streams* const s = new Streams;
    return *s;
  }

  void set(const StreamOrder& o) {
    std::lock_guard lock(mu_);
    run_until_locked(all_pending());
    order_ = o;
    rng_.seed(o.seed);
    configured_ = true;
  }

  StreamOrder order() {
    std::lock_guard lock(mu_);
    configure();
    return order_;
  }

  cudaError_t enqueue(cudaStream_t s, const char* what, Work work) {
    std::lock_guard lock(mu_);
    configure();
    const std::uint64_t id = add(s, what, std::move(work), {});
    return order_.lazy ? cudaSuccess : run_until_locked({id});
  }

  void record(cudaEvent_t e, cudaStream_t s) {
    std::lock_guard lock(mu_);
    configure();
    records_[e] = add(s, "event record", {}, {});
    if (!order_.lazy) run_until_locked({records_[e]});
  }

  void wait(cudaStream_t s, cudaEvent_t e) {
    std::lock_guard lock(mu_);
    configure();
    std::vector<std::uint64_t> after;
    if (const auto it = records_.find(e); it != records_.end()) after.push_back(it->second);  // never recorded: no-op
    const std::uint64_t id = add(s, "event wait", {}, std::move(after));
    if (!order_.lazy) run_until_locked({id});
  }

  cudaError_t drain_stream(cudaStream_t s) {
    std::lock_guard lock(mu_);
    const auto it = last_.find(key(s));
    return it == last_.end() ? take_error() : run_until_locked({it->second});
  }

  cudaError_t drain_event(cudaEvent_t e) {
    std::lock_guard lock(mu_);
    const auto it = records_.find(e);
    return it == records_.end() ? take_error() : run_until_locked({it->second});
  }

  bool done(cudaEvent_t e) {
    std::lock_guard lock(mu_);
    const auto it = records_.find(e);
    return it == records_.end() || pending_.count(it->second) == 0;
  }

  cudaError_t drain_all() {
    std::lock_guard lock(mu_);
    return run_until_locked(all_pending());
  }

  void flags(cudaStream_t s, unsigned f) {
    std::lock_guard lock(mu_);
    if ((f & cudaStreamNonBlocking) != 0) non_blocking_.insert(key(s));
    else non_blocking_.erase(key(s));
  }

  void forget(cudaEvent_t e) {
    std::lock_guard lock(mu_);
    records_.erase(e);
  }

  std::size_t queued() {
    std::lock_guard lock(mu_);
    return pending_.size();
  }

 private:
  Streams() = default;

  void configure() {
    if (configured_) return;
    configured_ = true;
    if (const char* env = std::getenv("ESS_EMU_STREAM_ORDER"); env != nullptr && *env != '\0') {
      order_ = StreamOrder::parse(env);
      rng_.seed(order_.seed);
    }
  }

  // The legacy stream and the per-thread default stream are each one queue; a created stream its own.
  static const void* key(cudaStream_t s) { return is_legacy(s) ? static_cast<const void*>(cudaStreamLegacy) : s; }

  bool blocking(cudaStream_t s) const { return !is_legacy(s) && non_blocking_.count(key(s)) == 0; }

  std::vector<std::uint64_t> legacy_prerequisites() const {
    std::vector<std::uint64_t> v;
    for (const auto& [stream, id] : last_) {
      if (pending_.count(id) == 0) continue;
      if (stream == cudaStreamLegacy || non_blocking_.count(stream) == 0) v.push_back(id);
    }
    return v;
  }

  std::uint64_t add(cudaStream_t s, const char* what, Work work, std::vector<std::uint64_t> after) {
    const std::uint64_t id = ++serial_;
    const void* k = key(s);
    if (const auto it = last_.find(k); it != last_.end()) after.push_back(it->second);
    if (is_legacy(s)) {
      for (const std::uint64_t p : legacy_prerequisites()) after.push_back(p);
    } else if (blocking(s)) {
      if (const auto it = last_.find(cudaStreamLegacy); it != last_.end()) after.push_back(it->second);
    }
    pending_[id] = Op{s, what, std::move(work), std::move(after)};
    last_[k] = id;
    return id;
  }

  std::vector<std::uint64_t> all_pending() const {
    std::vector<std::uint64_t> v;
    for (const auto& [id, op] : pending_) v.push_back(id);
    return v;
  }

  // Runs the pending operations `targets` need (themselves and, transitively, what they wait
  // for), ready ones in the order's choice, until none of them is pending.
  cudaError_t run_until_locked(const std::vector<std::uint64_t>& targets) {
    std::set<std::uint64_t> needed;
    std::vector<std::uint64_t> stack(targets.begin(), targets.end());
    while (!stack.empty()) {
      const std::uint64_t id = stack.back();
      stack.pop_back();
      const auto it = pending_.find(id);
      if (it == pending_.end() || !needed.insert(id).second) continue;
      for (const std::uint64_t p : it->second.after) stack.push_back(p);
    }
    while (!needed.empty()) {
      std::vector<std::uint64_t> ready;
      for (const std::uint64_t id : needed) {
        bool ok = true;
        for (const std::uint64_t p : pending_.at(id).after) ok = ok && pending_.count(p) == 0;
        if (ok) ready.push_back(id);
      }
      const std::uint64_t pick = order_.lazy ? ready[std::uniform_int_distribution<std::size_t>(0, ready.size() - 1)(rng_)]
                                             : ready.front();
      Op op = std::move(pending_.at(pick));
      pending_.erase(pick);
      needed.erase(pick);
      if (op.work) {
        if (const cudaError_t e = op.work(); e != cudaSuccess && error_ == cudaSuccess) error_ = e;
      }
    }
    return take_error();
  }

  cudaError_t take_error() { return std::exchange(error_, cudaSuccess); }

  std::recursive_mutex mu_;
  bool configured_ = false;
  StreamOrder order_;
  std::mt19937_64 rng_;
  std::uint64_t serial_ = 0;
  std::map<std::uint64_t, Op> pending_;
  std::map<const void*, std::uint64_t> last_;       // each stream's latest operation
  std::map<cudaEvent_t, std::uint64_t> records_;    // each event's latest record
  std::set<const void*> non_blocking_;
  cudaError_t error_ = cudaSuccess;
};

}  // namespace

std::string StreamOrder::describe() const { return lazy ? "lazy:" + std::to_string(seed) : "issue"; }

StreamOrder StreamOrder::parse(const std::string& text) {
  if (text == "issue") return {};
  if (text.rfind("lazy:", 0) == 0 && text.size() > 5 && text.find_first_not_of("0123456789", 5) == std::string::npos &&
      text.size() <= 5 + 19) {
    return {true, std::stoull(text.substr(5))};
  }
  throw std::invalid_argument("ESS_EMU_STREAM_ORDER = '" + text + "': issue, or lazy:SEED (SEED a decimal integer)");
}

void set_stream_order(const StreamOrder& order) { Streams::get().set(order); }
StreamOrder stream_order() { return Streams::get().order(); }
cudaError_t enqueue(cudaStream_t stream, const char* what, Work work) {
  return Streams::get().enqueue(stream, what, std::move(work));
}
void record_event(cudaEvent_t event, cudaStream_t stream) { Streams::get().record(event, stream); }
void wait_event(cudaStream_t stream, cudaEvent_t event) { Streams::get().wait(stream, event); }
cudaError_t drain_stream(cudaStream_t stream) { return Streams::get().drain_stream(stream); }
cudaError_t drain_event(cudaEvent_t event) { return Streams::get().drain_event(event); }
cudaError_t drain_all() { return Streams::get().drain_all(); }
bool event_done(cudaEvent_t event) { return Streams::get().done(event); }
void note_stream_flags(cudaStream_t stream, unsigned flags) { Streams::get().flags(stream, flags); }
void forget_event(cudaEvent_t event) { Streams::get().forget(event); }
std::size_t queued_operations() { return Streams::get().queued(); }

}  // namespace ess::emu
