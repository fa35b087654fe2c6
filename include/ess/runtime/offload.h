// The per-layer step a serving engine calls: ESS's offloaded latent cache behind one object.
//
// The engine's indexer picks each query token's top-k logical token ids; Offload::step turns
// them into buffer rows, the rows of the layer's device latent buffer that FlashMLA's sparse
// decode reads (its `indices`), after fetching the misses from the pinned Total Memory Pool
// with FlashTrans, all on the engine's stream. Offload::write_back copies the entries the
// model wrote this step back to the host pool. Requests are admitted (with LRU-Warmup from
// the prefill's top-k), extended as decode appends tokens, and released.
//
// Shapes. A step serves a static batch of B positions (padded positions included, so shapes
// stay fixed under CUDA graphs): position b is pool row rows[b] (-1 = padded: skipped, its
// outputs -1), holds lengths[b] tokens and has T query tokens (MTP) of K ids each; ids are
// -1 (padding) or in [0, lengths[b]). lengths[b] is the request's length, or on foreign pages from
// 1 to it (the other engine may give the pages of tokens its device has not confirmed yet, vLLM's
// async scheduling with drafts: the step serves the first lengths[b], its newest T before that). Pool row r's slots are the buffer rows [r x rows_per_request(), ... + slots) of
// each layer's buffer (with regions, the rows of the blocks Offload::place gave it: PoolRows); with reserve_newest, the T rows after them (its reserved rows) hold the step's newest
// tokens (HiSparse's reserved slot): an id among a position's T newest tokens maps there,
// outside the LRU, whose rules (docs/architecture.md, "Exact semantics") hold for every other
// id. Slot and row indices are int32 (no 32K cap); addresses are 64-bit.
//
// Residency (OffloadConfig::residency). A whole request's ids map to its own rows (whole_units:
// `slots` tokens per pool row it takes), its newest T to its reserved rows, with no LRU and no
// copy; write_back also copies the newest entries into their own rows. A demoted request's LRU
// is LRU-Warmup over the query rows it selected while whole. Admission, growth and release move
// requests between the two as the mode says (docs/architecture.md, "Residency").
//
// Streams and graphs (CUDA backend). step and write_back enqueue on the given stream and
// return: no host synchronization, no allocation, no host-visible data dependence, so they
// can be captured in a CUDA graph and replayed. Their argument pointers are device memory
// and must stay valid (same addresses) for every replay. The lifecycle calls (admit, warmup,
// extend, release, ...) are host calls made between steps and are never captured. By default
// each waits for the device before it returns (the device is idle before and after it). With
// set_lifecycle_stream they are stream-ordered instead: their device work (the LRU resets,
// table uploads from pinned staging, LRU-Warmup on the GPU swap engine, the loads from the host
// pool) is enqueued on that stream and they return without waiting, so an admission does not
// wait for the forward in flight. The engine issues its steps on that stream, or orders them
// after it; work it issued on other streams that touches a request's rows or host pages
// (a write-back on a side stream) it orders before the lifecycle stream before calling. Two
// calls still wait for the stream: truncate (it zeroes and frees host entries a write-back
// enqueued earlier may still write) and a demotion (it reads back the query rows the request
// recorded while whole). A released request's host pages return to the pool once the stream
// has passed the release (checked without waiting at later releases, admissions and growth;
// waited for only when an admission or growth needs them; until then they count in
// stats().host_bytes_used; the id itself may be admitted again at once). Its prefix-cache holds
// end at the release itself, and retained prefix pages are evicted for room only when the
// retiring pages would not be enough either, so the prefix cache evolves as with a waiting
// lifecycle. A release's promotion and an admission's demotion change other requests' rows:
// steps or write-backs of those in flight on other streams the engine orders before the
// lifecycle stream too.
//
// Backends. kCpu keeps everything in host memory and runs synchronously (the stream is
// ignored, every pointer is host memory); kCuda needs the CUDA backend and a device. For
// valid input the two give the same rows, bit for bit. Invalid input: kCpu throws ess::Error
// naming the position and leaves every state unchanged; kCuda, which cannot check without
// synchronizing, treats ids outside [-1, length) as padding, and so a position whose request has no
// region yet (regions): nothing is served for it or written back from it.
//
// Thread safety: one thread at a time per Offload.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "ess/cache/host_memory.h"
#include "ess/cache/total_pool.h"
#include "ess/cache/types.h"
#include "ess/model/entry_layout.h"
#include "ess/model/model_spec.h"
#include "ess/ops/flashtrans.h"
#include "ess/ops/row_layout.h"
#include "ess/runtime/residency.h"

