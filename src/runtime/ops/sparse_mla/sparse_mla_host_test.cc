// The host run of the sparse MLA cases (sparse_mla_cases.h): the CPU reference stands in for
// the device, so every problem the GPU test builds, the launch arguments it passes and every
// assertion it makes run on a CPU machine. The reference follows the kernel's documented
// contract where the contract fixes the output: bf16 = the fp32 output rounded to nearest
// even, ids outside [-1, slots) reported at their smallest flat position and read as masked,
// only the first row_lengths ids of a row read (clamped to [0, K]).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ess/model/numerics.h"
#include "ess/ops/reference.h"
#include "runtime/ops/launch_args.h"
#include "sparse_mla_cases.h"

namespace ess::mla_test {
namespace {

using test::device_pointer;

// The launch the device backend makes for this decode: check_args must accept it.
void expect_launch_accepted(const Problem& p, bool want_f32, bool want_bf16, bool with_lengths) {
  cuda::SparseMlaArgs a = shape_args(p);
  a.q = device_pointer<const std::uint16_t>();
  a.kv = device_pointer<const std::uint8_t>();
  a.kv_offsets = device_pointer<const std::uint64_t>();
  a.indices = device_pointer<const std::int32_t>();
  a.row_lengths = with_lengths ? device_pointer<const std::int32_t>() : nullptr;
  a.out = want_bf16 ? device_pointer<std::uint16_t>() : nullptr;
  a.out_f32 = want_f32 ? device_pointer<float>() : nullptr;
  a.lse = device_pointer<float>();
  EXPECT_EQ(cuda::check_args(a), "");
}

Output reference_decode(const Problem& p, const std::vector<std::int32_t>& ids, bool want_f32, bool want_bf16,
                        const std::vector<std::int32_t>& row_lengths) {
  expect_launch_accepted(p, want_f32, want_bf16, !row_lengths.empty());
  const std::size_t hv = static_cast<std::size_t>(p.H) * kV;
  const auto K = static_cast<std::size_t>(p.K);
  const ref::SparseMlaParams params{kLayout, p.H, p.scale};
  // The ids the kernel reads: the first row_lengths of each row; a bad one is reported at the
  // smallest flat position and read as masked (Problem::entry gives nullptr for it).
  std::vector<std::int32_t> read = ids;
  Output out;
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    const auto len = static_cast<std::size_t>(row_lengths.empty() ? p.K : std::clamp(row_lengths[t], 0, p.K));
    std::fill(read.begin() + static_cast<std::ptrdiff_t>(t * K + len), read.begin() + static_cast<std::ptrdiff_t>((t + 1) * K), -1);
    for (std::size_t k = 0; k < len && out.bad < 0; ++k) {
      if (ids[t * K + k] < -1 || ids[t * K + k] >= p.slots) out.bad = static_cast<int>(t * K + k);
    }
  }
  std::vector<float> o32(p.tokens() * hv);
  out.lse.resize(p.tokens() * static_cast<std::size_t>(p.H));
  for (std::size_t t = 0; t < p.tokens(); ++t) {
    ref::sparse_mla_decode_f32(params, p.q_of(t), p.ptrs(t, read), {o32.data() + t * hv, hv},
                               {out.lse.data() + t * static_cast<std::size_t>(p.H), static_cast<std::size_t>(p.H)});
  }
  if (want_bf16) {
    out.o16.resize(o32.size());
    for (std::size_t i = 0; i < o32.size(); ++i) out.o16[i] = bf16_from_float(o32[i]);
  }
  if (want_f32) out.o32 = std::move(o32);
  return out;
}

MergeOutput reference_merge(const MergeInput& in, MergePlace, bool want_bf16) {
  cuda::MergeArgs a;
  a.rows = in.rows;
  a.dim = in.dim;
  a.o_a = device_pointer<const float>();
  a.lse_a = device_pointer<const float>();
  a.o_b = device_pointer<const float>();
  a.lse_b = device_pointer<const float>();
  a.out_f32 = device_pointer<float>();
  a.out = want_bf16 ? device_pointer<std::uint16_t>() : nullptr;
  a.lse = device_pointer<float>();
  EXPECT_EQ(cuda::check_args(a), "");
  MergeOutput out;
  out.o32.resize(in.oa.size());
  out.lse.resize(static_cast<std::size_t>(in.rows));
  ref::merge_states(static_cast<int>(in.rows), in.dim, in.oa, in.la, in.ob, in.lb, out.o32, out.lse);
  if (want_bf16) {
    out.o16.resize(out.o32.size());
    for (std::size_t i = 0; i < out.o32.size(); ++i) out.o16[i] = bf16_from_float(out.o32[i]);
  }
  return out;
}

bool always() { return true; }

}  // namespace

const MlaBackend& mla_backend() {
  static const MlaBackend b{{"cpu-reference", always}, reference_decode};
  return b;
}

const MergeBackend& merge_backend() {
  static const MergeBackend b{{"cpu-reference", always}, reference_merge};
  return b;
}

}  // namespace ess::mla_test
