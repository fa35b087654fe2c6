// The sparse MLA decode and the merge on the device (sparse_mla_cases.h; the host run of the
// same cases is sparse_mla_host_test.cc). Skipped without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "ess/core/error.h"
#include "ess/ops/sparse_mla.h"
#include "ess/runtime/backend.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/device_buffer.h"
#include "sparse_mla_cases.h"
#include "testing/device_io.h"
#include "testing/testing.h"

namespace ess::mla_test {
namespace {

using test::download;
using test::upload;

// Runs the decode on the GPU; outputs are pre-filled with NaN so that unwritten values show.
Output run_decode(const Problem& p, const std::vector<std::int32_t>& ids, bool want_f32, bool want_bf16,
                  const std::vector<std::int32_t>& row_lengths) {
  const auto d_len = upload(row_lengths);
  const auto d_kv = upload(p.kv);
  const auto d_off = upload(p.offsets);
  const auto d_ids = upload(ids);
  const auto d_q = upload(p.q);
  const std::size_t rows = p.tokens() * static_cast<std::size_t>(p.H);
  cuda::DeviceBuffer<float> d_o32(rows * kV), d_lse(rows);
  cuda::DeviceBuffer<std::uint16_t> d_o16(rows * kV);
  cuda::DeviceBuffer<int> d_bad(1);
  ESS_CUDA_CHECK(cudaMemset(d_o32.get(), 0xff, rows * kV * 4), "fill");
  ESS_CUDA_CHECK(cudaMemset(d_o16.get(), 0xff, rows * kV * 2), "fill");
  ESS_CUDA_CHECK(cudaMemset(d_lse.get(), 0xff, rows * 4), "fill");
  ESS_CUDA_CHECK(cudaMemset(d_bad.get(), 0xff, 4), "fill");  // -1
  cuda::SparseMlaArgs a = shape_args(p);
  a.q = d_q.get();
  a.kv = d_kv.get();
  a.kv_offsets = d_off.get();
  a.indices = d_ids.get();
  a.out = want_bf16 ? d_o16.get() : nullptr;
  a.out_f32 = want_f32 ? d_o32.get() : nullptr;
  a.lse = d_lse.get();
  a.bad_index = d_bad.get();
  a.row_lengths = row_lengths.empty() ? nullptr : d_len.get();
  ESS_CUDA_CHECK(static_cast<cudaError_t>(cuda::sparse_mla_decode(a, nullptr)), "sparse_mla_decode");
  ESS_CUDA_CHECK(cudaDeviceSynchronize(), "sparse_mla_decode");
  Output out;
  if (want_f32) out.o32 = download(d_o32, rows * kV);
  if (want_bf16) out.o16 = download(d_o16, rows * kV);
  out.lse = download(d_lse, rows);
  out.bad = download(d_bad, 1)[0];
  return out;
}

// The merge on the device; outputs pre-filled with NaN.
MergeOutput run_merge(const MergeInput& in, MergePlace place, bool want_bf16) {
  const std::size_t n = in.oa.size();
  const auto rows = static_cast<std::size_t>(in.rows);
  auto d_oa = upload(in.oa), d_ob = upload(in.ob), d_la = upload(in.la), d_lb = upload(in.lb);
  cuda::DeviceBuffer<float> d_o(n), d_l(rows);
  cuda::DeviceBuffer<std::uint16_t> d_o16(n);
  ESS_CUDA_CHECK(cudaMemset(d_o.get(), 0xff, n * 4), "fill");
  ESS_CUDA_CHECK(cudaMemset(d_l.get(), 0xff, rows * 4), "fill");
  ESS_CUDA_CHECK(cudaMemset(d_o16.get(), 0xff, n * 2), "fill");
  cuda::MergeArgs a;
  a.rows = in.rows;
  a.dim = in.dim;
  a.o_a = d_oa.get();
  a.lse_a = d_la.get();
  a.o_b = d_ob.get();
  a.lse_b = d_lb.get();
  float* o = place == MergePlace::kOverA ? d_oa.get() : place == MergePlace::kOverB ? d_ob.get() : d_o.get();
  float* l = place == MergePlace::kOverA ? d_la.get() : place == MergePlace::kOverB ? d_lb.get() : d_l.get();
  a.out_f32 = o;
  a.lse = l;
  a.out = want_bf16 ? d_o16.get() : nullptr;
  ESS_CUDA_CHECK(static_cast<cudaError_t>(cuda::merge_states(a, nullptr)), "merge_states");
  ESS_CUDA_CHECK(cudaDeviceSynchronize(), "merge_states");
  MergeOutput out;
  const cuda::DeviceBuffer<float>& ob = place == MergePlace::kOverA ? d_oa : place == MergePlace::kOverB ? d_ob : d_o;
  const cuda::DeviceBuffer<float>& lb = place == MergePlace::kOverA ? d_la : place == MergePlace::kOverB ? d_lb : d_l;
  out.o32 = download(ob, n);
  out.lse = download(lb, rows);
  if (want_bf16) out.o16 = download(d_o16, n);
  return out;
}

bool device_present() { return cuda_device_present(); }

TEST(SparseMlaLauncher, RefusesWhatCheckArgsRefuses) {
  // The launchers run check_args before any CUDA call: no device needed.
  std::vector<std::uint8_t> dummy(64);
  cuda::SparseMlaArgs ok;
  ok.batch = 1;
  ok.heads = 64;
  ok.topk = 1;
  ok.softmax_scale = 0.1f;
  ok.q = reinterpret_cast<const std::uint16_t*>(dummy.data() + 16 - reinterpret_cast<std::uintptr_t>(dummy.data()) % 16);
  ok.kv = dummy.data() + 16 - reinterpret_cast<std::uintptr_t>(dummy.data()) % 16;
  ok.kv_offsets = reinterpret_cast<const std::uint64_t*>(ok.kv);
  ok.indices = reinterpret_cast<const std::int32_t*>(ok.kv);
  ok.lse = reinterpret_cast<float*>(dummy.data());
  const auto bad = [&](auto&& change) {
    cuda::SparseMlaArgs a = ok;
    change(a);
    return cuda::sparse_mla_decode(a, nullptr);
  };
  const int kInvalid = static_cast<int>(cudaErrorInvalidValue);
  EXPECT_EQ(bad([](auto& a) { a.heads = 96; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.heads = 192; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.heads = 0; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.topk = 0; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.query_tokens = 0; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.softmax_scale = 0.0f; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.softmax_scale = kInf; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.lse = nullptr; }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.q = reinterpret_cast<const std::uint16_t*>(a.kv + 2); }), kInvalid);
  EXPECT_EQ(bad([](auto& a) { a.batch = 0; }), 0);  // nothing to do
  cuda::MergeArgs m;
  m.rows = 1;
  m.dim = 6;
  EXPECT_EQ(cuda::merge_states(m, nullptr), kInvalid);
  m.rows = 0;
  m.dim = 8;
  m.o_a = m.o_b = m.lse_a = m.lse_b = ok.lse;
  EXPECT_EQ(cuda::merge_states(m, nullptr), 0);
  EXPECT_DOUBLE_EQ(cuda::sparse_mla_flops(128, 2, 128, 2048), 128.0 * 2 * 128 * 2048 * 2 * (576 + 512));
}

}  // namespace

const MlaBackend& mla_backend() {
  static const MlaBackend b{{"cuda", device_present}, run_decode};
  return b;
}

const MergeBackend& merge_backend() {
  static const MergeBackend b{{"cuda", device_present}, run_merge};
  return b;
}

}  // namespace ess::mla_test
