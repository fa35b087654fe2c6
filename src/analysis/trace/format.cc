#include "ess/trace/format.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>

#include "ess/core/error.h"
#include "ess/core/files.h"
#include "ess/core/text.h"
#include "ess/model/model_spec.h"

static_assert(std::endian::native == std::endian::little, "the trace reader assumes a little-endian host");

namespace ess::trace {

namespace {

// A header larger than this is not a trace (safetensors' own limit, MAX_HEADER_SIZE).
constexpr std::uint64_t kMaxHeader = 100'000'000;

std::optional<std::size_t> dtype_size(const std::string& d) {
  static const std::map<std::string, std::size_t> sizes{
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},   {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4},  {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  auto it = sizes.find(d);
  if (it == sizes.end()) return std::nullopt;
  return it->second;
}

struct TensorInfo {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // relative to the data section
  std::uint64_t end = 0;
};

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

}  // namespace

// A mapped file that shrinks while it is read (truncated by another process, a network
// filesystem that lost it) raises SIGBUS on the next touch of a page past its new end. The
// mappings alive now are kept in fixed storage for the handler, which may only call
// async-signal-safe functions: a fault inside one ends the process with exit status 3 and a
// message naming the file, as `ess` does for any run that cannot complete; a fault elsewhere
// goes to the handler that was there before (the default one, or a sanitizer's).
namespace {

constexpr int kMaxGuarded = 64;
struct GuardedMapping {
  std::atomic<bool> live{false};
  std::atomic<std::uintptr_t> begin{0};
  std::atomic<std::size_t> size{0};
  char message[1024] = {};
  std::size_t message_size = 0;
};
GuardedMapping g_guarded[kMaxGuarded];
struct sigaction g_previous_sigbus {};

extern "C" void trace_mapping_fault(int sig, siginfo_t* info, void*) {
  const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (auto& g : g_guarded) {
    if (!g.live.load()) continue;
    const std::uintptr_t b = g.begin.load();
    if (addr >= b && addr - b < g.size.load()) {
      [[maybe_unused]] const auto n = ::write(STDERR_FILENO, g.message, g.message_size);
      ::_exit(3);
    }
  }
  // Not a trace's page: the fault repeats under the previous handler when this returns.
  ::sigaction(sig, &g_previous_sigbus, nullptr);
}

void install_mapping_guard() {
  static const bool installed = [] {
    if (::sigaction(SIGBUS, nullptr, &g_previous_sigbus) != 0) return false;
    struct sigaction sa {};
    sa.sa_sigaction = trace_mapping_fault;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    return ::sigaction(SIGBUS, &sa, nullptr) == 0;
  }();
  (void)installed;
}

// A slot for the mapping (-1 when all are taken: the mapping is then unguarded).
int guard_mapping(const void* begin, std::size_t size, const std::string& path) {
  install_mapping_guard();
  for (int i = 0; i < kMaxGuarded; ++i) {
    bool expected = false;
    if (!g_guarded[i].live.compare_exchange_strong(expected, true)) continue;
    auto& g = g_guarded[i];
    const std::string text = fmt::format(
        "ess: cannot complete: {}: the trace file shrank while it was read (truncated by another process, or lost by "
        "its filesystem); nothing was written\n",
        printable(path));
    g.message_size = std::min(text.size(), sizeof(g.message));
    std::memcpy(g.message, text.data(), g.message_size);
    g.size.store(size);
    g.begin.store(reinterpret_cast<std::uintptr_t>(begin));
    return i;
  }
  return -1;
}

void unguard_mapping(int slot) {
  if (slot < 0) return;
  g_guarded[slot].begin.store(0);
  g_guarded[slot].size.store(0);
  g_guarded[slot].live.store(false);
}

}  // namespace

struct TraceReader::Mapping {
  const std::uint8_t* data = nullptr;
  std::size_t size = 0;
  void* mapped = nullptr;
  int guard = -1;
  std::vector<std::uint8_t> bytes;  // from_bytes keeps its own copy
  ~Mapping() {
    unguard_mapping(guard);
    if (mapped != nullptr) munmap(mapped, size);
  }
};

TraceReader::TraceReader(TraceReader&&) noexcept = default;
TraceReader& TraceReader::operator=(TraceReader&&) noexcept = default;
TraceReader::~TraceReader() = default;

TraceReader::TraceReader(const std::string& path) : path_(path), map_(std::make_unique<Mapping>()) {
  check_input_file(path, "trace");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ESS_CHECK(fd >= 0, "{}: cannot open trace: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    ESS_THROW("{}: cannot stat trace: {}", path, std::strerror(err));
  }
  map_->size = static_cast<std::size_t>(st.st_size);
  if (map_->size > 0) {
    void* p = ::mmap(nullptr, map_->size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    ESS_CHECK(p != MAP_FAILED, "{}: cannot map trace ({} bytes): {}", path, map_->size, std::strerror(err));
    map_->mapped = p;
    map_->data = static_cast<const std::uint8_t*>(p);
    map_->guard = guard_mapping(p, map_->size, path);
  } else {
    ::close(fd);
  }
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

namespace {

// The file's two sections: the JSON header (after its 8-byte length) and the data after it.
struct Header {
  nlohmann::json json;
  std::uint64_t data_start = 0;  // file offset of the data section
  std::uint64_t data_size = 0;
};

// Checks the header length at offset 0 and parses the JSON header that follows it.
Header read_header(const std::string& path, const std::uint8_t* base, std::size_t size) {
  ESS_CHECK(size >= 8, "{}: truncated: the file has {} bytes, less than the 8-byte header length at offset 0", path,
            size);
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);
  ESS_CHECK(header_len <= size - 8,
            "{}: header length {} at offset 0 runs past the end of the file ({} bytes; truncated or not a trace)",
            path, header_len, size);
  ESS_CHECK(header_len <= kMaxHeader, "{}: header length {} at offset 0 exceeds the {} byte limit", path,
            header_len, kMaxHeader);
  const char* hb = reinterpret_cast<const char*>(base + 8);
  Header h;
  // Keys seen in each open object: a key given twice is refused (the parser would keep the
  // last one, and a tensor named twice would leave the other's bytes unaccounted for).
  std::vector<std::set<std::string>> open;
  std::string twice;
  const nlohmann::json::parser_callback_t note = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::object_start) {
      open.emplace_back();
    } else if (event == nlohmann::json::parse_event_t::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == nlohmann::json::parse_event_t::key && !open.empty()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!open.back().insert(key).second && twice.empty()) twice = key;
    }
    return true;
  };
  try {
    h.json = nlohmann::json::parse(hb, hb + header_len, note);
  } catch (const nlohmann::json::parse_error& e) {
    ESS_THROW("{}: malformed JSON header at byte offset {}: {}", path, 8 + (e.byte > 0 ? e.byte - 1 : 0),
              printable(e.what()));
  } catch (const nlohmann::json::exception& e) {  // e.g. a number too large for any type
    ESS_THROW("{}: malformed JSON header (offset 8, {} bytes): {}", path, header_len, printable(e.what()));
  }
  ESS_CHECK(twice.empty(), "{}: the JSON header (offset 8, {} bytes) gives the key '{}' twice in one object", path,
            header_len, printable(twice));
  ESS_CHECK(h.json.is_object(), "{}: the JSON header at offset 8 is a {}, not an object", path, h.json.type_name());
  h.data_start = 8 + header_len;
  h.data_size = size - h.data_start;
  return h;
}

// The header's '__metadata__' object (string values only), empty when absent.
std::map<std::string, std::string> read_metadata(const std::string& path, const nlohmann::json& header) {
  std::map<std::string, std::string> md;
  if (auto it = header.find("__metadata__"); it != header.end()) {
    ESS_CHECK(it->is_object(), "{}: header '__metadata__' is a {}, not an object of strings", path, it->type_name());
    for (const auto& [k, v] : it->items()) {
      ESS_CHECK(v.is_string(), "{}: metadata '{}' is a {}, not a string (safetensors metadata values are strings)",
                path, printable(k), v.type_name());
      md[k] = v.get<std::string>();
    }
  }
  return md;
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
  ESS_CHECK(version == kFormatVersion, "{}: trace format version {} is not supported (this reader reads version {})",
            path, version, kFormatVersion);
  const auto nreq = parse_int(path, "ess.requests", need("ess.requests"), 0, 1 << 24);
  meta.layers = static_cast<int>(parse_int(path, "ess.layers", need("ess.layers"), 1, 4096));
  meta.mtp = static_cast<int>(parse_int(path, "ess.mtp", need("ess.mtp"), 1, 64));
  meta.topk = static_cast<int>(parse_int(path, "ess.topk", need("ess.topk"), 1, 1 << 20));
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
               k != "ess.mtp" && k != "ess.topk" && !k.starts_with("requests.")) {
      meta.extra[k] = v;
    }
  }
  return nreq;
}

