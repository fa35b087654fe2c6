// The ESS top-k trace format, version 1 (docs/trace-format.md): a safetensors file.
//
//   [8 bytes]  u64 little-endian N, the length of the JSON header
//   [N bytes]  JSON header: {"__metadata__": {string: string}, "<tensor>": {"dtype", "shape",
//              "data_offsets": [begin, end]}, ...}; offsets are relative to the data section
//   [...]      the data section: raw little-endian tensors
//
// Per request i (0 <= i < ess.requests):
//   requests.<i>.topk          I32 [steps, layers, mtp, topk]  decode top-k ids, -1 = padding
//   requests.<i>.lengths       I64 or I32 [steps]             context length at each step: the
//                                                              step's ids lie in [0, length)
//   requests.<i>.prefill_topk  I32 [layers, windows, topk]    optional: the top-k of the last
//                                                              `windows` prefill query positions,
//                                                              oldest first (for LRU-Warmup);
//                                                              ids lie in [0, lengths[0])
// Metadata (all values strings, as safetensors requires): ess.format = "ess-topk-trace",
// ess.version = "1" (or "2" with ess.unit_tokens > 1), ess.requests, ess.layers, ess.mtp, ess.topk, ess.model, ess.provenance,
// ess.synthetic = "true" | "false", optional ess.note, ess.generator (the profile JSON),
// ess.unit_tokens (the tokens an id names: 1, the default, a token; 4 a DeepSeek-V4 C4 entry;
// a MiniMax-M3 block's sparse_block_size: id u covers tokens [u x n, (u + 1) x n), and a step of
// length L selects among ceil(L / n) ids), requests.<i>.id, requests.<i>.context (the prompt
// length in tokens; default lengths[0]).
//
// TraceReader memory-maps the file: the id tensors are read in place, never copied (unless a
// foreign writer left them misaligned). Opening checks the structure (header, dtypes, shapes,
// offsets, metadata); validate_request() checks every id. Every failure is an ess::Error
// naming the file, request, tensor and byte offset.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ess/io/output_file.h"

namespace ess::trace {

// The newest version this reader reads: 2 adds ess.unit_tokens (a version-1 reader would read
// its ids as tokens). A trace of tokens is written as version 1, one of units as version 2.
inline constexpr int kFormatVersion = 2;
inline constexpr const char* kFormatName = "ess-topk-trace";

// The ids `tokens` tokens make when an id names `unit_tokens` tokens: ceil(tokens / unit_tokens).
constexpr std::int64_t ids_of(std::int64_t tokens, std::int64_t unit_tokens) {
  return (tokens + unit_tokens - 1) / unit_tokens;
}

struct TraceMeta {
  int version = 1;  // ess.version (the writer writes 1 for tokens, 2 for units)
  int layers = 0;
  int mtp = 1;       // query tokens per request per step (T)
  int topk = 2048;   // K
  int unit_tokens = 1;  // tokens an id names (ess.unit_tokens)
  std::string model;
  std::string provenance;  // how the trace was made: "synthetic: ess trace gen ..." or a recorder
  bool synthetic = false;
  std::string note;
  std::string generator;   // the generator profile (JSON text) for synthetic traces, else empty
  std::map<std::string, std::string> extra;  // any other metadata, kept as is
};

struct RequestView {
  std::int64_t index = 0;
  std::string id;
  std::int64_t steps = 0;
  int layers = 0;
  int mtp = 1;
  int topk = 0;
  int unit_tokens = 1;                      // tokens an id names (TraceMeta::unit_tokens)
  int prefill_windows = 0;                  // 0 = no prefill top-k
  const std::int32_t* topk_ids = nullptr;   // [steps][layers][mtp][topk]
  const std::int32_t* prefill_ids = nullptr;  // [layers][prefill_windows][topk]
  std::vector<std::int64_t> lengths;        // [steps]
  std::int64_t context = 0;                 // prompt length (metadata requests.<i>.context,
                                            // else lengths[0]): the base of the memory ratio
  // Optional (metadata requests.<i>.prefix_group / prefix_tokens): the requests of one group
  // share their first prefix_tokens prompt tokens (a system prompt, a template, a turn).
  std::string prefix_group;                 // empty: none
  std::int64_t prefix_tokens = 0;           // in [0, context]; 0 without a group
  std::uint64_t topk_offset = 0;            // byte offset of topk_ids in the file
  std::uint64_t prefill_offset = 0;