namespace ess {

enum class Backend { kCpu, kCuda };


// The device latent buffer of every layer: FlashMLA's KV cache viewed as buffer rows of
// layout.bytes() bytes, one base per layer, placed by `rows` (RowLayout). Empty layer_base: ESS
// allocates a contiguous buffer per layer itself (Offload::buffer() gives it).
//
// A buffer may keep each entry in two parts (RowTail; DeepSeek-V4's C4 pages: values and scales
// in separate runs of a page; K and V in two tensors): with tail_base (one per layer, the
// caller's buffers only), row p's first tail.head_bytes lie at layer_base + rows.offset(p) and
// its next tail.bytes at tail_base + tail.rows.offset(p); the host pool holds entries whole
// (layout.bytes(): head, tail, padding). tail.head and tail.delta are ESS's to fill.
//
// Regions (OffloadConfig::region_blocks > 0): the buffer is another engine's paged cache (vLLM's
// hot slab), `blocks` blocks of rows.block_rows rows, and each request's rows lie in blocks that
// engine hands it (Offload::place), not at row x rows_per_request.
struct LatentBuffer {
  std::vector<std::uint8_t*> layer_base;
  RowLayout rows;
  std::int64_t blocks = 0;  // the caller's buffer's blocks; needed with regions (their ids are checked against it)
  std::vector<std::uint8_t*> tail_base;
  RowTail tail{};
  bool split() const { return !tail_base.empty(); }
  // Where layer `layer`'s tails are, for FlashTrans (EntryCopy::src_tail / dst_tail); not split: none.
  RowTail tail_of(int layer) const;
};

struct OffloadConfig {
  int layers = 0;
  LatentLayout layout;             // 656-byte entries for DeepSeek-V3.2
  std::int32_t max_requests = 0;   // pool rows
  int query_tokens = 1;            // T: query tokens per request per step (MTP)
  int topk = 2048;                 // K: ids per query token
  std::int32_t slots = 0;          // LRU-managed slots per request-layer: at least min(K, max_context)
  bool reserve_newest = false;     // T more buffer rows per pool row for each step's newest tokens
  std::int64_t max_context = 0;    // longest request, tokens
  std::uint64_t host_bytes = 0;    // Total Memory Pool capacity (0: max_requests x max_context x layers)
  // Another engine's host block pool as the Total Memory Pool (total_pool.h, "Foreign pages"):
  // the pool memory comes from the Offload's host allocator (that engine's region), requests
  // come by adopt and repage, and host_bytes must be 0. Disabled: ESS's own pages.
  ForeignPages foreign;
  int warmup_windows = 32;         // LRU-Warmup: the last this-many prefill query positions
  int copy_blocks = 0;             // FlashTrans grid of the step's copies (0 = its default)
  // Regions: each pool row's rows_per_request() rows lie in `region_blocks` blocks of the caller's
  // paged buffer (LatentBuffer::rows.block_rows rows each) that Offload::place names, in order.
  // 0: pool row r's rows are buffer rows [r x rows_per_request(), ...). Needs the caller's buffer
  // (layer_base, blocks) and residency kSparse.
  std::int32_t region_blocks = 0;
  // Regions: the region group of each layer ([layers]; empty: one group). A request has a region in every group
  // (the other engine may keep groups of layers in blocks of their own: vLLM's hot cache groups), placed together.
  std::vector<std::int32_t> region_group;
  int region_groups() const {
    return region_group.empty() ? 1 : 1 + *std::max_element(region_group.begin(), region_group.end());
  }
  int region_group_of(int layer) const { return region_group.empty() ? 0 : region_group[static_cast<std::size_t>(layer)]; }
  // kWhole and kAdaptive need reserve_newest: a whole request's newest entries reach its rows
  // from the reserved rows, by write_back.
  Residency residency = Residency::kSparse;
  // kAdaptive: a request is made whole (at admission, or promoted at a release) only if this
  // many pool rows stay free after it, so that the next admission does not demote it at once.
  std::int32_t whole_headroom = 1;
  // The query rows a whole request keeps of its recent steps (per layer, at most warmup_windows),
  // from which a demotion rebuilds its LRU by LRU-Warmup (the CUDA backend holds them on the
  // device: max_requests x layers x this x topk int32 when residency is not kSparse).
  int demotion_windows = 8;
  Backend backend = Backend::kCpu;
  int device = 0;

