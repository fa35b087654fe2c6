// The emulated CUDA runtime API (include/cuda_runtime.h) over the CPU device (device.h).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "device.h"
#include "streams.h"

using ess::emu::Device;

namespace {

Device& dev() { return Device::get(); }

cudaError_t bad(const std::string& what, bool bug = true) { return dev().fail(cudaErrorInvalidValue, what, bug); }

// A copy's device side must lie inside one allocation; its host side is the caller's. Checked
// when the copy is issued; the bytes move when it runs.
cudaError_t check_copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, const char* call) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return bad(std::string(call) + ": a null pointer");
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDefault) {
    // Unified addressing: whichever side is an allocation is checked as one.
  } else if (kind != cudaMemcpyHostToHost && !dst_dev && !src_dev) {
    return bad(std::string(call) + ": unknown copy kind " + std::to_string(static_cast<int>(kind)));
  }
  if (dst_dev && dev().find(dst, bytes) == nullptr) {
    return bad(std::string(call) + ": destination [" + std::to_string(reinterpret_cast<std::uintptr_t>(dst)) + ", +" +
               std::to_string(bytes) + ") is not inside one device allocation");
  }
  if (src_dev && dev().find(src, bytes) == nullptr) {
    return bad(std::string(call) + ": source [" + std::to_string(reinterpret_cast<std::uintptr_t>(src)) + ", +" +
               std::to_string(bytes) + ") is not inside one device allocation");
  }
  return cudaSuccess;
}

// Issues a copy on `stream` (streams.h: run now, or when a synchronization needs it). As CUDA's,
// a copy from pageable host memory (not an allocation of the device) takes its bytes when issued,
// and one into pageable host memory returns only when it is done.
cudaError_t copy_on(cudaStream_t stream, void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, const char* call) {
  if (const cudaError_t f = dev().injected("cudaMemcpy"); f != cudaSuccess) return f;
  if (const cudaError_t e = check_copy(dst, src, bytes, kind, call); e != cudaSuccess || bytes == 0) return e;
  ess::emu::Work work;
  if (dev().find(src, bytes) == nullptr) {
    const auto* s = static_cast<const std::uint8_t*>(src);
    auto staged = std::make_shared<std::vector<std::uint8_t>>(s, s + bytes);
    work = [=] {
      std::memmove(dst, staged->data(), bytes);
      return cudaSuccess;
    };
  } else {
    work = [=] {
      std::memmove(dst, src, bytes);
      return cudaSuccess;
    };
  }
  const cudaError_t e = ess::emu::enqueue(stream, call, std::move(work));
  if (e != cudaSuccess || dev().find(dst, bytes) != nullptr) return e;
  return ess::emu::drain_stream(stream);
}

cudaError_t sync(const std::string& when) {
  return dev().check_guards(when) ? cudaSuccess : dev().fail(cudaErrorIllegalAddress, when + ": out-of-range write", false);
}

// A synchronization: the work it waited for ran (its first error, already reported, is the
// result), else the guards are checked.
cudaError_t after(cudaError_t ran, const std::string& when) { return ran != cudaSuccess ? ran : sync(when); }

cudaError_t check_stream(cudaStream_t s, const char* call) {
  return dev().valid_stream(s) ? cudaSuccess
                               : dev().fail(cudaErrorInvalidResourceHandle, std::string(call) + ": not a live stream", true);
}

}  // namespace

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return bad("cudaGetDeviceCount: null");
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return bad("cudaGetDevice: null");
  *device = dev().current_device();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device != 0) return dev().fail(cudaErrorInvalidDevice, "cudaSetDevice: the emulated target has device 0 only", false);
  dev().set_current_device(device);
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return bad("cudaGetDeviceProperties: null");
  if (device != 0) return dev().fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties: no such device", false);
  *prop = cudaDeviceProp{};
  std::strncpy(prop->name, "ESS emulated CUDA device (CPU)", sizeof prop->name - 1);
  prop->multiProcessorCount = Device::kMultiprocessors;
  prop->sharedMemPerBlockOptin = Device::kSharedMemoryOptin;
  prop->major = 9;
  prop->minor = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr) return bad("cudaDeviceGetAttribute: null");
  if (device != 0) return dev().fail(cudaErrorInvalidDevice, "cudaDeviceGetAttribute: no such device", false);
  switch (attr) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = Device::kSharedMemoryOptin; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = Device::kSharedMemoryDefault; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = Device::kMultiprocessors; return cudaSuccess;
  }
  return bad("cudaDeviceGetAttribute: attribute " + std::to_string(static_cast<int>(attr)) + " is not emulated");
}

cudaError_t cudaDeviceSynchronize() {
  if (const cudaError_t f = dev().injected("cudaDeviceSynchronize"); f != cudaSuccess) return f;
  return after(ess::emu::drain_all(), "cudaDeviceSynchronize");
}
cudaError_t cudaGetLastError() { return dev().take_last_error(); }
cudaError_t cudaPeekAtLastError() { return dev().peek_last_error(); }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
  }
  return "unrecognized error code";
}

cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  if (const cudaError_t f = dev().injected("cudaMalloc"); f != cudaSuccess) return f;
  if (p == nullptr) return bad("cudaMalloc: null");
  *p = dev().allocate(bytes, Device::Kind::kDevice);
  return *p != nullptr ? cudaSuccess : dev().fail(cudaErrorMemoryAllocation, "cudaMalloc", false);
}

