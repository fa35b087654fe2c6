// The lightning-indexer logits and the top-k on the device (indexer_cases.h; the host run of
// the same cases is indexer_host_test.cc). Skipped without a CUDA device, but for the
// launchers' argument checks, which run before any CUDA call.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <vector>

#include "ess/ops/indexer.h"
#include "ess/runtime/backend.h"
#include "indexer_cases.h"
#include "testing/device_io.h"
#include "testing/testing.h"

namespace ess::indexer_test {
namespace {

using test::download;
using test::upload;

std::vector<float> device_logits(const Problem& p) {
  const std::vector<float> filled(static_cast<std::size_t>(p.B) * p.T * static_cast<std::size_t>(p.stride),
                                  std::bit_cast<float>(kSentinel));
  const auto arena = upload(p.arena), q = upload(p.q);
  const auto table = upload(p.table), lengths = upload(p.lengths);
  const auto w = upload(p.w);
  auto logits = upload(filled);
  cuda::IndexerArgs a;
  a.batch = p.B;
  a.query_tokens = p.T;
  a.heads = p.H;
  a.head_dim = kDim;
  a.q = q.get();
  a.weights = w.get();
  a.pages = arena.get();
  a.page_table = table.get();
  a.max_pages = p.max_pages;
  a.lengths = lengths.get();
  a.logits = logits.get();
  a.logits_stride = p.stride;
  EXPECT_EQ(cuda::indexer_logits(a, nullptr), 0);
  test::sync("indexer logits");
  return download(logits);
}

TopkRun device_topk(const std::vector<float>& logits, std::int64_t stride, const std::vector<std::int32_t>& lengths, int k,
                    bool report_nan) {
  const auto d_logits = upload(logits);
  const auto d_len = upload(lengths);
  cuda::DeviceBuffer<std::int32_t> d_out(lengths.size() * static_cast<std::size_t>(k));
  const auto d_nan = upload(std::vector<int>{-1});
  cuda::TopkArgs ta;
  ta.rows = static_cast<std::int64_t>(lengths.size());
  ta.k = k;
  ta.logits = d_logits.get();
  ta.stride = stride;
  ta.lengths = d_len.get();
  ta.out = d_out.get();
  ta.nan_row = report_nan ? d_nan.get() : nullptr;
  EXPECT_EQ(cuda::topk(ta, nullptr), 0);
  test::sync("top-k");
  return {download(d_out), download(d_nan)[0]};
}

bool device_present() { return cuda_device_present(); }

// The launchers refuse what check_args refuses, before any CUDA call (no device needed):
// pointers are checked whenever there is a batch, even one with no keys (max_pages 0).
TEST(IndexerLauncher, RefusesWhatCheckArgsRefuses) {
  const int kInvalid = static_cast<int>(cudaErrorInvalidValue);
  cuda::IndexerArgs a;
  a.batch = 0;
  EXPECT_EQ(cuda::indexer_logits(a, nullptr), 0);  // nothing to do
  a.batch = 1;
  EXPECT_EQ(a.max_pages, 0);
  EXPECT_EQ(cuda::indexer_logits(a, nullptr), kInvalid);  // null pointers
  EXPECT_DOUBLE_EQ(cuda::indexer_flops(10, 64, 128), 2.0 * 10 * 64 * 128);
  alignas(16) static float dummy[16];
  cuda::TopkArgs ta;
  EXPECT_EQ(cuda::topk(ta, nullptr), 0);  // no rows: nothing to do
  ta.rows = 1;
  ta.logits = dummy;
  ta.stride = 8;
  ta.lengths = reinterpret_cast<const std::int32_t*>(dummy);
  ta.out = reinterpret_cast<std::int32_t*>(dummy);
  for (const int k : {0, 2049}) {
    ta.k = k;
    EXPECT_EQ(cuda::topk(ta, nullptr), kInvalid) << "k = " << k;
  }
}

}  // namespace

const IndexerBackend& indexer_backend() {
  static const IndexerBackend b{{"cuda", device_present}, device_logits, device_topk};
  return b;
}

}  // namespace ess::indexer_test
