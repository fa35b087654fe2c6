// The C ABI's table of bad inputs, as a careless or hostile caller gives them: each case is a call
// that must return its status with a message containing a word (the field, tensor or handle at
// fault) and leave the fixture engine's digest unchanged. Then handles used after destroy, and
// threads on one engine: bit-exact against one thread, or refused cleanly once destroyed. Runs
// under the sanitizers too (use after free, overflow, leaks).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ess/ess_c.h"

namespace {

constexpr int kEntry = 656;
constexpr std::int64_t kR1 = 1, kShared = 3, kReleased = 5;

std::string last() { return ess_last_error(); }

// A DLTensor with its own shape and strides (and, unless given, its own zeroed data).
struct Tensor {
  std::vector<std::int64_t> shape, strides;
  std::vector<std::uint8_t> storage;
  DLTensor t{};

  Tensor(std::vector<std::int64_t> s, std::uint8_t code, std::uint8_t bits, void* data = nullptr,
         DLDeviceType device = kDLCPU)
      : shape(std::move(s)) {
    if (data == nullptr) {
      std::int64_t n = bits / 8;
      for (std::int64_t d : shape) n *= d;
      storage.assign(static_cast<std::size_t>(n) + 16, 0);
      data = storage.data();
    }
    t.data = data;
    t.device = {device, 0};
    t.ndim = static_cast<int>(shape.size());
    t.dtype = {code, bits, 1};
    t.shape = shape.data();
  }
  Tensor& with_strides(std::vector<std::int64_t> s) {
    strides = std::move(s);
    t.strides = strides.data();
    return *this;
  }
  DLTensor* operator&() { return &t; }
  std::int32_t* i32() { return static_cast<std::int32_t*>(t.data); }
};

Tensor i32(std::vector<std::int64_t> shape) { return Tensor(std::move(shape), kDLInt, 32); }

ess_config config() {
  ess_config c;
  ess_config_init(&c);
  c.layers = 2;
  c.max_requests = 3;
  c.max_context = 128;
  c.topk = 8;
  c.slots = 16;
  c.reserve_newest = 1;
  return c;
}

ess_engine* make(const ess_config& c) {
  ess_engine* e = nullptr;
  EXPECT_EQ(ess_engine_create(&c, &e), ESS_OK) << last();
  return e;
}

// FNV-1a over everything a caller can observe of the engine.
struct Digest {
  std::uint64_t h = 1469598103934665603ull;
  template <typename T>
  void add(const T& v) {
    add_bytes(&v, sizeof v);
  }
  void add_bytes(const void* p, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<const std::uint8_t*>(p)[i]) * 1099511628211ull;
  }
};

std::uint64_t digest(ess_engine* e) {
  Digest d;
  ess_stats s;
  ess_stats_init(&s);
  EXPECT_EQ(ess_engine_get_stats(e, &s), ESS_OK) << last();
  d.add(s);
  ess_host_layout hl;
  ess_host_layout_init(&hl);
  EXPECT_EQ(ess_engine_host_layout(e, &hl), ESS_OK) << last();
  d.add(hl);
  for (std::int64_t id : {kR1, kShared}) {
    std::int32_t row = 0;
    std::int64_t length = 0, count = 0;
    EXPECT_EQ(ess_request_get(e, id, &row, &length), ESS_OK) << last();
    d.add(row);
    d.add(length);
    std::vector<std::int32_t> pages(64);
    EXPECT_EQ(ess_request_host_pages(e, id, pages.data(), 64, &count), ESS_OK) << last();
    d.add_bytes(pages.data(), static_cast<std::size_t>(count) * 4);
    for (int layer = 0; layer < 2; ++layer) {
      Tensor out({length, kEntry}, kDLUInt, 8);
      EXPECT_EQ(ess_request_read_entries(e, id, layer, 0, &out), ESS_OK) << last();
      d.add_bytes(out.storage.data(), static_cast<std::size_t>(length) * kEntry);
    }
  }
  std::vector<std::uint8_t> row(kEntry);
  for (int layer = 0; layer < 2; ++layer) {
    for (int r = 0; r < 3 * 17; ++r) {
      EXPECT_EQ(ess_engine_read_row(e, layer, r, row.data(), row.size()), ESS_OK) << last();
      d.add_bytes(row.data(), row.size());
    }
  }
  return d.h;
}

