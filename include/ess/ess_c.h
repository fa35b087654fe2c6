/* ESS's C ABI: the per-layer step and its request lifecycle for engines written in any
 * language (the Python package `ess` is built on it).
 *
 * C99. Every object is an opaque handle; every call returns an ess_status, and on failure
 * ess_last_error() gives this thread's message naming what was wrong, where (request,
 * layer, position, field) and the offending value. A call that fails changes nothing.
 *
 * Tensors are DLPack DLTensors (dlpack/dlpack.h). They are read when they are bound (the
 * engine's layer buffers at creation, the step's inputs and outputs in ess_step_bind), so
 * the per-layer call takes only integers; a bound tensor's memory must stay valid, at the
 * same address, while its binding lives. Streams and events are opaque pointers
 * (cudaStream_t, cudaEvent_t); the CPU backend ignores them.
 *
 * Structs passed in begin with struct_size: set it with the matching ess_*_init (or to
 * sizeof), so a library built against a later header can tell which fields a caller knows.
 *
 * Handles are not addresses: each is a number given out once in the process's life. A call
 * with NULL, a handle of another kind, or one that was destroyed (a binding also when its
 * engine was) returns ESS_ERROR_INVALID_ARGUMENT naming it, and so does a second destroy.
 *
 * Threads: calls on one engine and its bindings may come from several threads. Each call holds
 * the engine's lock, so they run one at a time, each as a whole; which runs first is the
 * callers' to order. A destroy waits for a call in flight, after which calls are refused.
 * Separate engines do not share a lock. ess_last_error is per thread. */
#ifndef ESS_ESS_C_H_
#define ESS_ESS_C_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#if defined(_WIN32)
#define ESS_API
#else
#define ESS_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Raised when a change breaks callers built against an earlier header. */
#define ESS_ABI_VERSION 1

typedef enum ess_status {
  ESS_OK = 0,
  ESS_ERROR_INVALID_ARGUMENT = 1, /* refused: a value, shape, dtype, device or state named in the message */
  ESS_ERROR_OUT_OF_MEMORY = 2,    /* host or device memory could not be allocated */
  ESS_ERROR_UNAVAILABLE = 3,      /* the CUDA backend is not in this build, or no such device */
  ESS_ERROR_DEVICE = 4,           /* a CUDA call failed */
  ESS_ERROR_INTERNAL = 5          /* a bug in ESS: please report the message */
} ess_status;

typedef enum ess_backend { ESS_BACKEND_CPU = 0, ESS_BACKEND_CUDA = 1 } ess_backend;

/* The per-layer step's eviction policy. The GPU swap engine implements LRU (with LRU-Warmup);
 * `ess trace analyze` compares the others on traces. */
typedef enum ess_policy { ESS_POLICY_LRU = 0 } ess_policy;

/* Where requests live on the device (docs/architecture.md, "Residency"): each in a Sparse Memory
 * Pool; each whole (every entry in rows of its own, read in place, no swap; refused when its rows
 * are not free); whole while pool rows are free, demoted under pressure, promoted back. */
typedef enum ess_residency { ESS_RESIDENCY_SPARSE = 0, ESS_RESIDENCY_WHOLE = 1, ESS_RESIDENCY_ADAPTIVE = 2 } ess_residency;

typedef struct ess_engine ess_engine;
typedef struct ess_step_binding ess_step_binding;
typedef struct ess_write_back_binding ess_write_back_binding;

/* ---- library ---------------------------------------------------------------------------- */
ESS_API int ess_abi_version(void);
ESS_API const char* ess_version(void);            /* "0.1.0" */
ESS_API const char* ess_status_name(ess_status status);
/* This thread's message of its last failed call ("" when none failed). Valid until the next
 * failing call on this thread. */
ESS_API const char* ess_last_error(void);
ESS_API int ess_cuda_built(void);                 /* 1 when the CUDA backend is in this build */
ESS_API int ess_cuda_device_count(void);          /* 0 without the backend, a driver or a device */