  // Layers (those whose cache ESS holds: every layer, DeepSeek-V4's C4 layers) and entry layout of a
  // model; the rest as given.
  static OffloadConfig for_model(const ModelSpec& model, std::int32_t max_requests, std::int32_t slots,
                                 std::int64_t max_context, int query_tokens = 1);
  // Throws ess::Error naming the field unless usable (slots below min(K, max_context) are refused).
  void validate() const;
  std::int32_t rows_per_request() const { return slots + (reserve_newest ? query_tokens : 0); }
  int recorded_windows() const { return std::min(demotion_windows, warmup_windows); }
  // The pool rows a whole request of `length` tokens takes: each holds `slots` of its tokens.
  std::int32_t whole_rows(std::int64_t length) const {
    return static_cast<std::int32_t>(std::max<std::int64_t>(1, (length + slots - 1) / slots));
  }
};

struct LayerStep {
  int layer = 0;
  int batch = 0;                          // B, padded positions included
  const std::int32_t* rows = nullptr;     // [B] pool row of each position, -1 = padded
  const std::int32_t* topk = nullptr;     // [B][T][K] logical token ids, -1 = padding
  // [B] tokens of each position after this step's extend (its last T are the newest); ids at
  // or past it are invalid.
  const std::int32_t* lengths = nullptr;
  std::int32_t* physical = nullptr;       // [B][T][K] out: the buffer row of each id, -1 = padding
  // Optional, for the DA overlap: per query row (position, query token), its buffer rows that were resident before the step
  // and those this step fetches, each compacted to the front in the row's order, -1 after.
  std::int32_t* resident = nullptr;       // [B][T][K] out
  std::int32_t* fetched = nullptr;        // [B][T][K] out
  std::int32_t* resident_count = nullptr; // [B][T] out
  std::int32_t* fetched_count = nullptr;  // [B][T] out
  // [B][2] out, optional: the LRU's distinct hits and misses per position (the reserved
  // newest rows are outside the LRU and not counted).
  std::int32_t* counts = nullptr;
  cuda::Stream stream = nullptr;
  // The fetch on another stream (the DA overlap): the decision runs on `stream`, the copy on
  // `copy_stream` after it, and `copy_done` (a cudaEvent_t the caller owns) is recorded when
  // the copy ends; attention over fetched rows waits for it. nullptr: the copy runs on
  // `stream`. kCpu ignores both.
  cuda::Stream copy_stream = nullptr;
  void* copy_done = nullptr;
  // Scratch set of this step (0 or 1): two steps whose copies may be in flight together (the
  // DBA halves of one layer) use different parts.
  int part = 0;
  // false: decide and fill every output but copy nothing (the fetched rows keep stale bytes:
  // NOT lossless; for benchmarks that take the copy's share out of a step).
  bool fetch = true;
  // The query group this call serves: query tokens [query_begin, query_end) of the T (0, 0 =
  // all T). The other query tokens are padding for this call: their outputs are -1 and the
  // LRU does not see them. A step whose working set exceeds the slots is served one group
  // after another (Offload::query_groups), the group's attention run before the next group's
  // step, since that step may evict what the previous group read.
  int query_begin = 0;
  int query_end = 0;
};

// The D2H write-back of the entries the model wrote this step: positions [length - T, length)
// of each position's request (those that exist: a request of fewer than T tokens has fewer;
// reserved row or source row t holds token length - T + t), from the reserved rows
// (reserve_newest) or from source_rows.
// Write-backs share one scratch list (CUDA backend): issue them on one stream, or order them.
struct WriteBack {
  int layer = 0;
  int batch = 0;
  const std::int32_t* rows = nullptr;         // [B], -1 = padded
  const std::int32_t* lengths = nullptr;      // [B] after this step's extend
  const std::int32_t* source_rows = nullptr;  // [B][T] buffer rows; nullptr = the reserved rows
  cuda::Stream stream = nullptr;
};

struct OffloadStats {
  std::int64_t steps = 0;          // layer steps run
  std::int64_t warmup_fills = 0;   // buffer rows loaded by LRU-Warmup
  // kCpu: counted; kCuda: 0 (they stay on the device: LayerStep::counts).
  std::int64_t hits = 0, misses = 0, reserved_hits = 0;
  std::uint64_t host_bytes_used = 0, host_bytes_capacity = 0;
  // Of the used bytes: pages several requests (or the prefix cache) hold, and pages only the
  // prefix cache holds (retained); and what the live requests would hold without sharing.
  std::uint64_t host_bytes_shared = 0, host_bytes_retained = 0, host_bytes_unshared = 0;
  std::int32_t requests = 0;
  // Residency: the requests whole now; position-layer-steps served whole and sparse; step calls
  // that ran a swap decision (a step whose real positions are all whole runs none); demotions
  // and promotions so far.
  std::int32_t whole_requests = 0;
  std::int64_t whole_steps = 0, sparse_steps = 0, swap_launches = 0;
  std::int64_t demotions = 0, promotions = 0;
};

// Failures. Bad input throws ess::Error and changes nothing. A failed device call (the CUDA
// backend: a launch, copy, allocation, event or synchronization) throws ess::DeviceError (or
// ess::OutOfMemory) naming the call, and the engine is unusable from then on: its device state may
// be half-updated, so every later call but config, host_pool, buffer, device_bytes and stats
// throws ess::DeviceError naming the call and that first failure. Destroy it (which frees all
// it took) and make a new one; nothing it holds is served again.
class Offload {
 public:
  static constexpr int kParts = 2;  // scratch sets (LayerStep::part)