// An engine with request kR1 written, warmed up and stepped at row 0, kShared on its first page at
// row 1, kReleased admitted and released, and a bound step and write-back over row 0.
struct Fixture {
  ess_engine* e = nullptr;
  Tensor rows = i32({1}), lens = i32({1}), ids = i32({1, 8}), phys = i32({1, 8});
  ess_step_binding* step = nullptr;
  ess_write_back_binding* wb = nullptr;

  Fixture() {
    e = make(config());
    EXPECT_EQ(ess_request_admit(e, kR1, 100, 0, nullptr), ESS_OK) << last();
    std::mt19937 rng(7);
    for (int layer = 0; layer < 2; ++layer) {
      Tensor entries({100, kEntry}, kDLUInt, 8);
      for (auto& b : entries.storage) b = static_cast<std::uint8_t>(rng());
      EXPECT_EQ(ess_request_write_entries(e, kR1, layer, 0, &entries), ESS_OK) << last();
    }
    EXPECT_EQ(ess_request_admit_shared(e, kShared, 100, kR1, 64, 1, nullptr), ESS_OK) << last();
    EXPECT_EQ(ess_request_admit(e, kReleased, 10, 2, nullptr), ESS_OK) << last();
    EXPECT_EQ(ess_request_release(e, kReleased), ESS_OK) << last();
    Tensor windows = i32({2, 1, 8});
    const std::int32_t w[8] = {0, 1, 2, 3, -1, -1, -1, -1};
    for (int i = 0; i < 16; ++i) windows.i32()[i] = w[i % 8];
    EXPECT_EQ(ess_request_warmup(e, kR1, &windows), ESS_OK) << last();
    rows.i32()[0] = 0;
    lens.i32()[0] = 100;
    const std::int32_t k[8] = {1, 9, 20, 99, -1, -1, -1, -1};
    for (int i = 0; i < 8; ++i) ids.i32()[i] = k[i];
    ess_step_tensors st = tensors(&rows, &ids, &lens, &phys);
    EXPECT_EQ(ess_step_bind(e, &st, &step), ESS_OK) << last();
    EXPECT_EQ(ess_step(step, 0, -1, nullptr), ESS_OK) << last();
    EXPECT_EQ(ess_step(step, 1, -1, nullptr), ESS_OK) << last();
    EXPECT_EQ(ess_write_back_bind(e, &rows, &lens, nullptr, &wb), ESS_OK) << last();
  }
  ~Fixture() { ess_engine_destroy(e); }

  static ess_step_tensors tensors(DLTensor* r, DLTensor* t, DLTensor* l, DLTensor* p) {
    ess_step_tensors st;
    ess_step_tensors_init(&st);
    st.rows = r;
    st.topk = t;
    st.lengths = l;
    st.physical = p;
    return st;
  }
  // Binds a step over row 0 with `tokens` as its top-k and `length`, and runs layer 0.
  ess_status step_with(std::vector<std::int32_t> tokens, std::int32_t length = 100) {
    Tensor k = i32({1, 8}), l = i32({1}), p = i32({1, 8});
    for (int i = 0; i < 8; ++i) k.i32()[i] = i < static_cast<int>(tokens.size()) ? tokens[static_cast<std::size_t>(i)] : -1;
    l.i32()[0] = length;
    ess_step_tensors st = tensors(&rows, &k, &l, &p);
    ess_step_binding* b = nullptr;
    if (ess_step_bind(e, &st, &b) != ESS_OK) return ESS_ERROR_INTERNAL;
    const ess_status s = ess_step(b, 0, -1, nullptr);
    ess_step_binding_destroy(b);  // succeeds: the step's message stays this thread's last
    return s;
  }
  ess_status bind(const ess_step_tensors& st) {
    ess_step_binding* b = nullptr;
    const ess_status s = ess_step_bind(e, &st, &b);
    if (b != nullptr) ess_step_binding_destroy(b);
    return s;
  }
  ess_status create(const ess_config& c) {
    ess_engine* x = nullptr;
    const ess_status s = ess_engine_create(&c, &x);
    if (x != nullptr) ess_engine_destroy(x);
    return s;
  }
};

struct Case {
  const char* name;
  ess_status status;
  const char* word;
  std::function<ess_status(Fixture&)> call;
};

constexpr ess_status kInvalid = ESS_ERROR_INVALID_ARGUMENT;
constexpr std::int64_t kHuge = std::int64_t{1} << 40;