/* ---- engine ----------------------------------------------------------------------------- */
typedef struct ess_config {
  uint32_t struct_size;
  /* The model: the path of its Hugging Face config.json, or that file's text (its fields),
   * or neither: the shipped DeepSeek-V3.2-Exp. Not both. */
  const char* model_path;
  const char* model_json;
  int32_t layers;          /* 0: the model's offloaded layers (num_hidden_layers; DeepSeek-V4: its C4 layers) */
  int32_t max_requests;    /* pool rows (requests decoded at once) */
  int64_t max_context;     /* longest request, tokens (DeepSeek-V4: C4 entries, as its lengths and top-k ids) */
  int32_t query_tokens;    /* T: query tokens per request per step (MTP); default 1 */
  int32_t topk;            /* K: ids per query token; 0: the model's index_topk */
  int32_t slots;           /* LRU slots per request-layer; 0: from ratio */
  double ratio;            /* Sparse Memory Ratio: slots = ceil(ratio x max_context) when slots is 0 */
  int32_t reserve_newest;  /* 1: T more rows per request-layer hold each step's newest tokens */
  int32_t warmup_windows;  /* LRU-Warmup: the prefill's last this-many query positions; default 32 */
  int32_t policy;          /* ess_policy */
  int32_t backend;         /* ess_backend */
  int32_t device;          /* CUDA device */
  int32_t copy_blocks;     /* FlashTrans grid (0: its default) */
  uint64_t host_bytes;     /* Total Memory Pool capacity; 0: max_requests x max_context x layers entries */
  /* The engine's own layer buffers (FlashMLA's KV cache), `layers` tensors, each [rows, E],
   * [blocks, block_rows, E] or with size-1 dimensions between (E = the entry's bytes over
   * the dtype's; uint8 [.., 656] for DeepSeek-V3.2), rows contiguous and 16-byte aligned,
   * on the backend's device. NULL: ESS allocates them (ess_engine_layer_data). */
  const DLTensor* const* latent;
  int32_t latent_count;
  /* The Total Memory Pool's memory, the caller's: host_memory_bytes bytes at host_memory, 4 KiB-
   * aligned, at least the pool's capacity (host_bytes rounded down to whole pages of every layer),
   * valid while the engine lives; NULL (and 0): ESS allocates it. Engines in several processes may
   * map one region: with the same configuration and the same sequence of request calls they give
   * each request the same pages, so one process can write a request's entries and every one read
   * them (each still zeroes the pages it hands out: order those calls before the writer's writes).
   * host_memory_pinned: 1 when the caller registered the region as pinned, mapped memory (the CUDA
   * backend reads the pool zero-copy and refuses other memory). */
  void* host_memory;
  uint64_t host_memory_bytes;
  int32_t host_memory_pinned;
  /* Foreign pages: host_memory is another engine's host block pool (vLLM's HiSparse host pool),
   * whose pages that engine hands out. host_pages_per_layer > 0 turns it on: page g (64 entries)
   * of layer l lies at host_memory + (host_layer_first_page[l] + g) x host_page_stride (an array
   * of `layers` values, read at creation), regions not overlapping, all within
   * host_memory_bytes; host_bytes must be 0. Requests then come by ess_request_adopt and
   * ess_request_repage (the other engine's block tables) and ESS writes a page only when asked
   * (write-back, ess_request_write_entries). 0: ESS hands out its own pages. */
  int64_t host_pages_per_layer;
  uint64_t host_page_stride;
  const int64_t* host_layer_first_page;
  /* ess_residency (whole and adaptive need reserve_newest), and for
   * adaptive the pool rows left free when a request is made whole (default 1). */
  int32_t residency;
  int32_t whole_headroom;
  /* Entries in two parts (DeepSeek-V4's C4 pages: a token's values in one run of the page, its
   * scales in another; K and V in two tensors): with latent_tail (`layers` tensors laid out as
   * `latent` is, 8-byte aligned, on the backend's device), row p's first split_bytes lie in
   * latent[l] (whose last dimension then spans split_bytes) and its next tail_bytes in
   * latent_tail[l] (last dimension tail_bytes), each at row p's place in its tensor. split_bytes a
   * positive multiple of 16, tail_bytes of 8, together within the entry; the Total Memory Pool
   * holds entries whole; tails that share a byte with any head of the same layer are refused,
   * naming both rows. NULL (and 0s): entries whole in `latent`. */
  const DLTensor* const* latent_tail;
  int32_t latent_tail_count;
  int32_t split_bytes;
  int32_t tail_bytes;
  /* Regions: `latent` is another engine's paged cache ([blocks, block_rows, E] tensors, e.g. vLLM's
   * HiSparse hot slab) and each request's rows (its slots, then its reserved rows) lie in
   * region_blocks of its blocks, which ess_request_place names. 0: pool row r's rows are rows
   * [r x rows_per_request, ...) of the layer buffers. Needs latent and ESS_RESIDENCY_SPARSE.
   * region_group: with regions, `layers` values (read at creation), each layer's region group: a
   * request has a region in each group (vLLM keeps groups of layers in blocks of their own); NULL:
   * one group. */
  int32_t region_blocks;
  const int32_t* region_group;
} ess_config;