// One tensor entry of the header: dtype, shape and data offsets, checked against the file.
TensorInfo read_tensor(const std::string& path, std::size_t size, const Header& h, const std::string& name,
                       const nlohmann::json& t) {
  ESS_CHECK(t.is_object(), "{}: tensor '{}': header entry is a {}, not an object", path, name, t.type_name());
  for (const auto& [key, value] : t.items()) {
    (void)value;
    ESS_CHECK(key == "dtype" || key == "shape" || key == "data_offsets",
              "{}: tensor '{}': unknown field '{}' (a tensor entry has dtype, shape and data_offsets)", path, name,
              printable(key));
  }
  TensorInfo info;
  const auto d = t.find("dtype");
  ESS_CHECK(d != t.end() && d->is_string(), "{}: tensor '{}': 'dtype' missing or not a string", path, name);
  info.dtype = d->get<std::string>();
  const auto dsize = dtype_size(info.dtype);
  ESS_CHECK(dsize.has_value(), "{}: tensor '{}': unknown dtype '{}'", path, name, printable(info.dtype));
  const auto sh = t.find("shape");
  ESS_CHECK(sh != t.end() && sh->is_array(), "{}: tensor '{}': 'shape' missing or not an array", path, name);
  std::uint64_t numel = 1;
  for (const auto& e : *sh) {
    ESS_CHECK(e.is_number_integer() && e.get<std::int64_t>() >= 0,
              "{}: tensor '{}': shape entry {} is not a non-negative integer", path, name, e.dump());
    const auto v = e.get<std::int64_t>();
    ESS_CHECK(v == 0 || numel <= (std::numeric_limits<std::uint64_t>::max() / 16) / static_cast<std::uint64_t>(v),
              "{}: tensor '{}': shape {} overflows", path, name, sh->dump());
    numel *= static_cast<std::uint64_t>(v);
    info.shape.push_back(v);
  }
  const auto off = t.find("data_offsets");
  ESS_CHECK(off != t.end() && off->is_array() && off->size() == 2 && (*off)[0].is_number_unsigned() &&
                (*off)[1].is_number_unsigned(),
            "{}: tensor '{}': 'data_offsets' must be [begin, end] of non-negative integers", path, name);
  info.begin = (*off)[0].get<std::uint64_t>();
  info.end = (*off)[1].get<std::uint64_t>();
  ESS_CHECK(info.begin <= info.end, "{}: tensor '{}': data_offsets [{}, {}] are reversed", path, name, info.begin,
            info.end);
  ESS_CHECK(info.end <= h.data_size,
            "{}: tensor '{}': data [{}, {}) at file offset {} runs past the end of the file ({} bytes; truncated?)",
            path, name, info.begin, info.end, h.data_start + info.begin, size);
  ESS_CHECK(info.end - info.begin == numel * *dsize,
            "{}: tensor '{}': shape {} of {} needs {} bytes but data_offsets [{}, {}) hold {}", path, name,
            sh->dump(), info.dtype, numel * *dsize, info.begin, info.end, info.end - info.begin);
  return info;
}