const std::vector<Case>& cases() {
  static const std::vector<Case> table = {
      // ---- NULL and struct_size
      {"null config", kInvalid, "ess_config is required", [](Fixture&) {
         ess_engine* x = nullptr;
         return ess_engine_create(nullptr, &x);
       }},
      {"null engine out-pointer", kInvalid, "out-pointer", [](Fixture&) {
         ess_config c = config();
         return ess_engine_create(&c, nullptr);
       }},
      {"config of another size", kInvalid, "struct_size", [](Fixture& f) {
         ess_config c = config();
         c.struct_size = 8;
         return f.create(c);
       }},
      {"null info", kInvalid, "ess_engine_info is required", [](Fixture& f) { return ess_engine_get_info(f.e, nullptr); }},
      {"stats of another size", kInvalid, "ess_stats.struct_size = 0", [](Fixture& f) {
         ess_stats s{};
         return ess_engine_get_stats(f.e, &s);
       }},
      {"step tensors of another size", kInvalid, "ess_step_tensors.struct_size", [](Fixture& f) {
         ess_step_tensors st = Fixture::tensors(&f.rows, &f.ids, &f.lens, &f.phys);
         st.struct_size += 4;
         return f.bind(st);
       }},
      {"null engine", kInvalid, "engine is NULL", [](Fixture&) { return ess_request_extend(nullptr, kR1, 1); }},
      // ---- foreign pages on an engine that hands out its own
      {"adopt on own pages", kInvalid, "hands out its own pages", [](Fixture& f) {
         const std::int32_t pages[] = {0};
         return ess_request_adopt(f.e, 40, 10, pages, 1, -1, nullptr);
       }},
      {"repage on own pages", kInvalid, "hands out its own pages", [](Fixture& f) {
         return ess_request_repage(f.e, kR1, 70, 1, nullptr, 0);
       }},
      {"adopt with null pages", kInvalid, "pages is NULL", [](Fixture& f) {
         return ess_request_adopt(f.e, 40, 10, nullptr, 1, -1, nullptr);
       }},
      {"repage with a negative count", kInvalid, "page_count = -1", [](Fixture& f) {
         const std::int32_t pages[] = {0};
         return ess_request_repage(f.e, kR1, 70, 0, pages, -1);
       }},
      {"config with foreign pages but no region", kInvalid, "needs host_memory", [](Fixture& f) {
         ess_config c = config();
         const std::int64_t first[] = {0, 8};
         c.host_pages_per_layer = 8;
         c.host_page_stride = 64 * kEntry;
         c.host_layer_first_page = first;
         return f.create(c);
       }},
      {"config with a stride but no foreign pages", kInvalid, "host_pages_per_layer is 0", [](Fixture& f) {
         ess_config c = config();
         c.host_page_stride = 64 * kEntry;
         return f.create(c);
       }},
      {"place without regions", kInvalid, "the engine has no regions", [](Fixture& f) {
         const std::int32_t blocks[] = {0};
         return ess_request_place(f.e, kR1, blocks, 1);
       }},
      {"place with null blocks", kInvalid, "blocks is NULL with count 2", [](Fixture& f) {
         return ess_request_place(f.e, kR1, nullptr, 2);
       }},
      {"config with regions but no buffers", kInvalid, "need the caller's paged buffer", [](Fixture& f) {
         ess_config c = config();
         c.region_blocks = 2;
         return f.create(c);
       }},
      {"null buffer row output", kInvalid, "out-pointer is NULL", [](Fixture& f) { return ess_engine_buffer_row(f.e, 0, 0, 0, nullptr); }},
      {"buffer row of a slot past the request's rows", kInvalid, "slot 99 outside", [](Fixture& f) {
         std::int32_t out = 0;
         return ess_engine_buffer_row(f.e, 0, 0, 99, &out);
       }},
      {"buffer row of a layer past the engine's", kInvalid, "layer 5 outside", [](Fixture& f) {
         std::int32_t out = 0;
         return ess_engine_buffer_row(f.e, 5, 0, 0, &out);
       }},
      {"region groups without regions", kInvalid, "region_group has 2 values", [](Fixture& f) {
         ess_config c = config();
         const std::int32_t groups[] = {0, 1};
         c.region_group = groups;
         return f.create(c);
       }},
      {"null step binding", kInvalid, "step binding is NULL", [](Fixture&) { return ess_step(nullptr, 0, -1, nullptr); }},
      {"null row output", kInvalid, "output is NULL", [](Fixture& f) { return ess_engine_read_row(f.e, 0, 0, nullptr, kEntry); }},
      {"null topk", kInvalid, "topk is required", [](Fixture& f) {
         return f.bind(Fixture::tensors(&f.rows, nullptr, &f.lens, &f.phys));
       }},
      {"null tensor data", kInvalid, "rows has no data", [](Fixture& f) {
         Tensor r({1}, kDLInt, 32, nullptr);
         r.t.data = nullptr;
         return f.bind(Fixture::tensors(&r, &f.ids, &f.lens, &f.phys));
       }},
      {"null shape", kInvalid, "rows has no shape", [](Fixture& f) {
         Tensor r = i32({1});
         r.t.shape = nullptr;
         return f.bind(Fixture::tensors(&r, &f.ids, &f.lens, &f.phys));
       }},
      {"null query-group bounds", kInvalid, "bounds and count are required", [](Fixture& f) {
         std::int32_t count = 0;
         return ess_query_groups(f.e, &f.rows, &f.ids, &f.lens, nullptr, &count);
       }},
      // ---- dtype, shape, rank, strides, device
      {"int64 rows", kInvalid, "rows has dtype", [](Fixture& f) {
         Tensor r({1}, kDLInt, 64);
         return f.bind(Fixture::tensors(&r, &f.ids, &f.lens, &f.phys));
       }},
      {"float topk", kInvalid, "topk has dtype", [](Fixture& f) {
         Tensor k({1, 8}, kDLFloat, 32);
         return f.bind(Fixture::tensors(&f.rows, &k, &f.lens, &f.phys));
       }},
      {"two-lane entries", kInvalid, "whole-byte scalar", [](Fixture& f) {
         Tensor x({1, 328}, kDLUInt, 8);
         x.t.dtype.lanes = 2;
         return ess_request_write_entries(f.e, kR1, 0, 0, &x);
       }},
      {"topk of the wrong shape", kInvalid, "topk has shape [1, 7]", [](Fixture& f) {
         Tensor k = i32({1, 7});
         return f.bind(Fixture::tensors(&f.rows, &k, &f.lens, &f.phys));
       }},
      {"rank 0", kInvalid, "0 dimensions", [](Fixture& f) {
         Tensor r = i32({1});
         r.t.ndim = 0;
         return f.bind(Fixture::tensors(&r, &f.ids, &f.lens, &f.phys));
       }},
      {"rank 9", kInvalid, "9 dimensions", [](Fixture& f) {
         Tensor k = i32({1, 1, 1, 1, 1, 1, 1, 1, 8});
         return f.bind(Fixture::tensors(&f.rows, &k, &f.lens, &f.phys));
       }},
      {"empty dimension", kInvalid, "dimension 0 is empty", [](Fixture& f) {
         Tensor r = i32({1});
         r.shape[0] = 0;
         return f.bind(Fixture::tensors(&r, &f.ids, &f.lens, &f.phys));
       }},
      {"negative dimension", kInvalid, "dimension 1 is empty", [](Fixture& f) {
         Tensor x({1, kEntry}, kDLUInt, 8);
         x.shape[1] = -kEntry;
         return ess_request_write_entries(f.e, kR1, 0, 0, &x);
       }},
      {"shape product overflows", kInvalid, "overflow 64 bits", [](Fixture& f) {
         Tensor x({1, kEntry}, kDLUInt, 8);
         x.shape = {kHuge, kHuge, kEntry};
         x.t.shape = x.shape.data();
         x.t.ndim = 3;
         return ess_request_write_entries(f.e, kR1, 0, 0, &x);
       }},
      {"shape product overflows to the entry size", kInvalid, "overflow 64 bits", [](Fixture& f) {
         Tensor x({1, kEntry}, kDLUInt, 8);
         x.shape = {std::int64_t{1} << 62, 4, kEntry};  // 2^64 x 656 wraps to 0 x 656
         x.t.shape = x.shape.data();
         x.t.ndim = 3;
         return ess_request_read_entries(f.e, kR1, 0, 0, &x);
       }},
      {"non-contiguous topk", kInvalid, "topk is not contiguous", [](Fixture& f) {
         Tensor k = i32({1, 16});
         k.shape = {1, 8};
         k.with_strides({16, 2});
         return f.bind(Fixture::tensors(&f.rows, &k, &f.lens, &f.phys));
       }},
      {"rows on a GPU", kInvalid, "rows is on cuda:0", [](Fixture& f) {
         Tensor r({1}, kDLInt, 32, f.rows.t.data, kDLCUDA);
         return f.bind(Fixture::tensors(&r, &f.ids, &f.lens, &f.phys));
       }},
      {"entries on another device type", kInvalid, "DLPack device type", [](Fixture& f) {
         Tensor x({1, kEntry}, kDLUInt, 8, nullptr, kDLROCM);
         return ess_request_write_entries(f.e, kR1, 0, 0, &x);
       }},
      {"latent buffer whose shape overflows", kInvalid, "overflow 64 bits", [](Fixture& f) {
         static std::vector<std::uint8_t> buf(4 * kEntry + 16);
         Tensor l({std::int64_t{1} << 60, 1 << 10, kEntry}, kDLUInt, 8, buf.data());
         const DLTensor* ptrs[] = {&l.t, &l.t};
         ess_config c = config();
         c.latent = ptrs;
         c.latent_count = 2;
         return f.create(c);
       }},
      {"latent buffer whose strides overflow", kInvalid, "overflow 64 bits", [](Fixture& f) {
         static std::vector<std::uint8_t> buf(4 * kEntry + 16);
         Tensor l({64, kEntry}, kDLUInt, 8, buf.data());
         l.with_strides({std::int64_t{1} << 60, 1});
         const DLTensor* ptrs[] = {&l.t, &l.t};
         ess_config c = config();
         c.latent = ptrs;
         c.latent_count = 2;
         return f.create(c);
       }},
      // ---- out-of-range and non-finite numbers
      {"ratio NaN", kInvalid, "ratio = nan", [](Fixture& f) {
         ess_config c = config();
         c.slots = 0;
         c.ratio = std::nan("");
         return f.create(c);
       }},
      {"ratio infinite", kInvalid, "ratio = inf", [](Fixture& f) {
         ess_config c = config();
         c.slots = 0;
         c.ratio = INFINITY;
         return f.create(c);
       }},
      {"slots whose rows exceed int32", kInvalid, "rows per request exceed int32", [](Fixture& f) {
         ess_config c = config();
         c.max_requests = 1;
         c.max_context = std::numeric_limits<std::int32_t>::max();
         c.slots = std::numeric_limits<std::int32_t>::max();
         c.host_bytes = 1 << 20;
         return f.create(c);
       }},
      {"default host pool beyond 64 bits", kInvalid, "beyond 64 bits", [](Fixture& f) {
         ess_config c = config();
         c.layers = 1024;
         c.max_requests = 1 << 21;
         c.slots = 1024;
         c.reserve_newest = 0;
         c.max_context = std::numeric_limits<std::int32_t>::max();
         return f.create(c);
       }},
      {"negative slots", kInvalid, "slots = -1", [](Fixture& f) {
         ess_config c = config();
         c.slots = -1;
         return f.create(c);
       }},
      {"reserve_newest 2", kInvalid, "reserve_newest = 2", [](Fixture& f) {
         ess_config c = config();
         c.reserve_newest = 2;
         return f.create(c);
       }},
      {"layer -1", kInvalid, "layer -1", [](Fixture& f) { return ess_step(f.step, -1, -1, nullptr); }},
      {"layer int32 max", kInvalid, "layer 2147483647", [](Fixture& f) {
         return ess_request_write_entries(f.e, kR1, std::numeric_limits<std::int32_t>::max(), 0, &f.rows);
       }},
      {"batch -2", kInvalid, "batch -2", [](Fixture& f) { return ess_step(f.step, 0, -2, nullptr); }},
      {"batch past the bound", kInvalid, "batch 2", [](Fixture& f) { return ess_write_back(f.wb, 0, 2, nullptr); }},
      {"extend by -1", kInvalid, "by -1 tokens", [](Fixture& f) { return ess_request_extend(f.e, kR1, -1); }},
      {"extend past max_context", kInvalid, "exceeds max_context", [](Fixture& f) {
         return ess_request_extend(f.e, kR1, std::numeric_limits<std::int64_t>::max());
       }},
      {"first token int64 max", kInvalid, "outside its 100 tokens", [](Fixture& f) {
         Tensor x({1, kEntry}, kDLUInt, 8);
         return ess_request_write_entries(f.e, kR1, 0, std::numeric_limits<std::int64_t>::max(), &x);
       }},
      {"negative host-pages capacity", kInvalid, "capacity = -1", [](Fixture& f) {
         std::int64_t n = 0;
         return ess_request_host_pages(f.e, kR1, nullptr, -1, &n);
       }},
      {"read a row of the wrong size", kInvalid, "entry is 656", [](Fixture& f) {
         std::vector<std::uint8_t> out(1000);
         return ess_engine_read_row(f.e, 0, 0, out.data(), out.size());
       }},
      {"lifecycle stream: ordered 2", kInvalid, "ordered = 2", [](Fixture& f) {
         return ess_engine_set_lifecycle_stream(f.e, nullptr, 2);
       }},
      {"lifecycle stream given without ordering", kInvalid, "with ordered = 0", [](Fixture& f) {
         return ess_engine_set_lifecycle_stream(f.e, reinterpret_cast<void*>(0x10), 0);
       }},
      // ---- ids: unknown, released, duplicate
      {"unknown request", kInvalid, "request 99", [](Fixture& f) { return ess_request_release(f.e, 99); }},
      {"released request", kInvalid, "request 5", [](Fixture& f) { return ess_request_extend(f.e, kReleased, 1); }},
      {"request admitted twice", kInvalid, "already", [](Fixture& f) {
         return ess_request_admit(f.e, kR1, 10, -1, nullptr);
       }},
      {"row taken", kInvalid, "row 0", [](Fixture& f) { return ess_request_admit(f.e, 7, 10, 0, nullptr); }},
      {"negative id", kInvalid, "-5 is negative", [](Fixture& f) { return ess_request_admit(f.e, -5, 10, -1, nullptr); }},
      {"warm-up refused on its second layer", kInvalid, "layer 1 window 0 position 0 selects token 500",
       [](Fixture& f) {
         Tensor w = i32({2, 1, 8});
         for (int i = 0; i < 16; ++i) w.i32()[i] = -1;
         w.i32()[0] = 50;   // layer 0: fine, would be warmed first
         w.i32()[8] = 500;  // layer 1: beyond the request's 100 tokens
         return ess_request_warmup(f.e, kR1, &w);
       }},
      {"warm-up with an id twice", kInvalid, "selects token 3 twice", [](Fixture& f) {
         Tensor w = i32({2, 1, 8});
         for (int i = 0; i < 16; ++i) w.i32()[i] = -1;
         w.i32()[8] = 3;
         w.i32()[9] = 3;
         return ess_request_warmup(f.e, kR1, &w);
       }},
      {"step id past the length", kInvalid, "selects token 100", [](Fixture& f) { return f.step_with({100}); }},
      {"step id twice", kInvalid, "twice", [](Fixture& f) { return f.step_with({4, 4}); }},
      {"step length not the request's", kInvalid, "has length 99", [](Fixture& f) { return f.step_with({1}, 99); }},
      // ---- shared prefixes and query groups
      {"shared prefix of an unknown source", kInvalid, "source of request 99", [](Fixture& f) {
         return ess_request_admit_shared(f.e, 8, 100, 99, 64, -1, nullptr);
       }},
      {"shared prefix longer than the source", kInvalid, "prefix", [](Fixture& f) {
         return ess_request_admit_shared(f.e, 8, 100, kR1, 101, -1, nullptr);
       }},
      {"write into a shared page", kInvalid, "read-only", [](Fixture& f) {
         Tensor x({1, kEntry}, kDLUInt, 8);
         return ess_request_write_entries(f.e, kShared, 0, 0, &x);
       }},
      {"publish with float tokens", kInvalid, "prompt_tokens", [](Fixture& f) {
         Tensor p({64}, kDLFloat, 32);
         return ess_request_publish(f.e, kR1, &p, nullptr);
       }},
      {"admit on a 2-D prompt", kInvalid, "prompt_tokens", [](Fixture& f) {
         Tensor p = i32({2, 64});
         return ess_request_admit_cached(f.e, 8, &p, -1, nullptr, nullptr);
       }},
      {"query groups of a wrong topk", kInvalid, "topk has shape", [](Fixture& f) {
         Tensor k = i32({1, 4});
         std::int32_t bounds[2], count = 0;
         return ess_query_groups(f.e, &f.rows, &k, &f.lens, bounds, &count);
       }},
      {"query group out of range", kInvalid, "query group [0, 2)", [](Fixture& f) {
         return ess_step_group(f.step, 0, -1, 0, 2, nullptr);
       }},
      // ---- handles: garbage, of another kind, destroyed
      {"garbage engine handle", kInvalid, "is not live", [](Fixture&) {
         return ess_request_extend(reinterpret_cast<ess_engine*>(std::uintptr_t{0x1234}), kR1, 1);
       }},
      {"a binding passed as an engine", kInvalid, "engine handle", [](Fixture& f) {
         return ess_request_extend(reinterpret_cast<ess_engine*>(f.step), kR1, 1);
       }},
      {"an engine passed as a binding", kInvalid, "step binding handle", [](Fixture& f) {
         return ess_step(reinterpret_cast<ess_step_binding*>(f.e), 0, -1, nullptr);
       }},
      {"engine used after destroy", kInvalid, "is not live", [](Fixture&) {
         ess_engine* x = make(config());
         ess_engine_destroy(x);
         ess_stats s;
         ess_stats_init(&s);
         return ess_engine_get_stats(x, &s);
       }},
      {"engine destroyed twice", kInvalid, "destroyed already", [](Fixture&) {
         ess_engine* x = make(config());
         EXPECT_EQ(ess_engine_destroy(x), ESS_OK);
         return ess_engine_destroy(x);
       }},
      {"binding of a destroyed engine", kInvalid, "or its engine was", [](Fixture& f) {
         ess_engine* x = make(config());
         ess_step_tensors st = Fixture::tensors(&f.rows, &f.ids, &f.lens, &f.phys);
         ess_step_binding* b = nullptr;
         EXPECT_EQ(ess_step_bind(x, &st, &b), ESS_OK);
         ess_engine_destroy(x);
         return ess_step(b, 0, -1, nullptr);
       }},
      {"binding destroyed twice", kInvalid, "destroyed already", [](Fixture& f) {
         ess_write_back_binding* b = nullptr;
         EXPECT_EQ(ess_write_back_bind(f.e, &f.rows, &f.lens, nullptr, &b), ESS_OK);
         EXPECT_EQ(ess_write_back_binding_destroy(b), ESS_OK);
         return ess_write_back_binding_destroy(b);
       }},
      {"binding destroyed after its engine", kInvalid, "is not live", [](Fixture& f) {
         ess_engine* x = make(config());
         ess_step_tensors st = Fixture::tensors(&f.rows, &f.ids, &f.lens, &f.phys);
         ess_step_binding* b = nullptr;
         EXPECT_EQ(ess_step_bind(x, &st, &b), ESS_OK);
         ess_engine_destroy(x);
         return ess_step_binding_destroy(b);
       }},
  };
  return table;
}