  // Allocates the pools (the Total Memory Pool from `host`, which must outlive this object)
  // and, without `buffer`, the device latent buffers.
  explicit Offload(const OffloadConfig& config, LatentBuffer buffer = {},
                   HostAllocator& host = default_host_allocator());
  ~Offload();
  Offload(const Offload&) = delete;
  Offload& operator=(const Offload&) = delete;

  // ---- request lifecycle (host calls between steps) ----
  // The lifecycle calls' stream (CUDA backend; "Streams and graphs" above): from now on their
  // device work is enqueued on `stream` (nullptr: the legacy default stream) and not waited for.
  // Changing it orders the new stream after the old one's work (an event, no wait).
  // clear_lifecycle_stream: back to the default, each call waiting for the device (it waits for
  // the old stream's work once). kCpu ignores both. `stream` must be a live stream of the
  // engine's device (CUDA cannot tell a destroyed handle reliably; a failure of the handoff makes
  // the engine unusable, as any failed device call does).
  void set_lifecycle_stream(cuda::Stream stream);
  void clear_lifecycle_stream();
  // A request with `prompt_length` tokens in the host pool (entries zeroed): returns its pool
  // row, the lowest free one, or `row` when given (an engine that numbers its request slots
  // itself, as SGLang's req_pool_indices, keeps its numbers; it must be free). The engine
  // then writes the prompt's entries (host_entry, or write_back from its prefill buffer) and
  // calls warmup.
  std::int32_t admit(RequestId id, std::int64_t prompt_length, std::int32_t row = -1);
  // The same for a request whose first `prefix` prompt tokens are those of the admitted
  // request `source`: it shares source's full host pages of that prefix (no copy; read-only,
  // host_entry refuses them) and gets a copy of the rest; write its other entries as usual.
  // Pages holding the request's last T tokens are never shared (write_back may write them),
  // here, in admit_cached and in publish. Its buffer rows start empty: warm it up as usual.
  std::int32_t admit_shared(RequestId id, std::int64_t prompt_length, RequestId source, std::int64_t prefix,
                            std::int32_t row = -1);
  // The same on the host prefix cache: the prompt's longest prefix of whole 64-token pages
  // that a request published (see publish) is reused without a copy. Returns the row and the
  // tokens reused (a multiple of 64): write the entries from there on.
  struct Admitted {
    std::int32_t row = -1;
    std::int64_t reused_tokens = 0;
  };
  Admitted admit_cached(RequestId id, std::span<const std::int32_t> prompt_tokens, std::int32_t row = -1);
  // Registers the request's prompt in the host prefix cache once its entries are written: its
  // whole 64-token pages become read-only, shared with later requests on the same prompt
  // prefix, and stay retained after release until the pool needs their space. Returns the
  // pages (per layer) registered.
  std::int64_t publish(RequestId id, std::span<const std::int32_t> prompt_tokens);
  // LRU-Warmup of every layer: `windows` is [layers][W][K] (the prefill's last W query
  // positions' top-k, oldest first, -1 = padding; W <= warmup_windows uses the last W); the
  // resulting residency is loaded into the slots from the host pool. A whole request instead
  // has every entry loaded into its rows (call it, W = 0 included, once the prompt is written)
  // and keeps the windows for a later demotion. With reserve_newest the reserved rows also get
  // the request's newest min(T, length) entries (token length - T + t in reserved row t), so a
  // step at the prompt's own length reads them.
  void warmup(RequestId id, std::span<const std::int32_t> windows, int window_count);
  // Appends n tokens to the request (host pages; their entries arrive by write_back). A whole
  // request that needs another pool row borrows a free one; kWhole refuses (changing nothing)
  // when none is free, kAdaptive demotes the request.
  void extend(RequestId id, std::int64_t n);
  // Takes back the last tokens an extend added that the engine did not keep (speculative
  // decoding: a step's T draft tokens, of which only some are accepted): the request's length
  // becomes `length`, at least its length - T. Needs reserve_newest (those tokens were in the
  // reserved rows, never in the LRU, so the device state stays exact); their host entries are
  // zeroed, pages past the length freed. Write the kept ones back (write_back with source_rows)
  // before the step that reads them.
  void truncate(RequestId id, std::int64_t length);
  void release(RequestId id);
  // Foreign pages only (OffloadConfig::foreign). Admits a request of `length` tokens whose
  // entries the other engine has written on `pages` (its block table: ceil(length / 64) page
  // indices, the same in every layer); its row as admit's. Nothing is copied or zeroed; warm
  // it up as usual.
  std::int32_t adopt(RequestId id, std::int64_t length, std::span<const std::int32_t> pages, std::int32_t row = -1);
  // Foreign pages only. The request's length anew, and its pages from page `first_page` on
  // (TotalPool::repage): extend's growth and truncate's rule for shrinking (at least its
  // length - T, reserve_newest). A page may change only to one holding the same entries (the
  // device rows stay valid).
  void repage(RequestId id, std::int64_t length, std::int64_t first_page, std::span<const std::int32_t> pages);
  // Regions only (OffloadConfig::region_blocks). The request's rows from now on lie in `blocks`:
  // its region of every region group, group after group (region_groups() x region_blocks block ids
  // of the buffer, distinct, none in another request's region), each its slots first, then its
  // reserved rows. Its device residency is forgotten (as reset does; the rows of its old regions
  // are never written again), and with reserve_newest its newest min(T, length) entries are loaded
  // into its new reserved rows. A request must be placed before its warmup and its first step; its
  // regions are freed when it is released.
  void place(RequestId id, std::span<const std::int32_t> blocks);
  // The buffer row of row `slot` of pool row `row` in `layer` (slot < rows_per_request(); its
  // reserved row t is slot slots + t): row x rows_per_request() + slot, or in its region of the
  // layer's group (-1 when not placed).
  std::int32_t buffer_row(int layer, std::int32_t row, std::int32_t slot) const;
  // Forgets the request's device residency (every layer's LRU empty, as at admit); its host
  // entries stay. Then warmup again, e.g. when the engine resumes a preempted request whose
  // device rows it reused, or to replay a measurement from the same state.
  void reset(RequestId id);
  std::int32_t row(RequestId id) const;
  std::int64_t length(RequestId id) const;
  // Whether the request is whole now (Residency), and the pool rows it takes: its own row first,
  // then those it borrows, each holding `slots` of its tokens in order; {row} when sparse.
  bool whole(RequestId id) const;
  std::vector<std::int32_t> whole_units(RequestId id) const;
  // The host pool's entry of (request, layer, token), for the engine to fill the prompt.
  std::span<std::uint8_t> host_entry(RequestId id, int layer, std::int64_t token);

