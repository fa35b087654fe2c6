"""ESS in the place of SGLang's HiSparseCoordinator (sglang==0.5.23,
sglang/srt/managers/hisparse_coordinator.py): the same constructor, the same methods, attributes,
argument lists and return types at every call site of that release, so SGLang's own
`--enable-hisparse` runs ESS once `install()` has put this class where ModelRunner imports it.

Where the bytes live. Every request's ESS rows (its LRU slots plus T reserved rows for the step's
newest tokens: T = 1, or the draft tokens of a verify step) lie inside SGLang's HiSparse device pool (`HiSparseDSATokenToKVPool.kv_buffer`), in a region
this coordinator takes from the top of the pool's allocator at construction: FlashMLA reads the
rows `swap_in_selected_pages` returns from the same buffer it reads under HiSparse. The model writes
each decode token with its unchanged `set_mla_kv_buffer(out_cache_loc)`: `map_last_loc_to_buffer`
points out_cache_loc's entry of the allocator's full-to-device mapping at the request's reserved
row, as upstream does. The Total Memory Pool (host) is ESS's own.

Order, as upstream's. map_last_loc_to_buffer (ScheduleBatch.prepare_for_decode, on the schedule
stream) backs up the previous step's newest entries on a backup stream that waits for the schedule
and producer (forward) streams; wait_for_pending_backup (ModelRunner, before the forward) makes the
forward wait for that backup and nothing else. Prefill KV is staged to the host on a staging
stream (admit_request_into_staging) and the request joins decode when collect_ready_reqs finds the
copy done on every TP rank. `num_real_reqs` is an int32 [1] device tensor read when the swap runs.

Speculative decoding: prepare_spec_verify extends every request by the T draft tokens and points
their out_cache_loc at the T reserved rows; the verify forward swaps [bs, T, K]; commit_spec_accept_tokens
writes the accepted entries back and takes the others back (Offload::truncate).

PD decode (direct admission): `mem_pool_host` is ESS's Total Memory Pool, laid out as upstream's "layer_first"
host pool (one region per layer, a request's page at the same index in every layer), so SGLang's transfer backend
registers it and writes the prefill's KV straight into ESS's pages; admit_request_direct then only warms the
request's rows up from them.

What differs from upstream is in docs/integration.md; what this build cannot serve (two-batch overlap, MiniMax /
DeepSeek-V4 pools) is refused by name at construction."""
from __future__ import annotations

import ctypes
import logging
from typing import List, NamedTuple, Optional

import torch

from .. import _args
from .._errors import InvalidArgument, InvalidType
from ..engine import Engine
from . import _device

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"   # the release whose call sites this class is checked against
ENTRY_BYTES = 656           # DeepSeek-V3.2's FP8 latent entry (FlashMLA's layout)


class HiSparseAct(NamedTuple):
    """A request whose prefill KV is being staged to the host (upstream's HiSparseAct, plus the copy)."""
    start_event: object
    finish_event: object
    req: object


class HiSparseTokenStats(NamedTuple):
    device_tokens: int
    device_token_usage: float
    host_tokens: int
    host_token_usage: float


class SpecScratch(NamedTuple):
    """What SGLang reads of upstream's HiSparseSpecSwapManager: the speculative scratch slots a request takes from the
    device allocator (ESS's verify rows are among the rows claimed at construction: none)."""
    scratch_capacity: int


