#include <cuda_runtime.h>

#include <cstdint>

#include "harness/rig/fills.h"

namespace ess::rig {
namespace {

__device__ inline std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

__device__ inline float unit(std::uint64_t i, std::uint64_t seed) {  // [0, 1)
  return static_cast<float>(mix(i * 0x9E3779B97F4A7C15ULL + seed) >> 40) * (1.0f / 16777216.0f);
}

__global__ void fill_bf16_kernel(std::uint16_t* p, std::size_t n, float scale, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float v = (2.0f * unit(i, seed) - 1.0f) * scale;
    p[i] = static_cast<std::uint16_t>(__float_as_uint(v) >> 16);  // truncation is fine for stand-ins
  }
}

__global__ void fill_fp8_kernel(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    // e4m3 with exponent field <= 8 (|x| < 4) and a random sign and mantissa: never NaN.
    const auto r = static_cast<std::uint32_t>(mix(i + seed * 0x632BE59BD9B4E019ULL));
    p[i] = static_cast<std::uint8_t>((r & 0x80u) | (((r >> 8) % 9u) << 3) | ((r >> 16) & 7u));
  }
}

__global__ void fill_f32_kernel(float* p, std::size_t n, float lo, float hi, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    p[i] = lo + (hi - lo) * unit(i, seed);
  }
}

int grid_for(std::size_t n) {
  const std::size_t g = (n + 255) / 256;
  return static_cast<int>(g < 4096 ? (g > 0 ? g : 1) : 4096);
}

}  // namespace

int fill_bf16(std::uint16_t* p, std::size_t n, float scale, std::uint64_t seed, cuda::Stream stream) {
  if (n == 0) return cudaSuccess;
  fill_bf16_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(p, n, scale, seed);
  return cudaGetLastError();
}

int fill_fp8(std::uint8_t* p, std::size_t n, std::uint64_t seed, cuda::Stream stream) {
  if (n == 0) return cudaSuccess;
  fill_fp8_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(p, n, seed);
  return cudaGetLastError();
}

int fill_f32(float* p, std::size_t n, float lo, float hi, std::uint64_t seed, cuda::Stream stream) {
  if (n == 0) return cudaSuccess;
  fill_f32_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(p, n, lo, hi, seed);
  return cudaGetLastError();
}

}  // namespace ess::rig
