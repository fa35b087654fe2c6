// The emulated device's streams: when the work issued to them runs.
//
// Order "issue" (the default): each operation runs when it is issued, so every stream runs in
// issue order and events only order what already happened. Order "lazy:SEED": an operation
// (a kernel, an async copy or memset, an event record or wait) is queued on its stream and runs
// only when a synchronization needs it (cudaStreamSynchronize, cudaEventSynchronize, a
// synchronous copy, a memset into pinned host memory, cudaFree, cudaDeviceSynchronize), and then only the operations
// that one needs, each after its stream's earlier work, the records its waits name and (a
// blocking stream and the legacy stream) each other's earlier work, chosen among the ready ones
// by a generator seeded with SEED. So work on a stream nobody waits for runs as late as the
// rules allow, and a read that forgot to wait for it sees the bytes from before it.
//
// The order comes from ESS_EMU_STREAM_ORDER at the first use, or set_stream_order (tests).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>

namespace ess::emu {

struct StreamOrder {
  bool lazy = false;
  std::uint64_t seed = 0;
  std::string describe() const;
  // "issue" or "lazy:SEED"; throws std::invalid_argument naming the value otherwise.
  static StreamOrder parse(const std::string& text);
};

// Runs every queued operation first (cudaDeviceSynchronize), then switches.
void set_stream_order(const StreamOrder& order);
StreamOrder stream_order();

// The work of one operation; its error becomes the device's last error and the next
// synchronization's result, as a failed kernel's does.
using Work = std::function<cudaError_t()>;

// Queues `work` on `stream`; in issue order runs it and returns its error (else cudaSuccess).
cudaError_t enqueue(cudaStream_t stream, const char* what, Work work);
void record_event(cudaEvent_t event, cudaStream_t stream);
void wait_event(cudaStream_t stream, cudaEvent_t event);
// Run what each needs; return the first error of the work run (cudaSuccess if none).
cudaError_t drain_stream(cudaStream_t stream);
cudaError_t drain_event(cudaEvent_t event);
cudaError_t drain_all();
// Whether the event's latest record has run (true when it was never recorded); runs nothing.
bool event_done(cudaEvent_t event);
void note_stream_flags(cudaStream_t stream, unsigned flags);
// A destroyed event's records are forgotten (a new event at its address starts unrecorded).
void forget_event(cudaEvent_t event);
std::size_t queued_operations();

}  // namespace ess::emu