ESS_API void ess_config_init(ess_config* config);
/* On success *engine is a new engine; on failure it is NULL. */
ESS_API ess_status ess_engine_create(const ess_config* config, ess_engine** engine);
ESS_API ess_status ess_engine_destroy(ess_engine* engine); /* also destroys its bindings; NULL is a no-op (ESS_OK) */

typedef struct ess_engine_info {
  uint32_t struct_size;
  int32_t layers;
  int32_t max_requests;
  int64_t max_context;
  int32_t query_tokens;
  int32_t topk;
  int32_t slots;
  int32_t rows_per_request;  /* slots + (reserve_newest ? T : 0): row r's rows start at r x this (without regions) */
  int32_t reserve_newest;
  int32_t backend;
  int32_t device;
  int32_t entry_bytes;       /* 656 for DeepSeek-V3.2 */
  /* Where physical row p of a layer's buffer lives, in bytes from its base:
   * (p / block_rows) x block_stride + (p % block_rows) x row_stride (block_rows 0: p x row_stride). */
  uint64_t row_stride;
  int64_t block_rows;
  uint64_t block_stride;
  uint64_t host_bytes_capacity;
  /* A buffer in two parts (ess_config.latent_tail): the head's and the tail's bytes of a row, and
   * where row p's tail lives from its layer's tail base; 0s when entries are whole. */
  int32_t split_bytes;
  int32_t tail_bytes;
  uint64_t tail_row_stride;
  int64_t tail_block_rows;
  uint64_t tail_block_stride;
} ess_engine_info;

ESS_API void ess_engine_info_init(ess_engine_info* info);
ESS_API ess_status ess_engine_get_info(const ess_engine* engine, ess_engine_info* info);
/* The base address of a layer's buffer (the engine's own, or the one ESS allocated). */
ESS_API ess_status ess_engine_layer_data(const ess_engine* engine, int32_t layer, void** data);
/* The device memory the engine allocated at creation and holds until it is destroyed, as asked of
 * cudaMalloc: the GPU swap engine's state, the step scratch, the write-back lists, the page tables,
 * the lifecycle's load scratch and the layer buffers when ESS allocated them (not the caller's). 0 on
 * the CPU backend. */
ESS_API ess_status ess_engine_device_bytes(const ess_engine* engine, uint64_t* bytes);
/* The lifecycle calls' stream (CUDA backend). ordered = 1: from now on the device work of
 * admit, warmup, extend, release, reset, adopt and repage is enqueued on `stream` (a
 * cudaStream_t; NULL: the legacy default stream) and they return without waiting for the device,
 * so an admission does not wait for the forward in flight; the engine issues its steps on that
 * stream or orders them after it. truncate and a demotion still wait for that stream; a released
 * request's host pages return to the pool once the stream has passed the release. ordered = 0:
 * each call waits for the device (the default; `stream` must be NULL). Changing the stream orders
 * the new one after the old one's work. The CPU backend accepts and ignores both. */
ESS_API ess_status ess_engine_set_lifecycle_stream(ess_engine* engine, void* stream, int32_t ordered);
/* A copy of physical row `row` of a layer: `bytes` must be the entry size. */
ESS_API ess_status ess_engine_read_row(const ess_engine* engine, int32_t layer, int32_t row, void* out, size_t bytes);

/* The Total Memory Pool (host) as another engine's transfer backend addresses it: one region per
 * layer, `pages_per_layer` pages of `page_tokens` entries each; page g of layer l starts at
 * ess_engine_host_layer(l) + g x page_bytes, and a request's page i is the same g in every layer
 * (ess_request_host_pages). Token t of a request is entry t % page_tokens of its page t / page_tokens.
 * A transfer may write the pages of a request admitted with ess_request_admit (its own pages) before
 * the first step or warmup reads them; pages shared through a prefix are read-only. */
