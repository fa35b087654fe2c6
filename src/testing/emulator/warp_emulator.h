// The warp-level part of the CPU emulator of one CUDA thread block (the fibers and barriers
// are cta_emulator.h's), for running device code written against a primitives policy
// (sparse_mla_cta.h) without a GPU. Barriers: __syncthreads (all
// threads), named barriers (bar.sync id, count) and an internal per-warp barrier behind every
// warp collective (shuffle, vote, ldmatrix, mma), which the emulator implements as
//   deposit inputs -> warp barrier -> lane 0 computes every lane's result -> warp barrier
// and checks that all 32 lanes ran the same collective (divergent collectives fail the test;
// missing lanes deadlock, which is reported). cp.async copies are queued per thread and done
// at the latest moment the PTX allows (cp.async.wait_group), so a read of data not yet waited
// for sees stale bytes; shared memory starts as 0xff bytes (NaN in bf16 and fp32) so a read
// of never-written data shows in the output. Global addresses given to cp.async must lie in a
// registered range; shared addresses must lie in the block's shared memory; ldmatrix rows
// must be 16-byte aligned.
//
// The PTX semantics used (independent of mma_layout.h; see mma_layout_test.cc):
//   mma.m16n8k16 bf16: g = lane / 4, t = lane % 4;
//     A element a_i (half i % 2 of reg i / 2): row g (+8 unless i in {0,1,4,5}), col 2t + (i & 1) (+8 for i >= 4)
//     B element b_i (half i % 2 of reg i / 2): row 2t + (i & 1) (+8 for i >= 2), col g
//     C/D element c_i: row g (+8 for i >= 2), col 2t + (i & 1)
//   ldmatrix.x4: lanes 8m..8m+7 address the rows of matrix m; reg m of lane L = row L/4,
//     cols 2(L%4), 2(L%4)+1 (with .trans: elements [2(L%4)][L/4], [2(L%4)+1][L/4]).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "ess/model/numerics.h"
#include "testing/emulator/cta_emulator.h"

namespace ess::emu {

// ---- one thread block ----------------------------------------------------------------------------
struct Range {
  const std::uint8_t* begin;
  std::size_t bytes;
};

struct Block {
  Block(int threads, std::size_t smem_bytes, Fibers& f)
      : fibers(f), smem(smem_bytes, 0xff), all(threads), cp(static_cast<std::size_t>(threads)) {
    for (int i = 0; i < threads / 32; ++i) warps.push_back(std::make_unique<Warp>());
  }

  // Per-warp exchange for collectives.
  struct Warp {
    Barrier bar{32};
    std::array<int, 32> tag{};
    std::array<std::array<std::uint64_t, 4>, 32> in{};   // generic payload
    std::array<std::array<std::uint32_t, 2>, 32> in_b{};
    std::array<std::array<float, 4>, 32> in_c{};
    std::array<std::array<std::uint64_t, 4>, 32> out{};
  };
  struct Copy {
    std::uint32_t dst;
    const std::uint8_t* src;
    bool fill;
  };
  struct CpAsync {
    std::vector<Copy> pending;               // issued, not committed
    std::vector<std::vector<Copy>> groups;   // committed, oldest first
  };

  Fibers& fibers;
  std::vector<unsigned char> smem;
  Barrier all;
  std::vector<std::pair<int, std::unique_ptr<Barrier>>> named;  // (id, barrier)
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<CpAsync> cp;
  std::vector<Range> global;  // where cp.async may read

  Barrier& named_barrier(int id, int count) {
    for (auto& [i, b] : named) {
      if (i == id) return *b;
    }
    named.emplace_back(id, std::make_unique<Barrier>(count));
    return *named.back().second;
  }
};

// The primitives policy for sparse_mla_cta on the emulator (one object per thread).
class Prims {
 public:
  Prims(Block& b, int tid) : b_(b), tid_(tid) {}

  int tid() const { return tid_; }
  void sync_cta() const { b_.all.arrive_and_wait(b_.fibers); }
  void sync_pair(int r) const { b_.named_barrier(r + 1, 64).arrive_and_wait(b_.fibers); }

