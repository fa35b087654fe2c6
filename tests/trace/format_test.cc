// The trace format: C++ round trip, Python-writes / C++-reads, and every kind of bad input.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "ess/io/text.h"
#include "ess/trace/analyzer.h"
#include "ess/trace/format.h"
#include "test_util.h"

namespace ess::trace {
namespace {

using testing::expect_error;
using testing::read_bytes;
using testing::temp_path;
using testing::write_bytes;

TraceMeta small_meta() {
  TraceMeta m;
  m.layers = 2;
  m.mtp = 2;
  m.topk = 4;
  m.model = "tiny";
  m.provenance = "format_test";
  m.synthetic = true;
  m.note = "test trace";
  m.extra["user.key"] = "value";
  return m;
}

// Two requests: the first with prefill windows, the second without. Every query selects
// distinct ids below its step's length.
std::vector<RequestData> small_requests() {
  std::vector<RequestData> rs(2);
  for (int i = 0; i < 2; ++i) {
    auto& r = rs[static_cast<std::size_t>(i)];
    r.id = "req-" + std::to_string(i);
    const int steps = 3 + i;
    for (int s = 0; s < steps; ++s) {
      r.lengths.push_back(20 + s);
      for (int l = 0; l < 2; ++l) {
        for (int t = 0; t < 2; ++t) {
          for (int k = 0; k < 4; ++k) r.topk.push_back(k == 3 && t == 1 ? -1 : (s + l + t + 5 * k) % (20 + s));
        }
      }
    }
    if (i == 0) {
      r.prefill_windows = 3;
      for (int l = 0; l < 2; ++l) {
        for (int w = 0; w < 3; ++w) {
          for (int k = 0; k < 4; ++k) r.prefill.push_back(w + 4 * k + l);
        }
      }
      r.context = 18;
    }
  }
  return rs;
}

// Prefix groups: written, read back, and refused when inconsistent; the analyzer counts the
// host pages the groups share.
TEST(TraceFormat, PrefixGroupsRoundTripAndAreValidated) {
  const auto path = temp_path("groups.safetensors");
  auto rs = small_requests();
  rs.push_back(rs[1]);
  rs[2].id = "req-2";
  for (auto& r : rs) r.context = 200;  // 4 pages
  for (auto& r : rs) r.lengths.assign(r.lengths.size(), 210);
  rs[1].prefix_group = rs[2].prefix_group = "system";
  rs[1].prefix_tokens = 150;  // the group shares min(150, 130) = 130 tokens: 2 full pages
  rs[2].prefix_tokens = 130;
  write_trace(path, small_meta(), rs);
  const TraceReader r(path);
  EXPECT_EQ(r.request(0).prefix_group, "");
  EXPECT_EQ(r.request(1).prefix_group, "system");
  EXPECT_EQ(r.request(1).prefix_tokens, 150);
  AnalyzeConfig c;
  c.policies = {"lru"};
  c.recommend = false;
  c.prefetch = false;
  c.slots = {8};
  const auto a = analyze(r, c);
  ASSERT_TRUE(a.prefix_sharing.has_value());
  EXPECT_EQ(a.prefix_sharing->groups, 1);
  EXPECT_EQ(a.prefix_sharing->requests, 2);
  EXPECT_EQ(a.prefix_sharing->pages_unshared, 3 * 4);
  EXPECT_EQ(a.prefix_sharing->pages_shared, 3 * 4 - 2);
  EXPECT_EQ(to_json(a)["prefix_sharing"]["pages_shared"], 10);
  rs[2].prefix_tokens = 201;  // past its context
  testing::expect_error([&] { write_trace(temp_path("bad.safetensors"), small_meta(), rs); }, {"prefix_tokens 201"});
  rs[2].prefix_tokens = 5;
  rs[2].prefix_group.clear();
  testing::expect_error([&] { write_trace(temp_path("bad.safetensors"), small_meta(), rs); }, {"no prefix_group"});
}

TEST(TraceFormat, RoundTripsThroughTheWriterAndTheMappedReader) {
  const auto path = temp_path("t.safetensors");
  const auto rs = small_requests();
  write_trace(path, small_meta(), rs);
  const TraceReader r(path);
  EXPECT_EQ(r.meta().layers, 2);
  EXPECT_EQ(r.meta().mtp, 2);
  EXPECT_EQ(r.meta().topk, 4);
  EXPECT_EQ(r.meta().model, "tiny");
  EXPECT_TRUE(r.meta().synthetic);
  EXPECT_EQ(r.meta().note, "test trace");
  EXPECT_EQ(r.meta().extra.at("user.key"), "value");
  ASSERT_EQ(r.requests(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    const auto& v = r.request(i);
    EXPECT_EQ(v.id, rs[i].id);
    EXPECT_EQ(v.lengths, rs[i].lengths);
    EXPECT_EQ(v.steps, static_cast<std::int64_t>(rs[i].lengths.size()));
    const std::vector<std::int32_t> ids(v.topk_ids, v.topk_ids + rs[i].topk.size());
    EXPECT_EQ(ids, rs[i].topk);
    EXPECT_EQ(v.prefill_windows, rs[i].prefill_windows);
    if (v.prefill_windows > 0) {
      const std::vector<std::int32_t> pf(v.prefill_ids, v.prefill_ids + rs[i].prefill.size());
      EXPECT_EQ(pf, rs[i].prefill);
    }
    r.validate_request(i);
  }
  EXPECT_EQ(r.request(0).context, 18);  // from metadata
  EXPECT_EQ(r.request(1).context, 20);  // lengths[0]
  // step(s, layer) views the right rows.
  EXPECT_EQ(r.request(1).step(2, 1)[0], rs[1].topk[(2 * 2 + 1) * 8]);
  // The data section is 8-aligned, so the ids are read in place.
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(r.request(0).topk_ids) % 4, 0u);
}

// The Debian python3 found at configure time, when it has numpy; else false with the reason.
bool python_with_numpy(std::string& py, std::string& why) {
#ifndef ESS_SYSTEM_PYTHON3
  why = "no /usr/bin/python3 at configure time";
  return false;
#else
  py = ESS_SYSTEM_PYTHON3;
  why = py + " has no numpy (install Debian's python3-numpy)";
  return std::system((py + " -c 'import numpy' 2>/dev/null").c_str()) == 0;
#endif
}

// Python writes with numpy alone (python/ess_trace.py), C++ reads: every value equal.
TEST(TraceFormat, PythonWritesCppReads) {
  std::string py, why;
  if (!python_with_numpy(py, why)) GTEST_SKIP() << why;
  const auto trace = temp_path("py.safetensors");
  const auto raw = temp_path("py.raw");
  const std::string cmd = py + " " + ESS_SOURCE_DIR + "/tests/trace/write_python_trace.py " + ESS_SOURCE_DIR + " " +
                          trace + " " + raw;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto bytes = read_bytes(raw);
  std::vector<std::int64_t> expect(bytes.size() / 8);
  std::memcpy(expect.data(), bytes.data(), expect.size() * 8);
  const TraceReader r(trace);
  EXPECT_EQ(r.meta().model, "test-model");
  EXPECT_EQ(r.meta().note, "round trip");
  ASSERT_EQ(r.requests(), 3u);
  std::size_t at = 0;
  for (std::size_t i = 0; i < r.requests(); ++i) {
    const auto& v = r.request(i);
    EXPECT_EQ(v.id, "py-" + std::to_string(i));
    r.validate_request(i);
    const std::size_t n = static_cast<std::size_t>(v.steps) * 3 * 2 * 16;
    for (std::size_t k = 0; k < n; ++k) ASSERT_EQ(v.topk_ids[k], expect.at(at + k)) << "request " << i << " id " << k;
    at += n;
    for (std::size_t s = 0; s < v.lengths.size(); ++s) ASSERT_EQ(v.lengths[s], expect.at(at + s));
    at += v.lengths.size();
    EXPECT_EQ(v.context, v.lengths[0] - 2);
    const std::size_t m = static_cast<std::size_t>(v.prefill_windows) * 3 * 16;
    for (std::size_t k = 0; k < m; ++k) ASSERT_EQ(v.prefill_ids[k], expect.at(at + k));
    at += m;
  }
  EXPECT_EQ(at, expect.size());
}

// A trace of units written by python/ess_trace.py (the recorders' writer): the C++ reader takes its
// unit and version, and its ids against ceil(length / unit).
TEST(TraceFormat, PythonWritesATraceOfUnitsCppReadsIt) {
  std::string py, why;
  if (!python_with_numpy(py, why)) GTEST_SKIP() << why;
  const auto trace = temp_path("py_units.safetensors");
  const std::string cmd = py + " -c \"import sys; sys.path.insert(0, '" + ESS_SOURCE_DIR + "/python'); import ess_trace; " +
                          "w = ess_trace.TraceWriter(model='m', layers=1, mtp=1, topk=2, provenance='p', " +
                          "synthetic=False, unit_tokens=4); w.add_request(topk=[[[[0, 2]]], [[[2, 1]]]], " +
                          "lengths=[10, 11]); w.write('" + trace + "')\"";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const TraceReader r(trace);
  EXPECT_EQ(r.meta().version, 2);
  EXPECT_EQ(r.meta().unit_tokens, 4);
  EXPECT_EQ(r.request(0).ids_of(r.request(0).lengths[1]), 3);
  EXPECT_NO_THROW(r.validate_all());
}

// ---- bad input -------------------------------------------------------------------------------

std::vector<std::uint8_t> image(const std::string& header, const std::vector<std::uint8_t>& data) {
  std::vector<std::uint8_t> out(8 + header.size() + data.size());
  const std::uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, header.data(), header.size());
  if (!data.empty()) std::memcpy(out.data() + 8 + header.size(), data.data(), data.size());
  return out;
}

nlohmann::json good_header(int steps = 1) {
  // One request, 1 layer, mtp 1, topk 2: topk I32 [steps,1,1,2] then lengths I64 [steps].
  const auto n = static_cast<std::uint64_t>(steps);
  return {{"__metadata__",
           {{"ess.format", "ess-topk-trace"},
            {"ess.version", "1"},
            {"ess.requests", "1"},
            {"ess.layers", "1"},
            {"ess.mtp", "1"},
            {"ess.topk", "2"}}},
          {"requests.0.topk", {{"dtype", "I32"}, {"shape", {steps, 1, 1, 2}}, {"data_offsets", {0, 8 * n}}}},
          {"requests.0.lengths", {{"dtype", "I64"}, {"shape", {steps}}, {"data_offsets", {8 * n, 16 * n}}}}};
}

std::vector<std::uint8_t> good_data(std::vector<std::int32_t> ids, std::vector<std::int64_t> lengths) {
  std::vector<std::uint8_t> d(ids.size() * 4 + lengths.size() * 8);
  std::memcpy(d.data(), ids.data(), ids.size() * 4);
  std::memcpy(d.data() + ids.size() * 4, lengths.data(), lengths.size() * 8);
  return d;
}

TraceReader parse(const nlohmann::json& h, const std::vector<std::uint8_t>& data) {
  return TraceReader::from_bytes(image(h.dump(), data), "bad.safetensors");
}

TEST(TraceFormatBadInput, TheGoodImageParses) {
  const auto r = parse(good_header(), good_data({3, 4}, {10}));
  EXPECT_EQ(r.request(0).step(0, 0)[1], 4);
  r.validate_all();
}

TEST(TraceFormatBadInput, TruncatedFiles) {
  const auto path = temp_path("t.safetensors");
  write_trace(path, small_meta(), small_requests());
  auto bytes = read_bytes(path);
  ASSERT_GT(bytes.size(), 100u);
  bytes.erase(bytes.end() - 10, bytes.end());
  write_bytes(path, bytes);
  expect_error([&] { TraceReader r(path); }, {path, "tensor 'requests.1.lengths'", "file offset", "runs past the end"});
  expect_error([&] { TraceReader::from_bytes(std::vector<std::uint8_t>{1, 2, 3}, "short.bin"); },
               {"short.bin", "truncated", "offset 0"});
  expect_error([&] { TraceReader("/nonexistent/x.safetensors"); }, {"/nonexistent/x.safetensors", "does not exist"});
}

TEST(TraceFormatBadInput, HeaderLengthPastTheEnd) {
  auto img = image(good_header().dump(), good_data({3, 4}, {10}));
  const std::uint64_t huge = img.size();
  std::memcpy(img.data(), &huge, 8);
  expect_error([&] { TraceReader::from_bytes(img, "f.st"); }, {"f.st", "header length", "past the end"});
}

TEST(TraceFormatBadInput, MalformedJson) {
  auto text = good_header().dump();
  text.pop_back();  // the closing brace
  expect_error([&] { TraceReader::from_bytes(image(text, good_data({3, 4}, {10})), "f.st"); },
               {"f.st", "malformed JSON header", "byte offset"});
  expect_error([&] { TraceReader::from_bytes(image("[1,2]", {}), "f.st"); }, {"not an object"});
  // Found by the fuzzer: a number no type can hold is a JSON error too, not a crash.
  expect_error([&] { TraceReader::from_bytes(image("{\"a\": 299999999E9999999}", {}), "f.st"); },
               {"f.st", "malformed JSON header"});
}

TEST(TraceFormatBadInput, UnknownAndUnsupportedDtypes) {
  auto h = good_header();
  h["requests.0.topk"]["dtype"] = "Q32";
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"bad.safetensors", "requests.0.topk", "unknown dtype 'Q32'"});
  h = good_header();
  h["requests.0.topk"]["dtype"] = "F32";
  const auto data_start = 8 + h.dump().size();  // the data section starts after the header
  expect_error([&] { parse(h, good_data({3, 4}, {10})); },
               {"request 0", "requests.0.topk", "file offset " + std::to_string(data_start), "F32 is not supported"});
}