typedef struct ess_host_layout {
  uint32_t struct_size;
  int32_t layers;
  int32_t page_tokens;       /* 64 */
  int32_t pinned;            /* 1: page-locked (registered with CUDA), 0: pageable */
  uint64_t entry_bytes;
  uint64_t page_bytes;       /* bytes from one page to the next: page_tokens x entry_bytes (foreign pages: their stride) */
  int64_t pages_per_layer;
  uint64_t layer_bytes;      /* pages_per_layer x page_bytes: each region's size */
} ess_host_layout;

ESS_API void ess_host_layout_init(ess_host_layout* layout);
ESS_API ess_status ess_engine_host_layout(const ess_engine* engine, ess_host_layout* layout);
/* The start of a layer's region of the host pool. */
ESS_API ess_status ess_engine_host_layer(const ess_engine* engine, int32_t layer, void** data);
/* The request's page indices, one per page_tokens tokens (rounded up), into `pages` (room for
 * `capacity`); *count is set to how many there are, also when `capacity` is too small (then
 * ESS_INVALID_ARGUMENT and nothing is written). pages may be NULL with capacity 0 to ask the count. */
ESS_API ess_status ess_request_host_pages(const ess_engine* engine, int64_t id, int32_t* pages, int64_t capacity,
                                          int64_t* count);

typedef struct ess_stats {
  uint32_t struct_size;
  int64_t steps;             /* layer steps run */
  int64_t warmup_fills;      /* rows loaded by LRU-Warmup */
  int64_t hits, misses;      /* distinct ids: CPU backend counted; CUDA backend 0 (see the counts output) */
  int64_t reserved_hits;     /* ids that were among their step's newest (reserve_newest) */
  uint64_t host_bytes_used;
  uint64_t host_bytes_capacity;
  int32_t requests;
  /* Of host_bytes_used: pages several holders share (requests on one prompt prefix, the
   * prefix cache); pages only the prefix cache holds (retained). What the live requests would
   * hold without sharing. */
  uint64_t host_bytes_shared;
  uint64_t host_bytes_retained;
  uint64_t host_bytes_unshared;
  /* Residency: requests whole now; position-layer-steps served whole and sparse; steps that ran a
   * swap decision; demotions and promotions. (A caller built against the layout that ends before
   * whole_requests gets the fields it knows.) */
  int32_t whole_requests;
  int64_t whole_steps, sparse_steps, swap_launches;
  int64_t demotions, promotions;
} ess_stats;

ESS_API void ess_stats_init(ess_stats* stats);
ESS_API ess_status ess_engine_get_stats(const ess_engine* engine, ess_stats* stats);

/* ---- requests (host calls between steps) ------------------------------------------------ */
/* The pool rows the request takes, its own first: one when it is sparse, ceil(length / slots) when
 * it is whole (each holding `slots` of its tokens in order), into `rows` (room for `capacity`);
 * *count is set to how many, also when `capacity` is too small (then ESS_INVALID_ARGUMENT and
 * nothing is written); *whole (may be NULL) to 1 when the request is whole. */
ESS_API ess_status ess_request_residency(const ess_engine* engine, int64_t id, int32_t* whole, int32_t* rows,
                                         int32_t capacity, int32_t* count);
/* Admits request `id` (any non-negative number the engine chooses) with `prompt_length`
 * tokens into pool row `row` (-1: the lowest free row); *row_out (may be NULL) gets the row. */
ESS_API ess_status ess_request_admit(ess_engine* engine, int64_t id, int64_t prompt_length, int32_t row,
                                     int32_t* row_out);
/* Shared prompt prefixes in the host pool. admit_shared: a request whose first `prefix` tokens
 * are those of the admitted request `source` shares its full host pages (no copy; read-only).
 * admit_cached: `prompt_tokens` (int32 host [n]) finds the longest prefix of whole 64-token
 * pages a request published; *reused_out (may be NULL) gets the tokens reused, whose entries
 * need no writing. publish: registers the request's written prompt in the prefix cache (its
 * whole pages become read-only and stay retained after release until space is needed);
 * *pages_out (may be NULL) gets the pages per layer registered. */
ESS_API ess_status ess_request_admit_shared(ess_engine* engine, int64_t id, int64_t prompt_length, int64_t source,
                                            int64_t prefix, int32_t row, int32_t* row_out);
ESS_API ess_status ess_request_admit_cached(ess_engine* engine, int64_t id, const DLTensor* prompt_tokens, int32_t row,
                                            int32_t* row_out, int64_t* reused_out);
