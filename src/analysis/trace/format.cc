// The trace format's schema (docs/trace-format.md) over the safetensors container
// (safetensors.h): the ess.* metadata, each request's tensors, and the checks of every id.
#include "ess/trace/format.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstring>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "analysis/trace/mapped_file.h"
#include "analysis/trace/safetensors.h"
#include "ess/core/error.h"
#include "ess/io/text.h"
#include "ess/model/model_spec.h"

static_assert(std::endian::native == std::endian::little, "the trace reader assumes a little-endian host");

namespace ess::trace {

namespace {

std::int64_t parse_int(const std::string& path, const std::string& key, const std::string& value, std::int64_t lo,
                       std::int64_t hi) {
  std::int64_t v = 0;
  const auto* first = value.data();
  const auto* last = value.data() + value.size();
  auto [p, ec] = std::from_chars(first, last, v);
  ESS_CHECK(ec == std::errc() && p == last, "{}: metadata '{}' = '{}' is not an integer", path, key, printable(value));
  ESS_CHECK(v >= lo && v <= hi, "{}: metadata '{}' = {} is outside [{}, {}]", path, key, v, lo, hi);
  return v;
}

// Checks the format name and version, fills `meta` from the ess.* metadata (the rest goes to
// meta.extra) and returns the declared request count.
std::int64_t read_meta(const std::string& path, const std::map<std::string, std::string>& md, TraceMeta& meta) {
  auto need = [&](const std::string& key) -> const std::string& {
    auto it = md.find(key);
    ESS_CHECK(it != md.end(), "{}: metadata '{}' is missing (not an ESS top-k trace?)", path, key);
    return it->second;
  };
  ESS_CHECK(need("ess.format") == kFormatName, "{}: metadata 'ess.format' = '{}', expected '{}'", path,
            printable(md.at("ess.format")), kFormatName);
  const auto version = parse_int(path, "ess.version", need("ess.version"), 1, std::numeric_limits<int>::max());
  ESS_CHECK(version <= kFormatVersion, "{}: trace format version {} is not supported (this reader reads versions 1 to {})",
            path, version, kFormatVersion);
  meta.version = static_cast<int>(version);
  const auto nreq = parse_int(path, "ess.requests", need("ess.requests"), 0, 1 << 24);
  meta.layers = static_cast<int>(parse_int(path, "ess.layers", need("ess.layers"), 1, 4096));
  meta.mtp = static_cast<int>(parse_int(path, "ess.mtp", need("ess.mtp"), 1, 64));
  meta.topk = static_cast<int>(parse_int(path, "ess.topk", need("ess.topk"), 1, 1 << 20));
  if (auto it = md.find("ess.unit_tokens"); it != md.end()) {
    meta.unit_tokens = static_cast<int>(parse_int(path, "ess.unit_tokens", it->second, 1, 1 << 16));
    ESS_CHECK(meta.unit_tokens == 1 || version >= 2,
              "{}: metadata 'ess.unit_tokens' = {} in a version-1 trace (whose readers take ids for tokens); a trace "
              "of units is version 2",
              path, meta.unit_tokens);
  }
  for (const auto& [k, v] : md) {
    if (k == "ess.model") {
      meta.model = printable(v);
    } else if (k == "ess.provenance") {
      meta.provenance = printable(v);
    } else if (k == "ess.synthetic") {
      ESS_CHECK(v == "true" || v == "false", "{}: metadata 'ess.synthetic' = '{}', expected 'true' or 'false'", path,
                printable(v));
      meta.synthetic = v == "true";
    } else if (k == "ess.note") {
      meta.note = printable(v);
    } else if (k == "ess.generator") {
      meta.generator = v;
    } else if (k != "ess.format" && k != "ess.version" && k != "ess.requests" && k != "ess.layers" &&
               k != "ess.mtp" && k != "ess.topk" && k != "ess.unit_tokens" && !k.starts_with("requests.")) {
      meta.extra[k] = v;
    }
  }
  return nreq;
}

// What the per-request readers share: the file, its layout, its tensors and metadata.
struct RequestSource {
  const std::string& path;
  const std::uint8_t* base;
  const Header& header;
  const std::map<std::string, TensorInfo>& tensors;
  const std::map<std::string, std::string>& md;
  const TraceMeta& meta;
  std::int64_t nreq;
  std::vector<std::vector<std::int32_t>>& owned;  // tensors copied because misaligned