TEST(TraceFormatBadInput, ShapeAndLengthMismatches) {
  auto h = good_header();
  h["__metadata__"]["ess.layers"] = "2";
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"request 0", "requests.0.topk", "does not match"});
  h = good_header();
  h["requests.0.topk"]["shape"] = {1, 1, 1, 3};  // 12 bytes but offsets hold 8
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"requests.0.topk", "needs 12 bytes", "hold 8"});
  h = good_header(2);
  h["requests.0.lengths"]["shape"] = {1};
  h["requests.0.lengths"]["data_offsets"] = {16, 24};
  expect_error([&] { parse(h, good_data({3, 4, 5, 6}, {10})); }, {"requests.0.lengths", "does not match [steps=2]"});
  h = good_header();
  h["requests.0.topk"]["data_offsets"] = {8, 4};
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"reversed"});
  h = good_header();
  h["__metadata__"]["ess.requests"] = "2";
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"request 1", "'requests.1.topk' is missing"});
  expect_error([&] { parse(good_header(0), {}); }, {"request 0", "requests.0.topk", "at least one step"});
  h = good_header();
  h["requests.7.topk"] = h["requests.0.topk"];
  h["requests.7.topk"]["data_offsets"] = {16, 24};
  auto data = good_data({3, 4}, {10});
  data.resize(24, 0);
  expect_error([&] { parse(h, data); }, {"requests.7.topk", "not part of the format"});
}

