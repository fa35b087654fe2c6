"""ESS under vLLM's HiSparse (vllm==0.33.0): the decode swap of every target-model sparse MLA layer, over vLLM's
own host pool.

In vLLM 0.33.0 each HiSparse attention layer owns a cache handle (vllm/v1/hisparse/runtime.py,
HiSparseCacheHandle) whose `runtime` (HiSparseRuntime) decides which of a decode token's logical top-k
rows are in the GPU hot buffer, copies the misses in from the host pool and returns the physical rows
FlashMLA reads (`swap_in`). Here `HiSparseRuntime` is ESS's: one ESS engine layer per handle, the LRU
rows of each request in the hot regions vLLM hands it (EssDecode, "Hot regions"; a buffer of ESS's own,
latent_buffers, for an engine made without regions), a request without one read in place at vLLM's resident
pages, the misses copied from the host pool. That host pool is
vLLM's: ESS's Total Memory Pool sits on it as foreign pages (Engine's foreign_pages: vLLM's per-layer host
caches, its host blocks as ESS's pages), and each request's ESS page table is its vLLM host block table.
There is one copy of the context in host memory, vLLM's: its prefill writes it, its row mirror
(eager_host_mirror) adds each step's rows, its scheduler allocates, shares (prefix caching) and spills the
blocks, and its prefill staging reads them. ESS only reads them.
`ess.integrations.vllm_connector.HiSparseConnector` (loaded by vLLM through `kv_connector_module_path`) puts
these runtimes on the handles when vLLM registers its KV caches and drives `EssDecode` from the connector's
`start_load_kv`.

Rows and requests. A request's ESS pool row (and ESS request id) is its stable request-state index
(vLLM's input_batch.idx_mapping of its batch row), not its batch row: vLLM condenses and reorders the
batch between steps and refreshes the mapping in start_load_kv, so ESS positions are batch rows and
`rows[b]` names the state. Its host blocks are row b of the handle's `source_block_table`, which vLLM
gathers per batch row before the forward (v1/worker/gpu/block_table.py gather_block_tables). Decode rows
come first in vLLM's batch, at most T tokens each (T = 1 + the speculative tokens, vLLM's
max_decode_query_len): the forward's sparse MLA metadata says how many (its decode split) and how long
(its seq_lens, the device's count; the scheduler's runs ahead under async scheduling, and bounds it from above
under adaptive verification, which trims drafts on the device). Each decode token goes to its batch row's staged
query: with hot regions swap_in maps it on the device (from req_id_per_token) and reads in place the ids on pages
vLLM still holds resident (each step's newest entries among them), else start_step maps it from the scheduler's
counts and its newest entries are copied into the row's reserved rows. Tokens at or past num_valid_rows are
CUDA-graph padding."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, NamedTuple, Optional, Sequence

import torch

from .. import _args
from .._errors import InvalidArgument, InvalidType
from ..engine import Engine, ForeignPages
from . import _device
from .topk_recorder import TopkRecorder
from .vllm_overlap import DecodeOverlap

__all__ = ["VLLM_VERSION", "HotView", "latent_buffers", "host_pool_layout", "Scheduled",
           "scheduled_from_output", "source_blocks_from_output", "fresh_from_output", "EssDecode",
           "HiSparseRuntime"]

VLLM_VERSION = "0.33.0"   # the release whose call sites these classes are checked against
ENTRY_BYTES = 656         # vLLM's fp8_ds_mla row (FP8_DS_MLA_ROW_BYTES), ESS's DeepSeek-V3.2 entry
KERNEL_BLOCK = 64         # FlashMLA sparse's KV block size: attention_cache is [-1, 64, 656]; ESS's page
ACTIVE_TAIL_PAGES = 2     # vllm/v1/hisparse/types.py: a request's last pages, never unpinned (coordinator.py)


class HotView(NamedTuple):
    """What vLLM reads of a runtime's `hot` (upstream's PagedCacheView): the cache FlashMLA indexes with the
    physical rows swap_in returns."""
    cache: torch.Tensor
    attention_cache: torch.Tensor
    block_size: int
    attention_block_stride: int


def latent_buffers(layers: int, max_num_reqs: int, rows_per_request: int, device="cpu"):
    """One uint8 [blocks, 64, 656] buffer per layer: the ESS rows of max_num_reqs requests, then one scratch row
    (where the newest-entry copy of a padded token goes), rounded up to whole FlashMLA blocks."""
    blocks = -(-(max_num_reqs * rows_per_request + 1) // KERNEL_BLOCK)
    return [torch.zeros((blocks, KERNEL_BLOCK, ENTRY_BYTES), dtype=torch.uint8, device=device)
            for _ in range(layers)]


def host_pool_layout(backing: torch.Tensor, host_caches: Sequence[torch.Tensor]) -> ForeignPages:
    """The ForeignPages of vLLM's host pool for ESS: `backing` the pool's one allocation (HiSparseHostPool's
    `registered`: pinned, or the node's shared region), `host_caches` each target layer's host cache, rows of
    656 bytes in blocks of 64 (HiSparseRuntime.host_cache: [blocks x 64, 656]). A layer's block g is ESS's page g
    of that layer; the regions must lie in the backing at whole blocks from its start. Refused by name
    otherwise."""
    if not host_caches:
        raise InvalidArgument("host_pool_layout: no host caches")
    base, size = backing.data_ptr(), backing.numel() * backing.element_size()
    rows = host_caches[0].shape[0]
    page = KERNEL_BLOCK * ENTRY_BYTES
    firsts = []
    for l, cache in enumerate(host_caches):
        if cache.dim() != 2 or cache.shape[1] * cache.element_size() != ENTRY_BYTES or not cache.is_contiguous():
            raise InvalidArgument(f"host_pool_layout: layer {l}'s host cache is {cache.dtype} "
                                  f"{tuple(cache.shape)}; contiguous rows of {ENTRY_BYTES} bytes expected")
        if cache.shape[0] != rows or rows % KERNEL_BLOCK:
            raise InvalidArgument(f"host_pool_layout: layer {l} has {cache.shape[0]} host rows; every layer needs "
                                  f"the same whole blocks of {KERNEL_BLOCK} ({rows} at layer 0)")
        offset = cache.data_ptr() - base
        if offset < 0 or offset % page or offset + rows * ENTRY_BYTES > size:
            raise InvalidArgument(f"host_pool_layout: layer {l}'s host cache is at byte {offset} of the "
                                  f"{size}-byte host pool, not at whole {page}-byte blocks inside it")
        firsts.append(offset // page)
    return ForeignPages(rows // KERNEL_BLOCK, page, firsts)


class Scheduled(NamedTuple):
    """One scheduled request of a step, as vLLM's scheduler output gives it (the same values upstream's
    HiSparseConnectorScheduler.build_connector_meta reads)."""
    num_computed_tokens: int   # before this step
    num_scheduled_tokens: int


def scheduled_from_output(scheduler_output) -> Dict[str, Scheduled]:
    """vllm/v1/core/sched/output.py SchedulerOutput -> {request id: Scheduled}, read as upstream's
    HiSparseConnectorScheduler.build_connector_meta reads it (new requests, then cached ones)."""
    computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    return {rid: Scheduled(int(computed[rid]), int(n)) for rid, n in scheduler_output.num_scheduled_tokens.items()}


def source_blocks_from_output(scheduler_output, group: int) -> Dict[str, tuple]:
    """vllm/v1/core/sched/output.py SchedulerOutput -> {request id: (host blocks of KV cache group `group` (the
    HiSparse host source group, kv_cache_config.host_group_ids), whether they replace the request's blocks)}: a new
    request's block_ids replace, a cached request's new_block_ids are appended (None: none), unless it is in
    resumed_req_ids, whose new_block_ids are its whole list (CachedRequestData's contract; the GPU model runner's
    BlockTables.append_block_ids keeps its tables the same way). The host block table of every request, kept on
    the host from the scheduler's own output: start_step reads no block table entry back from the device."""
    blocks = {r.req_id: (list(r.block_ids[group]), True) for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    resumed = set(cached.resumed_req_ids)
    for rid, new in zip(cached.req_ids, cached.new_block_ids):
        if new is not None:
            blocks[rid] = (list(new[group]), rid in resumed)
    return blocks


def fresh_from_output(scheduler_output) -> set:
    """The requests whose blocks vLLM's scheduler hands out afresh this step: its new requests (scheduled_new_reqs,
    which under the GPU model runner v2 carry the ones resumed after preemption too: v1/core/sched/scheduler.py
    schedule, `scheduled_new_reqs.extend(scheduled_resumed_reqs)`) and the cached requests it marks resumed
    (scheduled_cached_reqs.resumed_req_ids, the other runner's)."""
    return {r.req_id for r in scheduler_output.scheduled_new_reqs} | set(
        scheduler_output.scheduled_cached_reqs.resumed_req_ids)


class EssDecode:
    """The per-worker decode state: one ESS engine for every target-model HiSparse layer, its host pool vLLM's
    (the engine was built with foreign_pages: host_pool_layout), the staging tensors its bound step reads (fixed
    addresses: the step can be captured in vLLM's FULL decode graphs), and the request bookkeeping start_step does
    before each forward.

    block_table: vLLM's host block table as the forward reads it (the handles' source_block_table: int32
    [batch rows, blocks], row b the blocks of batch row b's request). synchronize(): waits for the device work
    already enqueued, vLLM's row mirror included (without hot regions, before a short row's older entries are read
    on the host).
    Under CUDA the engine's lifecycle calls are ordered on the forward's stream (Engine.set_lifecycle_stream), so
    releases and adoptions wait for nothing on the host. counts_run_ahead: whether the scheduler's
    num_computed_tokens may exceed the device's (async scheduling with speculative decoding: upstream's
    HiSparseConnectorScheduler async_speculative); the host then keeps them (a request holds the blocks of its
    drafts) and the step takes the forward's seq_lens on the device (the engine on foreign pages serves a step
    below what a request holds).

    What start_step reads from the device: each batch row's state index only in a step where a decode request is
    new to ESS (a request keeps its state index while vLLM holds it); the decode rows' seq_lens only when the recorder
    is on, or without hot regions when the counts run ahead and a decode row has fewer than T tokens (its older
    tokens are read on the host); block table entries only when it is not given the scheduler's new blocks
    (source_blocks_from_output). adaptive_verification: the model runner trims the verify rows' drafts on the device
    (vLLM's enable_adaptive_verification; hot regions only): the scheduler's counts are upper bounds, every leading
    row of 1 to T tokens is staged (the forward's decode split is the host's spread of the trimmed total, which may
    cut a row on the device) and the lengths are the forward's seq_lens.
    Its staged tensors go to the device from pinned memory without a wait.

    Hot regions (the engine made with region_blocks: ESS's rows in vLLM's own GPU slab). `latent` is then each
    layer's attention view of vLLM's slab (HiSparseRuntime.hot.attention_cache: [blocks, 64, 656], FlashMLA's
    rows), and attention_block_stride its rows from one vLLM block to the next (PagedCacheView's: a multiple of
    64), so vLLM block k is ESS's block k x attention_block_stride / 64. vLLM packs its layers into hot cache groups
    (v1/hisparse/layout.py: as many as one indexer page holds), each handing a request a region of its own:
    region_group[l] is layer l's group (the engine's), in the order start_step's hot_blocks lists them. A decode
    request vLLM gave hot regions (HiSparseHotManager.require_hot: the scheduler output's blocks of the hot groups)
    has its ESS rows there, its reserved rows among them (Engine.place, again when a region changes); one without a
    hot region holds every context page resident (vLLM unpins a request's pages only once it has one), and
    swap_in reads its rows in place through vLLM's residency table (the handle's block_table, by state index),
    as vLLM's own resolution does, with no swap and no copy."""

    def __init__(self, engine: Engine, latent: Sequence[torch.Tensor], max_num_reqs: int, block_table: torch.Tensor,
                 device="cpu", synchronize: Callable[[], None] = lambda: None, counts_run_ahead: bool = True,
                 attention_block_stride: int = KERNEL_BLOCK, region_group: Optional[Sequence[int]] = None,
                 adaptive_verification: bool = False, overlap: Optional[Sequence[str]] = None):
        info = engine.info
        if not info.reserve_newest:
            raise InvalidArgument("EssDecode: the engine needs reserve_newest=True (each step's newest entries are "
                                  "ESS's reserved rows, or with hot regions read in place on vLLM's tail pages, never "
                                  "through the LRU)")
        if not 1 <= max_num_reqs <= info.max_requests:
            raise InvalidArgument(f"EssDecode: max_num_reqs = {max_num_reqs} outside [1, max_requests = "
                                  f"{info.max_requests}]")
        if len(latent) != info.layers:
            raise InvalidArgument(f"EssDecode: {len(latent)} latent buffers for {info.layers} layers")
        for l, t in enumerate(latent):
            if t.dim() != 3 or tuple(t.shape[1:]) != (KERNEL_BLOCK, ENTRY_BYTES):
                raise InvalidArgument(f"EssDecode: layer {l}'s latent is {tuple(t.shape)}; [blocks, {KERNEL_BLOCK}, "
                                      f"{ENTRY_BYTES}] expected")
        if attention_block_stride < KERNEL_BLOCK or attention_block_stride % KERNEL_BLOCK:
            raise InvalidArgument(f"EssDecode: attention_block_stride = {attention_block_stride}; a multiple of "
                                  f"{KERNEL_BLOCK} rows expected")
        if block_table.dim() != 2 or block_table.dtype != torch.int32:
            raise InvalidArgument(f"EssDecode: block_table is {block_table.dtype} {tuple(block_table.shape)}; int32 "
                                  "[batch rows, blocks] expected")
        self.engine, self.info, self.latent = engine, info, list(latent)
        self.max_num_reqs, self.block_table, self.device = max_num_reqs, block_table, torch.device(device)
        self.synchronize, self.counts_run_ahead = synchronize, bool(counts_run_ahead)
        self.regions = info.region_blocks > 0
        self.attention_block_stride = attention_block_stride
        self.block_scale = attention_block_stride // KERNEL_BLOCK   # vLLM block k -> ESS block k x this
        self.region_group = list(region_group) if region_group is not None else [0] * info.layers
        if len(self.region_group) != info.layers:
            raise InvalidArgument(f"EssDecode: region_group has {len(self.region_group)} values for {info.layers} "
                                  "layers")
        self.groups = max(self.region_group) + 1
        T, K = info.query_tokens, info.topk
        # With hot regions a step's T newest entries are read in place on vLLM's resident tail pages, which it never
        # unpins. The first of them lies at most 4T - 2 tokens before the end of what the scheduler allocated (its
        # count ahead by the drafts rejected and its tokens by the drafts trimmed, T - 1 each; its lookahead slots,
        # up to T; the window, T), and the last ACTIVE_TAIL_PAGES pages hold every position at most
        # (ACTIVE_TAIL_PAGES - 1) x 64 + 1 before that end.
        if self.regions and 4 * T - 2 > (ACTIVE_TAIL_PAGES - 1) * KERNEL_BLOCK + 1:
            raise InvalidArgument(f"EssDecode: T = {T} query tokens; with hot regions each step's T newest entries "
                                  f"are read from vLLM's {ACTIVE_TAIL_PAGES} active tail pages of {KERNEL_BLOCK}, "
                                  f"which hold them for T <= {((ACTIVE_TAIL_PAGES - 1) * KERNEL_BLOCK + 3) // 4}")
        self.adaptive = bool(adaptive_verification)
        if self.adaptive and not self.regions:
            raise InvalidArgument("EssDecode: adaptive_verification needs ESS's rows in vLLM's hot regions "
                                  "(region_blocks): a decode row's tokens are known only on the device then, and "
                                  "only that layout stages them there")
        self.pinned = self.device.type == "cuda"   # host staging pinned: its copies need no wait
        i32 = dict(dtype=torch.int32, device=self.device)
        self.rows = torch.full((max_num_reqs,), -1, **i32)          # batch row -> state index (ESS row), -1
        self.lengths = torch.zeros((max_num_reqs,), **i32)
        self.topk = torch.full((max_num_reqs, T, K), -1, **i32)
        self.physical = torch.full((max_num_reqs, T, K), -1, **i32)
        self.counts = torch.zeros((max_num_reqs, 2), **i32)
        # The DA overlap (vllm_overlap.py): each layer's schedule; with a DA layer the steps also give each query
        # row's resident and fetched rows, and the copy runs on a stream of its own.
        self.overlap = None
        if overlap is not None:
            if len(overlap) != info.layers:
                raise InvalidArgument(f"EssDecode: overlap has {len(overlap)} schedules for {info.layers} layers")
            if "dba" in overlap and not self.regions:
                raise InvalidArgument("EssDecode: DBA needs ESS's rows in vLLM's hot regions (region_blocks): its "
                                      "first half is swapped from the indexer, before the layer writes the step's "
                                      "newest entries, which only that layout reads in place")
            if any(schedule != "none" for schedule in overlap):
                self.overlap = DecodeOverlap(_device.for_device(str(self.device)), overlap, max_num_reqs, T, K,
                                             self.device)
        self.step_binding = engine.bind_step(self.rows, self.topk, self.lengths, self.physical, counts=self.counts,
                                             **(self.overlap.outputs() if self.overlap is not None else {}))
        self.max_swap_rows = max_num_reqs * T
        # ESS's own buffer (no regions; with them the newest entries are read in place): where each decode token's
        # newest entry goes, its request's reserved row t (int64, as vLLM's slot mappings are), the scratch row
        # after every request's rows for padding (rewritten with its own bytes).
        self.scratch_row = max_num_reqs * info.rows_per_request
        self.slot_mapping = torch.full((self.max_swap_rows,), self.scratch_row, dtype=torch.int64, device=self.device)
        # Per decode token i of the step: its batch row (-1: none), its row of the staged [B x T] queries; per
        # staged query: its token (-1: padding). (ESS's own buffer: start_step maps them.)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.token_row = torch.full((self.max_swap_rows,), -1, **i64)
        self.token_flat = torch.zeros((self.max_swap_rows,), **i64)
        self.query_token = torch.full((self.max_swap_rows,), -1, **i64)
        self.token_index = torch.arange(self.max_swap_rows, **i64)
        self.request_state_indices = torch.full((max_num_reqs,), -1, **i32)
        # Per batch row: the state index of a decode row read in place (hot regions: no hot region), -1 else (its
        # ESS row in `rows`).
        self.in_place_state = torch.full((max_num_reqs,), -1, **i32)
        # Hot regions: the step's queries scattered per token ([B x T] staged rows, then one row for tokens served no
        # row).
        self.topk_scatter = torch.full((max_num_reqs * T + 1, K), -1, **i32)
        self.batch = 0              # ESS positions staged for this step
        self.state_of: Dict[str, int] = {}     # vLLM request id -> state index (ESS request id and row)
        self.length_of: Dict[int, int] = {}    # state index -> tokens in ESS
        self.finished_since = set()            # ESS's requests vLLM finished since the last start_step
        self.blocks_of: Dict[str, list] = {}   # vLLM request id -> its host blocks (from the scheduler's output)
        self.hot_of = [{} for _ in range(self.groups)]   # hot regions, per group: vLLM request id -> its vLLM blocks
        self.placed: Dict[int, list] = {}      # hot regions: state index -> the ESS blocks its rows are placed on
        self.lifecycle_stream = None           # the engine's lifecycle stream (CUDA: the forward's, set per step)
        self.device_reads = 0                  # start_steps that read state indices, seq_lens or blocks back
        self.steps_started = 0                 # start_steps that staged a step
        # ESS_RECORD_TRACE: the top-k vLLM hands the swap, recorded as a trace (topk_recorder.py), by state index.
        self.recorder = TopkRecorder.from_environment(
            layers=info.layers, T=T, K=K, max_reqs=max_num_reqs, device=self.device,
            dev=_device.for_device(str(self.device)), provenance=f"vllm {VLLM_VERSION} with ess.integrations.vllm")

    def note_finished(self, request_ids: Iterable[str]):
        """Requests vLLM finished (the connector's get_finished, after every step, one without a forward
        included): released at the next start_step, with its other releases."""
        request_ids = set(request_ids)
        self.finished_since.update(rid for rid in request_ids if rid in self.state_of)
        for rid in request_ids:
            self.blocks_of.pop(rid, None)
            for hot in self.hot_of:
                hot.pop(rid, None)

    # ---- before each forward (the connector's start_load_kv) ----
    def start_step(self, request_ids: Sequence[str], request_state_indices, scheduled: Mapping[str, Scheduled],
                   finished: Iterable[str] = (), preempted: Iterable[str] = (), fresh: Iterable[str] = (),
                   all_context_pages_resident: bool = False, attn_metadata=None,
                   new_blocks: Optional[Mapping[str, tuple]] = None, hot_blocks: Optional[Mapping[str, tuple]] = None):
        """request_ids: the batch's request ids in batch order (input_batch.req_ids); request_state_indices: each
        batch row's state index (input_batch.idx_mapping, on the device or the host); scheduled: this step's
        requests; finished / preempted: the scheduler output's finished_req_ids / preempted_req_ids; fresh: the
        requests whose blocks the scheduler hands out afresh this step (fresh_from_output: new and resumed), any of
        which ESS still holds is released first (preempted in a step without a forward, whose preempted_req_ids
        never reach ESS, then resumed, most likely on the same state index and over other blocks);
        all_context_pages_resident: the connector metadata's; new_blocks: this step's host blocks of the scheduled
        requests (source_blocks_from_output), kept per request so that no block table entry is read back (None:
        the entries ESS needs are read from block_table, as the forward's); attn_metadata: the forward's sparse
        MLA metadata of an index-group leader layer (model_executor/layers/attention/sparse_mla_attention.py
        build: num_decodes, num_decode_tokens, seq_lens), padded under a FULL CUDA graph; hot_blocks (hot regions
        only, required then): this step's blocks of each of vLLM's hot cache groups, in region group order
        (source_blocks_from_output of each: a request's hot region there, region_blocks blocks handed out with the
        other groups' and held until it finishes or is preempted).

        Decode rows are the forward's: its first num_decodes rows (vLLM's split, split_decodes_and_prefills;
        under a FULL graph num_decodes and num_decode_tokens count the padded rows and tokens too, which follow
        the batch's). A decode row's tokens before this step are its seq_len minus its scheduled tokens: the
        scheduler's num_computed_tokens is an upper bound under async scheduling with speculative decoding (it
        counts the drafts of the step still running as kept), seq_lens is the device's true count. Without
        attn_metadata (tests, engines that have none) the decode rows are the batch's leading rows of at most T
        tokens and the scheduler's counts are taken as true.

        A row of n < T tokens is served with its n queries as the last n of its T (the others padding); without hot
        regions its T - n older tokens are copied into the reserved rows beside its n new ones (with hot regions
        every newest entry is read in place, on vLLM's tail pages). Each decode request is adopted
        over its host blocks when it first decodes and repaged to its new length every step after (its blocks
        from the first that can be new: nothing is copied, the entries are vLLM's). When every context page is
        resident and the batch has other rows, vLLM's index group resolves the decode tokens over resident pages
        instead of calling swap_in (index_group.py convert_logical_to_physical_topk): ESS serves no row then,
        and its requests' next ESS step repages them over the tokens in between.

        The batch (and attn_metadata against it) is checked before anything changes; a block table entry
        outside vLLM's host pool raises from the engine with the requests before it served."""
        T = self.info.query_tokens
        for name, ids in (("finished", finished), ("preempted", preempted), ("fresh", fresh)):
            if ids is None or isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise InvalidType(f"start_step: {name} = {ids!r}: an iterable of request ids is expected "
                                  "(the scheduler output's sets; empty when there are none)")
        R = len(request_ids)
        if R > self.max_num_reqs:
            raise InvalidArgument(f"start_step: {R} batch requests exceed max_num_seqs = {self.max_num_reqs}")
        for b, rid in enumerate(request_ids):
            if rid not in scheduled:
                raise InvalidArgument(f"start_step: batch row {b}: request {rid!r} is not scheduled")
            for what, v in zip(("computed tokens", "scheduled tokens"), scheduled[rid]):   # before anything changes
                _args.integer(f"start_step: request {rid!r}'s {what}", v, 0, 2**31 - 1)
        if self.adaptive and attn_metadata is None and R:
            raise InvalidArgument("start_step: adaptive verification: the forward's attention metadata is required "
                                  "(its seq_lens are the rows' true lengths, which the model runner decides on the "
                                  "device)")
        leading = 0   # the batch's leading rows of 1 to T tokens
        while leading < R and 1 <= scheduled[request_ids[leading]][1] <= T:
            leading += 1
        decodes = split = leading   # the rows ESS stages; the forward's decode rows
        if attn_metadata is not None:
            num_decodes, num_decode_tokens = int(attn_metadata.num_decodes), int(attn_metadata.num_decode_tokens)
            split = min(num_decodes, R)
            if split > leading:
                b = leading
                raise InvalidArgument(f"start_step: the forward's decode row {b} (request {request_ids[b]!r}) "
                                      f"has {scheduled[request_ids[b]][1]} tokens; ESS serves rows of 1 to T = {T}")
            if self.adaptive:
                # The scheduler's counts bound the rows' tokens (the model runner trims drafts on the device), and
                # the forward's decode split is the host's even spread of them: a row's tokens may straddle it, so
                # every leading row is staged (its tokens past the split take vLLM's prefill path).
                tokens = sum(scheduled[request_ids[b]][1] for b in range(leading))
                if num_decode_tokens < split or (num_decodes < R and num_decode_tokens > tokens):
                    raise InvalidArgument(f"start_step: the forward has {num_decodes} decode rows of "
                                          f"{num_decode_tokens} tokens; the batch's first {leading} rows hold 1 to "
                                          f"{tokens} tokens (adaptive verification trims drafts; only padded rows may "
                                          "add tokens, after every batch row)")
            else:
                decodes = split
                tokens = sum(scheduled[request_ids[b]][1] for b in range(decodes))
                if num_decode_tokens < tokens or (num_decodes < R and num_decode_tokens != tokens):
                    raise InvalidArgument(f"start_step: the forward has {num_decodes} decode rows of "
                                          f"{num_decode_tokens} tokens; the batch's first {decodes} rows hold {tokens} "
                                          "tokens (only padded rows may add tokens, after every batch row)")
        finished, preempted = set(finished) | self.finished_since, set(preempted) | set(fresh)
        if self.regions and hot_blocks is None:
            raise InvalidArgument("start_step: ESS's rows are in vLLM's hot regions: hot_blocks (the scheduler "
                                  "output's blocks of the hot group, source_blocks_from_output) is required")
        if not self.regions and hot_blocks is not None:
            raise InvalidArgument("start_step: hot_blocks given, but the engine has no regions (region_blocks = 0)")
        if hot_blocks is not None and len(hot_blocks) != self.groups:
            raise InvalidArgument(f"start_step: hot_blocks of {len(hot_blocks)} hot groups; the layers are in "
                                  f"{self.groups}")
        given_lists = [("new_blocks", new_blocks)] + [("hot_blocks", h) for h in (hot_blocks or ())]
        for what, given in given_lists:
            for rid, entry in (given or {}).items():
                if not (isinstance(entry, tuple) and len(entry) == 2):
                    raise InvalidType(f"start_step: {what}[{rid!r}] = {entry!r}: (blocks, replace) expected "
                                      "(source_blocks_from_output)")
                # (A hot region is appended to a request's empty hot list: no earlier list is needed.)
                if what == "new_blocks" and not entry[1] and (rid not in self.blocks_of or rid in finished or
                                                              rid in preempted):
                    raise InvalidArgument(f"start_step: {what} appends to request {rid!r}, whose blocks ESS was "
                                          "never given (a new request's replace them)")
        states_in = torch.as_tensor(request_state_indices).reshape(-1)
        if states_in.shape[0] < R:
            raise InvalidArgument(f"start_step: {R} batch requests but {states_in.shape[0]} state indices")
        forward_lengths = None   # the forward's seq_lens, one per batch row (the device's counts)
        if attn_metadata is not None and decodes:
            if getattr(attn_metadata, "seq_lens", None) is None:
                raise InvalidArgument("start_step: the forward's attention metadata has no seq_lens")
            forward_lengths = attn_metadata.seq_lens.reshape(-1)
            if forward_lengths.shape[0] < decodes:
                raise InvalidArgument(f"start_step: the forward's seq_lens has {forward_lengths.shape[0]} rows for "
                                      f"{decodes} decode rows")
        # Read back from the device (one copy) only what the host lacks: the state indices when a decode request
        # is new to ESS (a request keeps its state index while vLLM holds it: a preempted or resumed one is released
        # first), and the true lengths below.
        swap_path = not (all_context_pages_resident and split < R)
        served = decodes if swap_path else 0   # the decode rows ESS serves this step
        # Counts that run ahead are read back only where the host needs the true ones: a short row's older tokens
        # (read on the host) and the recorder's lengths. Otherwise the host keeps the scheduler's counts (an upper
        # bound: the blocks of its drafts are given, and ESS on foreign pages serves a step below what a request
        # holds) and the step's lengths are the forward's seq_lens, copied on the device.
        # With hot regions every row's newest entries are read on the device (vLLM's tail pages): only the recorder
        # needs the true lengths on the host. Under adaptive verification the device alone has them.
        ahead = attn_metadata is not None and served > 0 and (self.counts_run_ahead or self.adaptive)
        read_lengths = ahead and (self.recorder is not None or (not self.regions and any(
            scheduled[request_ids[b]][1] < T for b in range(served))))
        known = all(request_ids[b] in self.state_of and request_ids[b] not in finished and
                    request_ids[b] not in preempted for b in range(served))
        states, seq_lens = None, []
        if not known or read_lengths:
            parts = [states_in[:R].to(torch.int64)]
            if read_lengths:
                parts.append(forward_lengths[:decodes].to(device=states_in.device, dtype=torch.int64))
            host = [int(v) for v in torch.cat(parts).cpu().tolist()]
            self.device_reads += 1
            states, seq_lens = host[:R], host[R:]
        if states is not None:
            seen = {}
            for b, rid in enumerate(request_ids):
                s = states[b]
                if not 0 <= s < self.max_num_reqs:
                    raise InvalidArgument(f"start_step: batch row {b} (request {rid!r}): state index {s} outside "
                                          f"[0, {self.max_num_reqs})")
                if s in seen:
                    raise InvalidArgument(f"start_step: state index {s} is batch rows {seen[s]} and {b}")
                seen[s] = b
        decode_state = [states[b] if states is not None else self.state_of[request_ids[b]] for b in range(served)]
        # Per decode row: its batch row, request, state, tokens before this step as the host keeps them (the
        # scheduler's count: true, or run ahead by drafts not kept, whose blocks the request holds), tokens this
        # step, and tokens before this step as the device has them (read back, or the host's count when true or
        # when the step takes the forward's seq_lens on the device).
        positions = []
        for b in range(served):
            rid, s = request_ids[b], decode_state[b]
            c, n = scheduled[rid]
            true = c
            if seq_lens:
                low = 1 if self.adaptive else n   # (adaptive verification: 1 to n tokens this step)
                if not low <= seq_lens[b] <= c + n:
                    raise InvalidArgument(f"start_step: batch row {b} (request {rid!r}): the forward's seq_len "
                                          f"{seq_lens[b]} is outside [{low}, the scheduler's {c} computed + {n} "
                                          "scheduled tokens]")
                true = seq_lens[b] - n   # (true + n: the step's length)
            if c + n > self.info.max_context:
                raise InvalidArgument(f"start_step: request {rid!r} reaches {c + n} tokens; the engine holds "
                                      f"max_context = {self.info.max_context}")
            positions.append((b, rid, s, c, n, true))
        longest = max((c + n for _, _, _, c, n, _ in positions), default=0)
        if -(-longest // KERNEL_BLOCK) > self.block_table.shape[1]:
            raise InvalidArgument(f"start_step: a request reaches {longest} tokens, past the "
                                  f"{self.block_table.shape[1]} blocks of vLLM's host block table")
        if positions and max(p[0] for p in positions) >= self.block_table.shape[0]:
            raise InvalidArgument(f"start_step: {len(positions)} decode rows; vLLM's host block table has "
                                  f"{self.block_table.shape[0]} rows")
        mirror = None
        if new_blocks is not None:   # vLLM's host block table by request, as its model runner keeps its own
            mirror = self._blocks_after(self.blocks_of, new_blocks, finished, preempted)
            for b, rid, _, c, n, _ in positions:
                if len(mirror.get(rid, ())) < -(-(c + n) // KERNEL_BLOCK):
                    raise InvalidArgument(f"start_step: batch row {b} (request {rid!r}) reaches {c + n} tokens; "
                                          f"vLLM's scheduler gave it {len(mirror.get(rid, ()))} host blocks of "
                                          f"{KERNEL_BLOCK}")
        hot = None
        if hot_blocks is not None:   # vLLM's hot regions by group and request (its hot groups' blocks)
            hot = [self._blocks_after(kept, given, finished, preempted) for kept, given in zip(self.hot_of, hot_blocks)]
            R_blocks, limit = self.info.region_blocks, self.latent[0].shape[0]
            for g, regions in enumerate(hot):
                for rid, blocks in regions.items():
                    if blocks and len(blocks) != R_blocks:
                        raise InvalidArgument(f"start_step: request {rid!r} has {len(blocks)} blocks in hot group {g}; "
                                              f"a hot region is {R_blocks} (the hot group's blocks_per_request)")
                    for k in blocks:
                        if not 0 < k * self.block_scale < limit:
                            raise InvalidArgument(f"start_step: request {rid!r}'s hot block {k} is outside vLLM's slab "
                                                  f"of {limit // self.block_scale} blocks (or the null block)")
            owner = {}
            for rid in set().union(*hot):
                have = [g for g in range(self.groups) if hot[g].get(rid)]
                if have and len(have) != self.groups:
                    raise InvalidArgument(f"start_step: request {rid!r} has hot regions in groups {have} of "
                                          f"{self.groups}; vLLM hands a request all its hot regions at once")
                for g in have:
                    for k in hot[g][rid]:
                        if owner.setdefault(k, rid) != rid:
                            raise InvalidArgument(f"start_step: hot block {k} is in the regions of requests "
                                                  f"{owner[k]!r} and {rid!r}")
        # ESS's lifecycle calls (releases, adoptions, repages) on the forward's stream, after the forwards before it,
        # without a wait: a row released below may still be read by the forward in flight.
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            if stream.cuda_stream != self.lifecycle_stream:
                self.engine.set_lifecycle_stream(stream)
                self.lifecycle_stream = stream.cuda_stream
        for rid in list(self.state_of):
            if rid in finished or rid in preempted:
                self._release(rid)
        self.finished_since.clear()
        if mirror is not None:
            self.blocks_of = mirror
        if hot is not None:
            self.hot_of = hot
        plans = []   # (batch row, request, state, new length, first page to give, pages in all)
        for b, rid, s, c, n, _ in positions:
            if self.state_of.get(rid, s) != s:     # vLLM gave the request another state index
                self._release(rid)
            if rid not in self.state_of and s in self.length_of:
                self._release_state(s)              # the state's previous request left without notice
            if rid in self.state_of and c < self.length_of[s] - T:
                self._release(rid)                  # vLLM went back further than a step's drafts: start over
            pages = -(-(c + n) // KERNEL_BLOCK)
            # The first block that can be new: the one holding the first token past what ESS holds (or past
            # the drafts taken back); the blocks before it are vLLM's computed ones, which stay.
            first = min(self.length_of[s], c) // KERNEL_BLOCK if rid in self.state_of else 0
            plans.append((b, rid, s, c + n, first, pages))
        if new_blocks is None:
            # Every block entry this step gives ESS, read in one copy (the table is on the device under CUDA).
            rows = [b for b, *_, first, pages in plans for _ in range(first, pages)]
            cols = [p for *_, first, pages in plans for p in range(first, pages)]
            table = self.block_table
            if rows:
                self.device_reads += 1
            blocks = table[torch.tensor(rows, dtype=torch.int64, device=table.device),
                           torch.tensor(cols, dtype=torch.int64, device=table.device)].cpu().tolist() if rows else []
        else:
            blocks = []
            for _, rid, _, _, first, pages in plans:
                blocks += self.blocks_of[rid][first:pages]
        at = 0
        for b, rid, s, length, first, pages in plans:
            given = blocks[at:at + pages - first]
            at += pages - first
            if rid in self.state_of:
                self.engine.repage(s, length, given, first_page=first)
            else:
                self.engine.adopt(s, length, given, row=s)
                self.state_of[rid] = s
                if self.recorder is not None:
                    self.recorder.begin(s, rid, length)
            self.length_of[s] = length
        for _, rid, s, *_ in plans if self.regions else ():   # after every release: their blocks are free
            if self.hot_of[0].get(rid):   # its rows in its hot regions (placed anew: its LRU empty)
                region = [k * self.block_scale for hot in self.hot_of for k in hot[rid]]
                if self.placed.get(s) != region:
                    self.engine.place(s, region)
                    self.placed[s] = region
        self.steps_started += 1
        self._stage(len(request_ids), states if states is not None else states_in[:R], positions)
        if ahead and not read_lengths:   # the decode rows are batch rows 0 .. served - 1, every one staged
            self.lengths[:served].copy_(forward_lengths[:served].to(self.lengths.dtype), non_blocking=True)
        if self.recorder is not None:
            self.recorder.step([p[2] for p in positions], [true + n for *_, n, true in positions])

    @staticmethod
    def _blocks_after(kept, given, finished, preempted):
        """Block lists by request after a step's scheduler output: `given` ({rid: (blocks, replace)}) replaces or
        extends `kept`, the finished and preempted requests' lists dropped."""
        after = {rid: b for rid, b in kept.items() if rid not in finished and rid not in preempted}
        for rid, (blocks, replace) in given.items():
            after[rid] = ([] if replace else after.get(rid, [])) + [int(v) for v in blocks]
        return after

    def _row(self, s, slot):
        """ESS's own buffer: the buffer row (FlashMLA's row of `latent`) of row `slot` of state s's rows."""
        return s * self.info.rows_per_request + slot

    def _stage(self, R, states, positions):
        """The step's rows and lengths, and without hot regions how its tokens reach the staged queries and reserved
        rows. states: the R batch rows' state indices, a list read back or vLLM's tensor (copied on the device).

        Hot regions: swap_in maps the tokens on the device (from the forward's req_id_per_token) and reads each row's
        newest entries in place (vLLM's resident tail pages). Else per-token maps from the scheduler's counts, and
        the older tokens of short rows copied into the reserved rows from vLLM's host pool."""
        host = dict(pin_memory=self.pinned)
        rows = torch.full((self.max_num_reqs,), -1, dtype=torch.int32, **host)
        lengths = torch.zeros((self.max_num_reqs,), dtype=torch.int32, **host)
        in_place = torch.full((self.max_num_reqs,), -1, dtype=torch.int32, **host)
        staged = [(self.rows, rows), (self.lengths, lengths), (self.in_place_state, in_place)]
        for b, _, s, _, n, true in positions:
            # Hot regions: a row without one is read in place (vLLM's resident pages), no ESS row of its own.
            mine = not self.regions or s in self.placed
            rows[b], lengths[b] = (s if mine else -1), true + n
            in_place[b] = -1 if mine else s
        if not self.regions:
            staged += self._stage_tokens(positions)
        # From pinned memory without a wait (torch's pinned allocator keeps each buffer until its copy has run).
        for tensor, value in staged:
            tensor.copy_(value, non_blocking=self.pinned)
        if isinstance(states, torch.Tensor):
            self.request_state_indices[:R].copy_(states.to(self.device, torch.int32), non_blocking=True)
        else:
            self.request_state_indices[:R].copy_(torch.tensor(states[:R], dtype=torch.int32, **host),
                                                 non_blocking=self.pinned)
        self.request_state_indices[R:].fill_(-1)
        self.batch = len(positions)

    def _stage_tokens(self, positions):
        """ESS's own buffer: per decode token its batch row, staged query and reserved row, from the scheduler's
        counts (true: the forward's split keeps them); a row of n < T tokens has its T - n older tokens copied into
        its reserved rows from vLLM's host pool. The staged tensors and their values."""
        T, S = self.info.query_tokens, self.info.slots
        host = dict(pin_memory=self.pinned)
        token_row = torch.full((self.max_swap_rows,), -1, dtype=torch.int64, **host)
        token_flat = torch.zeros((self.max_swap_rows,), dtype=torch.int64, **host)
        token_slot = torch.full((self.max_swap_rows,), self.scratch_row, dtype=torch.int64, **host)
        query_token = torch.full((self.max_swap_rows,), -1, dtype=torch.int64, **host)
        if any(n < T and true > 0 for *_, n, true in positions):
            self.synchronize()   # the older tokens read below are vLLM's mirror of earlier steps' rows
        i = 0
        for b, _, s, _, n, true in positions:
            for t in range(n):
                q = T - n + t                       # the n queries are the last n of the row's T
                token_row[i], token_flat[i], token_slot[i] = b, b * T + q, self._row(s, S + q)
                query_token[b * T + q] = i
                i += 1
            for q in range(T - n):   # the row's older tokens among its T newest
                position = true + n - T + q
                if position >= 0:
                    for layer in range(self.info.layers):
                        p = self._row(s, S + q)
                        entry = self.engine.read_entries(s, layer, position, torch.empty((1, ENTRY_BYTES),
                                                                                         dtype=torch.uint8))
                        self.latent[layer][p // KERNEL_BLOCK, p % KERNEL_BLOCK].copy_(entry[0])
        return [(self.token_row, token_row), (self.token_flat, token_flat), (self.slot_mapping, token_slot),
                (self.query_token, query_token)]

    def close(self):
        """The recorder's trace written (ESS_RECORD_TRACE), before the engine goes."""
        if self.recorder is not None:
            self.recorder.close()

    def finish(self, request_id: str):
        """Forgets a request now (a finished one is otherwise released at the next start_step)."""
        if request_id not in self.state_of:
            raise InvalidArgument(f"finish: request {request_id!r} is not in ESS")
        self._release(request_id)

    def reset(self):
        """Forgets every request's device residency (vLLM's reset_capture_state after graph capture); the host
        entries stay, so the next steps miss and copy in again."""
        for s in self.length_of:
            self.engine.reset(s)

    def _release(self, rid):
        s = self.state_of.pop(rid)
        self._release_state(s)

    def _release_state(self, s):
        self.placed.pop(s, None)   # its hot region's blocks are free in the engine with its release
        if s in self.length_of:
            self.engine.release(s)
            del self.length_of[s]
            if self.recorder is not None:
                self.recorder.end(s)
        for rid, state in list(self.state_of.items()):
            if state == s:
                del self.state_of[rid]


class HiSparseRuntime:
    """ESS's stand-in for vllm/v1/hisparse/runtime.py's HiSparseRuntime on one target-model layer's cache handle.

    `upstream`: the handle's own runtime, kept for what stays vLLM's (its host pool, the prefill staging, the
    index-group leadership and the connector worker's mirror); None in tests without vLLM."""

    def __init__(self, decode: EssDecode, layer: int, handle, upstream=None):
        info = decode.info
        if not 0 <= layer < info.layers:
            raise InvalidArgument(f"HiSparseRuntime: layer {layer} outside [0, {info.layers})")
        if getattr(handle, "draft_layer", False):
            raise InvalidArgument(f"HiSparseRuntime: layer {layer} is a speculator's layer; ESS serves the target "
                                  "model's layers (the drafter keeps vLLM's runtime)")
        latent = decode.latent[layer]   # [blocks, 64, 656]: FlashMLA's rows (with hot regions, vLLM's slab)
        self.decode, self.layer, self.handle, self.upstream = decode, layer, handle, upstream
        self._hot = HotView(latent, latent, KERNEL_BLOCK, decode.attention_block_stride)
        self._blocks = latent
        self.layers_served = 0     # swap_in calls that ran this forward (0 or 1)
        self.steps_served = 0      # over the runtime's life

    # ---- what vLLM reads on the runtime (vllm/v1/hisparse/runtime.py HiSparseCacheHandle, index_group.py) ----
    @property
    def max_num_reqs(self) -> int:
        return self.decode.max_num_reqs

    @property
    def max_swap_rows(self) -> int:
        return self.decode.max_swap_rows

    @property
    def request_state_indices(self) -> torch.Tensor:
        return self.decode.request_state_indices if self.upstream is None else self.upstream.request_state_indices

    @property
    def kv_dtype(self):
        return torch.uint8

    @property
    def row_width(self) -> int:
        return ENTRY_BYTES

    @property
    def eager_host_mirror(self) -> bool:
        return True if self.upstream is None else self.upstream.eager_host_mirror

    @property
    def is_group_leader(self) -> bool:
        return True if self.upstream is None else self.upstream.is_group_leader

    @property
    def hot(self):
        """ESS's buffer, unless vLLM resolves this forward over resident pages (index_group.py
        convert_logical_to_physical_topk's _convert_once path: all context pages resident and prefill tokens
        in the batch), whose rows are in upstream's hot slab. With hot regions ESS's rows are in that slab: always
        upstream's."""
        h = self.handle
        if self.upstream is not None and (self.decode.regions or (
                h.all_context_pages_resident and h.num_decode_tokens < h.num_actual_tokens)):
            return self.upstream.hot
        return self._hot

    # What upstream's connector worker (kv_connector/v1/hisparse/worker.py) reads on a handle's runtime for
    # vLLM's host pool: upstream's.
    @property
    def resident_source_index(self) -> int:
        return 0 if self.upstream is None else self.upstream.resident_source_index

    @property
    def device(self) -> torch.device:
        return self.decode.device if self.upstream is None else self.upstream.device

    def invalidate_written_slots(self, written_slots, req_id_per_token) -> None:
        """Upstream's hot-slot invalidation after the host mirror; ESS's rows are not vLLM's slots."""
        if self.upstream is not None:
            self.upstream.invalidate_written_slots(written_slots, req_id_per_token)

    def begin_forward(self) -> None:
        """A new forward (HiSparseCacheHandle._prepare_for_batch, once or more per forward)."""
        self.layers_served = 0

    def gather_prefill_cache(self, kv_cache, plan, resident_cache=None):
        """Prefill context from the host pool (index_group.py stage_prefill_rows): vLLM's own staging, over the one
        host pool ESS's decode reads too."""
        if self.upstream is None:
            raise InvalidArgument("gather_prefill_cache: prefill reads vLLM's host pool through vLLM's runtime; "
                                  "this runtime has none")
        return self.upstream.gather_prefill_cache(kv_cache, plan, resident_cache=resident_cache)

    def reset_hot_state(self) -> None:
        """Every ESS request's device residency forgotten, and upstream's runtime's hot state. (vLLM 0.33.0's
        worker resets the leader runtimes it gathered before ESS's went on the handles; the connector's worker,
        EssConnectorWorker.reset_hot_state, resets ESS's engine once for them.)"""
        self.decode.reset()
        if self.upstream is not None:
            self.upstream.reset_hot_state()

    def _resident_rows(self, resident, state, logical_topk_indices):
        """Hot regions: each token's ids looked up in vLLM's residency table (the handle's block_table,
        binding.py: residency[resident_source_index], by state index), as vLLM resolves resident pages
        (index_group.py _convert_once -> sparse_utils.py triton_convert_req_index_to_global_index with idx_mapping):
        id t of state s at block_table[s, t // 64] x attention_block_stride + t % 64. state: per token, the state
        index of its row (-1: none). Returns (inside [n, K]: an id on a page of the table, blocks [n, K], rows [n, K]
        of the attention view)."""
        table = resident.block_table
        ids = logical_topk_indices.to(torch.int64)
        pages = ids.clamp(min=0) // KERNEL_BLOCK
        inside = (ids >= 0) & (pages < table.shape[1])   # a page past the table: -1, as vLLM's conversion gives
        blocks = table.index_select(0, state.clamp(min=0).to(torch.int64)).to(torch.int64).gather(
            1, pages.clamp(max=table.shape[1] - 1))
        return inside, blocks, blocks * resident.view.attention_block_stride + ids.clamp(min=0) % KERNEL_BLOCK

    @staticmethod
    def _still_resident(valid, state, inside, blocks):
        """Hot regions: the ids of each ESS row's tokens (state >= 0) whose pages vLLM still holds resident (block
        > 0: vLLM unpins a page of a request with a hot region once its host copy is complete, and sends a lost page
        as block 0 before the forward that could read it), read in place as vLLM's own resolution reads them; the
        others go through ESS's LRU."""
        return (valid & (state >= 0)).unsqueeze(1) & inside & (blocks > 0)

    def _map_tokens(self, req_id_per_token, limit):
        """Hot regions: the step's tokens mapped on the device from the forward's req_id_per_token (each token's batch
        row, its rows' tokens consecutive and in batch order), so that a row's token count may be decided on the
        device (adaptive verification trims drafts there): a row of n tokens has them as the last n of its T staged
        queries. Returns per token whether it is served, its staged query row (B x T: none; _stage_queries), its
        state when its row is read in place, and its ESS row's state."""
        d = self.decode
        T, B = d.info.query_tokens, d.max_num_reqs
        i = d.token_index[:req_id_per_token.shape[0]]
        row = req_id_per_token.to(torch.int64)
        r = row.clamp(0, B - 1)
        decode_row = (d.rows >= 0) | (d.in_place_state >= 0)   # a decode row start_step staged
        valid = (i < limit) & (row >= 0) & (row < B) & decode_row.index_select(0, r)
        count = torch.zeros(B, dtype=torch.int64, device=i.device).index_add_(0, r, valid.to(torch.int64))
        first = torch.cumsum(count, 0) - count
        q = T - count.index_select(0, r) + i - first.index_select(0, r)
        valid = valid & (q >= 0) & (q < T)
        flat = torch.where(valid, r * T + q, torch.full_like(i, B * T))   # B x T: the scatter's spare row
        return valid, flat, d.in_place_state.index_select(0, r), d.rows.index_select(0, r)

    def _scatter(self, flat, queries):
        """Each token's top-k [n, K] in its staged query row (flat; B x T: none) of the scatter; returns its
        [B, T, K] staged rows."""
        d = self.decode
        B, T = d.max_num_reqs, d.info.query_tokens
        d.topk_scatter.fill_(-1)
        d.topk_scatter.index_copy_(0, flat, queries.to(torch.int32))
        return d.topk_scatter[:B * T].view(B, T, -1)

    def _stage_queries(self, flat, queries, first_row: int = 0):
        """Each token's top-k [n, K] into its staged query row, batch rows [first_row, B) of the staged table (a DBA
        second half leaves the first half's rows as its step read them)."""
        self.decode.topk[first_row:].copy_(self._scatter(flat, queries)[first_row:])

    def _staged_tokens(self, resident, req_id_per_token, limit, logical_topk_indices):
        """ESS's own buffer: the step's tokens by start_step's maps (from the scheduler's counts), each token's newest
        entry copied from where the model wrote it (resident.slot_mapping) into its reserved row. Returns per token
        whether it is served, its staged query row, and its state when read in place (none here)."""
        d = self.decode
        T, K, B = d.info.query_tokens, d.info.topk, d.max_num_reqs
        n = logical_topk_indices.shape[0]
        i = d.token_index[:n]
        row = d.token_row[:n]
        valid = (i < limit) & (row >= 0) & (req_id_per_token.to(torch.int64) == row)
        # The newest entries the model just wrote into the reserved rows (padding: into the scratch row).
        src_rows = resident.slot_mapping[:n].to(torch.int64)
        use = valid & (src_rows >= 0)
        src_rows = torch.where(use, src_rows, torch.zeros_like(i))
        # The resident view is strided (vllm/v1/hisparse/runtime.py PagedCacheView.bind: a block stride that
        # spans the slab's other groups), so only the n rows are gathered, by block and row, never the view whole.
        bs = resident.view.block_size
        newest = resident.view.cache[src_rows // bs, src_rows % bs].reshape(n, ENTRY_BYTES)
        dst = torch.where(use, d.slot_mapping[:n], torch.full_like(i, d.scratch_row))
        # A padded token rewrites the scratch row with its own bytes.
        blocks = self._blocks
        scratch = blocks[d.scratch_row // KERNEL_BLOCK, d.scratch_row % KERNEL_BLOCK].unsqueeze(0).expand(n, ENTRY_BYTES)
        newest = torch.where(use.unsqueeze(1), newest, scratch.clone())
        blocks.index_put_((dst // KERNEL_BLOCK, dst % KERNEL_BLOCK), newest)
        # The step's queries, staged [B, T, K]: staged query j is token query_token[j] (-1: padding).
        source = d.query_token
        at = source.clamp(0, n - 1)
        take = (source >= 0) & (source < n) & valid.index_select(0, at)
        picked = logical_topk_indices.to(torch.int32).index_select(0, at)
        d.topk.view(B * T, K).copy_(torch.where(take.unsqueeze(1), picked, torch.full_like(picked, -1)))
        return valid, d.token_flat[:n], torch.full_like(i, -1)

    # ---- the decode swap ----
    def _check_tokens(self, where, logical_topk_indices, req_id_per_token, block_size) -> int:
        d = self.decode
        K = d.info.topk
        n = int(logical_topk_indices.shape[0])
        if logical_topk_indices.dim() != 2 or logical_topk_indices.shape[1] != K:
            raise InvalidArgument(f"{where} (layer {self.layer}): logical_topk_indices has shape "
                                  f"{tuple(logical_topk_indices.shape)}; [n, K = {K}] expected")
        if not 1 <= n <= min(d.max_swap_rows, req_id_per_token.shape[0]):
            raise InvalidArgument(f"{where} (layer {self.layer}): {n} token rows; from 1 to max_swap_rows = "
                                  f"{d.max_swap_rows} and req_id_per_token's {req_id_per_token.shape[0]}")
        if block_size != KERNEL_BLOCK:
            raise InvalidArgument(f"{where} (layer {self.layer}): block_size = {block_size}; ESS's attention cache "
                                  f"has blocks of {KERNEL_BLOCK} rows")
        return n

    def _stage_swap(self, resident, req_id_per_token, n, num_valid_rows, logical_topk_indices, first_row=0,
                    record=True):
        """The step's queries staged from the tokens' top-k (batch rows [first_row, B) of the staged table), the
        recorder's record of them (record). Returns what the served rows are read from: per token whether it is
        served and its staged query row; with hot regions also whether its row is read whole in place (no hot
        region) and from which rows, each id's row looked up in vLLM's residency table, and which ids are read
        there (`still`; None without hot regions)."""
        d = self.decode
        B, T = d.max_num_reqs, d.info.query_tokens
        # Tokens at or past num_valid_rows are CUDA-graph padding.
        limit = num_valid_rows.reshape(-1)[:1].to(torch.int64)
        if not d.regions:
            valid, flat, _ = self._staged_tokens(resident, req_id_per_token[:n], limit, logical_topk_indices)
            if record and d.recorder is not None:   # every served row
                d.recorder.record(self.layer, d.rows, d.topk)
            return valid, flat, None, None, None, None
        valid, sink, in_place, state = self._map_tokens(req_id_per_token[:n], limit)
        flat = sink.clamp(max=B * T - 1)
        # One lookup in vLLM's residency table serves both: rows without a hot region read whole in place (every
        # page of theirs is resident), and an ESS row's ids on pages vLLM still holds.
        whole = (in_place >= 0).unsqueeze(1)
        inside, blocks, looked_up = self._resident_rows(resident, torch.where(in_place >= 0, in_place, state),
                                                        logical_topk_indices)
        whole_rows = torch.where(inside, looked_up, torch.full_like(looked_up, -1))
        still = self._still_resident(valid, state, inside, blocks)
        if record and d.recorder is not None:   # the top-k vLLM handed, ids read in place included
            d.recorder.record(self.layer, torch.where(d.rows >= 0, d.rows, d.in_place_state),
                              self._scatter(sink, logical_topk_indices))
        # ESS's LRU serves only the ids whose pages vLLM no longer holds.
        self._stage_queries(sink, torch.where(still, torch.full_like(logical_topk_indices, -1), logical_topk_indices),
                            first_row)
        return valid, flat, whole, whole_rows, looked_up, still

    def swap_first_half(self, *, resident, req_id_per_token: torch.Tensor, logical_topk_indices: torch.Tensor,
                        block_size: int, num_valid_rows: torch.Tensor, requests: int) -> None:
        """DBA (vllm_indexer_split.py): the swap of the batch's first `requests` decode rows, from the layer's
        indexer once it has their top-k (logical_topk_indices [n, K]: those rows' n tokens, the step's first), before
        the indexer runs over the other half; the layer's swap_in then swaps the rest. The decision runs on the
        current stream, the copy on the overlap's copy stream, recording the first-half event. The other arguments
        are the layer's swap_in's (the forward's attention metadata of the layer). Everything is checked before
        anything runs."""
        d = self.decode
        overlap = d.overlap
        if overlap is None or not overlap.runs_dba(self.layer):
            raise InvalidArgument(f"swap_first_half (layer {self.layer}): the layer does not run DBA (ESS_OVERLAP)")
        n = self._check_tokens("swap_first_half", logical_topk_indices, req_id_per_token, block_size)
        if not 1 <= requests < d.max_num_reqs or n < requests:
            raise InvalidArgument(f"swap_first_half (layer {self.layer}): {requests} rows of {n} tokens; a first half "
                                  f"of 1 to {d.max_num_reqs - 1} rows, each of at least one token")
        overlap.drop_first_half()   # (the layer's swap always takes one: only a failed forward leaves one)
        self._stage_swap(resident, req_id_per_token, n, num_valid_rows, logical_topk_indices, record=False)
        overlap.step_part(d.step_binding, self.layer, requests, 0, overlap.first_copy_done)
        overlap.first_half = (self.layer, requests, n, d.steps_started)

    def swap_in(self, *, resident, req_id_per_token: torch.Tensor, block_table, logical_topk_indices: torch.Tensor,
                block_size: int, num_valid_rows: torch.Tensor, return_valid_counts: bool = False,
                attention_indices_out: Optional[torch.Tensor] = None,
                valid_counts_out: Optional[torch.Tensor] = None):
        """HiSparseCacheHandle.swap_in's call: logical_topk_indices [n, K] (-1 = padding) of the step's first n
        decode tokens -> int32 [n, K] rows of `hot.attention_cache` (-1 for padding and for rows at or past
        num_valid_rows), with return_valid_counts also int32 [n] counts of rows >= 0.

        With hot regions the ids of each ESS row whose pages vLLM still holds resident (its newest entries among
        them, on its tail pages) are read in place there, the others go through ESS's LRU; else each row's T newest
        entries are copied into its reserved rows first, from resident.slot_mapping. block_table (vLLM's host block
        table) is the table start_step gave ESS its pages from, and block_size its blocks' size. ESS's step runs on
        the current stream, after the wait upstream's start_step put there for the previous steps' host writes. On a
        DA or DBA layer (ESS_OVERLAP; armed by vllm_overlap.py's wrapper of FlashMLA's FP8 decode, refused
        otherwise) the copy runs on the overlap's copy stream and the call returns the rows that were resident
        before the step (compacted per token), leaving the fetched ones for FlashMLA's second call: no valid counts
        or output buffer then. On a DBA layer whose indexer swapped the first half of the batch this step
        (swap_first_half) only the other rows are swapped here; both halves' rows are returned. Everything is
        checked before anything runs; a refused call serves nothing."""
        d = self.decode
        T, K = d.info.query_tokens, d.info.topk
        n = self._check_tokens("swap_in", logical_topk_indices, req_id_per_token, block_size)
        for name, out, shape in (("attention_indices_out", attention_indices_out, (n, K)),
                                 ("valid_counts_out", valid_counts_out, (n,))):
            if out is not None and (tuple(out.shape) != shape or out.dtype != torch.int32):
                raise InvalidArgument(f"swap_in (layer {self.layer}): {name} is {out.dtype} {tuple(out.shape)}; "
                                      f"int32 {shape} expected")
        if self.layers_served:
            raise InvalidArgument(f"swap_in (layer {self.layer}): called twice in one forward (begin_forward "
                                  "starts one)")
        overlap = d.overlap
        da = overlap is not None and overlap.runs_da(self.layer)
        if da and overlap.armed != self.layer:
            raise InvalidArgument(f"swap_in (layer {self.layer}): ESS_OVERLAP runs DA or DBA on this layer, which "
                                  "needs vLLM's FlashMLA sparse FP8 decode (FlashMLASparseImpl."
                                  "_host_backed_fp8_decode, kv_cache_dtype fp8_ds_mla) to read the two parts; this "
                                  "swap came from another decode path: set ESS_OVERLAP = none")
        if da and (return_valid_counts or attention_indices_out is not None):
            raise InvalidArgument(f"swap_in (layer {self.layer}): a DA swap returns the resident rows and leaves the "
                                  "fetched ones for FlashMLA's second call: no valid counts or output buffer")
        half = overlap.take_first_half(self.layer, d.steps_started) if da else None
        if half is not None and half[1] > n:
            raise RuntimeError(f"swap_in (layer {self.layer}): the indexer's DBA swap covered {half[1]} tokens; "
                               f"this swap has {n}")
        first = 0 if half is None else half[0]
        B = d.max_num_reqs   # every staged row: a fixed shape
        valid, flat, whole, whole_rows, looked_up, still = self._stage_swap(
            resident, req_id_per_token, n, num_valid_rows, logical_topk_indices, first)
        if da:   # the decision on the current stream, the copy on the overlap's copy stream
            if first:   # DBA: the rows after the indexer's first half
                overlap.step_part(overlap.offset_step(d, first), self.layer, B - first, 1)
            else:
                overlap.step_part(d.step_binding, self.layer, B)
        else:
            d.step_binding.step(self.layer, B,
                                stream=torch.cuda.current_stream(d.device) if d.device.type == "cuda" else None)
        if self.upstream is not None and self.upstream.is_group_leader:
            # vLLM's HiSparse statistics (worker.py get_kv_connector_stats reads the group leader's swap_stats,
            # uint64 [hits, misses]): the leader layer's LRU hits and misses of this step, added on the device.
            self.upstream.index_group.swap_stats.view(torch.int64).add_(d.counts.sum(0, dtype=torch.int64))

        def served(table, read_in_place):
            """Each token's rows of a staged [B, T, K] table (-1 where not valid), a row without a hot region's
            read in place (or -1: read_in_place False)."""
            rows = table.view(B * T, K).index_select(0, flat)
            if d.regions:
                rows = torch.where(whole, whole_rows if read_in_place else torch.full_like(whole_rows, -1),
                                   rows.to(torch.int64))
            return torch.where(valid.unsqueeze(1), rows, torch.full_like(rows, -1)).to(torch.int32)

        self.layers_served += 1
        self.steps_served += 1
        if da:   # Attn0 reads the resident rows beside the copy, Attn1 the fetched ones (vllm_overlap.py)
            rows = served(overlap.resident, True)
            if still is not None:   # the LRU's resident rows (compacted) after the ids read in place, in order
                rank = torch.cumsum((~still).to(torch.int64), 1) - 1
                rows = torch.where(still, looked_up, rows.gather(1, rank.clamp(0, K - 1)).to(torch.int64)).to(torch.int32)
            return overlap.leave(rows, served(overlap.fetched, False))
        physical = served(d.physical, True)
        if still is not None:
            physical = torch.where(still, looked_up, physical.to(torch.int64)).to(torch.int32)
        out = physical if attention_indices_out is None else attention_indices_out.copy_(physical)
        if not return_valid_counts:
            return out
        counts = (physical >= 0).sum(dim=1).to(torch.int32)
        return out, (counts if valid_counts_out is None else valid_counts_out.copy_(counts))
