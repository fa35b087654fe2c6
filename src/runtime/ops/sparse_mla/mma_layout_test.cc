// The sparse MLA kernel's index math (mma_layout.h), checked on the CPU by
// emulating one warp: fragments are built from a shared-memory image laid out as the kernel
// lays it out, through the kernel's ldmatrix lane -> address mappings, then multiplied with
// mma.m16n8k16's documented semantics and compared with a plain matrix product.
//
// The PTX semantics are encoded here independently of mma_layout.h, from the PTX ISA tables
// ("Matrix Fragments for mma.m16n8k16 with floating point type", "ldmatrix"):
//   groupID g = lane >> 2, threadID_in_group t = lane % 4
//   A: element a_i (i = 0..7) is half (i % 2) of register i / 2;
//      row = g for 0 <= i < 2 or 4 <= i < 6, g + 8 otherwise; col = 2t + (i & 1) (+ 8 for i >= 4)
//   B: element b_i (i = 0..3) is half (i % 2) of register i / 2;
//      row = 2t + (i & 1) (+ 8 for i >= 2); col = g
//   C/D: element c_i (i = 0..3): row = g (+ 8 for i >= 2); col = 2t + (i & 1)
//   ldmatrix .x4: threads 8m .. 8m+7 give the row addresses of matrix m; register m of lane L
//      holds row L / 4, columns 2 (L % 4) and 2 (L % 4) + 1 of matrix m (low, high); with
//      .trans the matrix is transposed: register m of lane L holds elements [2 (L % 4)][L / 4]
//      and [2 (L % 4) + 1][L / 4].
// Runs without a device (built with the CUDA target, not labelled gpu).
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "ess/model/numerics.h"
#include "runtime/ops/sparse_mla/mma_layout.h"

namespace ess::cuda::mla {
namespace {

using Regs4 = std::array<std::uint32_t, 4>;
using Warp4 = std::array<Regs4, 32>;
using Acc = std::array<std::array<double, 4>, 32>;  // [lane][c_i]

// ---- the PTX semantics (independent of mma_layout.h) -------------------------------------------
int isa_a_row(int lane, int i) { return (lane >> 2) + ((i < 2 || (i >= 4 && i < 6)) ? 0 : 8); }
int isa_a_col(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 4 ? 8 : 0); }
int isa_b_row(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 2 ? 8 : 0); }
int isa_b_col(int lane, int /*i*/) { return lane >> 2; }
int isa_c_row(int lane, int i) { return (lane >> 2) + (i >= 2 ? 8 : 0); }
int isa_c_col(int lane, int i) { return (lane % 4) * 2 + (i & 1); }

std::uint16_t half_of(std::uint32_t reg, int h) { return static_cast<std::uint16_t>(h == 0 ? reg & 0xffffu : reg >> 16); }
std::uint32_t pack(std::uint16_t lo, std::uint16_t hi) { return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16); }

// ldmatrix.sync.aligned.m8n8.x4{.trans}.b16 over a shared-memory image of bf16 elements;
// addr[lane] is the element offset of the row that lane provides.
Warp4 ldmatrix_x4(const std::vector<std::uint16_t>& smem, const std::array<int, 32>& addr, bool trans) {
  Warp4 r{};
  for (int m = 0; m < 4; ++m) {
    // matrix m, row rr, column cc
    const auto at = [&](int rr, int cc) {
      const int a = addr[static_cast<std::size_t>(8 * m + rr)];
      EXPECT_EQ(a % 8, 0) << "ldmatrix row addresses must be 16-byte aligned";
      return smem.at(static_cast<std::size_t>(a + cc));
    };
    for (int lane = 0; lane < 32; ++lane) {
      const int row = lane / 4;
      const int c2 = 2 * (lane % 4);
      r[static_cast<std::size_t>(lane)][static_cast<std::size_t>(m)] =
          trans ? pack(at(c2, row), at(c2 + 1, row)) : pack(at(row, c2), at(row, c2 + 1));
    }
  }
  return r;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: d = A B + c, from fragments.
void mma(Acc& d, const Warp4& a, const std::array<std::array<std::uint32_t, 2>, 32>& b) {
  double A[16][16] = {};
  double B[16][8] = {};
  int seen_a[16][16] = {};
  int seen_b[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) {
      const std::uint32_t reg = a[static_cast<std::size_t>(lane)][static_cast<std::size_t>(i / 2)];
      A[isa_a_row(lane, i)][isa_a_col(lane, i)] = bf16_to_float(half_of(reg, i % 2));
      ++seen_a[isa_a_row(lane, i)][isa_a_col(lane, i)];
    }
    for (int i = 0; i < 4; ++i) {
      const std::uint32_t reg = b[static_cast<std::size_t>(lane)][static_cast<std::size_t>(i / 2)];
      B[isa_b_row(lane, i)][isa_b_col(lane, i)] = bf16_to_float(half_of(reg, i % 2));
      ++seen_b[isa_b_row(lane, i)][isa_b_col(lane, i)];
    }
  }
  for (auto& row : seen_a) {
    for (int s : row) ASSERT_EQ(s, 1);
  }
  for (auto& row : seen_b) {
    for (int s : row) ASSERT_EQ(s, 1);
  }
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      double acc = 0;
      for (int k = 0; k < 16; ++k) acc += A[isa_c_row(lane, i)][k] * B[k][isa_c_col(lane, i)];
      d[static_cast<std::size_t>(lane)][static_cast<std::size_t>(i)] += acc;
    }
  }
}