class BadInput : public ::testing::TestWithParam<std::size_t> {};

TEST_P(BadInput, IsRefusedByNameAndChangesNothing) {
  const Case& c = cases()[GetParam()];
  Fixture f;
  const std::uint64_t before = digest(f.e);
  const ess_status s = c.call(f);
  const std::string message = last();
  EXPECT_EQ(s, c.status) << c.name << ": " << message;
  EXPECT_NE(message.find(c.word), std::string::npos) << c.name << ": '" << message << "' lacks '" << c.word << "'";
  EXPECT_EQ(digest(f.e), before) << c.name << ": a refused call changed the engine";
}

INSTANTIATE_TEST_SUITE_P(Table, BadInput, ::testing::Range<std::size_t>(0, cases().size()),
                         [](const ::testing::TestParamInfo<std::size_t>& i) {
                           std::string n = cases()[i.param].name;
                           for (char& ch : n) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return n;
                         });

TEST(BadInput, TheFixtureIsNotTrivial) {
  Fixture f;
  ess_stats s;
  ess_stats_init(&s);
  ASSERT_EQ(ess_engine_get_stats(f.e, &s), ESS_OK);
  EXPECT_EQ(s.steps, 2);
  EXPECT_GT(s.warmup_fills, 0);
  EXPECT_GT(s.host_bytes_shared, 0u);
  EXPECT_EQ(ess_engine_destroy(nullptr), ESS_OK);
}

