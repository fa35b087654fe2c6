// The C ABI as a C++ program sees it (linked against libess.so alone): statuses and messages,
// struct versions, the devices a tensor may live on, paged engine buffers, bindings that die
// with their engine, and the planner. Runs under the sanitizers too (leaks, use after free).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <functional>
#include <thread>
#include <string>
#include <vector>

#include "ess/ess_c.h"

namespace {

constexpr int kEntry = 656;

DLTensor tensor(void* data, std::vector<std::int64_t>& shape, std::uint8_t code, std::uint8_t bits,
                DLDeviceType device = kDLCPU) {
  DLTensor t{};
  t.data = data;
  t.device = {device, 0};
  t.ndim = static_cast<int>(shape.size());
  t.dtype = {code, bits, 1};
  t.shape = shape.data();
  return t;
}

ess_config small_config() {
  ess_config c;
  ess_config_init(&c);
  c.layers = 2;
  c.max_requests = 2;
  c.max_context = 128;
  c.topk = 8;
  c.slots = 16;
  return c;
}

std::string last() { return ess_last_error(); }

// The tensors a step binds: rows, top-k ids, lengths and the physical slots it writes.
ess_step_tensors step_tensors(DLTensor* rows, DLTensor* topk, DLTensor* lengths, DLTensor* physical) {
  ess_step_tensors st;
  ess_step_tensors_init(&st);
  st.rows = rows;
  st.topk = topk;
  st.lengths = lengths;
  st.physical = physical;
  return st;
}

TEST(CApi, StatusesNameTheProblem) {
  ess_config c = small_config();
  ess_engine* e = reinterpret_cast<ess_engine*>(1);
  c.policy = 7;
  EXPECT_EQ(ess_engine_create(&c, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(e, nullptr);
  EXPECT_NE(last().find("policy = 7"), std::string::npos) << last();
  c = small_config();
  c.struct_size -= 2;  // no layout of any header
  EXPECT_EQ(ess_engine_create(&c, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("struct_size"), std::string::npos) << last();
  c = small_config();
  c.model_json = "{not json";
  EXPECT_EQ(ess_engine_create(&c, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("model_json is not JSON"), std::string::npos) << last();
  c = small_config();
  c.backend = ESS_BACKEND_CUDA;
  c.device = 99;
  EXPECT_EQ(ess_engine_create(&c, &e), ESS_ERROR_UNAVAILABLE);
  EXPECT_NE(last().find(ess_cuda_built() ? "no CUDA device 99" : "without the CUDA backend"), std::string::npos)
      << last();
  EXPECT_STREQ(ess_status_name(ESS_ERROR_UNAVAILABLE), "ESS_ERROR_UNAVAILABLE");
  EXPECT_EQ(ess_engine_create(nullptr, &e), ESS_ERROR_INVALID_ARGUMENT);
  ess_engine_destroy(nullptr);
}

TEST(CApi, PagedEngineBuffersAndBindingsThatDieWithTheEngine) {
  // [blocks 4, block_rows 8, E]: 32 rows = 2 requests x 16 slots, placed by block.
  std::vector<std::vector<std::uint8_t>> storage(2, std::vector<std::uint8_t>(4 * 8 * kEntry + 16));
  std::vector<std::int64_t> shape = {4, 8, kEntry};
  std::vector<DLTensor> layers;
  for (auto& s : storage) layers.push_back(tensor(s.data(), shape, kDLUInt, 8));
  const DLTensor* ptrs[] = {&layers[0], &layers[1]};
  ess_config c = small_config();
  c.latent = ptrs;
  c.latent_count = 2;
  ess_engine* e = nullptr;
  ASSERT_EQ(ess_engine_create(&c, &e), ESS_OK) << last();
  ess_engine_info info;
  ess_engine_info_init(&info);
  ASSERT_EQ(ess_engine_get_info(e, &info), ESS_OK);
  EXPECT_EQ(info.block_rows, 8);
  EXPECT_EQ(info.block_stride, 8u * kEntry);
  void* base = nullptr;
  ASSERT_EQ(ess_engine_layer_data(e, 1, &base), ESS_OK);
  EXPECT_EQ(base, storage[1].data());
  std::uint64_t device_bytes = 1;
  ASSERT_EQ(ess_engine_device_bytes(e, &device_bytes), ESS_OK) << last();
  EXPECT_EQ(device_bytes, 0u);  // the CPU backend
  EXPECT_EQ(ess_engine_device_bytes(e, nullptr), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("bytes out-pointer is NULL"), std::string::npos) << last();

  std::int32_t row = -1;
  ASSERT_EQ(ess_request_admit(e, 3, 100, -1, &row), ESS_OK);
  std::vector<std::uint8_t> entry(kEntry, 0xAB);
  std::vector<std::int64_t> one = {1, kEntry};
  DLTensor entry_t = tensor(entry.data(), one, kDLUInt, 8);
  ASSERT_EQ(ess_request_write_entries(e, 3, 1, 42, &entry_t), ESS_OK) << last();

  std::int32_t rows[1] = {row}, lengths[1] = {100}, ids[8] = {42, -1, -1, -1, -1, -1, -1, -1}, phys[8];
  std::vector<std::int64_t> b = {1}, btk = {1, 8};
  DLTensor rows_t = tensor(rows, b, kDLInt, 32), len_t = tensor(lengths, b, kDLInt, 32);
  DLTensor ids_t = tensor(ids, btk, kDLInt, 32), phys_t = tensor(phys, btk, kDLInt, 32);
  ess_step_tensors st = step_tensors(&rows_t, &ids_t, &len_t, &phys_t);
  ess_step_binding* binding = nullptr;
  ASSERT_EQ(ess_step_bind(e, &st, &binding), ESS_OK) << last();
  ASSERT_EQ(ess_step(binding, 1, -1, nullptr), ESS_OK) << last();
  // Slot 0 of row `row`: physical row row x 16, in block row x 2, at block offset 0.
  EXPECT_EQ(phys[0], row * 16);
  EXPECT_EQ(phys[1], -1);
  const std::size_t at = static_cast<std::size_t>(phys[0] / 8) * 8 * kEntry + static_cast<std::size_t>(phys[0] % 8) * kEntry;
  EXPECT_EQ(storage[1][at], 0xAB);
  EXPECT_EQ(storage[1][at + kEntry - 1], 0xAB);

  // A tensor on a device the CPU backend cannot read; a misaligned or too-small buffer.
  DLTensor on_gpu = tensor(rows, b, kDLInt, 32, kDLCUDA);
  st.rows = &on_gpu;
  ess_step_binding* refused = reinterpret_cast<ess_step_binding*>(1);
  EXPECT_EQ(ess_step_bind(e, &st, &refused), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(refused, nullptr);
  EXPECT_NE(last().find("rows is on cuda:0; the CPU backend needs host memory"), std::string::npos) << last();
  ess_write_back_binding* wb = nullptr;
  EXPECT_EQ(ess_write_back_bind(e, &rows_t, &len_t, nullptr, &wb), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("reserve_newest is off"), std::string::npos) << last();
  std::int32_t src[1] = {0};
  DLTensor src_t = tensor(src, b, kDLInt, 32);
  ASSERT_EQ(ess_write_back_bind(e, &rows_t, &len_t, &src_t, &wb), ESS_OK) << last();
  // The engine goes first: its bindings go with it (no leak, no double free under ASan).
  ess_engine_destroy(e);

  ess_config bad = small_config();
  std::vector<std::int64_t> small_shape = {3, 8, kEntry};
  DLTensor small_t = tensor(storage[0].data(), small_shape, kDLUInt, 8);
  const DLTensor* small_ptrs[] = {&small_t, &small_t};
  bad.latent = small_ptrs;
  bad.latent_count = 2;
  EXPECT_EQ(ess_engine_create(&bad, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("holds 24 rows; 2 requests x 16 rows per request need 32"), std::string::npos) << last();
  DLTensor odd = tensor(storage[0].data() + 1, shape, kDLUInt, 8);
  const DLTensor* odd_ptrs[] = {&odd, &odd};
  bad.latent = odd_ptrs;
  EXPECT_EQ(ess_engine_create(&bad, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("not 16-byte aligned"), std::string::npos) << last();
}

// A buffer in two parts through the ABI: blocks of 8 rows, each block its 8 heads of 640 bytes then
// their 8 tails of 16 (strided views of one allocation per layer, as a C4 page is viewed); the
// step's row holds the entry's head and tail exactly there; the info reports the tail's layout;
// a tail tensor of the wrong width or without its sizes is refused by name.
TEST(CApi, ABufferInTwoPartsTakesHeadsAndTailsAtTheirPlaces) {
  constexpr int kHead = 640, kTail = kEntry - kHead, kBlock = 8 * kEntry;
  std::vector<std::vector<std::uint8_t>> storage(2, std::vector<std::uint8_t>(4 * kBlock + 16));
  std::vector<std::int64_t> head_shape = {4, 8, kHead}, tail_shape = {4, 8, kTail};
  std::vector<std::int64_t> head_strides = {kBlock, kHead, 1}, tail_strides = {kBlock, kTail, 1};
  std::vector<DLTensor> heads, tails;
  for (auto& s : storage) {
    heads.push_back(tensor(s.data(), head_shape, kDLUInt, 8));
    heads.back().strides = head_strides.data();
    tails.push_back(tensor(s.data() + 8 * kHead, tail_shape, kDLUInt, 8));
    tails.back().strides = tail_strides.data();
  }
  const DLTensor* head_ptrs[] = {&heads[0], &heads[1]};
  const DLTensor* tail_ptrs[] = {&tails[0], &tails[1]};
  ess_config c = small_config();
  c.latent = head_ptrs;
  c.latent_count = 2;
  c.latent_tail = tail_ptrs;
  c.latent_tail_count = 2;
  c.split_bytes = kHead;
  c.tail_bytes = kTail;
  ess_engine* e = nullptr;
  ASSERT_EQ(ess_engine_create(&c, &e), ESS_OK) << last();
  ess_engine_info info;
  ess_engine_info_init(&info);
  ASSERT_EQ(ess_engine_get_info(e, &info), ESS_OK);
  EXPECT_EQ(info.split_bytes, kHead);
  EXPECT_EQ(info.tail_bytes, kTail);
  EXPECT_EQ(info.row_stride, static_cast<std::uint64_t>(kHead));
  EXPECT_EQ(info.tail_row_stride, static_cast<std::uint64_t>(kTail));
  EXPECT_EQ(info.tail_block_rows, 8);
  EXPECT_EQ(info.tail_block_stride, static_cast<std::uint64_t>(kBlock));

  std::int32_t row = -1;
  ASSERT_EQ(ess_request_admit(e, 3, 100, -1, &row), ESS_OK);
  std::vector<std::uint8_t> entry(kEntry);
  for (int i = 0; i < kEntry; ++i) entry[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i * 7 + 1);
  std::vector<std::int64_t> one = {1, kEntry};
  DLTensor entry_t = tensor(entry.data(), one, kDLUInt, 8);
  ASSERT_EQ(ess_request_write_entries(e, 3, 1, 42, &entry_t), ESS_OK) << last();
  std::int32_t rows[1] = {row}, lengths[1] = {100}, ids[8] = {42, -1, -1, -1, -1, -1, -1, -1}, phys[8];
  std::vector<std::int64_t> b = {1}, btk = {1, 8};
  DLTensor rows_t = tensor(rows, b, kDLInt, 32), len_t = tensor(lengths, b, kDLInt, 32);
  DLTensor ids_t = tensor(ids, btk, kDLInt, 32), phys_t = tensor(phys, btk, kDLInt, 32);
  ess_step_tensors st = step_tensors(&rows_t, &ids_t, &len_t, &phys_t);
  ess_step_binding* binding = nullptr;
  ASSERT_EQ(ess_step_bind(e, &st, &binding), ESS_OK) << last();
  ASSERT_EQ(ess_step(binding, 1, -1, nullptr), ESS_OK) << last();
  const std::size_t block = static_cast<std::size_t>(phys[0] / 8) * kBlock, r = static_cast<std::size_t>(phys[0] % 8);
  EXPECT_EQ(0, std::memcmp(storage[1].data() + block + r * kHead, entry.data(), kHead));
  EXPECT_EQ(0, std::memcmp(storage[1].data() + block + 8 * kHead + r * kTail, entry.data() + kHead, kTail));

  // A caller built before buffers in two parts: its ess_engine_info ends there and is filled up to it.
  std::vector<std::uint8_t> old_info(sizeof(ess_engine_info), 0xEE);
  ess_engine_info* early = reinterpret_cast<ess_engine_info*>(old_info.data());
  early->struct_size = static_cast<std::uint32_t>(offsetof(ess_engine_info, split_bytes));
  ASSERT_EQ(ess_engine_get_info(e, early), ESS_OK) << last();
  EXPECT_EQ(early->row_stride, static_cast<std::uint64_t>(kHead));
  EXPECT_EQ(old_info[offsetof(ess_engine_info, split_bytes)], 0xEE) << "wrote past the caller's struct";
  early->struct_size = 12;
  EXPECT_EQ(ess_engine_get_info(e, early), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("ess_engine_info.struct_size = 12"), std::string::npos) << last();
  ess_engine_destroy(e);

  ess_config bad = c;
  bad.tail_bytes = 8;  // the tensors' last dimension spans 16
  EXPECT_EQ(ess_engine_create(&bad, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("latent tail buffer of layer 0 has shape [4, 8, 16]"), std::string::npos) << last();
  bad = c;
  bad.split_bytes = 0;
  EXPECT_EQ(ess_engine_create(&bad, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("split_bytes = 0"), std::string::npos) << last();
  bad = c;
  bad.latent_tail_count = 1;
  EXPECT_EQ(ess_engine_create(&bad, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("1 latent tail buffers for 2 layers"), std::string::npos) << last();
  bad = c;
  bad.latent = nullptr;
  bad.latent_count = 0;
  EXPECT_EQ(ess_engine_create(&bad, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("latent_tail needs the head buffers"), std::string::npos) << last();
}

// MTP 2, top-k 4, 5 slots: a step of 7 distinct ids runs in two query groups.
TEST(CApi, QueryGroupsServeAStepLargerThanThePool) {
  ess_config c = small_config();
  c.query_tokens = 2;
  c.topk = 4;
  c.slots = 5;
  ess_engine* e = nullptr;
  ASSERT_EQ(ess_engine_create(&c, &e), ESS_OK) << last();
  std::int32_t row = -1;
  ASSERT_EQ(ess_request_admit(e, 1, 50, -1, &row), ESS_OK) << last();
  std::int32_t rows[1] = {row}, lengths[1] = {50}, ids[8] = {0, 1, 2, 3, 3, 4, 5, 6}, phys[8];
  std::vector<std::int64_t> b = {1}, btk = {1, 2, 4};
  DLTensor rows_t = tensor(rows, b, kDLInt, 32), len_t = tensor(lengths, b, kDLInt, 32);
  DLTensor ids_t = tensor(ids, btk, kDLInt, 32), phys_t = tensor(phys, btk, kDLInt, 32);
  std::int32_t bounds[3] = {-7, -7, -7}, count = -7;
  ASSERT_EQ(ess_query_groups(e, &rows_t, &ids_t, &len_t, bounds, &count), ESS_OK) << last();
  EXPECT_EQ(count, 2);
  EXPECT_EQ(bounds[0], 0);
  EXPECT_EQ(bounds[1], 1);
  EXPECT_EQ(bounds[2], 2);
  ess_step_tensors st = step_tensors(&rows_t, &ids_t, &len_t, &phys_t);
  ess_step_binding* binding = nullptr;
  ASSERT_EQ(ess_step_bind(e, &st, &binding), ESS_OK) << last();
  EXPECT_EQ(ess_step(binding, 0, -1, nullptr), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("select 7 distinct ids, more than its 5 slots"), std::string::npos) << last();
  ASSERT_EQ(ess_step_group(binding, 0, -1, 0, 1, nullptr), ESS_OK) << last();
  EXPECT_GE(phys[0], 0);
  EXPECT_EQ(phys[4], -1);
  ASSERT_EQ(ess_step_group(binding, 0, -1, 1, 2, nullptr), ESS_OK) << last();
  EXPECT_EQ(phys[0], -1);
  EXPECT_GE(phys[7], 0);
  EXPECT_EQ(ess_step_group(binding, 0, -1, 1, 3, nullptr), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("query group [1, 3)"), std::string::npos) << last();
  EXPECT_EQ(ess_query_groups(e, &rows_t, &ids_t, &len_t, nullptr, &count), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("bounds holds T + 1 = 3 values"), std::string::npos) << last();
  ids[7] = 50;
  EXPECT_EQ(ess_query_groups(e, &rows_t, &ids_t, &len_t, bounds, &count), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("selects token 50, outside [0, 50)"), std::string::npos) << last();
  ess_engine_destroy(e);
}

TEST(CApi, SharedPromptPrefixes) {
  ess_config c = small_config();
  c.max_requests = 3;
  c.max_context = 256;
  ess_engine* e = nullptr;
  ASSERT_EQ(ess_engine_create(&c, &e), ESS_OK) << last();
  std::vector<std::int32_t> prompt(130);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(i * 3);
  std::vector<std::int64_t> n = {130};
  DLTensor prompt_t = tensor(prompt.data(), n, kDLInt, 32);
  ASSERT_EQ(ess_request_admit(e, 1, 130, -1, nullptr), ESS_OK) << last();
  std::int64_t pages = -1, reused = -1;
  ASSERT_EQ(ess_request_publish(e, 1, &prompt_t, &pages), ESS_OK) << last();
  EXPECT_EQ(pages, 2);
  std::int32_t row = -1;
  ASSERT_EQ(ess_request_admit_cached(e, 2, &prompt_t, -1, &row, &reused), ESS_OK) << last();
  EXPECT_EQ(reused, 128);
  EXPECT_GE(row, 0);
  EXPECT_EQ(ess_request_admit_shared(e, 3, 100, 9, 10, -1, nullptr), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("request 9: not admitted"), std::string::npos) << last();
  ASSERT_EQ(ess_request_admit_shared(e, 3, 100, 1, 70, -1, nullptr), ESS_OK) << last();
  ess_stats st;
  ess_stats_init(&st);
  ASSERT_EQ(ess_engine_get_stats(e, &st), ESS_OK) << last();
  EXPECT_EQ(st.requests, 3);
  EXPECT_EQ(st.host_bytes_unshared, (3u + 3u + 2u) * 2u * 64u * kEntry);
  EXPECT_EQ(st.host_bytes_shared, 2u * 2u * 64u * kEntry);  // the published pages (the third shares only the first)
  std::vector<std::int64_t> bad_shape = {1, 130};
  DLTensor bad = tensor(prompt.data(), bad_shape, kDLInt, 32);
  EXPECT_EQ(ess_request_publish(e, 1, &bad, nullptr), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("int32 [n]"), std::string::npos) << last();
  ess_engine_destroy(e);
}

// A transfer backend writes a request's pages of every layer through the host layout (one page
// index list for all layers); the engine reads exactly those bytes.
TEST(CApi, HostPagesAreWhereTheLayoutSays) {
  ess_config c = small_config();
  ess_engine* e = nullptr;
  ASSERT_EQ(ess_engine_create(&c, &e), ESS_OK) << last();
  ess_host_layout h;
  ess_host_layout_init(&h);
  ASSERT_EQ(ess_engine_host_layout(e, &h), ESS_OK) << last();
  EXPECT_EQ(h.layers, 2);
  EXPECT_EQ(h.page_tokens, 64);
  EXPECT_EQ(h.entry_bytes, static_cast<std::uint64_t>(kEntry));
  EXPECT_EQ(h.page_bytes, 64u * kEntry);
  EXPECT_EQ(h.layer_bytes, static_cast<std::uint64_t>(h.pages_per_layer) * h.page_bytes);
  ASSERT_EQ(ess_request_admit(e, 5, 10, -1, nullptr), ESS_OK) << last();   // a page below request 6's
  ASSERT_EQ(ess_request_admit(e, 6, 100, -1, nullptr), ESS_OK) << last();
  std::int64_t count = -1;
  ASSERT_EQ(ess_request_host_pages(e, 6, nullptr, 0, &count), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(count, 2);
  EXPECT_NE(last().find("request 6 has 2 pages; the output has room for 0"), std::string::npos) << last();
  std::vector<std::int32_t> pages(2, -1);
  ASSERT_EQ(ess_request_host_pages(e, 6, pages.data(), 2, &count), ESS_OK) << last();
  for (std::int32_t l = 0; l < 2; ++l) {
    void* base = nullptr;
    ASSERT_EQ(ess_engine_host_layer(e, l, &base), ESS_OK) << last();
    for (std::int64_t t = 0; t < 100; ++t) {
      auto* at = static_cast<std::uint8_t*>(base) + static_cast<std::size_t>(pages[static_cast<std::size_t>(t / 64)]) *
                                                       h.page_bytes + static_cast<std::size_t>(t % 64) * kEntry;
      std::memset(at, static_cast<int>((t * 7 + l * 3) & 0xff), kEntry);
    }
  }
  std::vector<std::uint8_t> out(100u * kEntry);
  for (std::int32_t l = 0; l < 2; ++l) {
    std::vector<std::int64_t> shape = {100, kEntry};
    DLTensor o = tensor(out.data(), shape, kDLUInt, 8);
    ASSERT_EQ(ess_request_read_entries(e, 6, l, 0, &o), ESS_OK) << last();
    for (std::int64_t t = 0; t < 100; ++t) {
      ASSERT_EQ(out[static_cast<std::size_t>(t) * kEntry + 17], static_cast<std::uint8_t>((t * 7 + l * 3) & 0xff))
          << "layer " << l << " token " << t;
    }
  }
  void* base = nullptr;
  EXPECT_EQ(ess_engine_host_layer(e, 2, &base), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("layer 2 out of [0, 2)"), std::string::npos) << last();
  EXPECT_EQ(ess_request_host_pages(e, 9, pages.data(), 2, &count), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("unknown request 9"), std::string::npos) << last();
  ess_engine_destroy(e);
}

TEST(CApi, ErrorsAreThreadLocal) {
  ess_engine* e = nullptr;
  ess_config c = small_config();
  c.slots = 1;
  ASSERT_EQ(ess_engine_create(&c, &e), ESS_ERROR_INVALID_ARGUMENT);
  const std::string mine = last();
  std::string theirs = "unset";
  std::thread([&] { theirs = ess_last_error(); }).join();
  EXPECT_EQ(theirs, "");
  EXPECT_EQ(last(), mine);
}

TEST(CApi, PlanIsEssPlan) {
  char* out = nullptr;
  ASSERT_EQ(ess_plan(R"({"hardware": "h200", "contexts": [32768], "min_otps": 15})", &out), ESS_OK) << last();
  const std::string json = out;
  ess_string_free(out);
  EXPECT_NE(json.find("\"plans\""), std::string::npos);
  EXPECT_NE(json.find("32768"), std::string::npos);
  EXPECT_EQ(ess_plan(R"({"contexts": "many"})", &out), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  EXPECT_NE(last().find("contexts"), std::string::npos) << last();
  EXPECT_EQ(ess_plan("[1, 2]", &out), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("must be a JSON object"), std::string::npos) << last();
  EXPECT_EQ(ess_plan(R"({"batch_step": 0})", &out), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("batch_step = 0"), std::string::npos) << last();
}

}  // namespace

namespace {

// A 4 KiB-aligned region of `bytes` inside `storage`.
std::uint8_t* aligned_region(std::vector<std::uint8_t>& storage) {
  auto* p = storage.data();
  return p + (4096 - reinterpret_cast<std::uintptr_t>(p) % 4096) % 4096;
}

}  // namespace

TEST(CApi, TheHostPoolInTheCallersMemory) {
  const std::size_t bytes = 2u << 20;
  std::vector<std::uint8_t> storage(bytes + 4096, 0xAB);
  std::uint8_t* region = aligned_region(storage);
  ess_config c = small_config();
  c.host_bytes = bytes;
  c.host_memory = region;
  c.host_memory_bytes = bytes;
  ess_engine* e = nullptr;
  ASSERT_EQ(ess_engine_create(&c, &e), ESS_OK) << last();
  void* layer1 = nullptr;
  ASSERT_EQ(ess_engine_host_layer(e, 1, &layer1), ESS_OK) << last();
  EXPECT_GE(static_cast<std::uint8_t*>(layer1), region);
  EXPECT_LT(static_cast<std::uint8_t*>(layer1), region + bytes);
  // A second engine on the same region, with the same calls, gives the request the same pages, so what one
  // writes the other reads.
  ess_engine* reader = nullptr;
  ASSERT_EQ(ess_engine_create(&c, &reader), ESS_OK) << last();
  int32_t row = -1;
  ASSERT_EQ(ess_request_admit(e, 7, 100, -1, &row), ESS_OK) << last();
  ASSERT_EQ(ess_request_admit(reader, 7, 100, -1, &row), ESS_OK) << last();
  std::vector<std::uint8_t> entries(100 * kEntry);
  for (std::size_t i = 0; i < entries.size(); ++i) entries[i] = static_cast<std::uint8_t>(i * 7 + 3);
  std::vector<std::int64_t> shape = {100, kEntry};
  DLTensor in = tensor(entries.data(), shape, kDLUInt, 8);
  ASSERT_EQ(ess_request_write_entries(e, 7, 1, 0, &in), ESS_OK) << last();
  std::vector<std::uint8_t> back(entries.size());
  DLTensor out = tensor(back.data(), shape, kDLUInt, 8);
  ASSERT_EQ(ess_request_read_entries(reader, 7, 1, 0, &out), ESS_OK) << last();
  EXPECT_EQ(back, entries);
  ess_engine_destroy(reader);
  ess_engine_destroy(e);
  // Refused by name, nothing created: a misaligned or short region, a flag that is not 0 or 1, sizes without one.
  ess_config bad = c;
  bad.host_memory = region + 8;
  EXPECT_EQ(ess_engine_create(&bad, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("is not 4 KiB-aligned"), std::string::npos) << last();
  bad = c;
  bad.host_memory_bytes = 4096;
  EXPECT_NE(ess_engine_create(&bad, &e), ESS_OK);
  EXPECT_NE(last().find("host"), std::string::npos) << last();
  bad = c;
  bad.host_memory_pinned = 2;
  EXPECT_EQ(ess_engine_create(&bad, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("host_memory_pinned = 2"), std::string::npos) << last();
  bad = small_config();
  bad.host_memory_bytes = bytes;
  EXPECT_EQ(ess_engine_create(&bad, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("host_memory is NULL"), std::string::npos) << last();
  EXPECT_EQ(e, nullptr);
}

TEST(CApi, AConfigOfAnEarlierHeaderGetsTheDefaultsOfTheFieldsItLacks) {
  // A caller built before the host memory fields (and before foreign pages): its struct ends there, and
  // whatever lies past it in its memory is not read.
  for (const std::size_t size :
       {offsetof(ess_config, host_memory), offsetof(ess_config, host_pages_per_layer), offsetof(ess_config, residency),
        offsetof(ess_config, latent_tail), offsetof(ess_config, region_blocks)}) {
    std::vector<std::uint8_t> memory(sizeof(ess_config), 0xEE);
    ess_config c = small_config();
    c.struct_size = static_cast<std::uint32_t>(size);
    std::memcpy(memory.data(), &c, size);
    ess_engine* e = nullptr;
    ASSERT_EQ(ess_engine_create(reinterpret_cast<const ess_config*>(memory.data()), &e), ESS_OK) << size << ": " << last();
    int32_t row = -1;
    EXPECT_EQ(ess_request_admit(e, 1, 100, -1, &row), ESS_OK) << last();
    ess_engine_destroy(e);
  }
}

// Residency through the C ABI: a whole request's rows (its own first, then those it borrows), its
// steps counted whole with no swap; an adaptive admission that finds no free row demotes it; the
// statistics for the earlier ess_stats layout too; bad values refused by name.
TEST(CApi, ResidencyRowsAndStatistics) {
  ess_config c = small_config();
  c.max_requests = 4;
  c.reserve_newest = 1;
  c.residency = ESS_RESIDENCY_ADAPTIVE;
  c.whole_headroom = 0;
  ess_engine* e = nullptr;
  ASSERT_EQ(ess_engine_create(&c, &e), ESS_OK) << last();
  int32_t row = -1;
  ASSERT_EQ(ess_request_admit(e, 7, 40, -1, &row), ESS_OK) << last();  // 3 rows of 16
  int32_t whole = 0, count = 0;
  int32_t rows[4] = {-1, -1, -1, -1};
  ASSERT_EQ(ess_request_residency(e, 7, &whole, rows, 4, &count), ESS_OK) << last();
  EXPECT_EQ(whole, 1);
  ASSERT_EQ(count, 3);
  EXPECT_EQ(rows[0], row);
  EXPECT_EQ(ess_request_residency(e, 7, &whole, rows, 2, &count), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("takes 3 pool rows; the output has room for 2"), std::string::npos) << last();
  EXPECT_EQ(count, 3);
  EXPECT_EQ(ess_request_residency(e, 8, &whole, rows, 4, &count), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("request 8: not admitted"), std::string::npos) << last();
  // Two more requests: the second finds no free row and demotes request 7.
  ASSERT_EQ(ess_request_admit(e, 8, 10, -1, nullptr), ESS_OK) << last();
  ASSERT_EQ(ess_request_admit(e, 9, 10, -1, nullptr), ESS_OK) << last();
  ASSERT_EQ(ess_request_admit(e, 10, 10, -1, nullptr), ESS_OK) << last();
  ASSERT_EQ(ess_request_residency(e, 7, &whole, rows, 4, &count), ESS_OK) << last();
  EXPECT_EQ(whole, 0);
  EXPECT_EQ(count, 1);
  ess_stats st;
  ess_stats_init(&st);
  ASSERT_EQ(ess_engine_get_stats(e, &st), ESS_OK) << last();
  EXPECT_EQ(st.demotions, 1);
  EXPECT_EQ(st.whole_requests, 3);  // 8, 9 and 10 fit one row each
  // A caller of the layout before residency gets its fields and nothing past them.
  std::vector<std::uint8_t> memory(sizeof(ess_stats), 0xEE);
  ess_stats old;
  ess_stats_init(&old);
  old.struct_size = static_cast<std::uint32_t>(offsetof(ess_stats, whole_requests));
  std::memcpy(memory.data(), &old, old.struct_size);
  ASSERT_EQ(ess_engine_get_stats(e, reinterpret_cast<ess_stats*>(memory.data())), ESS_OK) << last();
  EXPECT_EQ(memory[offsetof(ess_stats, whole_requests)], 0xEE);
  EXPECT_EQ(reinterpret_cast<ess_stats*>(memory.data())->requests, 4);
  ess_engine_destroy(e);

  c.residency = 3;
  EXPECT_EQ(ess_engine_create(&c, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("residency = 3"), std::string::npos) << last();
  c.residency = ESS_RESIDENCY_WHOLE;
  c.reserve_newest = 0;
  EXPECT_EQ(ess_engine_create(&c, &e), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("residency whole needs reserve_newest"), std::string::npos) << last();
}

// Another engine's host block pool (say vLLM's): padded pages, the layers' regions out of order. ESS reads
// the entries where that engine's block table puts them and never writes its region; what it cannot do
// there is refused by name.
TEST(CApi, ForeignPagesAreTheOtherEnginesBlocks) {
  const std::size_t stride = 64 * kEntry + 512, G = 6;
  const std::int64_t first[] = {static_cast<std::int64_t>(G) + 1, 0};  // layer 0 after layer 1, one page apart
  const std::size_t bytes = (2 * G + 1) * stride;
  std::vector<std::uint8_t> storage(bytes + 2 * 4096);
  std::uint8_t* region = aligned_region(storage);
  for (std::size_t i = 0; i < bytes; ++i) region[i] = static_cast<std::uint8_t>(i * 31 + 7);
  const std::vector<std::uint8_t> before(region, region + bytes);
  ess_config c = small_config();
  c.max_context = 256;
  c.reserve_newest = 1;
  c.host_memory = region;
  c.host_memory_bytes = (bytes + 4095) / 4096 * 4096;
  c.host_pages_per_layer = static_cast<std::int64_t>(G);
  c.host_page_stride = stride;
  c.host_layer_first_page = first;
  ess_engine* e = nullptr;
  ASSERT_EQ(ess_engine_create(&c, &e), ESS_OK) << last();
  ess_host_layout layout;
  ess_host_layout_init(&layout);
  ASSERT_EQ(ess_engine_host_layout(e, &layout), ESS_OK) << last();
  EXPECT_EQ(layout.page_bytes, stride);
  EXPECT_EQ(layout.pages_per_layer, static_cast<std::int64_t>(G));
  void* layer0 = nullptr;
  ASSERT_EQ(ess_engine_host_layer(e, 0, &layer0), ESS_OK) << last();
  EXPECT_EQ(layer0, region + first[0] * stride);
  const std::int32_t pages[] = {4, 1};
  int32_t row = -1;
  ASSERT_EQ(ess_request_adopt(e, 9, 100, pages, 2, 1, &row), ESS_OK) << last();
  EXPECT_EQ(row, 1);
  std::vector<std::uint8_t> got(100 * kEntry);
  std::vector<std::int64_t> shape = {100, kEntry};
  DLTensor out = tensor(got.data(), shape, kDLUInt, 8);
  for (int l = 0; l < 2; ++l) {
    ASSERT_EQ(ess_request_read_entries(e, 9, l, 0, &out), ESS_OK) << last();
    for (std::int64_t t = 0; t < 100; ++t) {
      const std::uint8_t* want = region + (first[l] + pages[t / 64]) * stride + (t % 64) * kEntry;
      ASSERT_EQ(0, std::memcmp(got.data() + t * kEntry, want, kEntry)) << "layer " << l << " token " << t;
    }
  }
  const std::int32_t more[] = {5};
  ASSERT_EQ(ess_request_repage(e, 9, 129, 2, more, 1), ESS_OK) << last();
  int64_t length = 0;
  ASSERT_EQ(ess_request_get(e, 9, nullptr, &length), ESS_OK);
  EXPECT_EQ(length, 129);
  std::int32_t listed[3] = {};
  int64_t count = 0;
  ASSERT_EQ(ess_request_host_pages(e, 9, listed, 3, &count), ESS_OK) << last();
  EXPECT_EQ(count, 3);
  EXPECT_EQ(listed[2], 5);
  // Refused, nothing changed.
  EXPECT_EQ(ess_request_admit(e, 10, 10, -1, nullptr), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("foreign pages"), std::string::npos) << last();
  const std::int32_t outside[] = {static_cast<std::int32_t>(G)};
  EXPECT_EQ(ess_request_adopt(e, 10, 10, outside, 1, -1, nullptr), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("outside [0, 6)"), std::string::npos) << last();
  EXPECT_EQ(ess_request_repage(e, 9, 200, 3, nullptr, 0), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("4 expected"), std::string::npos) << last();
  EXPECT_EQ(ess_request_repage(e, 9, 100, 3, nullptr, 0), ESS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last().find("takes back more than T"), std::string::npos) << last();
  ASSERT_EQ(ess_request_get(e, 9, nullptr, &length), ESS_OK);
  EXPECT_EQ(length, 129);
  ASSERT_EQ(ess_request_release(e, 9), ESS_OK) << last();
  ess_engine_destroy(e);
  EXPECT_EQ(0, std::memcmp(region, before.data(), bytes)) << "ESS wrote the other engine's pool";
  // Configurations that cannot be served: refused by name, nothing created.
  auto refused = [&](const std::function<void(ess_config&)>& change, const char* word) {
    ess_config bad = c;
    change(bad);
    ess_engine* x = nullptr;
    EXPECT_EQ(ess_engine_create(&bad, &x), ESS_ERROR_INVALID_ARGUMENT) << word;
    EXPECT_NE(last().find(word), std::string::npos) << last();
    EXPECT_EQ(x, nullptr);
  };
  refused([](ess_config& b) { b.host_bytes = 1 << 20; }, "host_bytes = 1048576 with foreign pages");
  refused([](ess_config& b) { b.host_layer_first_page = nullptr; }, "needs host_layer_first_page");
  refused([&](ess_config& b) { b.host_memory_bytes = bytes / 2 / 4096 * 4096; }, "beyond host_memory_bytes");
  refused([](ess_config& b) { b.host_pages_per_layer = -1; }, "host_pages_per_layer = -1");
  refused([](ess_config& b) { b.host_page_stride = 64; }, "page_stride = 64");
  const std::int64_t overlapping[] = {0, 3};
  refused([&](ess_config& b) { b.host_layer_first_page = overlapping; }, "overlap");
}