TEST(TraceFormatBadInput, MetadataErrors) {
  auto h = good_header();
  h["__metadata__"].erase("ess.topk");
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"'ess.topk' is missing"});
  h = good_header();
  h["__metadata__"]["ess.version"] = "3";
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"version 3 is not supported"});
  h = good_header();
  h["__metadata__"]["ess.mtp"] = "two";
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"'ess.mtp' = 'two' is not an integer"});
  h = good_header();
  h["__metadata__"]["ess.format"] = "pytorch";
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"ess.format"});
  h = good_header();
  h["__metadata__"]["ess.layers"] = 1;
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"'ess.layers'", "not a string"});
}

TEST(TraceFormatBadInput, StringsFromTheFilePrintWithoutTheirControlCharacters) {
  auto h = good_header();
  h["__metadata__"]["ess.model"] = "m\x1b[2Jx";
  h["__metadata__"]["ess.provenance"] = "line\nnext\\";
  h["__metadata__"]["requests.0.id"] = "\x07" "bell";
  const TraceReader r = parse(h, good_data({3, 4}, {10}));
  EXPECT_EQ(r.meta().model, "m\\x1b[2Jx");
  EXPECT_EQ(r.meta().provenance, "line\\x0anext\\\\");
  EXPECT_EQ(r.request(0).id, "\\x07bell");
  // Bytes that are not UTF-8 and the C1 controls (0x9b is CSI) are escaped too; UTF-8 text stays.
  EXPECT_EQ(printable("caf\xc3\xa9 \xe2\x82\xac"), "caf\xc3\xa9 \xe2\x82\xac");
  EXPECT_EQ(printable("a\xee\x9b" "b"), "a\\xee\\x9bb");
  EXPECT_EQ(printable("\xc2\x9b" "2J"), "\\xc2\\x9b2J");
  EXPECT_EQ(printable("\xed\xa0\x80\xc0\xaf\xf4\x90\x80\x80"),
            "\\xed\\xa0\\x80\\xc0\\xaf\\xf4\\x90\\x80\\x80");
  EXPECT_EQ(printable("\xe2\x82"), "\\xe2\\x82");  // cut short
  h = good_header();
  h["__metadata__"]["ess.format"] = "\x1b]0;title\x07";
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"'\\x1b]0;title\\x07'"});
}

