// Offload's CPU backend: the cache engine's SwapEngine decides, memcpy fetches, host memory
// holds the layer buffers. The reference of the CUDA backend's contract (offload.h).
#include <bit>
#include <cstring>
#include <unordered_set>

#include "ess/cache/sparse_pool.h"
#include "ess/cache/swap_engine.h"
#include "ess/core/error.h"
#include "runtime/offload/offload_impl.h"
#include "runtime/offload/reserved_rows.h"

namespace ess {
namespace {

// The SwapEngine needs a Sparse Memory Pool for its geometry and rows; the bytes live in the
// layer buffers, so its storage holds nothing.
class NoSlotStorage final : public SlotStorage {
 public:
  std::string_view backend() const override { return "none"; }
  void allocate(const SparsePoolConfig&) override {}
  void fill(const MissPlan&, const TotalPool&) override { ESS_ASSERT(false, "offload: the swap engine's storage is unused"); }
  void read(std::int32_t, int, std::int32_t, std::span<std::uint8_t>) const override {
    ESS_ASSERT(false, "offload: the swap engine's storage is unused");
  }
  const std::uint8_t* host_entry(std::int32_t, int, std::int32_t) const override { return nullptr; }
};

class CpuOffload final : public OffloadBackend {
 public:
  CpuOffload(OffloadState& state, bool owned) : x_(state), sparse_(pool_config(state.config), std::make_unique<NoSlotStorage>()) {
    SwapEngine::Config ec;
    ec.warmup_windows = state.config.warmup_windows;
    engine_ = std::make_unique<SwapEngine>(*state.pool, sparse_, ec);
    if (owned) {
      const auto bytes = static_cast<std::size_t>(state.config.max_requests) * state.config.rows_per_request() *
                         state.buffer.rows.row_stride;
      for (int l = 0; l < state.config.layers; ++l) {
        owned_.emplace_back(bytes, std::uint8_t{0});
        state.buffer.layer_base.push_back(owned_.back().data());
      }
    }
  }

  void admit(std::int32_t, RequestId id) override { engine_->admit(id); }
  void release(std::int32_t, RequestId id) override { engine_->release(id); }
  void reset(std::int32_t, RequestId id) override {
    engine_->release(id);
    engine_->admit(id);
  }
  void pages_added(std::int32_t, RequestId, std::int64_t) override {}

  void warmup(std::int32_t row, RequestId id, std::span<const std::int32_t> windows, int W) override {
    const std::size_t per_layer = static_cast<std::size_t>(W) * static_cast<std::size_t>(x_.config.topk);
    const std::int64_t length = x_.pool->length(id);
    for (int l = 0; l < x_.config.layers; ++l) {
      const WarmupResult r = engine_->warmup(id, l, windows.subspan(static_cast<std::size_t>(l) * per_layer, per_layer), length);
      for (const MissEntry& m : r.plan.entries) copy_in(l, id, m.token, physical(row, m.slot));
      warmup_fills_ += static_cast<std::int64_t>(r.plan.entries.size());
    }
  }

