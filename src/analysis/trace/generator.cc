#include "ess/trace/generator.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "analysis/trace/shipped_profiles.h"
#include "ess/core/error.h"
#include "ess/core/json.h"
#include "ess/io/host_budget.h"
#include "ess/io/output_file.h"
#include "ess/io/text.h"
#include "ess/version.h"

namespace ess::trace {

// ---- profile -----------------------------------------------------------------------------

GeneratorProfile GeneratorProfile::from_json(const nlohmann::json& j, const std::string& source) {
  ESS_CHECK(j.is_object(), "{}: a generator profile must be a JSON object, got {}", source, j.type_name());
  static const std::set<std::string> known{
      "name",          "description",        "model",           "layers",           "topk",
      "mtp",           "accept_ratio",       "prefill_windows", "sink_tokens",      "recent_window",
      "candidate_base", "reference_context", "candidate_exponent", "mtp_divergence", "topic_shift_rate",
      "topic_shift_fraction", "candidate_churn", "drift",        "synthetic",        "calibration",
      "return_probability", "return_depth", "mtp_working_set", "shared_index", "unit_tokens"};
  for (const auto& [k, v] : j.items()) {
    ESS_CHECK(known.contains(k), "{}: unknown generator profile field '{}'", source, k);
  }
  if (auto it = j.find("synthetic"); it != j.end()) {
    ESS_CHECK(it->is_boolean() && it->get<bool>(), "{}: profile field 'synthetic' must be true (generated traces are "
              "synthetic)", source);
  }
  GeneratorProfile p;
  json_read(j, "name", p.name, source);
  json_read(j, "description", p.description, source);
  json_read(j, "model", p.model, source);
  json_read(j, "layers", p.layers, source);
  json_read(j, "topk", p.topk, source);
  json_read(j, "mtp", p.mtp, source);
  json_read(j, "accept_ratio", p.accept_ratio, source);
  json_read(j, "prefill_windows", p.prefill_windows, source);
  json_read(j, "sink_tokens", p.sink_tokens, source);
  json_read(j, "recent_window", p.recent_window, source);
  json_read(j, "candidate_base", p.candidate_base, source);
  json_read(j, "reference_context", p.reference_context, source);
  json_read(j, "candidate_exponent", p.candidate_exponent, source);
  json_read(j, "mtp_divergence", p.mtp_divergence, source);
  json_read(j, "topic_shift_rate", p.topic_shift_rate, source);
  json_read(j, "topic_shift_fraction", p.topic_shift_fraction, source);
  json_read(j, "candidate_churn", p.candidate_churn, source);
  json_read(j, "return_probability", p.return_probability, source);
  json_read(j, "return_depth", p.return_depth, source);
  json_read(j, "drift", p.drift, source);
  json_read(j, "shared_index", p.shared_index, source);
  json_read(j, "unit_tokens", p.unit_tokens, source);
  if (auto it = j.find("mtp_working_set"); it != j.end()) {
    const std::string where = source + ": mtp_working_set";
    ESS_CHECK(it->is_object() && it->contains("how") && it->contains("measured"),
              "{} must be an object with 'how' (the commands) and 'measured' (a list)", where);
    json_read(*it, "how", p.mtp_working_set_how, where);
    const nlohmann::json& list = (*it)["measured"];
    ESS_CHECK(list.is_array() && !list.empty(), "{}: 'measured' must be a non-empty list", where);
    for (const nlohmann::json& e : list) {
      ESS_CHECK(e.is_object(), "{}: every 'measured' entry must be an object", where);
      for (const auto& [k, v] : e.items()) {
        ESS_CHECK(k == "context" || k == "mtp" || k == "p99" || k == "max", "{}: unknown field '{}'", where, k);
      }
      WorkingSet w;
      json_read(e, "context", w.context, where);
      json_read(e, "mtp", w.mtp, where);
      json_read(e, "p99", w.p99, where);
      json_read(e, "max", w.max, where);
      ESS_CHECK(w.context > 0 && w.mtp >= 2 && w.p99 > 0 && w.max >= w.p99 &&
                    w.max <= double(w.mtp) * p.topk,
                "{}: entry context {} mtp {} p99 {} max {} must have context > 0, mtp >= 2 and 0 < p99 <= max <= "
                "mtp x topk ({})", where, w.context, w.mtp, w.p99, w.max, double(w.mtp) * p.topk);
      p.mtp_working_set.push_back(w);
    }
  }
  p.validate(source);
  return p;
}

GeneratorProfile GeneratorProfile::from_file(const std::string& path) {
  return from_json(read_json_file(path, "generator profile"), path);
}

GeneratorProfile GeneratorProfile::shipped_default() {
  return from_json(nlohmann::json::parse(shipped::kDefaultTraceProfileJson), "configs/trace-profiles/default.json");
}

void GeneratorProfile::validate(const std::string& source) const {
  auto in = [&](const char* key, double v, double lo, double hi) {
    ESS_CHECK(std::isfinite(v) && v >= lo && v <= hi, "{}: profile field '{}' = {} is outside [{}, {}]", source, key, v,
              lo, hi);
  };
  in("layers", layers, 1, 4096);
  in("unit_tokens", unit_tokens, 1, 1 << 16);
  in("topk", topk, 1, 1 << 20);
  in("mtp", mtp, 1, 16);
  in("accept_ratio", accept_ratio, 1, mtp);
  in("prefill_windows", prefill_windows, 0, 4096);
  in("sink_tokens", sink_tokens, 0, topk);
  in("recent_window", recent_window, 1, topk);
  ESS_CHECK(sink_tokens + recent_window < topk, "{}: sink_tokens {} + recent_window {} must be below topk {}", source,
            sink_tokens, recent_window, topk);
  in("candidate_base", candidate_base, 1, 1e9);
  in("reference_context", static_cast<double>(reference_context), 1, 1e12);
  in("candidate_exponent", candidate_exponent, 0, 2);
  in("mtp_divergence", mtp_divergence, 0, 1e6);
  in("topic_shift_rate", topic_shift_rate, 0, 1);
  in("topic_shift_fraction", topic_shift_fraction, 0, 1);
  in("candidate_churn", candidate_churn, 0, 1);
  in("return_probability", return_probability, 0, 1);
  in("return_depth", return_depth, 1, 64);
  ESS_CHECK(!drift.empty(), "{}: profile field 'drift' (per-layer heavy-hitter replacement rate) is missing or empty",
            source);
  ESS_CHECK(shared_index.empty() || (std::ssize(shared_index) == layers && !shared_index.front()),
            "{}: the index sharing pattern has {} layers (layer 0 shared: {}); the profile has {} layers, layer 0 its own",
            source, shared_index.size(), !shared_index.empty() && shared_index.front(), layers);
  for (std::size_t i = 0; i < drift.size(); ++i) {
    ESS_CHECK(std::isfinite(drift[i]) && drift[i] >= 0 && drift[i] <= 1, "{}: profile field 'drift'[{}] = {} is outside [0, 1]",
              source, i, drift[i]);
  }
}

nlohmann::json GeneratorProfile::to_json() const {
  nlohmann::json j = {{"name", name},
                      {"description", description},
                      {"synthetic", true},
                      {"model", model},
                      {"layers", layers},
                      {"topk", topk},
                      {"mtp", mtp},
                      {"accept_ratio", accept_ratio},
                      {"prefill_windows", prefill_windows},
                      {"sink_tokens", sink_tokens},
                      {"recent_window", recent_window},
                      {"candidate_base", candidate_base},
                      {"reference_context", reference_context},
                      {"candidate_exponent", candidate_exponent},
                      {"mtp_divergence", mtp_divergence},
                      {"topic_shift_rate", topic_shift_rate},
                      {"topic_shift_fraction", topic_shift_fraction},
                      {"candidate_churn", candidate_churn},
                      {"return_probability", return_probability},
                      {"return_depth", return_depth},
                      {"drift", drift}};
  if (!shared_index.empty()) j["shared_index"] = shared_index;
  if (unit_tokens != 1) j["unit_tokens"] = unit_tokens;
  return j;
}

void apply_model(GeneratorProfile& p, const ModelSpec& m) {
  p.model = m.name;
  p.layers = static_cast<int>(m.offloaded_layers().size());
  p.shared_index = m.shared_index;
  p.topk = m.selected_ids();
  p.unit_tokens = m.selection_block() * m.tokens_per_entry();
  // One query token a step without a next-n layer, and where SGLang's HiSparse serves the model without
  // speculative decoding (DeepSeek-V4, MiniMax-M3).
  if (m.num_nextn_predict_layers == 0 || m.is_deepseek_v4() || m.is_minimax_m3()) {
    p.mtp = 1;
    p.accept_ratio = 1.0;
  }
  if (p.unit_tokens == 1) return;
  const std::int64_t u = p.unit_tokens;
  if (m.is_minimax_m3()) {
    p.sink_tokens = m.sparse_init_blocks;
    p.recent_window = m.sparse_local_blocks;
  } else {
    p.sink_tokens = static_cast<int>(p.ids_of(p.sink_tokens));
    p.recent_window = static_cast<int>(p.ids_of(p.recent_window));
  }
  p.candidate_base = std::max(1.0, p.candidate_base / static_cast<double>(u));
  p.reference_context = std::max<std::int64_t>(1, p.reference_context / u);
  p.mtp_working_set.clear();  // measured over token ids
}

double GeneratorProfile::drift_of(int layer) const {
  if (drift.size() == static_cast<std::size_t>(layers)) return drift[static_cast<std::size_t>(layer)];
  if (drift.size() == 1 || layers == 1) return drift.front();
  const double x = static_cast<double>(layer) * static_cast<double>(drift.size() - 1) / static_cast<double>(layers - 1);
  const auto i = std::min(static_cast<std::size_t>(x), drift.size() - 2);
  const double f = x - static_cast<double>(i);
  return drift[i] * (1 - f) + drift[i + 1] * f;
}

// ---- the process -------------------------------------------------------------------------

namespace {

std::uint64_t splitmix(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

__extension__ typedef unsigned __int128 U128;

class Rng {
 public:
  explicit Rng(std::uint64_t seed) {
    for (auto& v : s_) v = splitmix(seed);
  }
  std::uint64_t next() {  // xoshiro256**
    const std::uint64_t r = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return r;
  }
  // Uniform in [0, n), n > 0.
  std::size_t below(std::size_t n) {
    return static_cast<std::size_t>((static_cast<U128>(next()) * n) >> 64);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Number of failures before the first success of a Bernoulli(p) sequence.
  std::size_t geometric(double p) {
    if (p >= 1) return 0;
    const double u = 1.0 - uniform();  // (0, 1]
    const double g = std::floor(std::log(u) / std::log1p(-p));
    return g >= 1e15 ? static_cast<std::size_t>(1e15) : static_cast<std::size_t>(g);
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t a, std::uint64_t b) {
  std::uint64_t x = seed ^ 0x5851f42d4c957f2dULL;
  splitmix(x);
  x ^= a * 0x9e3779b97f4a7c15ULL;
  splitmix(x);
  x ^= b * 0xc2b2ae3d27d4eb4fULL;
  return splitmix(x);
}

enum : std::uint8_t { kNone = 0, kHeavy = 1, kOther = 2 };

// What every layer of a request shares, decided once per request: the candidate set C (append
// only), the initial heavy set (C's first h tokens, position i = heavy slot i), and per tick (a
// prefill position or a decode step) the drift events (heavy slot, threshold u, candidate
// draw) and the topic-shift events. A layer with drift rate d applies the events with u < d,
// so layers with similar rates replace the same heavy slots with the same candidates: that is
// what makes adjacent layers similar (inter-layer similarity ~ min(d) / max(d)).
struct DriftEvent {
  std::int32_t position;
  float u;             // uniform in [0, max drift)
  float v;             // uniform in [0, 1): a return when v < return_probability
  std::uint32_t draw;  // candidate index = draw * |C| >> 32
  std::uint32_t back;  // return: which previous occupant of the heavy slot = back * depth >> 32
};
struct Tick {
  std::int64_t limit = 0;        // tokens [sinks, limit) may be candidates
  std::size_t c_size = 0;        // |C| after this tick's additions
  std::size_t drift_begin = 0, drift_end = 0;  // into Shared::drift
  std::size_t shift_begin = 0, shift_end = 0;  // into Shared::shift
  std::int64_t first_visible = 0;  // query 0 sees tokens [0, first_visible)
  int queries = 1;
};
struct ShiftEvent {
  std::int32_t position;
  std::int32_t token;
};
struct Shared {
  std::vector<std::int32_t> candidates;
  std::vector<Tick> ticks;
  std::vector<DriftEvent> drift;
  std::vector<ShiftEvent> shift;
  std::int64_t heavy = 0;  // h
};

// Builds the Shared process of one request tick by tick, from one Rng stream.
class SharedBuilder {
 public:
  // `context` and `final_length` in ids (GeneratorProfile::unit_tokens).
  SharedBuilder(const GeneratorProfile& p, std::int64_t context, std::int64_t final_length, std::uint64_t seed)
      : p_(p), h_(p.topk - p.sink_tokens - p.recent_window), rng_(seed),
        in_c_(static_cast<std::size_t>(final_length) + 1, 0) {
    sh_.heavy = h_;
    const double m = p.candidate_base *
                     std::pow(static_cast<double>(context) / static_cast<double>(p.reference_context), p.candidate_exponent);
    target_ = std::max<std::int64_t>(static_cast<std::int64_t>(std::llround(m)), h_ + 1);
    for (int l = 0; l < p.layers; ++l) dmax_ = std::max(dmax_, p.drift_of(l));
  }

  // Appends the tick whose query 0 sees tokens [0, first_visible): candidates, then (when
  // `evolve`) churn and drift events, then (when `shift`) a topic shift.
  void tick(std::int64_t first_visible, int queries, bool evolve, bool shift) {
    Tick t;
    t.first_visible = first_visible;
    t.queries = queries;
    const std::int64_t new_limit = std::max<std::int64_t>(p_.ids_of(first_visible) - p_.recent_window, p_.sink_tokens);
    if (sh_.ticks.empty()) {
      initial_candidates(new_limit);
    } else {
      grow_candidates(new_limit);
    }
    t.limit = limit_;
    t.drift_begin = sh_.drift.size();
    if (evolve && dmax_ > 0) {
      churn();
      drift_events();
    }
    t.drift_end = sh_.drift.size();
    t.shift_begin = sh_.shift.size();
    if (shift) shift_events();
    t.shift_end = sh_.shift.size();
    t.c_size = sh_.candidates.size();
    sh_.ticks.push_back(t);
  }

  Shared take() { return std::move(sh_); }

 private:
  // Initial C: a uniform sample of [sinks, limit); its first h tokens are the heavy set.
  void initial_candidates(std::int64_t new_limit) {
    limit_ = new_limit;
    const std::int64_t range = limit_ - p_.sink_tokens;
    const std::int64_t want = std::min(range, target_);
    if (want > 0) {
      std::vector<std::int32_t> all(static_cast<std::size_t>(range));
      for (std::int64_t i = 0; i < range; ++i) all[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(p_.sink_tokens + i);
      for (std::int64_t i = 0; i < want; ++i) {
        std::swap(all[static_cast<std::size_t>(i)], all[static_cast<std::size_t>(i) + rng_.below(static_cast<std::size_t>(range - i))]);
        push(all[static_cast<std::size_t>(i)]);
      }
    }
  }

  // Tokens leaving the recency window join C while it is below its target size.
  void grow_candidates(std::int64_t new_limit) {
    for (std::int64_t tok = limit_; tok < new_limit; ++tok) {
      if (static_cast<std::int64_t>(sh_.candidates.size()) < target_ || static_cast<std::int64_t>(sh_.candidates.size()) < h_) {
        push(static_cast<std::int32_t>(tok));
      }
    }
    limit_ = std::max(limit_, new_limit);
  }

  // Candidate churn: about candidate_churn x |C| fresh tokens join C.
  void churn() {
    if (!(p_.candidate_churn > 0)) return;
    const double expect = p_.candidate_churn * static_cast<double>(sh_.candidates.size());
    auto n = static_cast<std::size_t>(expect);
    if (rng_.uniform() < expect - static_cast<double>(n)) ++n;
    for (std::size_t k = 0; k < n; ++k) {
      const auto tok = fresh();
      if (tok >= 0) push(tok);
    }
  }

  // Drift events: each heavy slot independently with probability dmax (geometric skips).
  void drift_events() {
    for (std::size_t i = rng_.geometric(dmax_); i < static_cast<std::size_t>(h_); i += 1 + rng_.geometric(dmax_)) {
      const std::uint64_t bits = rng_.next();
      sh_.drift.push_back({static_cast<std::int32_t>(i), static_cast<float>(rng_.uniform() * dmax_),
                           static_cast<float>(rng_.uniform()), static_cast<std::uint32_t>(bits >> 32),
                           static_cast<std::uint32_t>(bits)});
    }
  }

  // A topic shift: topic_shift_fraction x h fresh tokens, each aimed at a random heavy slot.
  void shift_events() {
    const auto n = static_cast<std::size_t>(std::llround(p_.topic_shift_fraction * static_cast<double>(h_)));
    for (std::size_t k = 0; k < n; ++k) {
      const auto tok = fresh();
      if (tok < 0) break;
      push(tok);
      sh_.shift.push_back({static_cast<std::int32_t>(rng_.below(static_cast<std::size_t>(h_))), tok});
    }
  }

  // A token of [sinks, limit) not in C yet (32 tries), or -1.
  std::int32_t fresh() {
    const std::int64_t range = limit_ - p_.sink_tokens;
    if (range <= 0) return -1;
    for (int tries = 0; tries < 32; ++tries) {
      const auto tok = static_cast<std::int32_t>(p_.sink_tokens + static_cast<std::int64_t>(rng_.below(static_cast<std::size_t>(range))));
      if (in_c_[static_cast<std::size_t>(tok)] == 0) return tok;
    }
    return -1;
  }

  void push(std::int32_t tok) {
    in_c_[static_cast<std::size_t>(tok)] = 1;
    sh_.candidates.push_back(tok);
  }

  const GeneratorProfile& p_;
  std::int64_t h_;           // heavy set size
  std::int64_t target_ = 0;  // target |C| at this context
  double dmax_ = 0;          // the largest per-layer drift rate
  Rng rng_;
  std::vector<std::uint8_t> in_c_;  // token -> in C
  std::int64_t limit_ = 0;          // tokens [sinks, limit) may be candidates
  Shared sh_;
};

Shared make_shared_process(const GeneratorProfile& p, std::int64_t context, const std::vector<std::int64_t>& starts,
                           const std::vector<std::uint8_t>& shifts, int prefill_windows, std::uint64_t seed) {
  const std::int64_t final_length = starts.empty() ? context : starts.back() + p.mtp;
  SharedBuilder b(p, p.ids_of(context), p.ids_of(final_length), seed);
  for (int w = 0; w < prefill_windows; ++w) b.tick(context - prefill_windows + w + 1, 1, w > 0, false);
  for (std::size_t s = 0; s < starts.size(); ++s) {
    b.tick(starts[s] + 1, p.mtp, s > 0 || prefill_windows > 0, shifts[s] != 0);
  }
  return b.take();
}

class LayerProcess {
 public:
  LayerProcess(const GeneratorProfile& p, int layer, const Shared& shared, std::int64_t final_length, std::uint64_t seed)
      : K_(p.topk),
        sinks_(p.sink_tokens),
        window_(p.recent_window),
        h_(shared.heavy),
        drift_(p.drift_of(layer)),
        divergence_(std::min(1.0, p.mtp_divergence * p.drift_of(layer))),
        return_probability_(p.return_probability),
        depth_(static_cast<std::size_t>(p.return_depth)),
        history_(static_cast<std::size_t>(shared.heavy) * static_cast<std::size_t>(p.return_depth), -1),
        shared_(shared),
        unit_tokens_(p.unit_tokens),
        rng_(seed),
        where_(static_cast<std::size_t>(p.ids_of(final_length)) + 1, kNone),
        pos_(static_cast<std::size_t>(p.ids_of(final_length)) + 1, -1) {}

  // Applies tick `i` and writes its queries' ids (queries x K) to `out`.
  void run_tick(std::size_t i, std::int32_t* out) {
    const Tick& t = shared_.ticks[i];
    for (; consumed_ < t.c_size; ++consumed_) {
      const std::int32_t tok = shared_.candidates[consumed_];
      add(static_cast<std::int64_t>(heavy_.size()) < h_ ? kHeavy : kOther, tok);
    }
    limit_ = t.limit;
    for (std::size_t e = t.drift_begin; e < t.drift_end; ++e) {
      const DriftEvent& ev = shared_.drift[e];
      if (static_cast<double>(ev.u) >= drift_ || other_.empty() ||
          static_cast<std::size_t>(ev.position) >= heavy_.size()) {
        continue;
      }
      // A return: the heavy slot gets back one of its previous occupants. The history is per
      // slot, so layers that share the slot's events also share its returns.
      if (static_cast<double>(ev.u) < drift_ && static_cast<double>(ev.v) < return_probability_) {
        const std::size_t k = static_cast<std::size_t>((static_cast<std::uint64_t>(ev.back) * depth_) >> 32);
        const std::int32_t r = history_[static_cast<std::size_t>(ev.position) * depth_ + k];
        if (r >= 0 && where_[static_cast<std::size_t>(r)] == kOther) {
          swap_heavy(static_cast<std::size_t>(ev.position), static_cast<std::size_t>(pos_[static_cast<std::size_t>(r)]));
          continue;
        }
      }
      // The shared draw over C (as of this tick); a layer whose heavy set already holds that
      // candidate draws one of its own instead.
      const std::int32_t c = shared_.candidates[static_cast<std::size_t>((static_cast<std::uint64_t>(ev.draw) * t.c_size) >> 32)];
      const std::size_t oi = where_[static_cast<std::size_t>(c)] == kOther ? static_cast<std::size_t>(pos_[static_cast<std::size_t>(c)])
                                                                         : rng_.below(other_.size());
      swap_heavy(static_cast<std::size_t>(ev.position), oi);
    }
    for (std::size_t e = t.shift_begin; e < t.shift_end; ++e) {
      const ShiftEvent& ev = shared_.shift[e];
      if (where_[static_cast<std::size_t>(ev.token)] != kOther || static_cast<std::size_t>(ev.position) >= heavy_.size()) continue;
      swap_heavy(static_cast<std::size_t>(ev.position), static_cast<std::size_t>(pos_[static_cast<std::size_t>(ev.token)]));
    }
    for (int q = 0; q < t.queries; ++q) {
      emit(out + static_cast<std::size_t>(q) * static_cast<std::size_t>(K_), ids_of(t.first_visible + q, unit_tokens_),
           q > 0);
    }
  }

 private:
  // Writes the K ids of a query that sees ids [0, visible); `diverge` for MTP tokens t > 0.
  void emit(std::int32_t* row, std::int64_t visible, bool diverge) {
    if (visible <= K_) {
      for (std::int64_t i = 0; i < K_; ++i) row[i] = i < visible ? static_cast<std::int32_t>(i) : -1;
      return;
    }
    std::int64_t n = 0;
    for (std::int32_t i = 0; i < sinks_; ++i) row[n++] = i;
    for (std::int64_t t = visible - window_; t < visible; ++t) row[n++] = static_cast<std::int32_t>(t);
    const std::int64_t heavy_at = n;
    std::copy(heavy_.begin(), heavy_.end(), row + n);
    n += static_cast<std::int64_t>(heavy_.size());
    if (diverge && divergence_ > 0 && !other_.empty()) {
      std::size_t taken = 0;
      for (std::size_t i = rng_.geometric(divergence_); i < heavy_.size() && taken < other_.size();
           i += 1 + rng_.geometric(divergence_)) {
        // Draw without replacement: move the drawn candidate to the back region.
        const std::size_t j = rng_.below(other_.size() - taken);
        const std::size_t back = other_.size() - 1 - taken;
        swap_other(j, back);
        row[static_cast<std::size_t>(heavy_at) + i] = other_[back];
        ++taken;
      }
    }
    // Short contexts: top up with tokens between the candidates' range and this query's window.
    for (std::int64_t t = sinks_; n < K_ && t < visible - window_; ++t) {
      if (where_[static_cast<std::size_t>(t)] != kHeavy && (t >= limit_ || where_[static_cast<std::size_t>(t)] == kNone)) {
        row[n++] = static_cast<std::int32_t>(t);
      }
    }
    ESS_ASSERT(n == K_, "generator: query seeing {} tokens produced {} of {} ids", visible, n, K_);
  }

  void add(std::uint8_t kind, std::int32_t tok) {
    auto& v = kind == kHeavy ? heavy_ : other_;
    where_[static_cast<std::size_t>(tok)] = kind;
    pos_[static_cast<std::size_t>(tok)] = static_cast<std::int32_t>(v.size());
    v.push_back(tok);
  }
  // Heavy slot hi takes candidate oi; the heavy hitter it held drops to the candidates and
  // becomes the slot's most recent previous occupant.
  void swap_heavy(std::size_t hi, std::size_t oi) {
    const std::int32_t a = heavy_[hi];
    const std::int32_t b = other_[oi];
    std::int32_t* hist = history_.data() + hi * depth_;
    std::copy_backward(hist, hist + depth_ - 1, hist + depth_);
    hist[0] = a;
    heavy_[hi] = b;
    other_[oi] = a;
    where_[static_cast<std::size_t>(a)] = kOther;
    where_[static_cast<std::size_t>(b)] = kHeavy;
    pos_[static_cast<std::size_t>(a)] = static_cast<std::int32_t>(oi);
    pos_[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(hi);
  }
  void swap_other(std::size_t i, std::size_t j) {
    std::swap(other_[i], other_[j]);
    pos_[static_cast<std::size_t>(other_[i])] = static_cast<std::int32_t>(i);
    pos_[static_cast<std::size_t>(other_[j])] = static_cast<std::int32_t>(j);
  }

  std::int64_t K_;
  std::int32_t sinks_;
  std::int64_t window_;
  std::int64_t h_;
  double drift_;
  double divergence_;
  double return_probability_;
  std::size_t depth_;
  std::vector<std::int32_t> history_;  // per heavy slot: its last depth_ occupants, newest first
  const Shared& shared_;
  std::int64_t unit_tokens_;  // tokens an id names: a query's tokens as ids
  Rng rng_;
  std::size_t consumed_ = 0;  // candidates of C taken in so far
  std::int64_t limit_ = 0;
  std::vector<std::int32_t> heavy_;
  std::vector<std::int32_t> other_;
  std::vector<std::uint8_t> where_;
  std::vector<std::int32_t> pos_;
};

}  // namespace

RequestData generate_request(const GeneratorProfile& p, std::int64_t context, std::int64_t steps, std::uint64_t seed,
                             int index) {
  p.validate("generator profile");
  ESS_CHECK(context >= 1 && context <= kMaxGeneratedContext, "trace gen: context {} is outside [1, 2^24]", context);
  ESS_CHECK(steps >= 1 && steps <= (1LL << 24), "trace gen: steps {} is outside [1, 2^24]", steps);
  const int T = p.mtp;
  const int W = static_cast<int>(std::min<std::int64_t>(p.prefill_windows, context));
  const auto K = static_cast<std::size_t>(p.topk);
  RequestData r;
  r.id = fmt::format("synthetic-{}", index);
  r.prefill_windows = W;
  r.context = context;

  // Request-level events: tokens accepted per step, topic shifts.
  Rng req(stream_seed(seed, static_cast<std::uint64_t>(index), 0xffffffffULL));
  std::vector<std::int64_t> start(static_cast<std::size_t>(steps));
  std::vector<std::uint8_t> shift(static_cast<std::size_t>(steps), 0);
  std::int64_t pos = context;
  const double extra = p.accept_ratio - 1.0;
  for (std::int64_t s = 0; s < steps; ++s) {
    start[static_cast<std::size_t>(s)] = pos;
    shift[static_cast<std::size_t>(s)] = req.uniform() < p.topic_shift_rate ? 1 : 0;
    // accepted in [1, T] with mean accept_ratio: 1 + floor(extra) + Bernoulli(frac(extra)).
    std::int64_t a = 1 + static_cast<std::int64_t>(std::floor(extra));
    if (req.uniform() < extra - std::floor(extra)) ++a;
    pos += std::min<std::int64_t>(a, T);
  }
  r.lengths.resize(static_cast<std::size_t>(steps));
  for (std::int64_t s = 0; s < steps; ++s) r.lengths[static_cast<std::size_t>(s)] = start[static_cast<std::size_t>(s)] + T;
  const std::int64_t final_length = r.lengths.back();
  const Shared shared =
      make_shared_process(p, context, start, shift, W, stream_seed(seed, static_cast<std::uint64_t>(index), 0xfffffffeULL));

  const std::size_t row = static_cast<std::size_t>(T) * K;
  r.topk.assign(static_cast<std::size_t>(steps) * static_cast<std::size_t>(p.layers) * row, -1);
  r.prefill.assign(static_cast<std::size_t>(p.layers) * static_cast<std::size_t>(W) * K, -1);
  const auto shared_layer = [&](int layer) {
    return static_cast<std::size_t>(layer) < p.shared_index.size() && p.shared_index[static_cast<std::size_t>(layer)];
  };
  tbb::parallel_for(0, p.layers, [&](int layer) {
    if (shared_layer(layer)) return;  // its leader's, below
    LayerProcess proc(p, layer, shared, final_length,
                      stream_seed(seed, static_cast<std::uint64_t>(index), static_cast<std::uint64_t>(layer)));
    // Prefill: positions context - W .. context - 1, one query each; position q sees [0, q + 1).
    for (int w = 0; w < W; ++w) {
      proc.run_tick(static_cast<std::size_t>(w),
                    r.prefill.data() + (static_cast<std::size_t>(layer) * static_cast<std::size_t>(W) + static_cast<std::size_t>(w)) * K);
    }
    for (std::int64_t s = 0; s < steps; ++s) {
      proc.run_tick(static_cast<std::size_t>(W) + static_cast<std::size_t>(s),
                    r.topk.data() + (static_cast<std::size_t>(s) * static_cast<std::size_t>(p.layers) + static_cast<std::size_t>(layer)) * row);
    }
  });
  const std::size_t window_ids = static_cast<std::size_t>(W) * K;
  for (int layer = 1, leader = 0; layer < p.layers; ++layer) {
    if (!shared_layer(layer)) {
      leader = layer;
      continue;
    }
    std::copy_n(r.prefill.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(leader) * window_ids), window_ids,
                r.prefill.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(layer) * window_ids));
    for (std::int64_t s = 0; s < steps; ++s) {
      const std::size_t at = static_cast<std::size_t>(s) * static_cast<std::size_t>(p.layers);
      std::copy_n(r.topk.begin() + static_cast<std::ptrdiff_t>((at + static_cast<std::size_t>(leader)) * row), row,
                  r.topk.begin() + static_cast<std::ptrdiff_t>((at + static_cast<std::size_t>(layer)) * row));
    }
  }
  return r;
}

TraceMeta synthetic_meta(const GeneratorProfile& p, const GenerateConfig& c) {
  TraceMeta m;
  m.layers = p.layers;
  m.mtp = p.mtp;
  m.topk = p.topk;
  m.unit_tokens = p.unit_tokens;
  m.model = p.model;
  m.synthetic = true;
  std::vector<std::string> ctx;
  for (auto x : c.contexts) ctx.push_back(std::to_string(x));
  m.provenance = fmt::format("synthetic: ess trace gen (profile '{}', contexts {}, {} requests, {} steps, seed {}); "
                             "ESS {}",
                             p.name, fmt::join(ctx, ","), c.requests, c.steps, c.seed, ESS_VERSION);
  m.note = "SYNTHETIC TRACE: generated by a parametric locality model calibrated to the statistics the ESS paper "
           "reports for DeepSeek-V3.2-Exp on LongBench v2; these are not a real model's top-k selections.";
  if (p.unit_tokens > 1) {
    m.note += fmt::format(" Its ids name units of {} tokens, selected by the same process over units: the locality of "
                          "a model that selects such units has not been measured.",
                          p.unit_tokens);
  }
  m.generator = p.to_json().dump();
  return m;
}

void generate_trace(const GeneratorProfile& p, const GenerateConfig& c, const std::string& path,
                    const std::function<void(double bytes)>& size,
                    const std::function<void(std::size_t done, std::size_t total)>& progress) {
  // Every argument before any file: a refused one leaves the target as it was.
  ESS_CHECK(!c.contexts.empty(), "trace gen: no context length given");
  ESS_CHECK(c.requests >= 1 && c.requests <= (1 << 20), "trace gen: requests {} must be in [1, 2^20]", c.requests);
  ESS_CHECK(c.steps >= 1 && c.steps <= (1LL << 24), "trace gen: steps {} is outside [1, 2^24]", c.steps);
  const auto most = model_max_length(p.model);
  for (const std::int64_t ctx : c.contexts) {
    ESS_CHECK(ctx >= 1 && ctx <= kMaxGeneratedContext, "trace gen: context {} is outside [1, 2^24]", ctx);
    // The last step's length is at most context + steps x T: within the model's, so that the
    // trace reader takes the file.
    ESS_CHECK(!most || ctx + c.steps * p.mtp <= *most,
              "trace gen: context {} + {} steps x MTP {} exceeds the max_position_embeddings ({}) of the profile's "
              "model '{}'",
              ctx, c.steps, p.mtp, most.value_or(0), printable(p.model));
  }
  // The file's size, against the room its folder has (a run killed for want of it leaves nothing).
  const double ids = static_cast<double>(c.requests) * static_cast<double>(c.steps) * p.layers * p.mtp * p.topk;
  const double bytes = 4.0 * ids + 8.0 * c.requests * static_cast<double>(c.steps) +
                       4.0 * c.requests * static_cast<double>(p.prefill_windows) * p.layers * p.topk;
  check_output_file(path, "trace");
  std::error_code ec;
  const auto dir = std::filesystem::path(path).parent_path();
  const auto room = std::filesystem::space(dir.empty() ? std::filesystem::path(".") : dir, ec);
  ESS_CHECK(ec || bytes <= static_cast<double>(room.available),
            "trace gen: the trace would take {:.1f} GB ({} requests x {} steps x {} layers x MTP {} x top-{}); '{}' "
            "has {:.1f} GB free",
            bytes / 1e9, c.requests, c.steps, p.layers, p.mtp, p.topk, path, static_cast<double>(room.available) / 1e9);
  // One request is generated in memory at a time.
  const double request_bytes = 4.0 * static_cast<double>(c.steps) * p.layers * p.mtp * p.topk;
  ESS_CHECK(request_bytes <= 16e9, "trace gen: one request's top-k would take {:.1f} GB in memory (limit 16 GB): fewer "
            "--steps", request_bytes / 1e9);
  // Its candidate process keeps about 5 bytes per token of the longest context.
  const std::int64_t longest = *std::max_element(c.contexts.begin(), c.contexts.end());
  check_host_memory(request_bytes + 5.0 * static_cast<double>(longest + c.steps * p.mtp),
                    fmt::format("trace gen: one request at context {} ({} steps)", longest, c.steps));
  std::vector<RequestShape> shapes;
  for (int i = 0; i < c.requests; ++i) {
    const auto ctx = c.contexts[static_cast<std::size_t>(i) % c.contexts.size()];
    shapes.push_back({fmt::format("synthetic-{}", i), c.steps, static_cast<int>(std::min<std::int64_t>(p.prefill_windows, ctx)), ctx,
                      {}, 0});
  }
  if (size) size(bytes);
  TraceWriter w(path, synthetic_meta(p, c), shapes);
  for (int i = 0; i < c.requests; ++i) {
    const auto ctx = c.contexts[static_cast<std::size_t>(i) % c.contexts.size()];
    const RequestData r = generate_request(p, ctx, c.steps, c.seed, i);
    w.write_request(static_cast<std::size_t>(i), r.topk, r.lengths, r.prefill);
    if (progress) progress(static_cast<std::size_t>(i) + 1, static_cast<std::size_t>(c.requests));
  }
  w.close();
}

}  // namespace ess::trace