// cudaFree and cudaFreeHost synchronize the device first, as CUDA's do.
cudaError_t cudaFree(void* p) {
  ess::emu::drain_all();
  return dev().release(p, Device::Kind::kDevice, "cudaFree") ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaHostAlloc(void** p, std::size_t bytes, unsigned) {
  if (const cudaError_t f = dev().injected("cudaHostAlloc"); f != cudaSuccess) return f;
  if (p == nullptr) return bad("cudaHostAlloc: null");
  *p = dev().allocate(bytes, Device::Kind::kPinnedHost);
  return *p != nullptr ? cudaSuccess : dev().fail(cudaErrorMemoryAllocation, "cudaHostAlloc", false);
}

cudaError_t cudaMallocHost(void** p, std::size_t bytes) { return cudaHostAlloc(p, bytes, cudaHostAllocDefault); }

cudaError_t cudaFreeHost(void* p) {
  ess::emu::drain_all();
  return dev().release(p, Device::Kind::kPinnedHost, "cudaFreeHost") ? cudaSuccess : cudaErrorInvalidValue;
}

// Mapped pinned memory is addressed by the device at the host's own address (unified
// addressing, as on every 64-bit CUDA platform); anything else has no device view.
cudaError_t cudaHostGetDevicePointer(void** device, void* host, unsigned) {
  if (device == nullptr) return bad("cudaHostGetDevicePointer: null");
  const Device::Allocation* a = dev().find(host, 1);
  if (a == nullptr || a->kind != Device::Kind::kPinnedHost) {
    return dev().fail(cudaErrorInvalidValue, "cudaHostGetDevicePointer: not pinned host memory", false);
  }
  *device = host;
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t stream) {
  if (const cudaError_t f = dev().injected("cudaMemset"); f != cudaSuccess) return f;
  if (const cudaError_t e = check_stream(stream, "cudaMemsetAsync"); e != cudaSuccess) return e;
  if (bytes == 0) return cudaSuccess;
  if (dev().find(p, bytes) == nullptr) return bad("cudaMemset: the range is not inside one allocation");
  return ess::emu::enqueue(stream, "cudaMemset", [=] {
    std::memset(p, value, bytes);
    return cudaSuccess;
  });
}

// On the legacy stream; as CUDA's, asynchronous with respect to the host unless the target is
// pinned host memory.
cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  if (const cudaError_t e = cudaMemsetAsync(p, value, bytes, cudaStreamLegacy); e != cudaSuccess) return e;
  const Device::Allocation* a = dev().find(p, bytes);
  return a != nullptr && a->kind == Device::Kind::kPinnedHost ? ess::emu::drain_stream(cudaStreamLegacy) : cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  if (const cudaError_t e = copy_on(cudaStreamLegacy, dst, src, bytes, kind, "cudaMemcpy"); e != cudaSuccess) return e;
  return ess::emu::drain_stream(cudaStreamLegacy);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  if (const cudaError_t e = check_stream(stream, "cudaMemcpyAsync"); e != cudaSuccess) return e;
  return copy_on(stream, dst, src, bytes, kind, "cudaMemcpyAsync");
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
  if (const cudaError_t f = dev().injected("cudaStreamCreate"); f != cudaSuccess) return f;
  if (stream == nullptr) return bad("cudaStreamCreate: null");
  *stream = dev().create_stream();
  ess::emu::note_stream_flags(*stream, flags);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned flags, int) {
  return cudaStreamCreateWithFlags(stream, flags);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  return dev().destroy_stream(stream) ? cudaSuccess
                                      : dev().fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: not a live stream", true);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (const cudaError_t f = dev().injected("cudaStreamSynchronize"); f != cudaSuccess) return f;
  if (const cudaError_t e = check_stream(stream, "cudaStreamSynchronize"); e != cudaSuccess) return e;
  return after(ess::emu::drain_stream(stream), "cudaStreamSynchronize");
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) {
  if (const cudaError_t f = dev().injected("cudaStreamWaitEvent"); f != cudaSuccess) return f;
  if (const cudaError_t e = check_stream(stream, "cudaStreamWaitEvent"); e != cudaSuccess) return e;
  if (!dev().valid_event(event)) return dev().fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: not a live event", true);
  ess::emu::wait_event(stream, event);
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  if (const cudaError_t f = dev().injected("cudaStreamIsCapturing"); f != cudaSuccess) return f;
  if (const cudaError_t e = check_stream(stream, "cudaStreamIsCapturing"); e != cudaSuccess) return e;
  if (status == nullptr) return bad("cudaStreamIsCapturing: null");
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
  if (const cudaError_t f = dev().injected("cudaEventCreate"); f != cudaSuccess) return f;
  if (event == nullptr) return bad("cudaEventCreate: null");
  *event = dev().create_event();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  ess::emu::forget_event(event);
  return dev().destroy_event(event) ? cudaSuccess
                                    : dev().fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy: not a live event", true);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (const cudaError_t f = dev().injected("cudaEventRecord"); f != cudaSuccess) return f;
  if (const cudaError_t e = check_stream(stream, "cudaEventRecord"); e != cudaSuccess) return e;
  if (!dev().valid_event(event)) return dev().fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: not a live event", true);
  ess::emu::record_event(event, stream);
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (const cudaError_t f = dev().injected("cudaEventSynchronize"); f != cudaSuccess) return f;
  if (!dev().valid_event(event)) return dev().fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: not a live event", true);
  return after(ess::emu::drain_event(event), "cudaEventSynchronize");
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (const cudaError_t f = dev().injected("cudaEventQuery"); f != cudaSuccess) return f;
  if (!dev().valid_event(event)) return dev().fail(cudaErrorInvalidResourceHandle, "cudaEventQuery: not a live event", true);
  return ess::emu::event_done(event) ? cudaSuccess : cudaErrorNotReady;
}