// ---- threads ----
// Steps long enough (K = 512 ids, most of them misses) that two threads' calls overlap.
constexpr int kContext = 4096, kTopK = 512;

// `steps` decode steps of the request at `row` over both layers with random top-k from `seed`.
std::vector<std::int32_t> decode(ess_engine* e, std::int32_t row, unsigned seed, int steps) {
  Tensor rows = i32({1}), lens = i32({1}), ids = i32({1, kTopK}), phys = i32({1, kTopK});
  rows.i32()[0] = row;
  lens.i32()[0] = kContext;
  ess_step_tensors st = Fixture::tensors(&rows, &ids, &lens, &phys);
  ess_step_binding* b = nullptr;
  EXPECT_EQ(ess_step_bind(e, &st, &b), ESS_OK) << last();
  std::mt19937 rng(seed);
  std::vector<std::int32_t> out;
  std::vector<std::int32_t> all(kContext);
  for (int i = 0; i < kContext; ++i) all[static_cast<std::size_t>(i)] = i;
  for (int s = 0; s < steps; ++s) {
    for (int layer = 0; layer < 2; ++layer) {
      std::shuffle(all.begin(), all.end(), rng);
      for (int k = 0; k < kTopK; ++k) ids.i32()[k] = all[static_cast<std::size_t>(k)];
      EXPECT_EQ(ess_step(b, layer, -1, nullptr), ESS_OK) << last();
      out.insert(out.end(), phys.i32(), phys.i32() + kTopK);
    }
  }
  ess_step_binding_destroy(b);
  return out;
}