TEST(TraceFormatBadInput, BadLengths) {
  const auto data_start = 8 + good_header().dump().size();
  expect_error([&] { parse(good_header(), good_data({3, 4}, {0})); },
               {"request 0", "requests.0.lengths", "byte offset " + std::to_string(data_start + 8), "length 0"});
}

TEST(TraceFormatBadInput, IdsOutOfRangeOrDuplicatedWithinAQuery) {
  {
    const auto r = parse(good_header(2), good_data({3, 4, 5, 11}, {10, 11}));
    // Step 1 has length 11: id 11 is one past the end. Byte offset = header + 8 + 3 * 4.
    const auto off = 8 + good_header(2).dump().size() + 12;
    expect_error([&] { r.validate_request(0); },
                 {"bad.safetensors", "request 0", "requests.0.topk", "byte offset " + std::to_string(off), "step 1",
                  "position 1", "id 11 is out of range [0, 11)"});
  }
  {
    const auto r = parse(good_header(), good_data({-2, 4}, {10}));
    expect_error([&] { r.validate_all(); }, {"id -2 is out of range"});
  }
  {
    const auto r = parse(good_header(), good_data({4, 4}, {10}));
    expect_error([&] { r.validate_all(); }, {"request 0", "requests.0.topk", "id 4 is selected twice", "first at position 0"});
  }
  {
    // -1 padding may repeat.
    const auto r = parse(good_header(), good_data({-1, -1}, {10}));
    EXPECT_NO_THROW(r.validate_all());
  }
}