  void step(const LayerStep& s) override {
    const OffloadConfig& c = x_.config;
    const int T = c.query_tokens, K = c.topk;
    const std::size_t P = static_cast<std::size_t>(T) * K;
    // Validate and gather the real positions, every id masked where it is a reserved newest
    // token or outside the query group; nothing changes until the swap engine has accepted
    // the whole batch.
    requests_.clear();
    positions_.clear();
    lengths_.clear();
    ids_.clear();
    reserved_.assign(static_cast<std::size_t>(s.batch) * P, -1);
    for (int b = 0; b < s.batch; ++b) {
      const std::int32_t row = s.rows[b];
      if (x_.padding(row, "step", b)) continue;
      const RequestId id = x_.request_at(row, "step", b);
      const std::int64_t len = x_.pool->length(id);
      ESS_CHECK(s.lengths[b] == len,
                "offload: step of layer {}: position {} (request {}) has length {}, the request holds {} tokens "
                "(extend before the step)",
                s.layer, b, id, s.lengths[b], len);
      const std::int32_t* ids = s.topk + static_cast<std::size_t>(b) * P;
      for (int t = 0; t < T; ++t) {
        if (t < s.query_begin || t >= s.query_end) {  // outside this call's query group: padding
          ids_.insert(ids_.end(), static_cast<std::size_t>(K), -1);
          continue;
        }
        std::unordered_set<std::int64_t> newest_seen;
        for (int k = 0; k < K; ++k) {
          const std::size_t i = static_cast<std::size_t>(t) * K + k;
          const std::int32_t tok = ids[i];
          if (c.reserve_newest && tok >= 0 && tok >= len - T && tok < len) {
            ESS_CHECK(newest_seen.insert(tok).second,
                      "offload: step of layer {}: position {} query token {} selects token {} twice", s.layer, b, t, tok);
            reserved_[static_cast<std::size_t>(b) * P + i] = static_cast<std::int32_t>(tok - (len - T));
            ids_.push_back(-1);
          } else {
            ids_.push_back(tok);
          }
        }
      }
      requests_.push_back(id);
      positions_.push_back(b);
      lengths_.push_back(len);
    }
    engine_->step({s.layer, requests_, ids_, lengths_}, result_);  // validates, or throws changing nothing
    // Fetch the misses; then every output.
    fetched_.assign(requests_.size(), {});
    for (const MissEntry& m : result_.plan.entries) {
      const auto j = static_cast<std::size_t>(m.batch);
      const std::int32_t row = s.rows[positions_[j]];
      if (s.fetch) copy_in(s.layer, requests_[j], m.token, physical(row, m.slot));
      fetched_[j].insert(m.slot);
    }
    std::size_t j = 0;
    for (int b = 0; b < s.batch; ++b) {
      const std::int32_t row = s.rows[b];
      const bool real = row >= 0;
      const std::size_t out0 = static_cast<std::size_t>(b) * P;
      std::uint32_t newest = 0;  // the reserved rows this position reads
      for (std::size_t i = 0; i < P; ++i) {
        std::int32_t p = -1;
        if (real) {
          const std::int32_t r = reserved_[out0 + i];
          const std::int32_t slot = result_.slot_ids[j * P + i];
          p = r >= 0 ? physical(row, c.slots + r) : (slot >= 0 ? physical(row, slot) : -1);
          newest |= r >= 0 ? 1u << r : 0u;
        }
        s.physical[out0 + i] = p;
      }
      reserved_hits_ += std::popcount(newest);
      if (s.counts != nullptr) {
        s.counts[2 * b] = real ? static_cast<std::int32_t>(result_.per_request[j].hits) : 0;
        s.counts[2 * b + 1] = real ? static_cast<std::int32_t>(result_.per_request[j].misses) : 0;
      }
      if (s.resident != nullptr) split_rows(s, b, real ? &fetched_[j] : nullptr, row);
      j += real ? 1 : 0;
    }
    ++steps_;
    hits_ += result_.total.hits;
    misses_ += result_.total.misses;
  }

  void write_back(const WriteBack& w) override {
    const OffloadConfig& c = x_.config;
    const int T = c.query_tokens;
    const std::int64_t rows = static_cast<std::int64_t>(c.max_requests) * c.rows_per_request();
    // Validate every position first, then copy.
    for (int b = 0; b < w.batch; ++b) {
      if (x_.padding(w.rows[b], "write_back", b)) continue;
      const RequestId id = x_.request_at(w.rows[b], "write_back", b);
      ESS_CHECK(w.lengths[b] == x_.pool->length(id),
                "offload: write_back of layer {}: position {} (request {}) has length {}, the request holds {} tokens",
                w.layer, b, id, w.lengths[b], x_.pool->length(id));
      for (int t = first_newest(w.lengths[b], T); w.source_rows != nullptr && t < T; ++t) {
        const std::int32_t src = w.source_rows[b * T + t];
        ESS_CHECK(src >= 0 && src < rows, "offload: write_back of layer {}: position {} token {} names row {}, outside [0, {})",
                  w.layer, b, t, src, rows);
      }
      for (int t = first_newest(w.lengths[b], T); t < T; ++t) {
        (void)x_.pool->writable_entry(id, w.layer, w.lengths[b] - T + t);  // not shared
      }
    }
    for (int b = 0; b < w.batch; ++b) {
      if (w.rows[b] < 0) continue;
      const RequestId id = x_.request_of_row[static_cast<std::size_t>(w.rows[b])];
      for (int t = first_newest(w.lengths[b], T); t < T; ++t) {
        const std::int32_t src = w.source_rows != nullptr ? w.source_rows[b * T + t] : physical(w.rows[b], c.slots + t);
        const std::uint8_t* from = row_ptr(w.layer, src);
        x_.pool->write(id, w.layer, w.lengths[b] - T + t, {from, x_.config.layout.bytes()});
      }
    }
  }

