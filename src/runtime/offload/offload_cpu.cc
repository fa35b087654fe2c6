// Offload's CPU backend: the cache engine's SwapEngine decides, memcpy fetches, host memory
// holds the layer buffers. The reference of the CUDA backend's contract (offload.h). A whole
// request (OffloadState::units_of_row) skips the SwapEngine: its ids map to its rows directly,
// and the LRU-visible ids of its steps are recorded for a later demotion's LRU-Warmup.
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
  CpuOffload(OffloadState& state, bool owned)
      : x_(state), sparse_(pool_config(state.config), std::make_unique<NoSlotStorage>()),
        recorded_(static_cast<std::size_t>(state.config.max_requests)) {
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

  void admit(std::int32_t row, RequestId id) override {
    engine_->admit(id);
    recorded_[static_cast<std::size_t>(row)].clear();
  }
  void release(std::int32_t, RequestId id) override { engine_->release(id); }
  void reset(std::int32_t row, RequestId id) override {
    engine_->release(id);
    engine_->admit(id);
    recorded_[static_cast<std::size_t>(row)].clear();
  }

  void placed(std::int32_t row, RequestId id) override { reset(row, id); }  // its rows are read through the front's state

  void units_changed(std::int32_t, RequestId) override {}  // the rows are read from the front's state

  void load_whole(std::int32_t row, RequestId id, std::span<const std::int32_t> windows, int W) override {
    const std::int64_t length = x_.pool->length(id);
    const std::size_t K = static_cast<std::size_t>(x_.config.topk);
    Recorded& rec = recorded_[static_cast<std::size_t>(row)];
    rec.clear();
    for (int l = 0; l < x_.config.layers; ++l) {
      for (std::int64_t t = 0; t < length; ++t) copy_in(l, id, static_cast<std::int32_t>(t), whole_row(row, static_cast<std::int32_t>(t)));
      for (int w = 0; w < W; ++w) {
        record(row, l, windows.subspan((static_cast<std::size_t>(l) * static_cast<std::size_t>(W) + static_cast<std::size_t>(w)) * K, K));
      }
    }
  }

  void demote(std::int32_t row, RequestId id) override {
    engine_->release(id);
    engine_->admit(id);
    const std::int64_t length = x_.pool->length(id);
    Recorded& rec = recorded_[static_cast<std::size_t>(row)];
    for (int l = 0; l < x_.config.layers && !rec.empty(); ++l) {
      const std::vector<std::int32_t> windows = rec.oldest_first(l);
      if (windows.empty()) continue;
      const WarmupResult r = engine_->warmup(id, l, windows, length);
      for (const MissEntry& m : r.plan.entries) copy_in(l, id, m.token, physical(l, row, m.slot));
      warmup_fills_ += static_cast<std::int64_t>(r.plan.entries.size());
    }
    rec.clear();
  }
  void pages_added(std::int32_t, RequestId, std::int64_t) override {}

  void warmup(std::int32_t row, RequestId id, std::span<const std::int32_t> windows, int W) override {
    const std::size_t per_layer = static_cast<std::size_t>(W) * static_cast<std::size_t>(x_.config.topk);
    const std::int64_t length = x_.pool->length(id);
    for (int l = 0; l < x_.config.layers; ++l) {
      const WarmupResult r = engine_->warmup(id, l, windows.subspan(static_cast<std::size_t>(l) * per_layer, per_layer), length);
      for (const MissEntry& m : r.plan.entries) copy_in(l, id, m.token, physical(l, row, m.slot));
      warmup_fills_ += static_cast<std::int64_t>(r.plan.entries.size());
    }
  }

  void load_newest(std::int32_t row, RequestId id) override {
    const std::int64_t length = x_.pool->length(id);
    const int T = x_.config.query_tokens;
    for (int l = 0; l < x_.config.layers; ++l) {
      for (std::int64_t t = std::max<std::int64_t>(0, length - T); t < length; ++t) {
        copy_in(l, id, static_cast<std::int32_t>(t), physical(l, row, x_.config.slots + static_cast<std::int32_t>(t - (length - T))));
      }
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
      const std::int64_t len = s.lengths[b];
      x_.check_step_length("step", s.layer, b, id, len);
      ESS_CHECK(x_.pool_rows(s.layer).placed(row), "offload: step of layer {}: position {} (request {}) has no region (place it first)",
                s.layer, b, id);
      const std::int32_t* ids = s.topk + static_cast<std::size_t>(b) * P;
      if (x_.whole(row)) {  // no LRU: its ids are checked here, mapped below
        check_whole_ids(s, b, id, len);
        continue;
      }
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
    if (!requests_.empty()) {
      engine_->step({s.layer, requests_, ids_, lengths_}, result_);  // validates, or throws changing nothing
      ++swap_launches_;
    } else {
      result_.plan.entries.clear();
      result_.total = {};
    }
    // Fetch the misses; then every output.
    fetched_.assign(requests_.size(), {});
    for (const MissEntry& m : result_.plan.entries) {
      const auto j = static_cast<std::size_t>(m.batch);
      const std::int32_t row = s.rows[positions_[j]];
      const std::int32_t p = physical(s.layer, row, m.slot);
      if (s.fetch) copy_in(s.layer, requests_[j], m.token, p);
      fetched_[j].insert(p);
    }
    std::size_t j = 0;
    for (int b = 0; b < s.batch; ++b) {
      const std::int32_t row = s.rows[b];
      if (row >= 0 && x_.whole(row)) {
        whole_step(s, b);
        continue;
      }
      const bool real = row >= 0;
      sparse_steps_ += real ? 1 : 0;
      const std::size_t out0 = static_cast<std::size_t>(b) * P;
      std::uint32_t newest = 0;  // the reserved rows this position reads
      for (std::size_t i = 0; i < P; ++i) {
        std::int32_t p = -1;
        if (real) {
          const std::int32_t r = reserved_[out0 + i];
          const std::int32_t slot = result_.slot_ids[j * P + i];
          p = r >= 0 ? physical(s.layer, row, c.slots + r) : (slot >= 0 ? physical(s.layer, row, slot) : -1);
          newest |= r >= 0 ? 1u << r : 0u;
        }
        s.physical[out0 + i] = p;
      }
      reserved_hits_ += std::popcount(newest);
      if (s.counts != nullptr) {
        s.counts[2 * b] = real ? static_cast<std::int32_t>(result_.per_request[j].hits) : 0;
        s.counts[2 * b + 1] = real ? static_cast<std::int32_t>(result_.per_request[j].misses) : 0;
      }
      if (s.resident != nullptr) split_rows(s, b, real ? &fetched_[j] : nullptr);
      j += real ? 1 : 0;
    }
    ++steps_;
    hits_ += result_.total.hits;
    misses_ += result_.total.misses;
  }

  void write_back(const WriteBack& w) override {
    const OffloadConfig& c = x_.config;
    const int T = c.query_tokens;
    const std::int64_t rows = x_.buffer_rows();
    // Validate every position first, then copy.
    for (int b = 0; b < w.batch; ++b) {
      if (x_.padding(w.rows[b], "write_back", b)) continue;
      const RequestId id = x_.request_at(w.rows[b], "write_back", b);
      ESS_CHECK(w.source_rows != nullptr || x_.pool_rows(w.layer).placed(w.rows[b]),
                "offload: write_back of layer {}: position {} (request {}) has no region (place it first)", w.layer, b, id);
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
      const bool whole = x_.whole(w.rows[b]);
      for (int t = first_newest(w.lengths[b], T); t < T; ++t) {
        const std::int32_t src = w.source_rows != nullptr ? w.source_rows[b * T + t] : physical(w.layer, w.rows[b], c.slots + t);
        const std::int32_t token = w.lengths[b] - T + t;
        if (x_.buffer.split()) {  // a split row leaves the entry's padding as the host holds it
          const auto held = x_.pool->entry(id, w.layer, token);
          entry_.assign(held.begin(), held.end());
        } else {
          entry_.resize(x_.config.layout.bytes());
        }
        x_.get_row(w.layer, src, entry_);
        x_.pool->write(id, w.layer, token, entry_);
        const std::int32_t to = whole ? whole_row(w.rows[b], token) : -1;  // its own row, read once it is not among the newest
        if (to >= 0 && to != src) x_.put_row(w.layer, to, entry_);
      }
    }
  }

  std::vector<std::uint8_t> read_row(int layer, std::int32_t p) const override {
    std::vector<std::uint8_t> v(x_.config.layout.bytes());
    x_.get_row(layer, p, v);
    return v;
  }

  std::uint64_t device_bytes() const override { return 0; }

  void add_stats(OffloadStats& st, bool) const override {
    st.steps = steps_;
    st.warmup_fills = warmup_fills_;
    st.hits = hits_;
    st.misses = misses_;
    st.reserved_hits = reserved_hits_;
    st.whole_steps = whole_steps_;
    st.sparse_steps = sparse_steps_;
    st.swap_launches = swap_launches_;
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
  std::int32_t physical(int layer, std::int32_t row, std::int32_t slot) const { return x_.pool_rows(layer).at(row, slot); }
  // The buffer row of token `token` of the whole request at `row`: `slots` tokens per pool row it takes.
  std::int32_t whole_row(std::int32_t row, std::int32_t token) const {
    const auto& units = x_.units_of_row[static_cast<std::size_t>(row)];
    return physical(0, units[static_cast<std::size_t>(token / x_.config.slots)], token % x_.config.slots);  // no regions
  }

  // The LRU-visible ids of a whole request's last recorded_windows() query rows per layer, as
  // LRU-Warmup replays them at a demotion.
  struct Recorded {
    std::vector<std::vector<std::int32_t>> ids;  // [layer]: a ring of windows of K ids
    std::vector<int> next, count;                // [layer]
    bool empty() const { return ids.empty(); }
    void clear() {
      ids.clear();
      next.clear();
      count.clear();
    }
    std::vector<std::int32_t> oldest_first(int layer) const {
      const auto l = static_cast<std::size_t>(layer);
      const std::size_t K = window_k;
      std::vector<std::int32_t> out;
      for (int i = 0; i < count[l]; ++i) {
        const int w = (next[l] - count[l] + i + capacity(l)) % capacity(l);
        out.insert(out.end(), ids[l].begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(w) * K),
                   ids[l].begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(w) + 1) * K));
      }
      return out;
    }
    int capacity(std::size_t l) const { return static_cast<int>(ids[l].size() / window_k); }
    std::size_t window_k = 1;
  };
  void record(std::int32_t row, int layer, std::span<const std::int32_t> window) {
    const int W = x_.config.recorded_windows();
    if (W <= 0) return;
    const std::size_t K = static_cast<std::size_t>(x_.config.topk);
    Recorded& rec = recorded_[static_cast<std::size_t>(row)];
    if (rec.empty()) {
      rec.window_k = K;
      rec.ids.assign(static_cast<std::size_t>(x_.config.layers), std::vector<std::int32_t>(static_cast<std::size_t>(W) * K, -1));
      rec.next.assign(static_cast<std::size_t>(x_.config.layers), 0);
      rec.count.assign(static_cast<std::size_t>(x_.config.layers), 0);
    }
    const auto l = static_cast<std::size_t>(layer);
    std::copy(window.begin(), window.end(), rec.ids[l].begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rec.next[l]) * K));
    rec.next[l] = (rec.next[l] + 1) % W;
    rec.count[l] = std::min(rec.count[l] + 1, W);
  }
  // A whole position's ids: each -1 or in [0, len), none twice in a query row.
  void check_whole_ids(const LayerStep& s, int b, RequestId id, std::int64_t len) {
    const int T = x_.config.query_tokens, K = x_.config.topk;
    const std::int32_t* ids = s.topk + static_cast<std::size_t>(b) * T * K;
    if (std::ssize(seen_) < len) seen_.resize(static_cast<std::size_t>(len), 0);
    for (int t = s.query_begin; t < s.query_end; ++t) {
      if (++stamp_ == 0) {  // the stamps wrapped: start them afresh
        std::ranges::fill(seen_, 0u);
        stamp_ = 1;
      }
      for (int k = 0; k < K; ++k) {
        const std::int32_t tok = ids[static_cast<std::size_t>(t) * K + k];
        if (tok == -1) continue;
        ESS_CHECK(tok >= 0 && tok < len,
                  "offload: step of layer {}: position {} (request {}) query token {} selects token {}, outside [0, {})",
                  s.layer, b, id, t, tok, len);
        ESS_CHECK(seen_[static_cast<std::size_t>(tok)] != stamp_,
                  "offload: step of layer {}: position {} query token {} selects token {} twice", s.layer, b, t, tok);
        seen_[static_cast<std::size_t>(tok)] = stamp_;
      }
    }
  }
  // A whole position's outputs: every id read in place (a newest one from its reserved row), no
  // LRU and no copy; its query rows recorded as the LRU would see them.
  void whole_step(const LayerStep& s, int b) {
    const OffloadConfig& c = x_.config;
    const int T = c.query_tokens, K = c.topk;
    const std::int32_t row = s.rows[b];
    const std::int32_t len = s.lengths[b];
    const std::size_t out0 = static_cast<std::size_t>(b) * T * K;
    std::uint32_t newest = 0;
    window_.resize(static_cast<std::size_t>(K));
    for (int t = 0; t < T; ++t) {
      const bool in_group = t >= s.query_begin && t < s.query_end;
      for (int k = 0; k < K; ++k) {
        const std::size_t i = out0 + static_cast<std::size_t>(t) * K + k;
        const std::int32_t tok = in_group ? s.topk[i] : -1;
        const bool reserved = tok >= 0 && tok >= len - T;
        s.physical[i] = tok < 0 ? -1 : reserved ? physical(s.layer, row, c.slots + (tok - (len - T))) : whole_row(row, tok);
        newest |= reserved ? 1u << (tok - (len - T)) : 0u;
        window_[static_cast<std::size_t>(k)] = reserved ? -1 : tok;
      }
      if (in_group) record(row, s.layer, window_);
    }
    reserved_hits_ += std::popcount(newest);
    ++whole_steps_;
    if (s.counts != nullptr) s.counts[2 * b] = s.counts[2 * b + 1] = 0;
    if (s.resident != nullptr) split_rows(s, b, nullptr);
  }
  void copy_in(int layer, RequestId id, std::int32_t token, std::int32_t p) { x_.put_row(layer, p, x_.pool->entry(id, layer, token)); }
  // Position b's query rows split into the rows resident before the step and those it fetched.
  // `fetched`: the buffer rows the step copied into.
  void split_rows(const LayerStep& s, int b, const std::unordered_set<std::int32_t>* fetched) const {
    const int T = x_.config.query_tokens, K = x_.config.topk;
    for (int t = 0; t < T; ++t) {
      const std::size_t at = (static_cast<std::size_t>(b) * T + t) * static_cast<std::size_t>(K);
      int nr = 0, nf = 0;
      for (int k = 0; k < K; ++k) {
        const std::int32_t p = s.physical[at + k];
        if (p < 0) continue;
        if (fetched != nullptr && fetched->contains(p)) {
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
  std::vector<std::uint32_t> seen_;  // token -> the stamp of the query row that last selected it
  std::uint32_t stamp_ = 0;
  std::vector<std::int32_t> window_;
  std::vector<std::uint8_t> entry_;  // one entry on its way from a row
  std::vector<Recorded> recorded_;  // [pool row]: whole requests' recorded windows
  SwapResult result_;
  std::int64_t steps_ = 0, warmup_fills_ = 0, hits_ = 0, misses_ = 0, reserved_hits_ = 0;
  std::int64_t whole_steps_ = 0, sparse_steps_ = 0, swap_launches_ = 0;
};

}  // namespace

std::unique_ptr<OffloadBackend> make_cpu_offload(OffloadState& state, bool owned) {
  return std::make_unique<CpuOffload>(state, owned);
}

}  // namespace ess