ESS_API ess_status ess_request_publish(ess_engine* engine, int64_t id, const DLTensor* prompt_tokens, int64_t* pages_out);
/* Writes entries [first_token, first_token + n) of one layer into the host pool: `entries` is
 * host memory (kDLCPU or kDLCUDAHost), n rows of the entry's bytes (uint8 [n, E], or any
 * dtype whose last dimension spans E bytes), rows contiguous. */
ESS_API ess_status ess_request_write_entries(ess_engine* engine, int64_t id, int32_t layer, int64_t first_token,
                                             const DLTensor* entries);
/* Reads them back (the same shapes; `entries` is written). */
ESS_API ess_status ess_request_read_entries(const ess_engine* engine, int64_t id, int32_t layer, int64_t first_token,
                                            const DLTensor* entries);
/* LRU-Warmup of every layer: `windows` is int32 host memory [layers, W, K], the prefill's
 * last W query positions' top-k, oldest first, -1 = padding; the resulting residency is
 * loaded into the request's rows from the host pool. */
ESS_API ess_status ess_request_warmup(ess_engine* engine, int64_t id, const DLTensor* windows);
ESS_API ess_status ess_request_extend(ess_engine* engine, int64_t id, int64_t tokens);
/* Takes back draft tokens that were not accepted: the length becomes `length`, at least its
 * length - T (engines with reserve_newest; the entries past it are zeroed). */
ESS_API ess_status ess_request_truncate(ess_engine* engine, int64_t id, int64_t length);
/* Foreign pages only (ess_config.host_pages_per_layer). adopt: admits request `id` (row as
 * ess_request_admit) of `length` tokens whose entries the other engine wrote on `pages`
 * (page_count = ceil(length / 64) indices in [0, host_pages_per_layer), the same in every layer;
 * nothing is copied or zeroed). repage: its length anew and its pages from `first_page` on
 * (those before kept; page_count new ones, ceil(length / 64) in all): growth as extend,
 * shrinking as truncate (by at most T, reserve_newest); a page may change only to one holding the
 * same entries. Checked whole before anything changes. */
ESS_API ess_status ess_request_adopt(ess_engine* engine, int64_t id, int64_t length, const int32_t* pages,
                                     int64_t page_count, int32_t row, int32_t* row_out);
ESS_API ess_status ess_request_repage(ess_engine* engine, int64_t id, int64_t length, int64_t first_page,
                                      const int32_t* pages, int64_t page_count);
ESS_API ess_status ess_request_release(ess_engine* engine, int64_t id);
/* Regions only (ess_config.region_blocks): request `id`'s rows lie from now on in `blocks`: its
 * region of each region group, group after group (groups x region_blocks block ids of the layer
 * tensors, distinct, none in another request's region). Its device residency is forgotten (as
 * ess_request_reset) and, with reserve_newest, its newest min(T, length) entries are loaded into its
 * new reserved rows. Place a request before its warmup and its first step (the CPU backend refuses a
 * step of an unplaced request by name; the CUDA backend serves it as padding and writes nothing
 * back from it); its blocks are free again once it is released. */
ESS_API ess_status ess_request_place(ess_engine* engine, int64_t id, const int32_t* blocks, int64_t count);
/* The physical row of row `slot` (its slots, then its reserved rows) of pool row `row` in `layer`:
 * row x rows_per_request + slot, or the row in its region of the layer's group; -1 while a row of
 * an engine with regions has none. */
ESS_API ess_status ess_engine_buffer_row(const ess_engine* engine, int32_t layer, int32_t row, int32_t slot,
                                         int32_t* out);
/* Forgets the request's device residency (its host entries stay); warm it up again after. */
ESS_API ess_status ess_request_reset(ess_engine* engine, int64_t id);
/* Its pool row and length (either pointer may be NULL). */
ESS_API ess_status ess_request_get(const ess_engine* engine, int64_t id, int32_t* row, int64_t* length);

/* ---- the per-layer step ----------------------------------------------------------------- */
/* The step's tensors, int32, contiguous, on the backend's device (host memory for the CPU
 * backend: kDLCPU or kDLCUDAHost). B positions (padded ones included); T and K as configured. */