  std::vector<std::uint8_t> read_row(int layer, std::int32_t p) const override {
    const std::uint8_t* r = row_ptr(layer, p);
    return {r, r + x_.config.layout.bytes()};
  }

  std::uint64_t device_bytes() const override { return 0; }

  void add_stats(OffloadStats& st) const override {
    st.steps = steps_;
    st.warmup_fills = warmup_fills_;
    st.hits = hits_;
    st.misses = misses_;
    st.reserved_hits = reserved_hits_;
  }

 private:
  static SparsePoolConfig pool_config(const OffloadConfig& c) {
    SparsePoolConfig sc;
    sc.num_layers = c.layers;
    sc.layout = c.layout;
    sc.max_requests = c.max_requests;
    sc.slots = c.slots;
    sc.query_tokens = c.query_tokens;
    sc.topk = c.topk;
    sc.max_context = c.max_context;
    return sc;
  }
  std::int32_t physical(std::int32_t row, std::int32_t slot) const { return row * x_.config.rows_per_request() + slot; }
  const std::uint8_t* row_ptr(int layer, std::int32_t p) const {
    return x_.buffer.layer_base[static_cast<std::size_t>(layer)] + x_.buffer.rows.offset(p);
  }
  void copy_in(int layer, RequestId id, std::int32_t token, std::int32_t p) {
    const auto e = x_.pool->entry(id, layer, token);
    std::memcpy(const_cast<std::uint8_t*>(row_ptr(layer, p)), e.data(), e.size());
  }
  // Position b's query rows split into the rows resident before the step and those it fetched.
  void split_rows(const LayerStep& s, int b, const std::unordered_set<std::int32_t>* fetched, std::int32_t row) const {
    const int T = x_.config.query_tokens, K = x_.config.topk;
    for (int t = 0; t < T; ++t) {
      const std::size_t at = (static_cast<std::size_t>(b) * T + t) * static_cast<std::size_t>(K);
      int nr = 0, nf = 0;
      for (int k = 0; k < K; ++k) {
        const std::int32_t p = s.physical[at + k];
        if (p < 0) continue;
        const std::int32_t slot = p - row * x_.config.rows_per_request();
        if (fetched != nullptr && fetched->contains(slot)) {
          s.fetched[at + nf++] = p;
        } else {
          s.resident[at + nr++] = p;
        }
      }
      for (int k = nr; k < K; ++k) s.resident[at + k] = -1;
      for (int k = nf; k < K; ++k) s.fetched[at + k] = -1;
      s.resident_count[static_cast<std::size_t>(b) * T + t] = nr;
      s.fetched_count[static_cast<std::size_t>(b) * T + t] = nf;
    }
  }

  OffloadState& x_;
  SparsePool sparse_;
  std::unique_ptr<SwapEngine> engine_;
  std::vector<std::vector<std::uint8_t>> owned_;
  // Per-step scratch.
  std::vector<RequestId> requests_;
  std::vector<int> positions_;
  std::vector<std::int64_t> lengths_;
  std::vector<std::int32_t> ids_, reserved_;
  std::vector<std::unordered_set<std::int32_t>> fetched_;
  SwapResult result_;
  std::int64_t steps_ = 0, warmup_fills_ = 0, hits_ = 0, misses_ = 0, reserved_hits_ = 0;
};

}  // namespace

std::unique_ptr<OffloadBackend> make_cpu_offload(OffloadState& state, bool owned) {
  return std::make_unique<CpuOffload>(state, owned);
}

}  // namespace ess