  // The tensor's int32 data in place, or an aligned copy kept in `owned`.
  const std::int32_t* data_of(const TensorInfo& t) const {
    const std::uint8_t* p = base + header.data_start + t.begin;
    if (reinterpret_cast<std::uintptr_t>(p) % alignof(std::int32_t) == 0) {
      return reinterpret_cast<const std::int32_t*>(p);
    }
    // A foreign writer left the tensor misaligned: copy it once.
    auto& buf = owned.emplace_back((t.end - t.begin) / 4);
    std::memcpy(buf.data(), p, t.end - t.begin);
    return buf.data();
  }
};

// requests.<i>.topk: [steps, layers, mtp, topk] of I32; sets r.steps and the ids.
void read_topk(const RequestSource& src, std::int64_t i, const std::string& prefix, RequestView& r) {
  const auto data_start = src.header.data_start;
  const std::string tname = prefix + "topk";
  const auto tk = src.tensors.find(tname);
  ESS_CHECK(tk != src.tensors.end(), "{}: request {}: tensor '{}' is missing ({} requests declared)", src.path, i, tname,
            src.nreq);
  const TensorInfo& ti = tk->second;
  ESS_CHECK(ti.dtype == "I32", "{}: request {}, tensor '{}' at file offset {}: dtype {} is not supported, expected I32",
            src.path, i, tname, data_start + ti.begin, ti.dtype);
  ESS_CHECK(ti.shape.size() == 4 && ti.shape[1] == src.meta.layers && ti.shape[2] == src.meta.mtp &&
                ti.shape[3] == src.meta.topk,
            "{}: request {}, tensor '{}' at file offset {}: shape {} does not match [steps, layers={}, mtp={}, "
            "topk={}]",
            src.path, i, tname, data_start + ti.begin, nlohmann::json(ti.shape).dump(), src.meta.layers, src.meta.mtp,
            src.meta.topk);
  r.steps = ti.shape[0];
  ESS_CHECK(r.steps >= 1, "{}: request {}, tensor '{}' at file offset {}: a request needs at least one step", src.path, i,
            tname, data_start + ti.begin);
  r.topk_ids = src.data_of(ti);
  r.topk_offset = data_start + ti.begin;
}

// requests.<i>.lengths: [steps] of I64 or I32, each in [1, 2^31-1]; sets r.lengths.
void read_lengths(const RequestSource& src, std::int64_t i, const std::string& prefix, RequestView& r) {
  const auto data_start = src.header.data_start;
  const std::string tname = prefix + "topk";
  const std::string lname = prefix + "lengths";
  const auto ln = src.tensors.find(lname);
  ESS_CHECK(ln != src.tensors.end(), "{}: request {}: tensor '{}' is missing", src.path, i, lname);
  const TensorInfo& li = ln->second;
  ESS_CHECK(li.dtype == "I64" || li.dtype == "I32",
            "{}: request {}, tensor '{}' at file offset {}: dtype {} is not supported, expected I64 or I32", src.path, i,
            lname, data_start + li.begin, li.dtype);
  ESS_CHECK(li.shape.size() == 1 && li.shape[0] == r.steps,
            "{}: request {}, tensor '{}' at file offset {}: shape {} does not match [steps={}] of '{}'", src.path, i,
            lname, data_start + li.begin, nlohmann::json(li.shape).dump(), r.steps, tname);
  r.lengths.resize(static_cast<std::size_t>(r.steps));
  const std::size_t esize = li.dtype == "I64" ? 8 : 4;
  for (std::int64_t s = 0; s < r.steps; ++s) {
    const std::uint64_t at = data_start + li.begin + static_cast<std::uint64_t>(s) * esize;
    std::int64_t v = 0;
    if (esize == 8) {
      std::memcpy(&v, src.base + at, 8);
    } else {
      std::int32_t v32 = 0;
      std::memcpy(&v32, src.base + at, 4);
      v = v32;
    }
    ESS_CHECK(v >= 1 && v <= std::numeric_limits<std::int32_t>::max(),
              "{}: request {}, tensor '{}', byte offset {} (step {}): length {} is outside [1, 2^31-1]", src.path, i,
              lname, at, s, v);
    r.lengths[static_cast<std::size_t>(s)] = v;
  }
}

// requests.<i>.prefill_topk (optional): [layers, windows, topk] of I32; sets the warm-up windows.
void read_prefill(const RequestSource& src, std::int64_t i, const std::string& prefix, RequestView& r) {
  const auto data_start = src.header.data_start;
  const std::string pname = prefix + "prefill_topk";
  const auto pf = src.tensors.find(pname);
  if (pf == src.tensors.end()) return;
  const TensorInfo& pi = pf->second;
  ESS_CHECK(pi.dtype == "I32",
            "{}: request {}, tensor '{}' at file offset {}: dtype {} is not supported, expected I32", src.path, i,
            pname, data_start + pi.begin, pi.dtype);
  ESS_CHECK(pi.shape.size() == 3 && pi.shape[0] == src.meta.layers && pi.shape[1] >= 1 && pi.shape[1] <= 1 << 16 &&
                pi.shape[2] == src.meta.topk,
            "{}: request {}, tensor '{}' at file offset {}: shape {} does not match [layers={}, windows>=1, "
            "topk={}]",
            src.path, i, pname, data_start + pi.begin, nlohmann::json(pi.shape).dump(), src.meta.layers, src.meta.topk);
  r.prefill_windows = static_cast<int>(pi.shape[1]);
  r.prefill_ids = src.data_of(pi);
  r.prefill_offset = data_start + pi.begin;
}

// Request i: its id and context (metadata) and its tensors.
RequestView read_request(const RequestSource& src, std::int64_t i) {
  RequestView r;
  r.index = i;
  r.layers = src.meta.layers;
  r.mtp = src.meta.mtp;
  r.topk = src.meta.topk;
  r.unit_tokens = src.meta.unit_tokens;
  const std::string prefix = fmt::format("requests.{}.", i);
  if (auto it = src.md.find(prefix + "id"); it != src.md.end()) {
    r.id = printable(it->second);
  } else {
    r.id = std::to_string(i);
  }
  read_topk(src, i, prefix, r);
  read_lengths(src, i, prefix, r);
  read_prefill(src, i, prefix, r);
  r.context = r.lengths.empty() ? 0 : r.lengths.front();
  if (auto it = src.md.find(prefix + "context"); it != src.md.end()) {
    r.context = parse_int(src.path, prefix + "context", it->second, 1, std::numeric_limits<std::int32_t>::max());
  }
  const std::uint64_t lengths_at = src.header.data_start + src.tensors.at(prefix + "lengths").begin;
  ESS_CHECK(r.context <= r.lengths.front(),
            "{}: request {}: metadata {}context = {} exceeds the length {} of its first step (tensor '{}lengths' at "
            "file offset {}): the prompt is part of every step's context",
            src.path, i, prefix, r.context, r.lengths.front(), prefix, lengths_at);
  if (const auto most = model_max_length(src.meta.model)) {
    const auto longest = std::max_element(r.lengths.begin(), r.lengths.end());
    const auto step = longest - r.lengths.begin();
    const std::uint64_t esize = src.tensors.at(prefix + "lengths").dtype == "I64" ? 8 : 4;
    ESS_CHECK(*longest <= *most,
              "{}: request {}, tensor '{}lengths', byte offset {} (step {}): length {} exceeds the max_position_embeddings "
              "({}) of the trace's model '{}'",
              src.path, i, prefix, lengths_at + static_cast<std::uint64_t>(step) * esize, step, *longest, *most,
              src.meta.model);
  }
  const auto group = src.md.find(prefix + "prefix_group");
  const auto tokens = src.md.find(prefix + "prefix_tokens");
  ESS_CHECK((group == src.md.end()) == (tokens == src.md.end()),
            "{}: metadata {}prefix_group and {}prefix_tokens go together (request {})", src.path, prefix, prefix, i);
  if (group != src.md.end()) {
    ESS_CHECK(!group->second.empty(), "{}: metadata {}prefix_group is empty", src.path, prefix);
    r.prefix_group = printable(group->second);
    r.prefix_tokens = parse_int(src.path, prefix + "prefix_tokens", tokens->second, 0, r.context);
  }
  return r;
}

// Rejects a requests.* tensor that no declared request consumed.
void check_no_stray_tensors(const std::string& path, const Header& h, const std::map<std::string, TensorInfo>& tensors,
                            std::int64_t nreq) {
  for (const auto& [name, t] : tensors) {
    if (!name.starts_with("requests.")) continue;
    const auto rest = name.substr(9);
    const auto dot = rest.find('.');
    std::int64_t idx = -1;
    const auto [p, ec] = std::from_chars(rest.data(), rest.data() + (dot == std::string::npos ? rest.size() : dot), idx);
    (void)p;
    const bool known = ec == std::errc() && idx >= 0 && idx < nreq && dot != std::string::npos &&
                       (rest.substr(dot + 1) == "topk" || rest.substr(dot + 1) == "lengths" ||
                        rest.substr(dot + 1) == "prefill_topk");
    ESS_CHECK(known, "{}: tensor '{}' at file offset {} is not part of the format ({} requests declared)", path, printable(name),
              h.data_start + t.begin, nreq);
  }
}

}  // namespace

struct TraceReader::Mapping {
  std::unique_ptr<MappedFile> file;  // a file's mapping (the constructor from a path)
  std::vector<std::uint8_t> bytes;  // from_bytes keeps its own copy
  const std::uint8_t* data = nullptr;
  std::size_t size = 0;
};

TraceReader::TraceReader(TraceReader&&) noexcept = default;
TraceReader& TraceReader::operator=(TraceReader&&) noexcept = default;
TraceReader::~TraceReader() = default;

TraceReader::TraceReader(const std::string& path) : path_(path), map_(std::make_unique<Mapping>()) {
  map_->file = std::make_unique<MappedFile>(path);
  map_->data = map_->file->data();
  map_->size = map_->file->size();
  parse();
}

TraceReader TraceReader::from_bytes(std::span<const std::uint8_t> bytes, std::string name) {
  TraceReader r;
  r.path_ = std::move(name);
  r.map_ = std::make_unique<Mapping>();
  // Copy into 8-aligned storage, as a mapping would be.
  r.map_->bytes.assign(bytes.begin(), bytes.end());
  r.map_->data = r.map_->bytes.data();
  r.map_->size = bytes.size();
  r.parse();
  return r;
}

void TraceReader::parse() {
  const Header header = read_header(path_, map_->data, map_->size);
  const std::map<std::string, std::string> md = read_metadata(path_, header.json);
  const std::int64_t nreq = read_meta(path_, md, meta_);
  const std::map<std::string, TensorInfo> tensors = read_tensors(path_, map_->size, header);
  const RequestSource src{path_, map_->data, header, tensors, md, meta_, nreq, owned_};
  requests_.reserve(static_cast<std::size_t>(nreq));
  for (std::int64_t i = 0; i < nreq; ++i) requests_.push_back(read_request(src, i));
  check_no_stray_tensors(path_, header, tensors, nreq);
}

std::optional<std::int64_t> model_max_length(std::string_view model) {
  std::string m(model);
  std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (m == "deepseek-v3.2-exp" || m == "deepseek-ai/deepseek-v3.2-exp" || m == "deepseek_v32") {
    static const std::int64_t most = ModelSpec::deepseek_v32_exp().max_position_embeddings;
    return most;
  }
  return std::nullopt;
}

std::int64_t TraceReader::total_steps() const {
  std::int64_t n = 0;
  for (const auto& r : requests_) n += r.steps;
  return n;
}

std::int64_t TraceReader::max_length() const {
  std::int64_t n = 0;
  for (const auto& r : requests_) {
    for (auto l : r.lengths) n = std::max(n, l);
  }
  return n;
}

std::int64_t TraceReader::validate_request(std::size_t i) const {
  const RequestView& r = request(i);
  std::int64_t maxlen = 0;
  for (auto l : r.lengths) maxlen = std::max(maxlen, l);
  std::vector<std::int32_t> seen(static_cast<std::size_t>(maxlen), -1);  // id -> position in the current row
  std::vector<std::int32_t> touched;
  touched.reserve(static_cast<std::size_t>(r.topk));
  const auto K = static_cast<std::size_t>(r.topk);

  auto check_row = [&](const std::int32_t* row, std::int64_t length, const char* tensor, std::uint64_t row_offset,
                       auto&& where) {
    const std::int64_t ids = r.ids_of(length);
    for (std::size_t k = 0; k < K; ++k) {
      const std::int32_t v = row[k];
      if (v == -1) continue;
      if (v < 0 || v >= ids) {
        for (auto t : touched) seen[static_cast<std::size_t>(t)] = -1;
        ESS_THROW("{}: request {} ('{}'), tensor 'requests.{}.{}', byte offset {} ({}, position {}): id {} is out of "
                  "range [0, {}){} (-1 is the only padding value)",
                  path_, r.index, r.id, r.index, tensor, row_offset + 4 * k, where(), k, v, ids,
                  r.unit_tokens > 1 ? fmt::format(" (ids of {} tokens over a length of {})", r.unit_tokens, length)
                                    : std::string());
      }
      auto& sv = seen[static_cast<std::size_t>(v)];
      if (sv >= 0) {
        const auto first = sv;
        for (auto t : touched) seen[static_cast<std::size_t>(t)] = -1;
        ESS_THROW("{}: request {} ('{}'), tensor 'requests.{}.{}', byte offset {} ({}, position {}): id {} is "
                  "selected twice in one query (first at position {})",
                  path_, r.index, r.id, r.index, tensor, row_offset + 4 * k, where(), k, v, first);
      }
      sv = static_cast<std::int32_t>(k);
      touched.push_back(v);
    }
    for (auto t : touched) seen[static_cast<std::size_t>(t)] = -1;
    touched.clear();
  };

  std::vector<std::uint32_t> stamp(static_cast<std::size_t>(maxlen), 0);  // id -> last step-layer counted
  std::uint32_t epoch = 0;
  std::int64_t max_ws = 0;
  for (std::int64_t s = 0; s < r.steps; ++s) {
    const std::int64_t length = r.lengths[static_cast<std::size_t>(s)];
    for (int l = 0; l < r.layers; ++l) {
      const auto ids = r.step(s, l);
      for (int t = 0; t < r.mtp; ++t) {
        const std::int32_t* row = ids.data() + static_cast<std::size_t>(t) * K;
        const auto off = r.topk_offset + static_cast<std::uint64_t>(row - r.topk_ids) * 4;
        check_row(row, length, "topk", off, [&] { return fmt::format("step {}, layer {}, query {}", s, l, t); });
      }
      if (++epoch == 0) {
        std::fill(stamp.begin(), stamp.end(), 0);
        epoch = 1;
      }
      std::int64_t ws = 0;
      for (const std::int32_t v : ids) {
        if (v < 0 || stamp[static_cast<std::size_t>(v)] == epoch) continue;
        stamp[static_cast<std::size_t>(v)] = epoch;
        ++ws;
      }
      max_ws = std::max(max_ws, ws);
    }
  }
  if (r.prefill_ids != nullptr) {
    const std::int64_t length = r.prompt_length();
    for (int l = 0; l < r.layers; ++l) {
      const auto ids = r.prefill(l);
      for (int w = 0; w < r.prefill_windows; ++w) {
        const std::int32_t* row = ids.data() + static_cast<std::size_t>(w) * K;
        const auto off = r.prefill_offset + static_cast<std::uint64_t>(row - r.prefill_ids) * 4;
        check_row(row, length, "prefill_topk", off, [&] { return fmt::format("layer {}, window {}", l, w); });
        // A warm-up window loads one row: its distinct ids (checked above) are its non-padding ones.
        max_ws = std::max<std::int64_t>(max_ws, std::count_if(row, row + K, [](std::int32_t v) { return v >= 0; }));
      }
    }
  }
  return max_ws;
}

void TraceReader::validate_all() const {
  for (std::size_t i = 0; i < requests_.size(); ++i) validate_request(i);
}

}  // namespace ess::trace