  // ---- the per-layer step ----
  void step(const LayerStep& step);
  // The query groups of a step (ess/cache/query_groups.h): boundaries [0, ..., T] of the
  // fewest consecutive ranges of the T query tokens whose working sets (distinct ids, the
  // reserved newest tokens left out) fit the slots at every real position; {0, T} when the
  // whole step fits. rows [batch], topk [batch][T][K] and lengths [batch] as for step, in host
  // memory on either backend (kCuda: a copy of the ids; a pool of min(T x K, max_context)
  // slots never needs more than one group). Throws ess::Error naming a position whose row
  // holds no request, whose length is not its request's, or whose id is outside [-1, length).
  std::vector<int> query_groups(int batch, const std::int32_t* rows, const std::int32_t* topk,
                                const std::int32_t* lengths) const;
  void write_back(const WriteBack& write_back);

  // ---- what is where ----
  const OffloadConfig& config() const;
  std::int32_t rows_per_request() const { return config().rows_per_request(); }
  // The layer's buffer as the engine passes it to FlashMLA.
  const LatentBuffer& buffer() const;
  // The bytes of buffer row p of a layer (a copy; for tests and tools).
  std::vector<std::uint8_t> read_row(int layer, std::int32_t p) const;
  // The Total Memory Pool (host accounting, entry offsets).
  const TotalPool& host_pool() const;
  // Counters and host accounting; on kCuda, warmup_fills is read from the device (the loads
  // it has run so far). Once the engine is unusable, the device counters as last read.
  OffloadStats stats() const;
  // The device memory this Offload allocated at construction and holds until it is destroyed,
  // as asked of cudaMalloc (the driver rounds each allocation up): the GPU swap engine's state,
  // both parts' step scratch, the write-back lists, the page tables, the lifecycle's load
  // scratch (one layer's warm-up windows and outputs, one load list) and, when ESS allocated
  // them, the layer buffers. 0 on kCpu. Lifecycle calls allocate no device memory; their
  // uploads are staged in pinned host memory (reused once the device has read it).
  std::uint64_t device_bytes() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ess