// A trace of units (ess.unit_tokens n): a step of length L selects among ceil(L / n) ids.
TEST(TraceFormatBadInput, IdsOfUnitsLieBelowTheUnitsTheLengthMakes) {
  auto units = [](const std::string& n) {
    nlohmann::json h = good_header();
    h["__metadata__"]["ess.version"] = "2";
    h["__metadata__"]["ess.unit_tokens"] = n;
    return h;
  };
  {
    // Length 300 in blocks of 128: ids 0, 1, 2 (the third block partial).
    const auto r = parse(units("128"), good_data({0, 2}, {300}));
    EXPECT_EQ(r.meta().unit_tokens, 128);
    EXPECT_EQ(r.request(0).unit_tokens, 128);
    EXPECT_EQ(r.request(0).ids_of(300), 3);
    EXPECT_NO_THROW(r.validate_all());
    EXPECT_TRUE(r.meta().extra.empty());  // a known key, not kept as extra metadata
  }
  {
    const auto r = parse(units("128"), good_data({0, 3}, {300}));
    expect_error([&] { r.validate_all(); }, {"id 3 is out of range [0, 3)", "ids of 128 tokens over a length of 300"});
  }
  expect_error([&] { parse(units("0"), good_data({0, 1}, {10})); }, {"ess.unit_tokens"});
  expect_error([&] { parse(units("four"), good_data({0, 1}, {10})); }, {"ess.unit_tokens"});
  EXPECT_EQ(parse(good_header(), good_data({0, 1}, {10})).meta().unit_tokens, 1);  // absent: tokens
  nlohmann::json v1 = units("128");
  v1["__metadata__"]["ess.version"] = "1";
  expect_error([&] { parse(v1, good_data({0, 1}, {300})); }, {"'ess.unit_tokens' = 128 in a version-1 trace"});
}