std::array<std::array<std::uint32_t, 2>, 32> b_pair(const Warp4& r, int first) {
  std::array<std::array<std::uint32_t, 2>, 32> b{};
  for (std::size_t l = 0; l < 32; ++l) b[l] = {r[l][static_cast<std::size_t>(first)], r[l][static_cast<std::size_t>(first + 1)]};
  return b;
}

// Bank-conflict freedom of one ldmatrix: each 8-lane phase reads 8 rows of 16 bytes; the 32
// 4-byte words must fall in 32 distinct banks.
void expect_conflict_free(const std::array<int, 32>& addr) {
  for (int m = 0; m < 4; ++m) {
    std::set<int> banks;
    for (int r = 0; r < 8; ++r) {
      const int byte = 2 * addr[static_cast<std::size_t>(8 * m + r)];
      for (int w = 0; w < 4; ++w) banks.insert((byte / 4 + w) % 32);
    }
    EXPECT_EQ(banks.size(), 32u) << "matrix " << m;
  }
}

std::uint16_t small_bf16(std::mt19937& rng) { return bf16_from_float(static_cast<float>(static_cast<int>(rng() % 9) - 4)); }

TEST(MmaLayout, AccumulatorMappingIsThePtxOne) {
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(frag_c_row(lane, i), isa_c_row(lane, i));
      EXPECT_EQ(frag_c_col(lane, i), isa_c_col(lane, i));
    }
  }
}

TEST(MmaLayout, SharedMemoryPlanFits) {
  EXPECT_EQ(kRowBytes % 16, 0);
  EXPECT_EQ(kSmemK % 128, 0);
  EXPECT_EQ(kSmemRaw % 16, 0);
  EXPECT_EQ(kSmemExchange % 16, 0);
  EXPECT_EQ(kRawTileBytes % 16, 0);
  EXPECT_LE(kSmemBytes, 227 * 1024);
  EXPECT_EQ(kSmemBytes, 207872);
  EXPECT_EQ(kEntryBytes, 41 * 16);
  // Score dims split in two halves of whole k-steps; output dims in two halves of n-tile pairs.
  EXPECT_EQ(kScoreDimsPerWarp % 16, 0);
  EXPECT_EQ(kOutDimsPerWarp % 16, 0);
}

TEST(MmaLayout, GatherAndDequantizationCoverEachByteOnce) {
  std::vector<int> raw(kRawTileBytes, 0);
  for (int tid = 0; tid < kThreads; ++tid) {
    for (int u = 0; u < kGatherSteps; ++u) {
      const int c = tid + u * kThreads;
      if (c >= kRawChunks) continue;
      const int e = c / kEntryChunks;
      const int k = c % kEntryChunks;
      // the kernel stores chunk c at byte 16 c: entry e's chunk k at e * 656 + 16 k
      EXPECT_EQ(16 * c, e * kEntryBytes + 16 * k);
      for (int x = 0; x < 16; ++x) ++raw[static_cast<std::size_t>(16 * c + x)];
    }
  }
  for (int v : raw) ASSERT_EQ(v, 1);
  // Dequantization: every (entry, value) of the tile written once, from its own tile scale.
  std::vector<int> k(static_cast<std::size_t>(kTileEntries) * kQkDim, 0);
  for (int tid = 0; tid < kThreads; ++tid) {
    for (int u = 0; u < kDequantSteps; ++u) {
      const int w = tid + u * kThreads;
      const int e = w >> 6;
      const int g = w & 63;
      ASSERT_LT(e, kTileEntries);
      EXPECT_EQ((g * 8) / 128, g >> 4);  // the scale index the kernel reads
      for (int x = 0; x < 8; ++x) ++k[static_cast<std::size_t>(e * kQkDim + g * 8 + x)];
    }
    const int e = tid >> 3;
    const int ch = tid & 7;
    for (int x = 0; x < 8; ++x) ++k[static_cast<std::size_t>(e * kQkDim + kNopeDim + ch * 8 + x)];
  }
  for (int v : k) ASSERT_EQ(v, 1);
}

