// The trace writer (docs/trace-format.md): the header first, then each request's tensors in
// order, into a file written beside its target and renamed into place by close().
#include <fmt/format.h>

#include <limits>
#include <nlohmann/json.hpp>

#include "ess/core/error.h"
#include "ess/io/output_file.h"
#include "ess/trace/format.h"

namespace ess::trace {

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
  ESS_CHECK(meta.unit_tokens >= 1 && meta.unit_tokens <= (1 << 16), "{}: trace writer: unit_tokens {} is outside [1, 65536]",
            path, meta.unit_tokens);
  nlohmann::json md = nlohmann::json::object();
  for (const auto& [k, v] : meta.extra) md[k] = v;
  md["ess.format"] = kFormatName;
  md["ess.version"] = meta.unit_tokens == 1 ? "1" : "2";  // version 1 readers take ids for tokens
  md["ess.requests"] = std::to_string(shapes_.size());
  md["ess.layers"] = std::to_string(meta.layers);
  md["ess.mtp"] = std::to_string(meta.mtp);
  md["ess.topk"] = std::to_string(meta.topk);
  if (meta.unit_tokens != 1) md["ess.unit_tokens"] = std::to_string(meta.unit_tokens);
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
