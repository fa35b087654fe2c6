// The merge kernel's own block program (merge_cta.h) run on the CPU by the CTA emulator
// (cta_emulator.h), on the cases of merge_cases.h, with the grid sparse_mla.cu takes (capped
// here at 4 blocks, so that warps loop over rows as they do on a large batch), outputs
// poisoned with NaN as the device test does, in place over a partial too, every buffer
// guarded. Runs without a device; label emulation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ess/model/numerics.h"
#include "merge_cases.h"
#include "runtime/ops/launch_args.h"
#include "runtime/ops/sparse_mla/merge_cta.h"
#include "testing/emulator/cta_emulator.h"

namespace ess::mla_test {
namespace {

class Prims {
 public:
  explicit Prims(emu::Cta& c) : c_(c) {}
  int tid() const { return c_.tid(); }
  int threads() const { return c_.threads(); }
  unsigned block() const { return c_.block(); }
  unsigned blocks() const { return c_.blocks(); }
  void sync_warp() const { c_.sync_warp(); }
  float exp(float x) const { return std::exp(x); }
  float log1p(float x) const { return std::log1p(x); }
  std::uint32_t pack_bf16(float lo, float hi) const {
    return static_cast<std::uint32_t>(bf16_from_float(lo)) | (static_cast<std::uint32_t>(bf16_from_float(hi)) << 16);
  }

 private:
  emu::Cta& c_;
};

std::uint64_t seed = 1;

MergeOutput emulated_merge(const MergeInput& in, MergePlace place, bool want_bf16) {
  const std::size_t n = in.oa.size();
  const auto rows = static_cast<std::size_t>(in.rows);
  emu::Guarded<float> oa, ob, la, lb, o(n, 0xff), l(rows, 0xff);
  emu::Guarded<std::uint16_t> o16(n, 0xff);
  oa.assign(in.oa);
  ob.assign(in.ob);
  la.assign(in.la);
  lb.assign(in.lb);
  cuda::MergeArgs a;
  a.rows = in.rows;
  a.dim = in.dim;
  a.o_a = oa.data();
  a.lse_a = la.data();
  a.o_b = ob.data();
  a.lse_b = lb.data();
  emu::Guarded<float>& out = place == MergePlace::kOverA ? oa : place == MergePlace::kOverB ? ob : o;
  emu::Guarded<float>& lse = place == MergePlace::kOverA ? la : place == MergePlace::kOverB ? lb : l;
  a.out_f32 = out.data();
  a.lse = lse.data();
  a.out = want_bf16 ? o16.data() : nullptr;
  EXPECT_EQ(cuda::check_args(a), "");
  const long long per_block = cuda::merge::kThreads / 32;
  const long long want = (in.rows + per_block - 1) / per_block;
  emu::launch("merge", static_cast<unsigned>(want < 4 ? want : 4), cuda::merge::kThreads, 0, seed++,
              [&](emu::Cta& c, std::uint8_t*) {
                Prims p(c);
                cuda::merge::merge_cta(a, p);
              });
  for (const std::string& d : {oa.damage(), ob.damage(), la.damage(), lb.damage(), o.damage(), l.damage(), o16.damage()}) {
    EXPECT_TRUE(d.empty()) << "merge: a buffer " << d;
  }
  MergeOutput r;
  r.o32 = out.values();
  r.lse = lse.values();
  if (want_bf16) r.o16 = o16.values();
  return r;
}

bool always() { return true; }

}  // namespace

const MergeBackend& merge_backend() {
  static const MergeBackend b{{"emulator", always}, emulated_merge};
  return b;
}

}  // namespace ess::mla_test