class HostPool:
    """ESS's Total Memory Pool where SGLang's PD decode side uses upstream's host pool (MLATokenToKVPoolHost, layout
    "layer_first", with pool_host/hisparse.py's alloc_paged_token_slots). get_contiguous_buf_infos gives the transfer
    backend one region per layer; SGLang page p (page_size tokens) of every layer lies at base[l] + p x item_len,
    i.e. host token slot s at base[l] + s x 656, and a request's slots are g x 64 + t % 64 for its ESS page g of
    token t: the transfer writes the prompt into ESS's own pages, with no copy after it."""
    layout = "layer_first"

    def __init__(self, coordinator):
        self._coordinator = coordinator
        engine = coordinator.engine
        h = engine.host_layout()
        self.layer_num = h.layers
        self.page_size = coordinator.page_size
        self.token_stride_size = h.entry_bytes
        self.size = h.pages_per_layer * h.page_tokens   # token slots of each layer
        self._per_token = h.layers * h.entry_bytes
        self._ptrs = [engine.host_layer(layer) for layer in range(h.layers)]
        self._layer_bytes = h.layer_bytes
        self._views = None

    def layer_view(self, layer: int):
        """Layer `layer`'s region as a uint8 [pages_per_layer x 64, 656] CPU tensor over ESS's memory (pinned when
        the engine is built for CUDA: device-to-host copies into it run asynchronously)."""
        if self._views is None:
            self._views = [torch.frombuffer((ctypes.c_uint8 * self._layer_bytes).from_address(ptr), dtype=torch.uint8)
                           .view(-1, self.token_stride_size) for ptr in self._ptrs]
        return self._views[layer]

    def runs(self, req_pool_idx: int, n: int):
        """The request's first n tokens in its pages as (host slot, first token, count) runs of consecutive slots."""
        pages = self._coordinator.engine.host_pages(_int("req_pool_idx", req_pool_idx))
        out = []
        for i, g in enumerate(pages):
            first, count = i * 64, min(64, n - i * 64)
            if count <= 0:
                break
            if out and out[-1][0] + out[-1][2] == g * 64:
                at, start, c = out[-1]
                out[-1] = (at, start, c + count)
            else:
                out.append((g * 64, first, count))
        return out

    def close(self):
        """Drops the tensor views: they point into the engine's memory, which closes next."""
        self._views = None

    def available_size(self) -> int:
        s = self._coordinator.engine.stats()
        return (s.host_bytes_capacity - s.host_bytes_used) // self._per_token

    def get_contiguous_buf_infos(self):
        """(data_ptrs, data_lens, item_lens) per layer, as upstream's, for the transfer engine to register."""
        n = self.layer_num
        return list(self._ptrs), [self._layer_bytes] * n, [self.token_stride_size * self.page_size] * n

    def alloc_paged_token_slots(self, req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx: int,
                                start_pos: int, num_tokens: int):
        return self._coordinator._alloc_direct(req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx,
                                               start_pos, num_tokens)

    def allocated_host_indices(self, req_to_host_pool, req_pool_idx: int, allocated_len: int):
        length = min(-(-_int("allocated_len", allocated_len) // self.page_size) * self.page_size, req_to_host_pool.shape[1])
        indices = req_to_host_pool[req_pool_idx, :length]
        return indices[indices >= 0]


def _token_stats_type():
    """SGLang's own HiSparseTokenStats where SGLang imports, else ours (the same fields)."""
    try:
        from sglang.srt.managers.hisparse_coordinator import HiSparseTokenStats as upstream
        return upstream
    except Exception:  # SGLang absent or not importable here: the same NamedTuple
        return HiSparseTokenStats


def _int(name: str, value) -> int:
    """An integer SGLang hands in (an int, a numpy integer, or a one-element integer tensor): never a float (a
    request slot 1.5 is not slot 1), a bool or a string."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise InvalidType(f"{name}: a {value.dtype} tensor of shape {list(value.shape)} is not an integer")
        value = value.item()
    return _args.integer(name, value, -2**63, 2**63 - 1)


def _int_tensor(name: str, t):
    if not isinstance(t, torch.Tensor):
        raise InvalidType(f"{name}: a torch tensor is expected, not {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidType(f"{name}: {t.dtype} where integers are meant (values would be truncated)")


def _ints(name: str, t) -> List[int]:
    """A host tensor's (or list's) integers, each checked as _int does."""
    if isinstance(t, torch.Tensor):
        _int_tensor(name, t)
        t = t.tolist()
    return [_int(f"{name}[{i}]", v) for i, v in enumerate(t)]


def _cuda_index(device) -> int:
    """SGLang passes "cuda" and sets each rank's current device."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _entry_rows(buf):
    """A layer's kv_buffer ([slots, 1, kv_cache_dim] of the pool's store dtype) as [slots, 656] bytes."""
    return buf.view(torch.uint8).view(-1, ENTRY_BYTES)


def _keep(tensor, stream):
    """The caching allocator must not hand `tensor`'s memory out again before `stream`'s work on it ends."""
    if tensor.is_cuda:
        tensor.record_stream(stream)


def _sglang_setting(bag: str, path: str):
    """A setting of the running SGLang: sglang.srt.runtime_context's `bag`() and the dotted `path` in it (0.5.23
    nests its namespaces: get_exec().overlap.enable_two_batch_overlap), or None outside SGLang. Inside SGLang a
    path its context does not have is refused by name (a setting read as None would silently allow what it
    guards)."""
    try:
        from sglang.srt import runtime_context
    except ImportError:  # not inside SGLang (tests, other engines)
        return None
    value = getattr(runtime_context, bag)()
    for name in path.split("."):
        try:
            value = getattr(value, name)
        except AttributeError:
            raise InvalidArgument(f"SGLang's runtime context has no {bag}().{path} (at {name!r}): this adapter "
                                  f"reads SGLang {SGLANG_VERSION}'s settings") from None
    return value


def _claim_top_rows(allocator, rows: int, keep_min: int, why: str) -> int:
    """Takes the top `rows` slots (whole pages) of the HiSparse device allocator for ESS and returns the
    first one. Only a fresh allocator (nothing allocated) can give them up; its size shrinks so that
    clear() keeps them out too. What stays SGLang's must hold `keep_min` slots (`why`: a context-length
    prefill, which lives in the device pool until staged; on a PD decode side, where no prefill runs,
    one slot per request for the transfer budget SGLang computes from it)."""
    inner = allocator.hisparse_attn_allocator
    page = inner.page_size
    pages = -(-rows // page)
    if getattr(inner, "ess_rows", None) is not None:
        raise InvalidArgument(f"this HiSparse device allocator already gave ESS its top {inner.ess_rows} slots "
                              "(one coordinator per pool)")
    if inner.available_size() != inner.size:
        raise InvalidArgument(
            f"ESS takes its rows from the HiSparse device pool at construction, before any allocation; "
            f"{inner.size - inner.available_size()} of its {inner.size} slots are in use")
    keep = inner.num_pages - pages
    if keep * page < keep_min:
        raise InvalidArgument(
            f"the HiSparse device pool holds {inner.size} slots; ESS needs {pages * page} of them for its rows "
            f"(req_to_token pool slots x (device_buffer_size + T), whole pages of {page}) and SGLang needs "
            f"{keep_min} ({why}) left: lower --max-running-requests or the hisparse device_buffer_size, or give "
            "the pool more memory")
    inner.num_pages = keep
    inner.size = keep * page
    inner.free_pages = inner.free_pages[inner.free_pages <= keep]
    inner.ess_rows = pages * page
    if hasattr(allocator, "_size_hisparse"):
        allocator._size_hisparse = inner.size
    return (keep + 1) * page  # page 0 is the padding sink; the allocator's pages are 1..num_pages


class HiSparseCoordinator:
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, top_k: int, device_buffer_size: int,
                 device: str, tp_group, host_to_device_ratio: int = 2, swap_in_block_size: int = 960,
                 shared_index_layers: Optional[List[bool]] = None, num_draft_tokens: int = 0):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.top_k = _int("top_k", top_k)
        self.device_buffer_size = _int("device_buffer_size", device_buffer_size)
        self.device = device
        self.swap_in_block_size = swap_in_block_size   # HiSparse's kernel grid; ESS sizes its own
        self.tp_group = tp_group
        self.dev = _device.for_device(device)
        self.compress_ratio = getattr(token_to_kv_pool_allocator, "compress_ratio", 1)

        self.pd_decode = _sglang_setting("get_disagg", "disaggregation_mode") == "decode"
        num_draft_tokens = 0 if num_draft_tokens is None else _int("num_draft_tokens", num_draft_tokens)
        if num_draft_tokens < 0:
            raise InvalidArgument(f"num_draft_tokens = {num_draft_tokens} is negative")
        if _sglang_setting("get_exec", "overlap.enable_two_batch_overlap"):
            raise InvalidArgument(
                "enable_two_batch_overlap: ESS stages a step's rows once per forward, at its first layer; two "
                "micro-batches interleaved layer by layer are not served yet")
        if num_draft_tokens and self.device_buffer_size < num_draft_tokens * self.top_k:
            # One swap call serves a verify step's T query tokens (FlashMLA runs once after it), so the pool
            # must hold their union: ESS cannot split the step into query groups there.
            raise InvalidArgument(
                f"device_buffer_size = {self.device_buffer_size} < num_draft_tokens {num_draft_tokens} x top_k "
                f"{self.top_k}: a verify step's query tokens may select more distinct tokens than the pool holds; "
                f"set the hisparse device_buffer_size to at least {num_draft_tokens * self.top_k}")
        if self.compress_ratio != 1 or not hasattr(token_to_kv_pool_allocator, "hisparse_attn_allocator"):
            raise InvalidArgument(
                f"{type(token_to_kv_pool_allocator).__name__}: ESS serves the DSA (DeepSeek-V3.2) HiSparse pool; "
                "DeepSeek-V4's compressed pool is not supported")
        kvcache = token_to_kv_pool_allocator.get_kvcache()
        if not hasattr(kvcache, "full_to_hisparse_device_index_mapping") or not hasattr(kvcache, "kv_cache_dim"):
            raise InvalidArgument(
                f"{type(kvcache).__name__}: ESS serves the DSA HiSparse MLA pool (MiniMax's block swap-in, "
                "swap_in_selected_blocks, is not supported)")
        self.mem_pool_device = kvcache
        self.page_size = kvcache.page_size
        entry = kvcache.kv_cache_dim * kvcache.kv_buffer[0].element_size()
        if entry != ENTRY_BYTES:
            raise InvalidArgument(f"the device pool's entries are {entry} bytes; ESS serves DeepSeek-V3.2's "
                                  f"{ENTRY_BYTES}-byte FP8 latent entries (--kv-cache-dtype fp8_e4m3)")
        self.layer_num = kvcache.layer_num
        self.start_layer = getattr(kvcache, "start_layer", 0) or 0
        if num_draft_tokens and self.page_size == 1:
            raise InvalidArgument(
                f"num_draft_tokens = {num_draft_tokens} with page size 1: SGLang's alloc_for_spec_decode then gives "
                "every draft token a device slot of its own (mem_cache/allocation.py: alloc_token_slots), which "
                "ESS's reserved rows would leave orphaned each verify step (upstream's HiSparse refuses fewer than "
                "num_draft_tokens + 1 slots a page too)")
        if self.pd_decode and 64 % self.page_size != 0:
            raise InvalidArgument(
                f"disaggregation_mode = decode with page size {self.page_size}: the transfer writes each SGLang page "
                "into one ESS host page of 64 tokens, so the page size must divide 64")

        # T query tokens per request per step: 1 in decode, the draft tokens of a verify step with speculative
        # decoding. A request's rows are its slots and T reserved rows (the step's newest tokens).
        self.T = max(1, num_draft_tokens)
        self.num_draft_tokens = num_draft_tokens
        max_reqs = req_to_token_pool.req_to_token.shape[0]
        max_context = req_to_token_pool.max_context_len
        self.max_batch = max_reqs
        rows_per_request = self.device_buffer_size + self.T
        if self.pd_decode:
            keep_min, why = max_reqs, "one slot per request: SGLang's PD transfer budget"
        else:
            keep_min, why = max_context, "the context length, for a prefill"
        self.row_base = _claim_top_rows(token_to_kv_pool_allocator, max_reqs * rows_per_request, keep_min, why)
        self.ess_rows = max_reqs * rows_per_request
        latent = [_entry_rows(buf)[self.row_base:self.row_base + self.ess_rows] for buf in kvcache.kv_buffer]
        device_tokens = kvcache.size if getattr(kvcache, "host_capacity_tokens", None) is None \
            else kvcache.host_capacity_tokens
        host_tokens = int(device_tokens * _args.real("host_to_device_ratio", host_to_device_ratio))
        # Whole 64-token pages per request-layer: one partly used page per request-layer at most.
        host_bytes = (host_tokens + max_reqs * 64) * self.layer_num * ENTRY_BYTES
        self.engine = Engine(max_requests=max_reqs, max_context=max_context, slots=self.device_buffer_size,
                             layers=self.layer_num, topk=self.top_k, query_tokens=self.T, reserve_newest=True,
                             backend="cuda" if self.dev.is_cuda else "cpu",
                             device=_cuda_index(device) if self.dev.is_cuda else 0,
                             host_bytes=host_bytes, latent=latent)
        self.info = self.engine.info
        if shared_index_layers is not None and any(shared_index_layers):
            logger.info("ESS: %d shared-index layers swap their own rows (no plan-then-IO prefetch)",
                        sum(shared_index_layers))

        # Upstream's attributes that SGLang reads.
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)
        self.raw_indices_buffer = torch.full((max_reqs, self.top_k), -1, dtype=torch.int32, device=device)
        self.ack_staging_queue: List[HiSparseAct] = []
        self.decode_producer_stream = None
        # PD decode (direct admission). The transfer budget SGLang computes from the HiSparse device allocator
        # counts padded_buffer_size + spec_swap.scratch_capacity slots per request; ESS takes none per request
        # (its rows were claimed above), so one slot: the budget is then the slots construction left SGLang.
        self.padded_buffer_size = 1
        self.spec_swap = SpecScratch(scratch_capacity=0)
        self.mem_pool_host = HostPool(self)
        self.req_to_host_pool_allocated_len = torch.zeros(max_reqs, dtype=torch.int64, device="cpu")
        self._req_to_host_pool = None
        self._direct = {}             # req_pool_idx -> tokens received by transfer, not yet admitted

        # The step's tensors, bound once (fixed addresses for CUDA graphs).
        i32 = dict(dtype=torch.int32, device=device)
        self._rows = torch.full((max_reqs,), -1, **i32)
        self._lengths = torch.zeros((max_reqs,), **i32)
        self._topk = torch.full((max_reqs, self.T, self.top_k), -1, **i32)
        self._physical = torch.full((max_reqs, self.T, self.top_k), -1, **i32)
        self._locs = torch.full((max_reqs, self.T, self.top_k), -1, **i32)
        self._padding = torch.zeros((max_reqs, self.T, self.top_k), dtype=torch.bool, device=device)
        self._padded_rows = torch.zeros((max_reqs,), dtype=torch.bool, device=device)
        self._row_zero = torch.zeros((max_reqs,), dtype=torch.bool, device=device)
        self._arange = torch.arange(max_reqs, **i32)
        self._step = self.engine.bind_step(self._rows, self._topk, self._lengths, self._physical)
        # The backup's own copy of a step's rows and lengths: the next step restages the step's tensors
        # while the backup may still read these.
        self._backup_rows = torch.full((max_reqs,), -1, **i32)
        self._backup_lengths = torch.zeros((max_reqs,), **i32)
        self._write_back = self.engine.bind_write_back(self._backup_rows, self._backup_lengths)
        # A verify step's accepted entries: from the reserved rows their verify slots name.
        self._commit_rows = torch.full((max_reqs,), -1, **i32)
        self._commit_lengths = torch.zeros((max_reqs,), **i32)
        self._commit_source = torch.full((max_reqs, self.T), -1, **i32)
        self._commit_write_back = self.engine.bind_write_back(self._commit_rows, self._commit_lengths,
                                                              self._commit_source)

        self.write_staging_stream = self.dev.Stream()
        self.decode_backup_stream = self.dev.Stream()
        self._backup_done_event = self.dev.Event()
        self._has_pending_backup = False
        # The last step map_last_loc_to_buffer prepared, whose newest entries the next one backs up:
        # (req_pool_indices, seq_lens) as SGLang passed them (new tensors every step), or None.
        self._backup_due = None
        self._dropped_rows: List[int] = []   # rows finished since that step: not backed up
        self._length = {}             # req_pool_idx -> tokens ESS holds
        self._retiring = []           # (req_pool_idx, event): released once the event's work is done
        self.tp_world_size = 1
        if tp_group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            self.tp_world_size = torch.distributed.get_world_size(group=tp_group)
        logger.info("ESS replaces HiSparse: %d requests x (%d slots + %d reserved) rows at device slot %d, "
                    "host pool %.1f GiB, backend %s", max_reqs, self.device_buffer_size, self.T, self.row_base,
                    host_bytes / 2**30, self.info.backend)

    @property
    def req_to_host_pool(self):
        """[request slots, context + page] int64 host token slots (-1: none), on the device, as upstream's; made when
        first read (PD decode's _pre_alloc), since only direct admission uses it."""
        if self._req_to_host_pool is None:
            self._req_to_host_pool = torch.full(
                (self.max_batch, self.req_to_token_pool.max_context_len + self.page_size), -1,
                dtype=torch.int64, device=self.device)
        return self._req_to_host_pool

    def host_token_len(self, kv_allocated_len: int) -> int:
        return _int("kv_allocated_len", kv_allocated_len)

    def _alloc_direct(self, req_to_host_pool, allocated_len, req_pool_idx, start_pos, num_tokens):
        """HostPool.alloc_paged_token_slots: the request enters ESS (host pages, all-or-nothing) and its token slots
        in the host pool's layer regions go to req_to_host_pool; the transfer then writes the prompt there."""
        idx, start, n = (_int("req_pool_idx", req_pool_idx), _int("start_pos", start_pos),
                         _int("num_tokens", num_tokens))
        if req_to_host_pool is not self._req_to_host_pool or allocated_len is not self.req_to_host_pool_allocated_len:
            raise InvalidArgument("alloc_paged_token_slots: pass the coordinator's own req_to_host_pool and "
                                  "req_to_host_pool_allocated_len")
        if start != 0 or int(allocated_len[idx]) != 0 or idx in self._length or idx in self._direct:
            raise InvalidArgument(
                f"alloc_paged_token_slots: request slot {idx}, start_pos {start}, {int(allocated_len[idx])} tokens "
                "allocated: ESS's host pool receives a whole prompt into a request slot that holds nothing")
        if not 0 < n <= self.req_to_token_pool.max_context_len:
            raise InvalidArgument(f"alloc_paged_token_slots: num_tokens = {n} outside [1, "
                                  f"{self.req_to_token_pool.max_context_len}]")
        self._retire(row=idx)
        self.engine.admit(idx, n, row=idx)   # host pages, zeroed; all-or-nothing
        pages = torch.tensor(self.engine.host_pages(idx), dtype=torch.int64)
        end = -(-n // self.page_size) * self.page_size
        slots = (pages.view(-1, 1) * 64 + torch.arange(64, dtype=torch.int64).view(1, -1)).view(-1)[:end]
        req_to_host_pool[idx, :end] = slots.to(req_to_host_pool.device, non_blocking=True)
        allocated_len[idx] = end
        self._direct[idx] = n
        return req_to_host_pool[idx, :n]

    # ---- the rows of a request, in SGLang's device pool ----
    def _extend_into_reserved(self, rows, req_pool_indices, locs):
        """Every request (`rows`, host ints, in req_pool_indices' order) grows by the step's T tokens, and their
        logical slots `locs` ([bs x T], token t of position b at b x T + t) map to the request's T reserved rows,
        where the model's unchanged set_mla_kv_buffer then writes them."""
        T = self.T
        for b, row in enumerate(rows):   # every request checked before any grows
            if self._length[row] + T > self.info.max_context:
                raise InvalidArgument(f"position {b} (request slot {row}): {self._length[row]} tokens + {T} exceed "
                                      f"the context length {self.info.max_context}")
        for row in rows:
            self.engine.extend(row, T)
            self._length[row] += T
        reserved = (req_pool_indices.to(torch.int64).view(-1, 1) * self.info.rows_per_request
                    + (self.row_base + self.info.slots)
                    + torch.arange(T, dtype=torch.int64, device=req_pool_indices.device).view(1, -1))
        mapping = self.mem_pool_device.full_to_hisparse_device_index_mapping
        self.dev.launch(lambda: mapping.index_copy_(0, locs, reserved.view(-1)))

    def _layer(self, layer_id: int) -> int:
        layer = _int("layer_id", layer_id) - self.start_layer
        if not 0 <= layer < self.layer_num:
            raise InvalidArgument(f"layer_id {layer_id} outside this pool's layers "
                                  f"[{self.start_layer}, {self.start_layer + self.layer_num})")
        return layer

    # ---- lifecycle (scheduler) ----
    def set_decode_producer_stream(self, stream) -> None:
        self.decode_producer_stream = stream

    def allocate_spec_scratch(self, req_pool_indices: List[int]) -> None:
        """Upstream reserves speculative scratch here; ESS's rows (slots >= T x K, T reserved) are fixed."""

    # ---- speculative decoding (EAGLE / MTP): a verify step of T tokens, some accepted ----
    def prepare_spec_verify(self, batch) -> None:
        """eagle_prepare_for_verify, before the verify forward: every request grows by the T draft tokens, whose
        KV the model writes at batch.out_cache_loc ([bs x T], token t of request b at b x T + t): pointed at the
        request's T reserved rows."""
        if not self.num_draft_tokens:
            raise InvalidArgument("prepare_spec_verify: this coordinator was built with num_draft_tokens = 0")
        rows = [_int("req_pool_idx", req.kv.req_pool_idx) for req in batch.reqs]
        T = self.T
        if batch.out_cache_loc.numel() != len(rows) * T:
            raise InvalidArgument(f"prepare_spec_verify: {batch.out_cache_loc.numel()} verify slots for {len(rows)} "
                                  f"requests x {T} draft tokens")
        seq_lens_cpu = getattr(batch, "seq_lens_cpu", None)
        lengths = None if seq_lens_cpu is None else _ints("seq_lens_cpu", seq_lens_cpu)
        self._check_batch("prepare_spec_verify", rows, lengths, grow=0)
        self._retire()
        self._extend_into_reserved(rows, batch.req_pool_indices, batch.out_cache_loc.to(torch.int64))

    def commit_spec_accept_tokens(self, batch, accept_indices) -> None:
        """run_eagle_verify, after the verify forward: accept_indices [bs, T] (int, -1 = rejected) names for each
        kept position L + s the verify slot b x T + j whose KV it keeps. Those entries go to the host pool (from
        the reserved rows) and each request keeps L + (accepted) tokens. The accepted counts are read on the host
        (a synchronization with the verify forward)."""
        mode = getattr(batch, "forward_mode", None)
        if mode is not None and mode.is_idle():
            return
        rows = [_int("req_pool_idx", req.kv.req_pool_idx) for req in batch.reqs]
        B, T = len(rows), self.T
        if B == 0:
            return
        accept = accept_indices.to("cpu", torch.int64)
        if tuple(accept.shape) != (B, T):
            raise InvalidArgument(f"commit_spec_accept_tokens: accept_indices has shape {tuple(accept.shape)}; "
                                  f"expected [{B}, {T}]")
        self._check_batch("commit_spec_accept_tokens", rows, None, grow=0)
        base = torch.arange(B, dtype=torch.int64).view(-1, 1) * T
        valid = accept >= 0
        kept = valid.sum(dim=1)
        slot = torch.where(valid, accept - base, torch.arange(T, dtype=torch.int64).view(1, -1))
        if bool(((slot < 0) | (slot >= T)).any()) or bool((valid[:, 1:] & ~valid[:, :-1]).any()) or \
                bool((kept < 1).any()):
            raise InvalidArgument(f"commit_spec_accept_tokens: accept_indices {accept.tolist()} are not each request's "
                                  f"own verify slots, kept from the first (at least the root)")
        rows_t = torch.tensor(rows, dtype=torch.int64)
        source = rows_t.view(-1, 1) * self.info.rows_per_request + self.info.slots + slot
        lengths = torch.tensor([self._length[r] for r in rows], dtype=torch.int64)
        self.wait_for_pending_backup()
        current = self.dev.current_stream()

        def stage():
            self._commit_rows[:B].copy_(rows_t)
            self._commit_lengths[:B].copy_(lengths)
            self._commit_source[:B].copy_(source)
        self._launch_backup(self._commit_write_back, B, stage)
        # The entries past each kept length are taken back once the write-back, which writes all T, is done.
        self._backup_done_event.synchronize()
        for row, n in zip(rows, kept.tolist()):
            self.engine.truncate(row, self._length[row] - T + n)
            self._length[row] += n - T
        self._backup_done_event.wait(current)

    def _check_batch(self, where, rows, lengths, grow):
        """Every request in ESS, once, with its length (+ grow) when the caller knows it: before anything changes."""
        for b, row in enumerate(rows):
            if row not in self._length:
                raise InvalidArgument(f"{where}: position {b}: request slot {row} is not in ESS (not staged, or "
                                      "already finished)")
            if lengths is not None and lengths[b] != self._length[row] + grow:
                raise InvalidArgument(f"{where}: position {b} (request slot {row}): seq_len {lengths[b]} is not its "
                                      f"{self._length[row]} tokens" + (f" + {grow}" if grow else ""))
        if len(set(rows)) != len(rows):
            raise InvalidArgument(f"{where}: a request slot appears twice in {rows}")
        if len(rows) > self.max_batch:
            raise InvalidArgument(f"{where}: {len(rows)} requests, at most {self.max_batch}")

    def swap_in_selected_blocks(self, req_pool_indices, seq_lens, top_k_blocks, layer_id, sparse_block_size):
        raise InvalidArgument("swap_in_selected_blocks (MiniMax's block swap-in) is not served by ESS")

    def destroy(self) -> None:
        self.write_staging_stream.synchronize()
        self.decode_backup_stream.synchronize()
        self._retire(force=True)
        self.mem_pool_host.close()
        self.engine.close()

    def get_token_stats(self):
        inner = self.token_to_kv_pool_allocator.hisparse_attn_allocator
        device_capacity = inner.size + self.ess_rows
        device_tokens = inner.size - inner.available_size() + len(self._length) * self.info.rows_per_request
        s = self.engine.stats()
        per_token = self.layer_num * ENTRY_BYTES
        host_capacity = s.host_bytes_capacity // per_token
        host_tokens = s.host_bytes_used // per_token
        return _token_stats_type()(
            device_tokens=device_tokens,
            device_token_usage=device_tokens / device_capacity if device_capacity > 0 else 0.0,
            host_tokens=host_tokens,
            host_token_usage=host_tokens / host_capacity if host_capacity > 0 else 0.0)

    # ---- admission ----
    def admit_request_into_staging(self, req) -> None:
        """After the prefill: the request's prompt KV (SGLang's device slots of req_to_token[idx, :extend_end])
        is copied into its ESS host pages on the staging stream (one device-to-host copy per run of consecutive
        pages and layer); collect_ready_reqs hands the request to decode."""
        idx = _int("req_pool_idx", req.kv.req_pool_idx)
        n = _int("extend_end", req.extend_end)
        self._retire(row=idx)
        self.engine.admit(idx, n, row=idx)   # host pages, all-or-nothing
        req.hisparse_staging = True
        full = self.req_to_token_pool.req_to_token[idx, :n].to(dtype=torch.int64, copy=True)
        device_locs = self.mem_pool_device.translate_loc_from_full_to_hisparse_device(full)
        runs = self.mem_pool_host.runs(idx, n)
        start, finish = self.dev.Event(), self.dev.Event()
        start.record()
        with self.dev.stream(self.write_staging_stream):
            start.wait(self.write_staging_stream)
            self.dev.launch(lambda: self._stage_copy(runs, device_locs))
            _keep(device_locs, self.write_staging_stream)
            finish.record()
        self.ack_staging_queue.append(HiSparseAct(start, finish, req))

    def _stage_copy(self, runs, device_locs):
        """The prompt's entries of every layer, gathered from SGLang's pool and copied once, straight into the
        request's ESS host pages (`runs`: HostPool.runs)."""
        for layer, buf in enumerate(self.mem_pool_device.kv_buffer):
            rows = _entry_rows(buf).index_select(0, device_locs)
            host = self.mem_pool_host.layer_view(layer)
            for at, start, count in runs:
                host[at:at + count].copy_(rows[start:start + count], non_blocking=True)

    def _finish_staging(self, req):
        idx = _int("req_pool_idx", req.kv.req_pool_idx)
        n = _int("extend_end", req.extend_end)
        # The prefill's device slots go back to SGLang's allocator (and its mapping to 0).
        self.token_to_kv_pool_allocator.free_hisparse(self.req_to_token_pool.req_to_token[idx, :n])
        self.engine.warmup(idx, self._warmup_windows(n))
        self._length[idx] = n
        req.hisparse_staging = False

    def _warmup_windows(self, n: int):
        """The first residency: the prompt's last min(n, slots) tokens, oldest first (SGLang hands over no
        prefill top-k to warm up from)."""
        K = self.top_k
        keep = min(n, self.info.slots)
        windows = -(-keep // K)
        ids = torch.full((windows * K,), -1, dtype=torch.int32)
        ids[windows * K - keep:] = torch.arange(n - keep, n, dtype=torch.int32)
        return ids.view(1, windows, K).expand(self.layer_num, windows, K).contiguous()

    def admit_request_direct(self, req) -> None:
        """The transfer is done (the prompt's KV is in ESS's host pages): the request's first residency is warmed up
        from them and it joins decode. Nothing of SGLang's device pool is taken."""
        idx = _int("req_pool_idx", req.kv.req_pool_idx)
        n = self.host_token_len(req.kv.kv_allocated_len)
        if self._direct.get(idx) != n:
            raise InvalidArgument(
                f"admit_request_direct: request slot {idx} with {n} tokens was not received through "
                f"mem_pool_host.alloc_paged_token_slots" + (f" (it received {self._direct[idx]})" if idx in self._direct
                                                            else ""))
        self.engine.warmup(idx, self._warmup_windows(n))
        del self._direct[idx]
        self._length[idx] = n
        req.hisparse_staging = False

    def has_ongoing_staging(self) -> bool:
        return len(self.ack_staging_queue) > 0

    def collect_ready_reqs(self):
        ready = []
        if not self.ack_staging_queue:
            return ready
        finished = 0
        for act in self.ack_staging_queue:
            if not act.finish_event.query():
                break
            finished += 1
        count = torch.tensor(finished, dtype=torch.int, device="cpu")
        if self.tp_world_size > 1:   # every TP rank hands the same requests to decode
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
        for _ in range(int(count.item())):
            act = self.ack_staging_queue.pop(0)
            act.finish_event.synchronize()
            self._finish_staging(act.req)
            ready.append(act.req)
        return ready

    def abort_staging_request(self, req) -> None:
        self.ack_staging_queue = [act for act in self.ack_staging_queue if act.req is not req]
        self.write_staging_stream.synchronize()
        idx = _int("req_pool_idx", req.kv.req_pool_idx)
        self.token_to_kv_pool_allocator.free_hisparse(self.req_to_token_pool.req_to_token[idx, :_int("extend_end", req.extend_end)])
        self.engine.release(idx)
        req.hisparse_staging = False

    def retract_req(self, req) -> None:
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)
        else:
            self.request_finished(req)

    def request_finished(self, req) -> None:
        if self.decode_producer_stream is not None:
            self.dev.current_stream().wait_stream(self.decode_producer_stream)
        self.wait_for_pending_backup()
        idx = _int("req_pool_idx", req.kv.req_pool_idx)
        if idx in self._direct:   # PD: received (or receiving failed) but never admitted; no device work of ours
            del self._direct[idx]
            self._forget_host_slots(idx)
            self.engine.release(idx)
            return
        if idx not in self._length:
            if getattr(req, "hisparse_staging", False):
                self.abort_staging_request(req)
            return   # never admitted to ESS (finished during prefill): nothing of ours to release
        # Decode tokens' logical slots map to the reserved row: unmap them so that SGLang's own free of
        # the request's KV does not hand ESS's rows to its allocator.
        allocated = self.req_to_token_pool.req_to_token[idx, :_int("kv_allocated_len", req.kv.kv_allocated_len)].to(torch.int64)
        mapping = self.mem_pool_device.full_to_hisparse_device_index_mapping
        self.dev.launch(lambda: mapping.index_fill_(0, allocated, 0))
        del self._length[idx]
        self._forget_host_slots(idx)
        if self._backup_due is not None:
            self._dropped_rows.append(idx)
        done = self.dev.Event()
        done.record()
        self._retiring.append((idx, done))
        self._retire()

    def _forget_host_slots(self, idx: int):
        if self._req_to_host_pool is not None and int(self.req_to_host_pool_allocated_len[idx]) > 0:
            self._req_to_host_pool[idx].fill_(-1)
        self.req_to_host_pool_allocated_len[idx] = 0

    def _retire(self, row: Optional[int] = None, force: bool = False):
        """Releases finished requests whose last device work is done; `row` (about to be reused) or every
        one with `force` waits for it."""
        keep = []
        for idx, event in self._retiring:
            if force or idx == row:
                event.synchronize()
            if event.query():
                self.engine.release(idx)
            else:
                keep.append((idx, event))
        self._retiring = keep

    # ---- decode ----
    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu,
                               req_pool_indices_cpu) -> None:
        """ScheduleBatch.prepare_for_decode, after seq_lens += 1 and alloc_decode: backs up the previous step's
        newest entries, extends every request by its new token and points out_cache_loc at the reserved rows."""
        rows = _ints("req_pool_indices_cpu", req_pool_indices_cpu)
        lengths = _ints("seq_lens_cpu", seq_lens_cpu)
        if len(rows) != len(lengths):
            raise InvalidArgument(f"map_last_loc_to_buffer: {len(rows)} requests with {len(lengths)} lengths")
        if self.num_draft_tokens:
            raise InvalidArgument("map_last_loc_to_buffer: with speculative decoding every step is a verify step "
                                  "(prepare_spec_verify)")
        self._check_batch("map_last_loc_to_buffer", rows, lengths, grow=self.T)
        self._retire()
        self._backup_previous_step()
        locs = self.token_to_kv_pool_allocator.get_last_loc_compressed(out_cache_loc).to(torch.int64)
        if self.page_size == 1:
            # alloc_for_decode's page-size-one path (allocator.alloc) gave each new token a device slot of
            # SGLang's too: it goes back, as upstream frees it (this branch synchronizes, as upstream's does).
            previous = self.mem_pool_device.full_to_hisparse_device_index_mapping[locs]
            stale = previous[previous > 0]
            if stale.numel() > 0:
                self.token_to_kv_pool_allocator.free_hisparse_indices(stale)
        self._extend_into_reserved(rows, req_pool_indices, locs)
        self._backup_due = (req_pool_indices, seq_lens)

    def _backup_previous_step(self):
        """The previous step's newest entries (written by its forward into the reserved rows) to the host pool,
        on the backup stream after the schedule and producer streams, as upstream's eager backup."""
        self.wait_for_pending_backup()   # the backup's own tensors are free again
        if self._backup_due is None:
            return
        (rows, lengths), dropped = self._backup_due, self._dropped_rows
        self._backup_due, self._dropped_rows = None, []
        B = int(rows.shape[0])

        def stage():
            self._backup_rows[:B].copy_(rows)
            self._backup_lengths[:B].copy_(lengths)
            for row in dropped:
                self._backup_rows[:B].masked_fill_(self._backup_rows[:B] == row, -1)
        self._launch_backup(self._write_back, B, stage, self.decode_producer_stream)
        _keep(rows, self.decode_backup_stream)
        _keep(lengths, self.decode_backup_stream)
        self._has_pending_backup = True

    def _launch_backup(self, binding, B, stage, producer=None):
        """On decode_backup_stream, after the current stream (and `producer`): `stage` fills the binding's
        tensors, then every layer's write-back; the backup event is recorded when it ends."""
        current = self.dev.current_stream()
        with self.dev.stream(self.decode_backup_stream):
            self.decode_backup_stream.wait_stream(current)
            if producer is not None:
                self.decode_backup_stream.wait_stream(producer)

            def backup():
                stage()
                stream = self.dev.handle(self.decode_backup_stream)
                for layer in range(self.layer_num):
                    binding.write_back(layer, B, stream)
            self.dev.launch(backup)
            self._backup_done_event.record()

    def wait_for_pending_backup(self) -> None:
        if not self._has_pending_backup:
            return
        self._backup_done_event.wait(self.dev.current_stream())
        self._has_pending_backup = False

    def swap_in_selected_pages(self, req_pool_indices, compressed_seq_lens, top_k_result, layer_id):
        """The dsa backend's decode, per layer: top_k_result [bs, K] logical token positions (-1 = padding) ->
        int32 [bs, K] slots of SGLang's device pool (FlashMLA's page_table_1), the misses fetched into them.
        bs may be a CUDA-graph batch: positions at or past num_real_reqs are padding."""
        layer = self._layer(layer_id)
        for name, t in (("req_pool_indices", req_pool_indices), ("compressed_seq_lens", compressed_seq_lens),
                        ("top_k_result", top_k_result)):
            _int_tensor(f"swap_in_selected_pages: {name}", t)
        B = int(req_pool_indices.shape[0])
        if B > self.max_batch:
            raise InvalidArgument(f"swap_in_selected_pages: batch {B} exceeds the {self.max_batch} request slots")
        T = self.T
        expected = (B, self.top_k) if T == 1 else (B, T, self.top_k)
        if tuple(top_k_result.shape) != expected:
            raise InvalidArgument(f"swap_in_selected_pages: top_k_result has shape {tuple(top_k_result.shape)}; "
                                  f"expected {list(expected)}")
        if compressed_seq_lens.numel() != B * T:
            raise InvalidArgument(f"swap_in_selected_pages: {compressed_seq_lens.numel()} seq_lens for {B} requests x "
                                  f"{T} query tokens")

        def swap():
            # Device work only (a CUDA graph replays it without this Python): the step's rows and lengths once
            # per forward, num_real_reqs read here, when the swap runs.
            if layer == 0:
                # Padding: positions at or past num_real_reqs, and SGLang's padding row 0 (req_to_token_pool
                # never gives it to a request; graph capture and DP padding point positions at it).
                self._rows[:B].copy_(req_pool_indices)
                torch.ge(self._arange[:B], self.num_real_reqs, out=self._padded_rows[:B])
                torch.eq(self._rows[:B], 0, out=self._row_zero[:B])
                self._padded_rows[:B].logical_or_(self._row_zero[:B])
                self._rows[:B].masked_fill_(self._padded_rows[:B], -1)
                # A verify step's seq_lens are per query token (L + t + 1): ESS takes each request's last, L + T.
                self._lengths[:B].copy_(compressed_seq_lens.view(B, T)[:, T - 1])
            self._topk[:B].view(top_k_result.shape).copy_(top_k_result)
            self._step.step(layer, B, self.dev.handle(self.dev.current_stream()))
            phys = self._physical[:B]
            torch.add(phys, self.row_base, out=self._locs[:B])
            torch.lt(phys, 0, out=self._padding[:B])
            self._locs[:B].masked_fill_(self._padding[:B], -1)
        self.dev.launch(swap)
        return self._locs[:B].view(expected)