// The score phase of every warp and the pair sum reproduce S = Q K^T for one tile.
TEST(MmaLayout, ScoresOfAllWarpsEqualQTimesKTransposed) {
  std::mt19937 rng(7);
  std::vector<std::uint16_t> q(static_cast<std::size_t>(kHeadsPerCta) * kRowElems, 0);
  std::vector<std::uint16_t> kt(static_cast<std::size_t>(kTileEntries) * kRowElems, 0);
  for (int h = 0; h < kHeadsPerCta; ++h) {
    for (int d = 0; d < kQkDim; ++d) q[static_cast<std::size_t>(tile_offset(h, d))] = small_bf16(rng);
  }
  for (int e = 0; e < kTileEntries; ++e) {
    for (int d = 0; d < kQkDim; ++d) kt[static_cast<std::size_t>(tile_offset(e, d))] = small_bf16(rng);
  }
  std::vector<double> s(static_cast<std::size_t>(kHeadsPerCta) * kTileEntries, 0.0);
  for (int warp = 0; warp < kWarps; ++warp) {
    const int rg = warp & 3;
    const int half = warp >> 2;
    std::array<Acc, 4> acc{};  // 4 n-tiles of 8 entries
    for (int kk = 0; kk < kScoreDimsPerWarp / 16; ++kk) {
      std::array<int, 32> qa{}, kb0{}, kb1{};
      for (int lane = 0; lane < 32; ++lane) {
        const auto l = static_cast<std::size_t>(lane);
        qa[l] = tile_offset(16 * rg + ldsm_a_row(lane), kScoreDimsPerWarp * half + ldsm_a_col(lane) + 16 * kk);
        kb0[l] = tile_offset(ldsm_b_row(lane), kScoreDimsPerWarp * half + ldsm_b_col(lane) + 16 * kk);
        kb1[l] = kb0[l] + 16 * kRowElems;  // entries 16-31
      }
      expect_conflict_free(qa);
      expect_conflict_free(kb0);
      const Warp4 a = ldmatrix_x4(q, qa, false);
      const Warp4 b0 = ldmatrix_x4(kt, kb0, false);
      const Warp4 b1 = ldmatrix_x4(kt, kb1, false);
      mma(acc[0], a, b_pair(b0, 0));
      mma(acc[1], a, b_pair(b0, 2));
      mma(acc[2], a, b_pair(b1, 0));
      mma(acc[3], a, b_pair(b1, 2));
    }
    for (int j = 0; j < 4; ++j) {
      for (int lane = 0; lane < 32; ++lane) {
        for (int i = 0; i < 4; ++i) {
          const int h = 16 * rg + frag_c_row(lane, i);
          const int e = 8 * j + frag_c_col(lane, i);
          s[static_cast<std::size_t>(h * kTileEntries + e)] +=
              acc[static_cast<std::size_t>(j)][static_cast<std::size_t>(lane)][static_cast<std::size_t>(i)];
        }
      }
    }
  }
  for (int h = 0; h < kHeadsPerCta; ++h) {
    for (int e = 0; e < kTileEntries; ++e) {
      double want = 0;
      for (int d = 0; d < kQkDim; ++d) {
        want += static_cast<double>(bf16_to_float(q[static_cast<std::size_t>(tile_offset(h, d))])) *
                bf16_to_float(kt[static_cast<std::size_t>(tile_offset(e, d))]);
      }
      ASSERT_EQ(s[static_cast<std::size_t>(h * kTileEntries + e)], want) << "head " << h << " entry " << e;
    }
  }
}

