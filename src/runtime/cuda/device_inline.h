// The qualifiers of code compiled twice: as CUDA device code by nvcc, and as plain C++ for the
// CPU's CTA emulator (src/testing/emulator) and the host references. A kernel's block program
// (the *_cta.h headers) and the helpers it shares with the host use these, and nothing else of
// the compiler.
#pragma once

#if defined(__CUDACC__)
#define ESS_DEVICE_INLINE __device__ __forceinline__  // device code; inline C++ on the host
#define ESS_HOST_DEVICE __host__ __device__           // callable from both
#define ESS_UNROLL _Pragma("unroll")
#define ESS_UNROLL_2 _Pragma("unroll 2")
#else
#define ESS_DEVICE_INLINE inline
#define ESS_HOST_DEVICE
#define ESS_UNROLL
#define ESS_UNROLL_2
#endif