typedef struct ess_step_tensors {
  uint32_t struct_size;
  const DLTensor* rows;           /* [B] pool row of each position, -1 = padded */
  const DLTensor* topk;           /* [B, T, K] or [B x T, K]: logical token ids, -1 = padding */
  const DLTensor* lengths;        /* [B] each position's tokens after this step's extend (on foreign
                                   * pages from 1 to what the request holds: its first lengths[b]) */
  const DLTensor* physical;       /* like topk, out: rows of the layer's buffer, -1 = padding */
  /* Optional outputs (NULL: not produced). */
  const DLTensor* counts;         /* [B, 2]: the LRU's distinct hits and misses per position */
  const DLTensor* resident;       /* like topk: the rows resident before the step, compacted */
  const DLTensor* fetched;        /* like topk: the rows this step fetches, compacted */
  const DLTensor* resident_count; /* [B, T] or [B x T] */
  const DLTensor* fetched_count;  /* [B, T] or [B x T] */
} ess_step_tensors;

ESS_API void ess_step_tensors_init(ess_step_tensors* tensors);
ESS_API ess_status ess_step_bind(ess_engine* engine, const ess_step_tensors* tensors, ess_step_binding** binding);
ESS_API ess_status ess_step_binding_destroy(ess_step_binding* binding);
/* One layer's step over the first `batch` positions of the binding (-1: all B): the misses
 * are fetched and `physical` filled, enqueued on `stream` (CUDA backend; graph-capturable). */
ESS_API ess_status ess_step(ess_step_binding* binding, int32_t layer, int32_t batch, void* stream);
/* The same with the fetch on `copy_stream` after the decision, `copy_done` (a cudaEvent_t)
 * recorded when it ends (both NULL: all on `stream`), and scratch `part` 0 or 1 (two steps
 * whose copies may be in flight together use different parts). */
ESS_API ess_status ess_step_async(ess_step_binding* binding, int32_t layer, int32_t batch, int32_t part, void* stream,
                                  void* copy_stream, void* copy_done);

/* Query groups. A pool of fewer than T x K slots serves a step whose T query tokens select
 * more distinct ids than it holds in consecutive groups of query tokens whose unions fit:
 * ess_query_groups gives them, from HOST copies of the step's rows [B], topk [B, T, K] (or
 * [B x T, K]) and lengths [B] on either backend: bounds[0..*count] (bounds must hold T + 1
 * values) with bounds[0] = 0, bounds[*count] = T; *count = 1 when the step fits whole. A pool
 * of min(T x K, max_context) slots never needs more than one group. */
ESS_API ess_status ess_query_groups(const ess_engine* engine, const DLTensor* rows, const DLTensor* topk,
                                    const DLTensor* lengths, int32_t* bounds, int32_t* count);
/* One query group's step: query tokens [query_begin, query_end) of the bound tensors (the
 * others are padding for this call, their outputs -1), as ess_step otherwise. Run the group's
 * attention before the next group's step, which may evict what it read. */
ESS_API ess_status ess_step_group(ess_step_binding* binding, int32_t layer, int32_t batch, int32_t query_begin,
                                  int32_t query_end, void* stream);

/* The write-back of the entries the model wrote this step (positions [length - T, length) of
 * each position's request) to the host pool: rows [B] and lengths [B] as in the step;
 * source_rows [B, T] rows of the layer's buffer, or NULL: the reserved rows. */
ESS_API ess_status ess_write_back_bind(ess_engine* engine, const DLTensor* rows, const DLTensor* lengths,
                                       const DLTensor* source_rows, ess_write_back_binding** binding);
ESS_API ess_status ess_write_back_binding_destroy(ess_write_back_binding* binding);
ESS_API ess_status ess_write_back(ess_write_back_binding* binding, int32_t layer, int32_t batch, void* stream);

/* ---- capacity planning ------------------------------------------------------------------ */
/* `ess plan` as a call: `request_json` is an object with optional keys model (config.json
 * path), hardware (shipped name or JSON path), deployment, contexts (array), min_otps,
 * modes (array of none/da/dba/layerwise), batch_step, mtp, accept, nodes, gpus_per_node, ep,
 * mem_fraction, no_tbo, misses, miss_exponent, miss_profile, op_table, engine ("sglang": each plan
 * gets the engine's "launch"); unknown keys are
 * refused. *result_json gets the JSON `ess plan --format json` prints; free it with
 * ess_string_free. */
ESS_API ess_status ess_plan(const char* request_json, char** result_json);
ESS_API void ess_string_free(char* s);

#ifdef __cplusplus
}
#endif

#endif /* ESS_ESS_C_H_ */