ess_engine* two_requests() {
  ess_config c = config();
  c.reserve_newest = 0;
  c.max_context = kContext;
  c.topk = kTopK;
  c.slots = 2 * kTopK;
  ess_engine* e = make(c);
  for (std::int32_t row = 0; row < 2; ++row) {
    EXPECT_EQ(ess_request_admit(e, 10 + row, kContext, row, nullptr), ESS_OK) << last();
  }
  return e;
}

TEST(Threads, TwoThreadsOnOneEngineAreBitExact) {
  ess_engine* serial = two_requests();
  const auto a = decode(serial, 0, 1, 100), b = decode(serial, 1, 2, 100);
  ess_engine* shared = two_requests();
  std::vector<std::int32_t> ta, tb;
  std::thread t1([&] { ta = decode(shared, 0, 1, 100); });
  std::thread t2([&] { tb = decode(shared, 1, 2, 100); });
  t1.join();
  t2.join();
  EXPECT_EQ(a, ta);
  EXPECT_EQ(b, tb);
  ess_stats s1, s2;
  ess_stats_init(&s1);
  ess_stats_init(&s2);
  ASSERT_EQ(ess_engine_get_stats(serial, &s1), ESS_OK);
  ASSERT_EQ(ess_engine_get_stats(shared, &s2), ESS_OK);
  EXPECT_EQ(s1.hits, s2.hits);
  EXPECT_EQ(s1.misses, s2.misses);
  EXPECT_EQ(s1.steps, s2.steps);
  ess_engine_destroy(serial);
  ess_engine_destroy(shared);
}