// The tensors tile the data section as safetensors requires: in the order of their offsets
// each starts where the one before ended (the first at 0), and the last ends at the end of the
// file. So no bytes lie between or after them and no two share a byte.
void check_layout(const std::string& path, const Header& h, const std::map<std::string, TensorInfo>& tensors) {
  std::vector<std::pair<const std::string*, const TensorInfo*>> order;
  for (const auto& [name, t] : tensors) order.emplace_back(&name, &t);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::tie(a.second->begin, a.second->end, *a.first) < std::tie(b.second->begin, b.second->end, *b.first);
  });
  std::uint64_t at = 0;
  const std::string* prev = nullptr;
  const TensorInfo* prev_t = nullptr;
  for (const auto& [name, t] : order) {
    if (t->begin < at) {
      ESS_THROW("{}: tensor '{}': data [{}, {}) at file offset {} overlaps tensor '{}' at data [{}, {}) (file offset "
                "{}): tensors may not share bytes",
                path, printable(*name), t->begin, t->end, h.data_start + t->begin, printable(*prev), prev_t->begin,
                prev_t->end, h.data_start + prev_t->begin);
    }
    if (t->begin > at) {
      ESS_THROW("{}: tensor '{}': data [{}, {}) at file offset {} leaves a hole of {} bytes at data [{}, {}) (file "
                "offset {}) {}: tensors must follow one another without gaps",
                path, printable(*name), t->begin, t->end, h.data_start + t->begin, t->begin - at, at, t->begin,
                h.data_start + at,
                prev == nullptr ? std::string("at the start of the data section")
                                : fmt::format("after tensor '{}'", printable(*prev)));
    }
    at = t->end;
    prev = name;
    prev_t = t;
  }
  ESS_CHECK(at == h.data_size,
            "{}: {} bytes at data [{}, {}) (file offset {} to the end, {}) follow {}: the tensors must cover the data "
            "section exactly",
            path, h.data_size - at, at, h.data_size, h.data_start + at, h.data_start + h.data_size,
            prev == nullptr ? std::string("a header without tensors") : fmt::format("the last tensor '{}'", printable(*prev)));
}