  long long shfl(long long v, int src) const {
    return static_cast<long long>(collective(1, {static_cast<std::uint64_t>(v), static_cast<std::uint64_t>(src)}, [](Block::Warp& w) {
      for (int l = 0; l < 32; ++l) {
        const auto s = static_cast<std::size_t>(w.in[static_cast<std::size_t>(l)][1] & 31u);
        w.out[static_cast<std::size_t>(l)][0] = w.in[s][0];
      }
    })[0]);
  }
  float shfl_xor(float v, int m) const {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &v, 4);
    const auto r = collective(2, {bits, static_cast<std::uint64_t>(m)}, [](Block::Warp& w) {
      for (std::size_t l = 0; l < 32; ++l) w.out[l][0] = w.in[l ^ (w.in[l][1] & 31u)][0];
    });
    const auto u = static_cast<std::uint32_t>(r[0]);
    float f = 0.0f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  std::uint32_t ballot(bool v) const {
    return static_cast<std::uint32_t>(collective(3, {v ? 1u : 0u}, [](Block::Warp& w) {
      std::uint64_t m = 0;
      for (std::size_t l = 0; l < 32; ++l) m |= (w.in[l][0] & 1u) << l;
      for (auto& o : w.out) o[0] = m;
    })[0]);
  }
  bool any(bool v) const { return ballot(v) != 0; }

  std::int32_t ldg(const std::int32_t* p) const { return *p; }
  void atomic_min_u32(unsigned* p, unsigned v) const { *p = std::min(*p, v); }  // fibers never run concurrently
  float exp2(float x) const { return std::exp2(x); }
  float log(float x) const { return std::log(x); }
  std::uint32_t smem_u32(const void* p) const {
    EXPECT_EQ(p, static_cast<const void*>(b_.smem.data()));
    return 0;  // shared-window addresses are byte offsets into the block's shared memory
  }

  void cp_async_16(std::uint32_t dst, const void* src, bool fill) const {
    const auto* s = static_cast<const std::uint8_t*>(src);
    EXPECT_EQ(dst % 16, 0u) << "cp.async destination not 16-byte aligned";
    EXPECT_LE(static_cast<std::size_t>(dst) + 16, b_.smem.size()) << "cp.async destination outside shared memory";
    bool inside = false;
    for (const Range& r : b_.global) inside = inside || (s >= r.begin && s + 16 <= r.begin + r.bytes);
    EXPECT_TRUE(inside) << "cp.async source outside every buffer of the launch";
    if (fill) {
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(s) % 16, 0u) << "cp.async source not 16-byte aligned";
    }
    b_.cp[static_cast<std::size_t>(tid_)].pending.push_back({dst, s, fill});
  }
  void cp_async_commit() const {
    auto& c = b_.cp[static_cast<std::size_t>(tid_)];
    c.groups.push_back(std::move(c.pending));
    c.pending.clear();
  }
  void cp_async_wait_all() const { complete(0); }
  void cp_async_wait_all_but_one() const { complete(1); }

