// The emulated CUDA target's stand-in for <cuda_runtime.h>: the part of the CUDA runtime API
// that ESS's host code calls, served by a CPU "device" (src/testing/emulated_cuda/device.h).
// Found before the CUDA toolkit's header by the emulated target's sources only. The functions
// have C++ linkage, so they never bind to libcudart's C symbols.
//
// What the device does: memory from cudaMalloc / cudaHostAlloc is host memory, poisoned and
// framed by guard bytes (checked at every synchronization and free); copies check that their
// device side lies inside one allocation; kernels run their CTA programs on the CTA emulator
// (the launchers in kernels.cc). When the work on each stream runs is streams.h's: at once, in
// issue order (the default), or, with ESS_EMU_STREAM_ORDER=lazy:SEED, only when a
// synchronization needs it, in a seeded order that stream order and event waits allow.
#pragma once

#include <cstddef>

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotSupported = 801,
};
using cudaError = cudaError_t;

struct CUstream_st;
struct CUevent_st;
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;

#define cudaStreamLegacy (reinterpret_cast<cudaStream_t>(0x1))
#define cudaStreamPerThread (reinterpret_cast<cudaStream_t>(0x2))

inline constexpr unsigned cudaStreamDefault = 0x0;
inline constexpr unsigned cudaStreamNonBlocking = 0x1;
inline constexpr unsigned cudaEventDefault = 0x0;
inline constexpr unsigned cudaEventDisableTiming = 0x2;
inline constexpr unsigned cudaHostAllocDefault = 0x0;
inline constexpr unsigned cudaHostAllocPortable = 0x1;
inline constexpr unsigned cudaHostAllocMapped = 0x2;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

// The emulated target captures no graphs: a stream is never capturing.
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};

enum cudaDeviceAttr {
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

struct cudaFuncAttributes {
  std::size_t sharedSizeBytes = 0;
  int maxDynamicSharedSizeBytes = 0;
};

struct cudaDeviceProp {
  char name[256] = {};
  int multiProcessorCount = 0;
  std::size_t sharedMemPerBlockOptin = 0;
  int major = 0, minor = 0;
};

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);

cudaError_t cudaMalloc(void** p, std::size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaHostAlloc(void** p, std::size_t bytes, unsigned flags);
cudaError_t cudaMallocHost(void** p, std::size_t bytes);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaHostGetDevicePointer(void** device, void* host, unsigned flags);
cudaError_t cudaMemset(void* p, int value, std::size_t bytes);
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t stream = nullptr);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned flags, int priority);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags = 0);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status);

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
// cudaSuccess once the work the event's latest record follows has run (or it was never
// recorded), else cudaErrorNotReady; runs nothing.
cudaError_t cudaEventQuery(cudaEvent_t event);

// The typed overloads of <cuda_runtime.h>.
template <typename T>
cudaError_t cudaMalloc(T** p, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
template <typename T>
cudaError_t cudaHostAlloc(T** p, std::size_t bytes, unsigned flags) {
  return cudaHostAlloc(reinterpret_cast<void**>(p), bytes, flags);
}
template <typename T>
cudaError_t cudaMallocHost(T** p, std::size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}

// Kernel attributes: the emulated kernels have no static shared memory to subtract (their
// launchers check the dynamic size against the device's limit themselves).
template <typename Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, Kernel*) {
  if (attr == nullptr) return cudaErrorInvalidValue;
  *attr = cudaFuncAttributes{};
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel*, cudaFuncAttribute, int) {
  return cudaSuccess;
}