TEST(TraceFormatBadInput, MisalignedTensorsAreCopiedNotMisread) {
  auto h = good_header();
  // Put the ids at data offset 2 (misaligned), after a 2-byte tensor another writer added.
  h["other"] = {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {0, 2}}};
  h["requests.0.topk"]["data_offsets"] = {2, 10};
  h["requests.0.lengths"]["data_offsets"] = {10, 18};
  const auto body = good_data({7, 9}, {12});
  std::vector<std::uint8_t> data(2 + body.size(), 0);
  std::memcpy(data.data() + 2, body.data(), body.size());
  const auto r = parse(h, data);
  EXPECT_EQ(r.request(0).step(0, 0)[0], 7);
  EXPECT_EQ(r.request(0).step(0, 0)[1], 9);
  EXPECT_EQ(r.request(0).lengths[0], 12);
}

// The tensors tile the data section exactly, as safetensors requires; each refusal names the
// tensor and its offsets.
TEST(TraceFormatBadInput, TensorsMustTileTheDataSection) {
  const auto start = 8 + good_header().dump().size();
  {  // bytes after the last tensor
    auto data = good_data({3, 4}, {10});
    data.resize(data.size() + 3, 0);
    expect_error([&] { parse(good_header(), data); },
                 {"bad.safetensors", "3 bytes at data [16, 19)", "file offset " + std::to_string(start + 16),
                  "'requests.0.lengths'", "cover the data section exactly"});
  }
  {  // a hole between the tensors
    auto h = good_header();
    h["requests.0.lengths"]["data_offsets"] = {12, 20};
    auto data = good_data({3, 4}, {10});
    data.insert(data.begin() + 8, 4, 0);
    expect_error([&] { parse(h, data); },
                 {"tensor 'requests.0.lengths'", "data [12, 20)", "hole of 4 bytes at data [8, 12)",
                  "file offset " + std::to_string(8 + h.dump().size() + 8), "after tensor 'requests.0.topk'"});
  }
  {  // a hole before the first tensor
    auto h = good_header();
    h["requests.0.topk"]["data_offsets"] = {4, 12};
    h["requests.0.lengths"]["data_offsets"] = {12, 20};
    auto data = good_data({3, 4}, {10});
    data.insert(data.begin(), 4, 0);
    expect_error([&] { parse(h, data); }, {"requests.0.topk", "hole of 4 bytes", "at the start of the data section"});
  }
  {  // two tensors over the same bytes
    auto h = good_header();
    h["extra"] = {{"dtype", "I32"}, {"shape", {2}}, {"data_offsets", {8, 16}}};
    expect_error([&] { parse(h, good_data({3, 4}, {10})); },
                 {"overlaps tensor", "data [8, 16)", "file offset " + std::to_string(8 + h.dump().size() + 8), "'extra'",
                  "'requests.0.lengths'"});
  }
  {  // a tensor inside another
    auto h = good_header();
    h["inner"] = {{"dtype", "I32"}, {"shape", {1}}, {"data_offsets", {4, 8}}};
    expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"tensor 'inner'", "data [4, 8)", "overlaps tensor 'requests.0.topk'"});
  }
  {  // empty tensors take no bytes: any number of them may sit at one offset
    auto h = good_header();
    h["empty.a"] = {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {8, 8}}};
    h["empty.b"] = {{"dtype", "I64"}, {"shape", {3, 0}}, {"data_offsets", {8, 8}}};
    EXPECT_NO_THROW(parse(h, good_data({3, 4}, {10})));
  }
}

TEST(TraceFormatBadInput, HeaderKeysGivenTwiceOrUnknown) {
  auto text = good_header().dump();
  const auto at = text.find("\"requests.0.topk\"");
  ASSERT_NE(at, std::string::npos);
  text.insert(at, "\"requests.0.topk\":{\"dtype\":\"I32\",\"shape\":[1,1,1,2],\"data_offsets\":[0,8]},");
  expect_error([&] { TraceReader::from_bytes(image(text, good_data({3, 4}, {10})), "f.st"); },
               {"f.st", "'requests.0.topk' twice"});
  auto h = good_header();
  h["requests.0.topk"]["stride"] = 4;
  expect_error([&] { parse(h, good_data({3, 4}, {10})); }, {"requests.0.topk", "unknown field 'stride'"});
}

TEST(TraceFormatBadInput, HeaderLargerThanSafetensorsTakes) {
  std::vector<std::uint8_t> img(16, 0);
  const std::uint64_t n = 100'000'001;
  std::memcpy(img.data(), &n, 8);
  img.resize(8 + n + 8, ' ');
  expect_error([&] { TraceReader::from_bytes(img, "f.st"); }, {"f.st", "header length 100000001", "limit"});
}