UPSTREAM_MODULE = "sglang.srt.managers.hisparse_coordinator"


def _replace(module):
    import sglang
    version = getattr(sglang, "__version__", None)
    if version != SGLANG_VERSION:
        raise InvalidArgument(f"sglang {version}: this adapter is checked against sglang {SGLANG_VERSION} "
                              "(re-run its conformance test against the new release first)")
    if module.HiSparseCoordinator is not HiSparseCoordinator:
        module.ESS_REPLACED = module.HiSparseCoordinator
        module.HiSparseCoordinator = HiSparseCoordinator
        logger.info("ESS: %s.HiSparseCoordinator is ESS's", module.__name__)


class _Finder:
    """Replaces the class as soon as SGLang imports its module (ModelRunner.maybe_init_hisparse_coordinator
    imports it when it builds the coordinator)."""

    def find_spec(self, name, path=None, target=None):
        if name != UPSTREAM_MODULE:
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader

        def exec_module(module, _exec=loader.exec_module):
            _exec(module)
            _replace(module)
        spec.loader.exec_module = exec_module
        return spec


def install():
    """Puts ESS's coordinator where SGLang's ModelRunner takes HiSparse's from
    (sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator), in this process: at once if SGLang's module
    is imported, else when it is. SGLang builds its model runners in spawned processes, which do not inherit
    this: launch with `python -m ess.integrations.sglang_launch ...` (every process of the server then installs
    it at start-up), or call install() at the start of each process. Refuses another sglang release."""
    import sys
    module = sys.modules.get(UPSTREAM_MODULE)
    if module is not None:
        _replace(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