  void ldsm_x4(std::uint32_t (&r)[4], std::uint32_t addr) const { ldmatrix(r, addr, false); }
  void ldsm_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) const { ldmatrix(r, addr, true); }

  void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) const {
    mma_k<16>(6, d, a, b0, b1, [](const Block::Warp& ww, double (&A)[16][16], double (&B)[16][8]) {
      for (int ln = 0; ln < 32; ++ln) {
        const auto L = static_cast<std::size_t>(ln);
        const int g = ln >> 2, t = ln & 3;
        for (int i = 0; i < 8; ++i) {
          const auto reg = static_cast<std::uint32_t>(ww.in[L][static_cast<std::size_t>(i / 2)]);
          const int row = g + ((i < 2 || (i >= 4 && i < 6)) ? 0 : 8);
          const int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
          A[row][col] = bf16_to_float(static_cast<std::uint16_t>(i % 2 == 0 ? reg & 0xffffu : reg >> 16));
        }
        for (int i = 0; i < 4; ++i) {
          const std::uint32_t reg = ww.in_b[L][static_cast<std::size_t>(i / 2)];
          const int row = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
          B[row][g] = bf16_to_float(static_cast<std::uint16_t>(i % 2 == 0 ? reg & 0xffffu : reg >> 16));
        }
      }
    });
  }

  // mma.m16n8k32.row.col.f32.e4m3.e4m3.f32 (the indexer's): lane (g = lane / 4, t = lane % 4)
  // holds A bytes a_i (byte i % 4 of reg i / 4) at row g (+8 for regs 1, 3), col 4t + i % 4 (+16
  // for regs 2, 3), B bytes b_i at row 4t + i % 4 (+16 for reg b1), col g, and C as the bf16
  // form's. The products are exact; the emulator sums them in double (the tensor core truncates
  // to about 13 bits: within the tests' bound, which is derived from that).
  void mma_e4m3(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) const {
    mma_k<32>(7, d, a, b0, b1, [](const Block::Warp& ww, double (&A)[16][32], double (&B)[32][8]) {
      for (int ln = 0; ln < 32; ++ln) {
        const auto L = static_cast<std::size_t>(ln);
        const int g = ln >> 2, t = ln & 3;
        for (int reg = 0; reg < 4; ++reg) {
          const auto v = static_cast<std::uint32_t>(ww.in[L][static_cast<std::size_t>(reg)]);
          for (int byte = 0; byte < 4; ++byte) {
            const int row = g + ((reg & 1) != 0 ? 8 : 0);
            const int col = 4 * t + byte + (reg >= 2 ? 16 : 0);
            A[row][col] = fp8_e4m3_to_float(static_cast<std::uint8_t>((v >> (8 * byte)) & 0xffu));
          }
        }
        for (int reg = 0; reg < 2; ++reg) {
          const std::uint32_t v = ww.in_b[L][static_cast<std::size_t>(reg)];
          for (int byte = 0; byte < 4; ++byte) {
            B[4 * t + byte + (reg == 1 ? 16 : 0)][g] = fp8_e4m3_to_float(static_cast<std::uint8_t>((v >> (8 * byte)) & 0xffu));
          }
        }
      }
    });
  }
  // __syncwarp: a warp-wide collective with nothing to exchange.
  void sync_warp() const {
    (void)collective(8, {}, [](Block::Warp&) {});
  }
  float fma(float x, float y, float z) const { return std::fma(x, y, z); }

  std::uint32_t pack_bf16(float lo, float hi) const {
    return static_cast<std::uint32_t>(bf16_from_float(lo)) | (static_cast<std::uint32_t>(bf16_from_float(hi)) << 16);
  }
  std::uint32_t fp8x2_to_bf16x2(std::uint32_t two, float scale) const {
    EXPECT_LE(two, 0xffffu);
    return pack_bf16(fp8_e4m3_to_float(static_cast<std::uint8_t>(two & 0xffu)) * scale,
                     fp8_e4m3_to_float(static_cast<std::uint8_t>((two >> 8) & 0xffu)) * scale);
  }

 private:
  int lane() const { return tid_ & 31; }
  Block::Warp& warp() const { return *b_.warps[static_cast<std::size_t>(tid_ >> 5)]; }

  // An m16n8kK MMA as a warp collective: every lane deposits its A, B and C fragments; lane 0
  // decodes A [16][K] and B [K][8] from all of them (`decode`, the type's fragment layout) and
  // computes each lane's D = A B + C (C/D: row g (+8 for d2, d3), col 2t + i % 2) in double.
  template <int K, typename Decode>
  void mma_k(int tag, float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1,
             Decode decode) const {
    Block::Warp& w = warp();
    const auto l = static_cast<std::size_t>(lane());
    w.in_b[l] = {b0, b1};
    for (std::size_t i = 0; i < 4; ++i) w.in_c[l][i] = d[i];
    const auto r = collective(tag, {a[0], a[1], a[2], a[3]}, [&decode](Block::Warp& ww) {
      double A[16][K], B[K][8];
      decode(ww, A, B);
      for (int ln = 0; ln < 32; ++ln) {
        const auto L = static_cast<std::size_t>(ln);
        const int g = ln >> 2, t = ln & 3;
        for (int i = 0; i < 4; ++i) {
          const int row = g + (i >= 2 ? 8 : 0);
          const int col = 2 * t + (i & 1);
          double acc = 0.0;
          for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
          const float v = static_cast<float>(acc + ww.in_c[L][static_cast<std::size_t>(i)]);
          std::uint32_t bits = 0;
          std::memcpy(&bits, &v, 4);
          ww.out[L][static_cast<std::size_t>(i)] = bits;
        }
      }
    });
    for (std::size_t i = 0; i < 4; ++i) {
      const auto u = static_cast<std::uint32_t>(r[i]);
      std::memcpy(&d[i], &u, 4);
    }
  }

  // deposit -> barrier -> lane 0 computes all results -> barrier -> read mine
  template <typename F>
  std::array<std::uint64_t, 4> collective(int tag, std::array<std::uint64_t, 4> in, F&& compute) const {
    Block::Warp& w = warp();
    const auto l = static_cast<std::size_t>(lane());
    w.tag[l] = tag;
    w.in[l] = in;
    w.bar.arrive_and_wait(b_.fibers);
    if (l == 0) {
      for (int t : w.tag) EXPECT_EQ(t, tag) << "lanes of a warp ran different collectives";
      compute(w);
    }
    w.bar.arrive_and_wait(b_.fibers);
    return w.out[l];
  }

  void ldmatrix(std::uint32_t (&r)[4], std::uint32_t addr, bool trans) const {
    const std::vector<unsigned char>& smem = b_.smem;
    const auto res = collective(trans ? 5 : 4, {addr}, [&smem, trans](Block::Warp& w) {
      for (int m = 0; m < 4; ++m) {
        for (int rr = 0; rr < 8; ++rr) {
          const auto a = static_cast<std::size_t>(w.in[static_cast<std::size_t>(8 * m + rr)][0]);
          EXPECT_EQ(a % 16, 0u) << "ldmatrix row address not 16-byte aligned";
          EXPECT_LE(a + 16, smem.size()) << "ldmatrix row outside shared memory";
        }
        const auto elem = [&](int row, int col) {
          const auto a = static_cast<std::size_t>(w.in[static_cast<std::size_t>(8 * m + row)][0]) + 2 * static_cast<std::size_t>(col);
          std::uint16_t v = 0;
          if (a + 2 <= smem.size()) std::memcpy(&v, smem.data() + a, 2);
          return static_cast<std::uint32_t>(v);
        };
        for (int ln = 0; ln < 32; ++ln) {
          const int row = ln / 4, c2 = 2 * (ln % 4);
          const std::uint32_t lo = trans ? elem(c2, row) : elem(row, c2);
          const std::uint32_t hi = trans ? elem(c2 + 1, row) : elem(row, c2 + 1);
          w.out[static_cast<std::size_t>(ln)][static_cast<std::size_t>(m)] = lo | (hi << 16);
        }
      }
    });
    for (std::size_t i = 0; i < 4; ++i) r[i] = static_cast<std::uint32_t>(res[i]);
  }

  // cp.async.wait_group n: every committed group but the newest n is complete.
  void complete(std::size_t keep) const {
    auto& c = b_.cp[static_cast<std::size_t>(tid_)];
    while (c.groups.size() > keep) {
      for (const auto& x : c.groups.front()) {
        if (static_cast<std::size_t>(x.dst) + 16 > b_.smem.size()) continue;
        if (x.fill) {
          std::memcpy(b_.smem.data() + x.dst, x.src, 16);
        } else {
          std::memset(b_.smem.data() + x.dst, 0, 16);
        }
      }
      c.groups.erase(c.groups.begin());
    }
  }

  Block& b_;
  int tid_;
};

}  // namespace ess::emu