  // The mtp x topk ids of one step of one layer.
  std::span<const std::int32_t> step(std::int64_t s, int layer) const {
    const std::size_t row = static_cast<std::size_t>(mtp) * static_cast<std::size_t>(topk);
    return {topk_ids + (static_cast<std::size_t>(s) * static_cast<std::size_t>(layers) + static_cast<std::size_t>(layer)) * row, row};
  }
  // The prefill_windows x topk ids of one layer (empty without prefill top-k).
  std::span<const std::int32_t> prefill(int layer) const {
    const std::size_t n = static_cast<std::size_t>(prefill_windows) * static_cast<std::size_t>(topk);
    if (prefill_ids == nullptr) return {};
    return {prefill_ids + static_cast<std::size_t>(layer) * n, n};
  }
  std::int64_t prompt_length() const { return lengths.empty() ? 0 : lengths.front(); }
  // The ids `tokens` tokens make: ceil(tokens / unit_tokens).
  std::int64_t ids_of(std::int64_t tokens) const { return trace::ids_of(tokens, unit_tokens); }
};

// A mapped trace that shrinks while it is read (truncated by another process, lost by a network
// filesystem) raises SIGBUS on the next touch of a page past its new end. The library installs no
// handler for it: a program that wants such a fault to end the run with exit status 3 and a
// message naming the trace (as `ess` does) calls this once; a fault outside a trace's pages goes
// on to the handler that was there before. Without it, the program's own SIGBUS handling applies
// (by default the process ends by the signal).
void install_mapping_guard();

class TraceReader {
 public:
  // Maps `path` and checks its structure. Throws ess::Error on any defect.
  explicit TraceReader(const std::string& path);
  // Parses an in-memory image (the fuzz target and tests); `name` is used in messages. The
  // bytes are copied once.
  static TraceReader from_bytes(std::span<const std::uint8_t> bytes, std::string name);

  TraceReader(TraceReader&&) noexcept;
  TraceReader& operator=(TraceReader&&) noexcept;
  ~TraceReader();

  const std::string& path() const { return path_; }
  const TraceMeta& meta() const { return meta_; }
  std::size_t requests() const { return requests_.size(); }
  const RequestView& request(std::size_t i) const { return requests_.at(i); }
  std::int64_t total_steps() const;
  std::int64_t max_length() const;

  // Checks every id of request i: -1 or in [0, ids_of(length of its step)) (prefill: of lengths[0]),
  // and no id twice within one query row. Thread-safe. Returns the largest working set (distinct
  // ids of one step of one layer over its mtp query tokens) of the request.
  std::int64_t validate_request(std::size_t i) const;
  void validate_all() const;

 private:
  TraceReader() = default;
  void parse();

  std::string path_;
  struct Mapping;
  std::unique_ptr<Mapping> map_;
  std::vector<std::vector<std::int32_t>> owned_;  // tensors copied because misaligned
  TraceMeta meta_;
  std::vector<RequestView> requests_;
};

// The longest context (max_position_embeddings) of the model a trace names in ess.model, for
// the models ESS ships (deepseek-v3.2-exp); nullopt for another name. A trace of a known model
// whose lengths exceed it is refused.
std::optional<std::int64_t> model_max_length(std::string_view model);

// Streams a trace to disk: the shapes of all requests are declared up front (so the header can
// be written first), then each request's tensors are written in order.
struct RequestShape {
  std::string id;
  std::int64_t steps = 0;
  int prefill_windows = 0;
  std::int64_t context = 0;  // written as requests.<i>.context when > 0
  std::string prefix_group;  // written with prefix_tokens when not empty
  std::int64_t prefix_tokens = 0;
};

class TraceWriter {
 public:
  TraceWriter(const std::string& path, const TraceMeta& meta, std::vector<RequestShape> shapes);
  ~TraceWriter();
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  // Writes request i (requests must come in order 0, 1, ...). `topk` is [steps][layers][mtp][K],
  // `lengths` [steps], `prefill` [layers][windows][K] (empty when windows == 0).
  void write_request(std::size_t i, std::span<const std::int32_t> topk, std::span<const std::int64_t> lengths,
                     std::span<const std::int32_t> prefill);
  // Flushes and closes; throws if a request was not written or the write failed.
  void close();

 private:
  std::string path_;
  TraceMeta meta_;
  std::vector<RequestShape> shapes_;
  std::size_t next_ = 0;
  std::unique_ptr<AtomicFile> file_;  // written beside the target, renamed into place by close()
};

// Writes a whole trace held in memory (tests, small traces).
struct RequestData {
  std::string id;
  std::vector<std::int32_t> topk;     // [steps][layers][mtp][K]
  std::vector<std::int64_t> lengths;  // [steps]
  std::vector<std::int32_t> prefill;  // [layers][windows][K]
  int prefill_windows = 0;
  std::int64_t context = 0;
  std::string prefix_group;
  std::int64_t prefix_tokens = 0;
};
void write_trace(const std::string& path, const TraceMeta& meta, const std::vector<RequestData>& requests);

}  // namespace ess::trace