// P (held in score-accumulator layout) times V (the tile's nope part, ldmatrix.trans) for
// every warp reproduces O = P V over the warp's output dims.
TEST(MmaLayout, ValuesOfAllWarpsEqualPTimesV) {
  std::mt19937 rng(11);
  std::vector<std::uint16_t> kt(static_cast<std::size_t>(kTileEntries) * kRowElems, 0);
  for (int e = 0; e < kTileEntries; ++e) {
    for (int d = 0; d < kQkDim; ++d) kt[static_cast<std::size_t>(tile_offset(e, d))] = small_bf16(rng);
  }
  std::vector<std::uint16_t> p(static_cast<std::size_t>(kHeadsPerCta) * kTileEntries);
  for (auto& x : p) x = small_bf16(rng);
  std::vector<double> o(static_cast<std::size_t>(kHeadsPerCta) * kNopeDim, 0.0);
  for (int warp = 0; warp < kWarps; ++warp) {
    const int rg = warp & 3;
    const int half = warp >> 2;
    // The scores as the kernel holds them: s[n-tile j][lane][c_i], placed by the ISA's C layout.
    std::array<std::array<std::array<std::uint16_t, 4>, 32>, 4> s{};
    for (int j = 0; j < 4; ++j) {
      for (int lane = 0; lane < 32; ++lane) {
        for (int i = 0; i < 4; ++i) {
          s[static_cast<std::size_t>(j)][static_cast<std::size_t>(lane)][static_cast<std::size_t>(i)] =
              p[static_cast<std::size_t>((16 * rg + isa_c_row(lane, i)) * kTileEntries + 8 * j + isa_c_col(lane, i))];
        }
      }
    }
    std::array<Acc, kOutDimsPerWarp / 8> acc{};
    for (int kk = 0; kk < kTileEntries / 16; ++kk) {
      Warp4 pa{};
      for (int lane = 0; lane < 32; ++lane) {
        const auto l = static_cast<std::size_t>(lane);
        for (int r = 0; r < 4; ++r) {
          const auto& frag = s[static_cast<std::size_t>(p_tile(kk, r))][l];
          pa[l][static_cast<std::size_t>(r)] =
              pack(frag[static_cast<std::size_t>(p_elem(r))], frag[static_cast<std::size_t>(p_elem(r) + 1)]);
        }
      }
      for (int np = 0; np < kOutDimsPerWarp / 16; ++np) {
        std::array<int, 32> va{};
        for (int lane = 0; lane < 32; ++lane) {
          va[static_cast<std::size_t>(lane)] =
              tile_offset(16 * kk + ldsm_bt_row(lane), kOutDimsPerWarp * half + ldsm_bt_col(lane) + 16 * np);
        }
        expect_conflict_free(va);
        const Warp4 b = ldmatrix_x4(kt, va, true);
        mma(acc[static_cast<std::size_t>(2 * np)], pa, b_pair(b, 0));
        mma(acc[static_cast<std::size_t>(2 * np + 1)], pa, b_pair(b, 2));
      }
    }
    for (int j = 0; j < kOutDimsPerWarp / 8; ++j) {
      for (int lane = 0; lane < 32; ++lane) {
        for (int i = 0; i < 4; ++i) {
          const int h = 16 * rg + frag_c_row(lane, i);
          const int d = kOutDimsPerWarp * half + 8 * j + frag_c_col(lane, i);
          o[static_cast<std::size_t>(h * kNopeDim + d)] +=
              acc[static_cast<std::size_t>(j)][static_cast<std::size_t>(lane)][static_cast<std::size_t>(i)];
        }
      }
    }
  }
  for (int h = 0; h < kHeadsPerCta; ++h) {
    for (int d = 0; d < kNopeDim; ++d) {
      double want = 0;
      for (int e = 0; e < kTileEntries; ++e) {
        want += static_cast<double>(bf16_to_float(p[static_cast<std::size_t>(h * kTileEntries + e)])) *
                bf16_to_float(kt[static_cast<std::size_t>(tile_offset(e, d))]);
      }
      ASSERT_EQ(o[static_cast<std::size_t>(h * kNopeDim + d)], want) << "head " << h << " dim " << d;
    }
  }
}

}  // namespace
}  // namespace ess::cuda::mla