TEST(Threads, DestroyWhileOtherThreadsCallIsRefusedCleanly) {
  ess_engine* e = two_requests();
  Tensor rows = i32({1}), lens = i32({1}), ids = i32({1, kTopK}), phys = i32({1, kTopK});
  lens.i32()[0] = kContext;
  for (int k = 0; k < kTopK; ++k) ids.i32()[k] = k;
  ess_step_tensors st = Fixture::tensors(&rows, &ids, &lens, &phys);
  ess_step_binding* b = nullptr;
  ASSERT_EQ(ess_step_bind(e, &st, &b), ESS_OK) << last();
  std::atomic<int> calls{0};
  std::atomic<bool> wrong{false};
  auto worker = [&] {
    for (;;) {
      ess_stats s;
      ess_stats_init(&s);
      const ess_status a = ess_step(b, 0, -1, nullptr);
      const ess_status c = ess_engine_get_stats(e, &s);
      ++calls;
      if (a != ESS_OK || c != ESS_OK) {
        wrong = wrong || (a != ESS_OK && a != ESS_ERROR_INVALID_ARGUMENT) ||
                (c != ESS_OK && c != ESS_ERROR_INVALID_ARGUMENT) ||
                std::string(ess_last_error()).find("not live") == std::string::npos;
        return;
      }
    }
  };
  std::thread t1(worker), t2(worker);
  while (calls < 50) std::this_thread::yield();
  EXPECT_EQ(ess_engine_destroy(e), ESS_OK);
  t1.join();
  t2.join();
  EXPECT_FALSE(wrong);
  EXPECT_EQ(ess_step(b, 0, -1, nullptr), ESS_ERROR_INVALID_ARGUMENT);
}

}  // namespace