// Every tensor entry of the header, by name, checked to tile the data section.
std::map<std::string, TensorInfo> read_tensors(const std::string& path, std::size_t size, const Header& h) {
  std::map<std::string, TensorInfo> tensors;
  for (const auto& [name, t] : h.json.items()) {
    if (name == "__metadata__") continue;
    tensors.emplace(name, read_tensor(path, size, h, printable(name), t));
  }
  check_layout(path, h, tensors);
  return tensors;
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
    for (std::size_t k = 0; k < K; ++k) {
      const std::int32_t v = row[k];
      if (v == -1) continue;
      if (v < 0 || v >= length) {
        for (auto t : touched) seen[static_cast<std::size_t>(t)] = -1;
        ESS_THROW("{}: request {} ('{}'), tensor 'requests.{}.{}', byte offset {} ({}, position {}): id {} is out of "
                  "range [0, {}) (-1 is the only padding value)",
                  path_, r.index, r.id, r.index, tensor, row_offset + 4 * k, where(), k, v, length);
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

// ---- writer ------------------------------------------------------------------------------

namespace {

std::size_t topk_elems(const TraceMeta& m, const RequestShape& s) {
  return static_cast<std::size_t>(s.steps) * static_cast<std::size_t>(m.layers) * static_cast<std::size_t>(m.mtp) *
         static_cast<std::size_t>(m.topk);
}
std::size_t prefill_elems(const TraceMeta& m, const RequestShape& s) {
  return static_cast<std::size_t>(m.layers) * static_cast<std::size_t>(s.prefill_windows) *
         static_cast<std::size_t>(m.topk);
}

}  // namespace

TraceWriter::TraceWriter(const std::string& path, const TraceMeta& meta, std::vector<RequestShape> shapes)
    : path_(path), meta_(meta), shapes_(std::move(shapes)) {
  ESS_CHECK(meta.layers >= 1 && meta.mtp >= 1 && meta.topk >= 1, "{}: trace writer: layers {}, mtp {}, topk {} must be positive",
            path, meta.layers, meta.mtp, meta.topk);
  nlohmann::json md = nlohmann::json::object();
  for (const auto& [k, v] : meta.extra) md[k] = v;
  md["ess.format"] = kFormatName;
  md["ess.version"] = std::to_string(kFormatVersion);
  md["ess.requests"] = std::to_string(shapes_.size());
  md["ess.layers"] = std::to_string(meta.layers);
  md["ess.mtp"] = std::to_string(meta.mtp);
  md["ess.topk"] = std::to_string(meta.topk);
  md["ess.model"] = meta.model;
  md["ess.provenance"] = meta.provenance;
  md["ess.synthetic"] = meta.synthetic ? "true" : "false";
  if (!meta.note.empty()) md["ess.note"] = meta.note;
  if (!meta.generator.empty()) md["ess.generator"] = meta.generator;
  nlohmann::json header = nlohmann::json::object();
  std::uint64_t off = 0;
  auto add = [&](const std::string& name, const char* dtype, std::vector<std::int64_t> shape, std::uint64_t bytes) {
    header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  };
  for (std::size_t i = 0; i < shapes_.size(); ++i) {
    const auto& s = shapes_[i];
    ESS_CHECK(s.steps >= 1 && s.prefill_windows >= 0, "{}: trace writer: request {} has {} steps and {} prefill windows",
              path, i, s.steps, s.prefill_windows);
    const std::string p = fmt::format("requests.{}.", i);
    md[p + "id"] = s.id.empty() ? std::to_string(i) : s.id;
    if (s.context > 0) md[p + "context"] = std::to_string(s.context);
    if (!s.prefix_group.empty()) {
      const std::int64_t ctx = s.context > 0 ? s.context : std::numeric_limits<std::int64_t>::max();
      ESS_CHECK(s.prefix_tokens >= 0 && s.prefix_tokens <= ctx,
                "{}: trace writer: request {} prefix_tokens {} must be in [0, its context {}]", path, i, s.prefix_tokens,
                s.context);
      md[p + "prefix_group"] = s.prefix_group;
      md[p + "prefix_tokens"] = std::to_string(s.prefix_tokens);
    } else {
      ESS_CHECK(s.prefix_tokens == 0, "{}: trace writer: request {} has prefix_tokens {} but no prefix_group", path, i,
                s.prefix_tokens);
    }
    add(p + "topk", "I32", {s.steps, meta.layers, meta.mtp, meta.topk}, topk_elems(meta, s) * 4);
    add(p + "lengths", "I64", {s.steps}, static_cast<std::uint64_t>(s.steps) * 8);
    if (s.prefill_windows > 0) {
      add(p + "prefill_topk", "I32", {meta.layers, s.prefill_windows, meta.topk}, prefill_elems(meta, s) * 4);
    }
  }
  header["__metadata__"] = md;
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');  // 8-aligned data section
  file_ = std::make_unique<AtomicFile>(path, "trace");  // the target is replaced only by close()
  const std::uint64_t n = text.size();
  file_->write(&n, 8);
  file_->write(text);
}

TraceWriter::~TraceWriter() = default;

void TraceWriter::write_request(std::size_t i, std::span<const std::int32_t> topk, std::span<const std::int64_t> lengths,
                                std::span<const std::int32_t> prefill) {
  ESS_CHECK(file_ != nullptr, "{}: trace writer is closed", path_);
  ESS_CHECK(i == next_ && i < shapes_.size(), "{}: trace writer: request {} written out of order (expected {} of {})",
            path_, i, next_, shapes_.size());
  const auto& s = shapes_[i];
  ESS_CHECK(topk.size() == topk_elems(meta_, s), "{}: trace writer: request {} topk has {} ids, expected {}", path_, i,
            topk.size(), topk_elems(meta_, s));
  ESS_CHECK(lengths.size() == static_cast<std::size_t>(s.steps), "{}: trace writer: request {} has {} lengths, expected {}",
            path_, i, lengths.size(), s.steps);
  ESS_CHECK(prefill.size() == prefill_elems(meta_, s), "{}: trace writer: request {} prefill has {} ids, expected {}",
            path_, i, prefill.size(), prefill_elems(meta_, s));
  file_->write(topk.data(), topk.size() * 4);
  file_->write(lengths.data(), lengths.size() * 8);
  file_->write(prefill.data(), prefill.size() * 4);
  ++next_;
}

void TraceWriter::close() {
  ESS_CHECK(file_ != nullptr, "{}: trace writer already closed", path_);
  ESS_CHECK(next_ == shapes_.size(), "{}: trace writer closed after {} of {} requests", path_, next_, shapes_.size());
  file_->commit();
  file_.reset();
}

void write_trace(const std::string& path, const TraceMeta& meta, const std::vector<RequestData>& requests) {
  std::vector<RequestShape> shapes;
  for (const auto& r : requests) {
    shapes.push_back({r.id, static_cast<std::int64_t>(r.lengths.size()), r.prefill_windows, r.context, r.prefix_group,
                      r.prefix_tokens});
  }
  TraceWriter w(path, meta, std::move(shapes));
  for (std::size_t i = 0; i < requests.size(); ++i) {
    w.write_request(i, requests[i].topk, requests[i].lengths, requests[i].prefill);
  }
  w.close();
}

}  // namespace ess::trace
