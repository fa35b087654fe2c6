// The GPU swap engine: the LRU decision for a whole batch of requests in one launch (one
// thread block per request), with no host synchronization, so a decode step can be
// captured in a CUDA graph. It implements exactly the semantics of the CPU engine
// (docs/architecture.md, "Exact semantics"): the same slot ids, the same miss plan in the
// same order, the same recency.
//
// Device state per request-layer (no per-token map; 12 bytes per slot):
//   order[S]          slots in ascending (recency, slot) order -- the CPU engine's LRU list
//   stamp[S]          recency: the step index of the slot's last use, -1 = never
//   token_of_slot[S]  resident token, -1 = empty
//   clock             the next step index
// Per step each block hashes its request's T x K selections in shared memory, scans the
// slots for hits, ranks the misses by first occurrence, takes victims from the front of
// `order`, and re-appends the working set in slot order -- O(T x K + S) per request. At a
// small batch a request's step is shared by a cluster of 2 to 8 blocks (the hash, the miss
// tokens and the slot flags spread over their shared memories, the scans joined across them),
// so batch 1 is decided on up to 8 SMs rather than one.
//
// Plain C++ declarations; kernels in swap_engine_gpu.cu.
#pragma once

#include <cstdint>
#include <vector>

#include "ess/cache/types.h"
#include "ess/ops/flashtrans.h"

namespace ess::cuda {

struct GpuSwapConfig {
  int rows = 0;              // Sparse Memory Pool rows (requests)
  int layers = 0;
  std::int32_t slots = 0;    // per request-layer
  // Largest T x K per launch (the shared-memory hash is sized for it). It may exceed `slots`:
  // a request's step then selects at most `slots` distinct ids (query groups); past them,
  // misses get no slot.
  int max_positions = 4096;
  int device = 0;
  // The blocks (a thread-block cluster) that decide one request's step: 0 = by the batch and the
  // step's size (swap_cluster_size: up to 8 at a small batch, 1 at a large one); 1, 2, 4 or 8 =
  // always that many (1: one block per request whatever the batch).
  int cluster = 0;
};

// One launch. Every pointer is device memory. Row r's state of `layer` is used.
struct GpuSwapStep {
  int layer = 0;
  int batch = 0;                          // B
  int query_tokens = 1;                   // T
  int topk = 0;                           // K
  const std::int32_t* rows = nullptr;     // [B] Sparse Memory Pool row of each batch position, -1 = padded
  const std::int32_t* ids = nullptr;      // [B][T][K] selected tokens, -1 = padding (validated)
  std::int32_t* slot_ids = nullptr;       // [B][T][K] out
  std::int32_t* fill_tokens = nullptr;    // [B][T*K] out: misses in canonical order
  std::int32_t* fill_slots = nullptr;     // [B][T*K] out
  std::uint64_t* fill_host_offsets = nullptr;  // [B][T*K] out, when page_table is given
  std::int32_t* counts = nullptr;         // [B][2] out: hits, misses
  // Total Memory Pool page tables mirrored on the device (optional):
  // page_table[(row * max_pages + token / 64) * layers + layer] = arena page (a new page's
  // entries of every layer are contiguous).
  const std::int32_t* page_table = nullptr;
  int max_pages = 0;
  std::uint64_t page_bytes = 0;
  std::uint64_t entry_bytes = 0;
};

struct SwapState;

class GpuSwapEngine {
 public:
  explicit GpuSwapEngine(const GpuSwapConfig& config, Stream stream = nullptr);
  ~GpuSwapEngine();
  GpuSwapEngine(const GpuSwapEngine&) = delete;
  GpuSwapEngine& operator=(const GpuSwapEngine&) = delete;

  // The device memory of the LRU state (order, recency, residency, clocks), as allocated.
  std::uint64_t device_bytes() const;

  // A fresh LRU for every layer of `row` (asynchronous on the engine's stream, or `stream`).
  void reset_row(int row);
  void reset_row(int row, Stream stream);
  // Launches one step on the engine's stream (or `stream`); returns at once. Throws only for
  // invalid shapes. A padded position (rows[b] = -1) gets slot ids -1 and counts 0.
  void step_async(const GpuSwapStep& step);
  void step_async(const GpuSwapStep& step, Stream stream);

  // Host conveniences for tests and tools (synchronous): ids are [B][T][K] host values.
  struct HostResult {
    std::vector<std::int32_t> slot_ids;
    std::vector<std::vector<MissEntry>> fills;  // per batch position, host_offset left 0
    std::vector<StepCounts> counts;
  };
  HostResult step(int layer, const std::vector<std::int32_t>& rows, int T, int K, const std::vector<std::int32_t>& ids);
  // LRU-Warmup of one request-layer: the windows ([W][K], oldest first) replayed on the
  // device as W steps with T = 1; returns one fill per slot whose token changed, in slot order.
  std::vector<MissEntry> warmup(int row, int layer, int K, const std::vector<std::int32_t>& windows);
  // The same enqueued on `stream`, every pointer device memory: `row_index` holds `row` (a step
  // reads its rows from the device), `ids` [W][K]; `before` is scratch of `slots` int32. Out:
  // the slots whose token changed, in slot order (`tokens`, `slots_out`, `count` of them).
  struct WarmupOut {
    std::int32_t* before = nullptr;
    std::int32_t* tokens = nullptr;
    std::int32_t* slots = nullptr;
    std::int32_t* count = nullptr;
    // The step's per-window outputs, scratch of K each (slot ids, miss tokens and slots) and 2 (counts).
    std::int32_t* step_slots = nullptr;
    std::int32_t* step_fill_tokens = nullptr;
    std::int32_t* step_fill_slots = nullptr;
    std::int32_t* step_counts = nullptr;
  };
  void warmup_async(int row, int layer, int K, const std::int32_t* row_index, const std::int32_t* ids, int W,
                    const WarmupOut& out, Stream stream);

  struct HostState {
    std::vector<std::int32_t> order, token_of_slot;
    std::vector<std::int64_t> recency;
    std::int32_t clock = 0;
  };
  HostState download(int row, int layer) const;

  const GpuSwapConfig& config() const { return config_; }
  // The blocks that decide each request of a step (GpuSwapConfig::cluster).
  int cluster_size(const GpuSwapStep& step) const;

 private:
  SwapState state() const;
  GpuSwapConfig config_;
  Stream stream_;
  int multiprocessors_ = 1;
  int cluster_limit_ = 1;  // the largest cluster the device holds (swap_step_cluster_limit)
  void free_state();
  std::int32_t* order_ = nullptr;
  std::int32_t* stamp_ = nullptr;
  std::int32_t* token_ = nullptr;
  std::int32_t* clock_ = nullptr;
};

}  // namespace ess::cuda
