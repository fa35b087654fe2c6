// The PTX the kernels share (CUDA sources only): shared-window addresses, cp.async groups and
// ldmatrix. Each kernel's primitives policy (its DevicePrims) calls these.
#pragma once

#include <cstdint>

namespace ess::cuda::ptx {

__device__ __forceinline__ std::uint32_t smem_u32(const void* ptr) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy, cached in L2 only (.cg).
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// The same with a source size: the first src_bytes are copied, the rest of the 16 zero-filled
// (0: nothing is read; src must still be a valid address).
__device__ __forceinline__ void cp_async_16_zfill(std::uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Every committed group but the newest N is complete.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8 x 16-byte matrices; lane l supplies the row address of matrix l / 8, row l % 8, and
// receives 4 bytes (bytes 4 * (l % 4) ..) of row l / 4 of each matrix (.trans: of column l / 4).
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

}  // namespace ess::cuda::ptx
