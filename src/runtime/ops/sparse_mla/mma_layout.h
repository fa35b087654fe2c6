// Index math of the sparse MLA decode kernel (sparse_mla.cu) that is easy to get wrong and
// cannot be watched on a device: the shared-memory layout of its tiles, the lane -> row
// address mapping it gives `ldmatrix`, and the (row, column) of each accumulator element of
// `mma.sync.m16n8k16` that the softmax and the epilogue use. Plain constexpr functions,
// compiled for the device by nvcc and for the host by the C++ compiler, so that
// mma_layout_test.cc can emulate a warp on the CPU: build fragments from a
// shared-memory image through these mappings, apply the PTX ISA's fragment semantics
// (encoded independently in the test) and compare with a plain matrix product.
//
// PTX facts the mappings rely on (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
// point type" and "ldmatrix"); g = lane / 4, t = lane % 4, "low" = bits 0-15 of a register:
//   A (16x16, row-major, 4 regs): reg0 = A[g][2t, 2t+1], reg1 = A[g+8][2t, 2t+1],
//                                  reg2 = A[g][2t+8, 2t+9], reg3 = A[g+8][2t+8, 2t+9]
//   B (16x8, "col", 2 regs):       reg0 = B[2t, 2t+1][g],  reg1 = B[2t+8, 2t+9][g]
//   C/D (16x8 fp32, 4 regs):       c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
//   ldmatrix.x4: lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i (16 bytes each);
//     destination register i of lane L holds matrix i's row L/4, elements 2(L%4), 2(L%4)+1;
//     with .trans it holds matrix i's elements [2(L%4)][L/4] and [2(L%4)+1][L/4].
// In every packed pair the lower-indexed element is in the low half.
#pragma once

#include "runtime/cuda/device_inline.h"

namespace ess::cuda::mla {

// ---- problem constants (DeepSeek-V3.2 absorbed MLA) -----------------------------------------
inline constexpr int kNopeDim = 512;                 // value dims = latent dims
inline constexpr int kRopeDim = 64;
inline constexpr int kQkDim = kNopeDim + kRopeDim;   // 576
inline constexpr int kEntryBytes = 656;              // LatentLayout: 512 FP8 + 4 fp32 + 64 bf16
inline constexpr int kEntryChunks = kEntryBytes / 16;  // 41 16-byte chunks
inline constexpr int kScaleOffset = 512;
inline constexpr int kRopeOffset = 528;

// ---- CTA tiling -----------------------------------------------------------------------------
inline constexpr int kHeadsPerCta = 64;   // one head block
inline constexpr int kTileEntries = 32;   // K ids per pipeline step
inline constexpr int kWarps = 8;          // 4 row groups (16 heads) x 2 halves
inline constexpr int kThreads = kWarps * 32;
// Warp w: row group w % 4 (heads 16 (w % 4) .. + 15 of the block); half w / 4 computes the
// partial scores over dims [288 half, 288 half + 288) and owns output dims
// [256 half, 256 half + 256).
inline constexpr int kScoreDimsPerWarp = kQkDim / 2;   // 288 = 18 k-steps of 16
inline constexpr int kOutDimsPerWarp = kNopeDim / 2;   // 256 = 32 n-tiles of 8

// ---- shared memory --------------------------------------------------------------------------
// Q (64 x 576) and the dequantized K tile (32 x 576) are bf16, row-major, with each row padded
// by 16 bytes: the row stride (1168 B = 292 words) moves consecutive rows by 4 banks, so the
// 8 rows of an ldmatrix 8x8 matrix (16 bytes each, same columns) cover all 32 banks once.
inline constexpr int kRowElems = kQkDim + 8;           // 584 bf16
inline constexpr int kRowBytes = kRowElems * 2;        // 1168
ESS_HOST_DEVICE constexpr int tile_offset(int row, int col) { return row * kRowElems + col; }  // in bf16

inline constexpr int kQBytes = kHeadsPerCta * kRowBytes;                 // 74,752
inline constexpr int kKTileBytes = kTileEntries * kRowBytes;             // 37,376 (x2 buffers)
inline constexpr int kRawTileBytes = kTileEntries * kEntryBytes;         // 20,992 (x2 buffers)
inline constexpr int kExchangeBytes = kWarps * 16 * 32 * 4;              // 16,384: partial scores
inline constexpr int kSmemQ = 0;
inline constexpr int kSmemK = kSmemQ + kQBytes;
inline constexpr int kSmemRaw = kSmemK + 2 * kKTileBytes;
inline constexpr int kSmemExchange = kSmemRaw + 2 * kRawTileBytes;
inline constexpr int kSmemBytes = kSmemExchange + kExchangeBytes;         // 207,872

// ---- ldmatrix.x4 lane -> row address (row, col of the 8-element row segment) ------------------
// A operand, a 16x16 block of a row-major [m][k] matrix: matrices (rows 0-7, k 0-7),
// (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) -> a0..a3.
ESS_HOST_DEVICE constexpr int ldsm_a_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
ESS_HOST_DEVICE constexpr int ldsm_a_col(int lane) { return (lane >> 4) * 8; }
// B operands of two adjacent n-tiles (n 0-7 and 8-15) x k 0-15 from a row-major [n][k] matrix
// (QK^T: n = entry, k = dim): matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
// (n 8-15, k 8-15) -> b0, b1 of n-tile 0, then b0, b1 of n-tile 1.
ESS_HOST_DEVICE constexpr int ldsm_b_row(int lane) { return (lane & 7) + (lane >> 4) * 8; }
ESS_HOST_DEVICE constexpr int ldsm_b_col(int lane) { return ((lane >> 3) & 1) * 8; }
// B operands of two n-tiles from a row-major [k][n] matrix with ldmatrix .trans (PV: k =
// entry, n = value dim): matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15),
// (k 8-15, n 8-15) -> b0, b1 of n-tile 0, then b0, b1 of n-tile 1.
ESS_HOST_DEVICE constexpr int ldsm_bt_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }  // k
ESS_HOST_DEVICE constexpr int ldsm_bt_col(int lane) { return (lane >> 4) * 8; }                    // n