TEST(TraceFormatBadInput, ContextAndLengthsAgreeWithEachOtherAndTheModel) {
  auto h = good_header();
  h["__metadata__"]["requests.0.context"] = "11";
  const auto start = 8 + h.dump().size();
  expect_error([&] { parse(h, good_data({3, 4}, {10})); },
               {"request 0", "requests.0.context = 11", "length 10 of its first step", "'requests.0.lengths'",
                "file offset " + std::to_string(start + 8)});
  h["__metadata__"]["requests.0.context"] = "10";
  EXPECT_NO_THROW(parse(h, good_data({3, 4}, {10})));
  // DeepSeek-V3.2-Exp holds 163840 tokens; the trace's second step is one past that.
  h = good_header(2);
  h["__metadata__"]["ess.model"] = "deepseek-v3.2-exp";
  const auto start2 = 8 + h.dump().size();
  expect_error([&] { parse(h, good_data({3, 4, 5, 6}, {163840, 163841})); },
               {"request 0", "'requests.0.lengths'", "byte offset " + std::to_string(start2 + 16 + 8), "step 1",
                "length 163841", "max_position_embeddings (163840)", "deepseek-v3.2-exp"});
  EXPECT_NO_THROW(parse(h, good_data({3, 4, 5, 6}, {163839, 163840})));
  h["__metadata__"]["ess.model"] = "some-other-model";  // unknown: only the format's own limit
  EXPECT_NO_THROW(parse(h, good_data({3, 4, 5, 6}, {163840, 1 << 30})));
}

// A mapped trace truncated by another process between opening and reading: with the guard a
// program chooses (install_mapping_guard, as `ess` does), a clean exit 3 naming the file, not SIGBUS.
TEST(TraceFormatDeathTest, AFileThatShrinksWhileItIsReadEndsTheRunNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto path = temp_path("shrinks.safetensors");
  TraceMeta meta = small_meta();
  meta.topk = 1024;  // 2 layers x MTP 2 x 1024 ids x 4 B = 16 KB per step: the ids span pages
  RequestData r;
  r.id = "long";
  for (int s = 0; s < 32; ++s) {
    for (int k = 0; k < 2 * 2 * 1024; ++k) r.topk.push_back(k % 1024 == 0 ? 0 : -1);
    r.lengths.push_back(100 + s);
  }
  write_trace(path, meta, {r});
  EXPECT_EXIT(
      {
        install_mapping_guard();
        const TraceReader reader(path);
        std::filesystem::resize_file(path, 4096);
        reader.validate_all();
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(3), "shrinks.safetensors: the trace file shrank while it was read");
}

// The library leaves SIGBUS to its caller: reading (and writing) a trace installs no handler.
TEST(TraceFormatDeathTest, TheLibraryInstallsNoSignalHandler) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: nothing installed before
  const auto path = temp_path("no_handler.safetensors");
  EXPECT_EXIT(
      {
        struct sigaction before {};
        struct sigaction after {};
        ::sigaction(SIGBUS, nullptr, &before);
        RequestData r;
        r.id = "a";
        r.topk.assign(2 * 2 * 4, -1);
        r.lengths.push_back(5);
        write_trace(path, small_meta(), {r});
        const TraceReader reader(path);
        reader.validate_all();
        ::sigaction(SIGBUS, nullptr, &after);
        std::_Exit(after.sa_handler == before.sa_handler && after.sa_sigaction == before.sa_sigaction ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(TraceFormat, WriterRefusesWrongShapesAndOrder) {
  const auto path = temp_path("w.safetensors");
  TraceWriter w(path, small_meta(), {{"a", 2, 0, 0, {}, 0}});
  std::vector<std::int32_t> ids(2 * 2 * 2 * 4, 0);
  std::vector<std::int64_t> lengths{5, 6};
  expect_error([&] { w.write_request(1, ids, lengths, {}); }, {"out of order"});
  expect_error([&] { w.write_request(0, std::span(ids).first(3), lengths, {}); }, {"topk has 3 ids"});
  expect_error([&] { w.close(); }, {"after 0 of 1 requests"});
}

}  // namespace
}  // namespace ess::trace