// ---- accumulator element i (0..3) of a lane: its (row, column) in the 16x8 tile --------------
ESS_HOST_DEVICE constexpr int frag_c_row(int lane, int i) { return (lane >> 2) + (i >> 1) * 8; }
ESS_HOST_DEVICE constexpr int frag_c_col(int lane, int i) { return (lane & 3) * 2 + (i & 1); }

// ---- P from the score accumulators --------------------------------------------------------
// The scores of a warp are 4 n-tiles (entries 8j .. 8j+7, j = 0..3) of C fragments. The A
// operand of k-step kk (entries 16kk .. 16kk+15) of P V is register r of
//   pack(C[n-tile p_tile(kk, r)][p_elem(r)], C[same][p_elem(r) + 1])
// i.e. reg0 = tile 2kk (c0, c1), reg1 = tile 2kk (c2, c3), reg2 = tile 2kk+1 (c0, c1),
// reg3 = tile 2kk+1 (c2, c3): the C layout of two adjacent n-tiles is the A layout of one
// k16 step.
ESS_HOST_DEVICE constexpr int p_tile(int kk, int reg) { return 2 * kk + (reg >> 1); }
ESS_HOST_DEVICE constexpr int p_elem(int reg) { return (reg & 1) * 2; }

// ---- the gather of one tile --------------------------------------------------------------------
// 16-byte chunk c (0 .. 32*41-1) of a raw tile is chunk c % 41 of entry c / 41, stored at byte
// 16c: the raw tile is the 32 entries back to back, exactly as in the slot array.
inline constexpr int kRawChunks = kTileEntries * kEntryChunks;  // 1312
inline constexpr int kGatherSteps = (kRawChunks + kThreads - 1) / kThreads;  // 6

// The dequantization of one tile: 32 entries x 64 groups of 8 FP8 values; group w
// (0..2047) is entry w / 64, values 8 (w % 64) .. + 7, tile scale (w % 64) / 16.
inline constexpr int kDequantGroups = kTileEntries * (kNopeDim / 8);  // 2048
inline constexpr int kDequantSteps = kDequantGroups / kThreads;      // 8
static_assert(kDequantGroups % kThreads == 0);
static_assert(kTileEntries * (kRopeDim * 2 / 16) == kThreads, "one rope chunk per thread");

}  // namespace ess::cuda::mla
