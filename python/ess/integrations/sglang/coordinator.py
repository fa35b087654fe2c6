"""ESS's HiSparseCoordinator (the package's docstring says where the bytes live and in which order the calls run):
construction (the rows claimed from SGLang's device pool, the engine, the bound step), the decode swap and the
backup of each step's newest entries, speculative decoding's verify steps, statistics. Admission and release are
staging.py's."""
from __future__ import annotations

import logging
from typing import List, Optional

import torch

from ... import _args
from ..._errors import InvalidArgument
from ...engine import Engine
from .. import _device
from ._common import (SGLANG_VERSION, HiSparseAct, SpecScratch, _claim_top_rows, _cuda_index, _int, _int_tensor,
                      _ints, _keep, _pool_slots, _return_top_rows, _sglang_setting, _token_stats_type,
                      residency_from_environment)
from ..topk_recorder import TopkRecorder
from .forward_batches import ForwardBatches
from .host_pool import HostPool
from .indexer_split import topk_broadcast_refusal
from .pools import device_pool
from .overlap import (DecodeSplit, check_decode_backend, layers_from_environment, register,
                      schedule_from_environment, unregister)
from .shared_index import SharedIndexPrefetch, check_pattern
from .staging import Staging

logger = logging.getLogger("ess.integrations.sglang")


class HiSparseCoordinator(Staging):
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
        # The device pool's kind (pools.py): DSA's latent entries, DeepSeek-V4's C4 entries (one per 4 tokens), or
        # MiniMax-M3's K / V.
        self.pool = device_pool(token_to_kv_pool_allocator)
        # The ids one swap hands ESS's step per query token: the top-k; for MiniMax-M3's block swap the tokens of
        # the selected blocks, at most device_buffer_size (upstream's bound, hisparse_coordinator.py).
        self.step_k = self.device_buffer_size if self.pool.blocks else self.top_k

        num_draft_tokens = 0 if num_draft_tokens is None else _int("num_draft_tokens", num_draft_tokens)
        if num_draft_tokens < 0:
            raise InvalidArgument(f"num_draft_tokens = {num_draft_tokens} is negative")
        if num_draft_tokens and self.pool.kind != "DSA":
            # Upstream's HiSparseSpecSwapManager refuses DeepSeek-V4 ("HiSparse spec swap currently supports DSA
            # caches only"; its indexer swaps in DECODE only); MiniMax-M3's block swap has no verify path upstream.
            raise InvalidArgument(f"num_draft_tokens = {num_draft_tokens} with the {self.pool.kind} pool: speculative "
                                  "decoding with HiSparse serves DSA caches only (as upstream's)")
        if num_draft_tokens and self.device_buffer_size < num_draft_tokens * self.top_k:
            # One swap call serves a verify step's T query tokens (FlashMLA runs once after it), so the pool
            # must hold their union: ESS cannot split the step into query groups there.
            raise InvalidArgument(
                f"device_buffer_size = {self.device_buffer_size} < num_draft_tokens {num_draft_tokens} x top_k "
                f"{self.top_k}: a verify step's query tokens may select more distinct tokens than the pool holds; "
                f"set the hisparse device_buffer_size to at least {num_draft_tokens * self.top_k}")
        self.mem_pool_device = self.pool.device
        self.page_size = self.pool.page_size
        if 64 % self.page_size != 0:
            raise InvalidArgument(
                f"page size {self.page_size}: ESS's host pages hold 64 tokens each, and the host slots SGLang reads "
                "(req_to_host_pool, page-rounded) and a PD transfer's pages must fall within them, so the page size "
                "must divide 64 (the DSA backend's is 64)")
        # PD decode (disaggregation_mode = decode) changes what the device pool must leave SGLang. Before SGLang
        # publishes its settings (a pool and coordinator built without a server, as its unit tests build them),
        # the stricter budget of the other modes.
        self.pd_decode = _sglang_setting("get_disagg", "disaggregation_mode") == "decode"
        if self.pd_decode and self.pool.kind != "DSA":
            layout = ("C4 pages in the device layout (37,440-byte page rows, which upstream's DeepSeekV4PagedHostPool "
                      "mirrors)" if self.pool.ratio != 1 else "K and V into two host tensors (upstream's "
                      "HiSparseMHATokenToKVPoolHost)")
            raise InvalidArgument(
                f"disaggregation_mode = decode with the {self.pool.kind} pool: the prefill side sends {layout}; "
                "ESS's host pool keeps whole entries, which a transfer cannot write")
        self.layer_num = self.pool.layer_num
        self.start_layer = self.pool.start_layer
        if num_draft_tokens and self.page_size == 1:
            raise InvalidArgument(
                f"num_draft_tokens = {num_draft_tokens} with page size 1: SGLang's alloc_for_spec_decode then gives "
                "every draft token a device slot of its own (mem_cache/allocation.py: alloc_token_slots), which "
                "ESS's reserved rows would leave orphaned each verify step (upstream's HiSparse refuses fewer than "
                "num_draft_tokens + 1 slots a page too)")

        # T query tokens per request per step: 1 in decode, the draft tokens of a verify step with speculative
        # decoding. A request's rows are its slots and T reserved rows (the step's newest tokens).
        self.T = max(1, num_draft_tokens)
        self.num_draft_tokens = num_draft_tokens
        max_reqs = req_to_token_pool.req_to_token.shape[0]
        max_context = req_to_token_pool.max_context_len
        self.max_batch = max_reqs
        host_bytes = self._check_settings(max_reqs, max_context, host_to_device_ratio)
        # ESS_OVERLAP: the schedule of the DSA backend's decode (overlap.py).
        self.overlap = schedule_from_environment()
        if self.overlap != "none" and getattr(self.pool, "bf16", False):
            raise InvalidArgument(f"ESS_OVERLAP = {self.overlap} with a bf16 latent (--kv-cache-dtype bfloat16): the "
                                  "overlap splits FlashMLA's FP8 sparse decode (flashmla_kv); unset it, or serve an "
                                  "FP8 cache")
        if self.overlap != "none" and self.pool.kind != "DSA":
            raise InvalidArgument(f"ESS_OVERLAP = {self.overlap} with the {self.pool.kind} pool: the overlap schedules "
                                  "run inside the DSA backend's decode, not this model's; unset it")
        # ESS_RESIDENCY: whether requests stay whole while ESS's rows are free (Engine's residency).
        self.residency = residency_from_environment()
        # ESS_OVERLAP_LAYERS: layer-wise, each layer's schedule per micro-batch.
        self._layer_schedules = (layers_from_environment(self.start_layer, self.layer_num)
                                 if self.overlap == "layerwise" else None)
        used = ({m for group in self._layer_schedules for m in group} if self._layer_schedules is not None
                else {self.overlap})
        if used & {"da", "dba"}:
            check_decode_backend(_sglang_setting("get_exec", "kernel.dsa_decode_backend"),
                                 f"ESS_OVERLAP = {self.overlap}", self.overlap)
        if "dba" in used and topk_broadcast_refusal() is not None:
            which = "" if self.overlap == "dba" else " (its DBA layers)"
            raise InvalidArgument(f"ESS_OVERLAP = {self.overlap}{which}: {topk_broadcast_refusal()}; unset it, or "
                                  "use ESS_OVERLAP = da")
        # Shared-index layers (GLM-5.2's index sharing): each follower's step starts at its leader's swap
        # (shared_index.py).
        if shared_index_layers is not None and self.pool.kind != "DSA":
            raise InvalidArgument(f"shared_index_layers with the {self.pool.kind} pool: index sharing is a DSA "
                                  "model's (upstream's resolve_shared_index_layers gives None for the others)")
        shared_index_layers = check_pattern(shared_index_layers, self.layer_num)
        rows_per_request = self.device_buffer_size + self.T
        if self.pd_decode:
            keep_min, why = max_reqs, "one slot per request: SGLang's PD transfer budget"
        else:
            keep_min, why = self.pool.units(max_context), "the context length, for a prefill"
        # Checked first, taken after: whatever fails from here on gives the rows back.
        self.row_base = _claim_top_rows(token_to_kv_pool_allocator, max_reqs * rows_per_request, keep_min, why)
        self.engine = None
        try:
            self._build(max_reqs, rows_per_request, host_bytes, host_to_device_ratio, device,
                        shared_index_layers, tp_group)
        except BaseException:
            if getattr(self, "decode_split", None) is not None:
                unregister(self.decode_split)
            if self.engine is not None:
                self.engine.close()
            _return_top_rows(token_to_kv_pool_allocator)
            raise

    def _check_settings(self, max_reqs, max_context, host_to_device_ratio) -> int:
        """The hisparse settings as the user gave them (top_k, device_buffer_size, host_to_device_ratio), checked
        before anything is taken from SGLang; returns the host pool's bytes."""
        if self.top_k < 1:
            raise InvalidArgument(f"top_k = {self.top_k}: the index top-k must be at least 1")
        need = min(self.top_k, self.pool.units(max_context))
        if self.device_buffer_size < need:
            raise InvalidArgument(
                f"device_buffer_size = {self.device_buffer_size} < top_k {self.top_k}: a request's device buffer "
                f"must hold one query token's top-k (min(top_k, entries of the context length {max_context}) = "
                f"{need})")
        ratio = _args.real("host_to_device_ratio", host_to_device_ratio)
        if ratio <= 0:
            raise InvalidArgument(f"host_to_device_ratio = {ratio}: it must be positive")
        host_units = self.pool.host_units(self.token_to_kv_pool_allocator, ratio)
        if host_units < 1:
            # A C4 pool's host pool is the allocator's logical pool / 4, whatever the ratio (upstream's).
            why = (f"host_to_device_ratio = {ratio}: the host pool would hold {host_units} entries a layer (the device "
                   "pool's x the ratio)") if self.pool.ratio == 1 else (
                   f"the C4 pool: its host pool would hold {host_units} entries a layer (the allocator's size_full / 4, "
                   "as upstream's, whatever host_to_device_ratio)")
            raise InvalidArgument(f"{why}; it must hold one")
        # Whole 64-entry pages per request-layer: one partly used page per request-layer at most.
        return (host_units + max_reqs * 64) * self.layer_num * self.pool.entry_bytes

    def _build(self, max_reqs, rows_per_request, host_bytes, host_to_device_ratio, device,
               shared_index_layers, tp_group):
        """The engine over the claimed rows and the coordinator's state (construction after the claim)."""
        self.ess_rows = max_reqs * rows_per_request
        buffers = self.pool.engine_buffers(self.row_base, self.ess_rows)
        self._latent = buffers["latent"]
        try:
            self.engine = Engine(max_requests=max_reqs, max_context=self.pool.units(self.req_to_token_pool.max_context_len),
                                 slots=self.device_buffer_size, layers=self.layer_num, topk=self.step_k,
                                 query_tokens=self.T, reserve_newest=True, residency=self.residency,
                                 backend="cuda" if self.dev.is_cuda else "cpu",
                                 device=_cuda_index(device) if self.dev.is_cuda else 0,
                                 host_bytes=host_bytes, **buffers)
        except InvalidArgument as e:
            raise InvalidArgument(
                f"hisparse settings top_k = {self.top_k}, device_buffer_size = {self.device_buffer_size}, "
                f"host_to_device_ratio = {host_to_device_ratio}, {max_reqs} request slots: {e}") from None
        self.info = self.engine.info

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
        self._verifying = set()       # req_pool_idx with a verify step prepared, not committed

        # The step's tensors, bound once (fixed addresses for CUDA graphs).
        i32 = dict(dtype=torch.int32, device=device)
        self._topk = torch.full((max_reqs, self.T, self.step_k), -1, **i32)
        self._physical = torch.full((max_reqs, self.T, self.step_k), -1, **i32)
        self._locs = torch.full((max_reqs, self.T, self.step_k), -1, **i32)
        self._padding = torch.zeros((max_reqs, self.T, self.step_k), dtype=torch.bool, device=device)
        self._padded_rows = torch.zeros((max_reqs,), dtype=torch.bool, device=device)
        self._row_zero = torch.zeros((max_reqs,), dtype=torch.bool, device=device)
        self._arange = torch.arange(max_reqs, **i32)
        # With a DA layer, the steps also give each query row's resident and fetched rows, and the copy runs on a
        # stream of its own (overlap.py).
        self.decode_split = None
        if self.overlap != "none":
            self.decode_split = DecodeSplit(self.dev, max_reqs, self.T, self.top_k, device, self._padding,
                                            self.overlap, self._layer_schedules)
            register(self.decode_split)
        # The rows and lengths of each batch a forward swaps for (the whole batch, or two-batch overlap's
        # micro-batches), each with its bound step.
        self._batches = ForwardBatches(self.engine, max_reqs, self._topk, self._physical, device,
                                       None if self.decode_split is None else self.decode_split.outputs())
        self.shared_index = None
        if shared_index_layers is not None:
            self.shared_index = SharedIndexPrefetch(self.dev, self.engine, shared_index_layers, max_reqs, self.T,
                                                    self.top_k, device, self.row_base)
            logger.info("ESS: shared-index prefetch: %d leader layers start the steps of %d shared layers",
                        len(self.shared_index.groups), sum(shared_index_layers))
        # ESS_RECORD_TRACE: the top-k SGLang hands the swap, recorded as a trace (topk_recorder.py).
        self._recorder = TopkRecorder.from_environment(
            layers=self.layer_num, T=self.T, K=self.step_k, max_reqs=max_reqs, device=device, dev=self.dev,
            provenance=f"sglang {SGLANG_VERSION} with ess.integrations.sglang", unit_tokens=self.pool.ratio)
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
        self.tp_world_size = 1
        if tp_group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            self.tp_world_size = torch.distributed.get_world_size(group=tp_group)
        logger.info("ESS replaces HiSparse: %d requests x (%d slots + %d reserved) rows at device slot %d, "
                    "host pool %.1f GiB, backend %s", max_reqs, self.device_buffer_size, self.T, self.row_base,
                    host_bytes / 2**30, self.info.backend)

    @property
    def req_to_host_pool(self):
        """[request slots, context + page] int64 host slots (-1: none), on the device, as upstream's: the context in
        the pool's entries (a C4 pool's, ceil(context / 4), upstream's max_compressed_context_len); made when first
        read."""
        if self._req_to_host_pool is None:
            entries = -(-self.req_to_token_pool.max_context_len // self.pool.ratio)
            self._req_to_host_pool = torch.full((self.max_batch, entries + self.page_size), -1, dtype=torch.int64,
                                                device=self.device)
        return self._req_to_host_pool

    def host_token_len(self, kv_allocated_len: int) -> int:
        """The host entries of a request of kv_allocated_len tokens (upstream's: // 4 for DeepSeek-V4's C4 pool)."""
        return _int("kv_allocated_len", kv_allocated_len) // self.pool.ratio

    # ---- the rows of a request, in SGLang's device pool ----
    def _extend_into_reserved(self, rows, req_pool_indices, locs, grows=None, writes=None):
        """Every request (`rows`, host ints, in req_pool_indices' order) grows by the step's T tokens (`grows`: by
        that many entries each, when the pool's entries are not tokens), and their logical slots `locs` ([bs x T],
        token t of position b at b x T + t) map to the request's T reserved rows, where the model's unchanged KV
        store then writes them (`writes`: a device bool [bs], the positions whose step writes an entry; the others'
        mapping stays as it is)."""
        T = self.T
        grows = [T] * len(rows) if grows is None else grows
        self._check_context(rows, grows)
        page = self.page_size
        grown = []
        try:
            for row, g in zip(rows, grows):
                if not g:
                    continue
                old = self._length[row]
                self._ess().extend(row, g)
                self._length[row] = old + g
                grown.append((row, old))
        except BaseException:
            for row, old in grown:   # all or nothing: the requests grown before the refusal shrink back
                self._ess().truncate(row, old)
                self._length[row] = old
            raise
        for row, old in grown:
            # The published slots reach at least the old length's last page (truncation leaves them): only a
            # request that enters a new page has slots to add, once a page, not a table read per step.
            if -(-self._length[row] // page) > -(-old // page):
                self._publish_host_slots(row, self._length[row])
        reserved = (req_pool_indices.to(torch.int64).view(-1, 1) * self.info.rows_per_request
                    + (self.row_base + self.info.slots)
                    + torch.arange(T, dtype=torch.int64, device=req_pool_indices.device).view(1, -1))
        mapping = self.mem_pool_device.full_to_hisparse_device_index_mapping

        def point():
            new = reserved.view(-1)
            if writes is not None:
                # Device work only (no mask read on the host): the other positions write back what they hold.
                new = torch.where(writes, new, mapping.index_select(0, locs))
            mapping.index_copy_(0, locs, new)
        self.dev.launch(point)

    def _check_context(self, rows, grows) -> None:
        """Every request's growth within the context length, before anything changes."""
        for b, (row, g) in enumerate(zip(rows, grows)):
            if self._length[row] + g > self.info.max_context:
                raise InvalidArgument(f"position {b} (request slot {row}): {self._length[row]} entries + {g} exceed "
                                      f"the context length {self.info.max_context}")

    def _new_forward(self) -> None:
        """A step's preparation: the next forward's batches are new, and so is the DA / DBA state (a forward that
        failed between a DBA first half and its forward_decode left one behind)."""
        self._batches.new_forward()
        if self.decode_split is not None:
            self.decode_split.new_forward()
        if self.shared_index is not None:
            self.shared_index.new_forward()

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
        self._new_forward()
        pending = [row for row in rows if row in self._verifying]
        if pending:
            raise InvalidArgument(f"prepare_spec_verify: request slots {pending} have a verify step not committed "
                                  "yet (commit_spec_accept_tokens)")
        self._extend_into_reserved(rows, batch.req_pool_indices, batch.out_cache_loc.to(torch.int64))
        self._verifying.update(rows)
        if self._recorder is not None:
            self._recorder.step(rows, [self._length[row] for row in rows], self._after_the_forward)

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
        _int_tensor("commit_spec_accept_tokens: accept_indices", accept_indices)
        accept = accept_indices.to("cpu", torch.int64)
        if tuple(accept.shape) != (B, T):
            raise InvalidArgument(f"commit_spec_accept_tokens: accept_indices has shape {tuple(accept.shape)}; "
                                  f"expected [{B}, {T}]")
        self._check_batch("commit_spec_accept_tokens", rows, None, grow=0)
        unprepared = [row for row in rows if row not in self._verifying]
        if unprepared:
            raise InvalidArgument(f"commit_spec_accept_tokens: request slots {unprepared} have no verify step "
                                  "prepared (prepare_spec_verify), or it was committed already")
        if bool((accept < -1).any()):
            raise InvalidArgument(f"commit_spec_accept_tokens: accept_indices {accept.tolist()} hold values below "
                                  "-1 (-1 marks a rejected position)")
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
            self._ess().truncate(row, self._length[row] - T + n)
            self._length[row] += n - T
            self._verifying.discard(row)
        self._backup_done_event.wait(current)

    def _check_batch(self, where, rows, lengths, grow):
        """Every request in ESS, once, with its length (+ grow) when the caller knows it: before anything changes."""
        for b, row in enumerate(rows):
            if row not in self._length:
                raise InvalidArgument(f"{where}: position {b}: request slot {row} is not in ESS (not staged, or "
                                      "already finished)")
            if lengths is None:
                continue
            if self.pool.ratio == 1 and lengths[b] != self._length[row] + grow:
                raise InvalidArgument(f"{where}: position {b} (request slot {row}): seq_len {lengths[b]} is not its "
                                      f"{self._length[row]} tokens" + (f" + {grow}" if grow else ""))
            if self.pool.ratio != 1 and (lengths[b] < 1 + grow or self.pool.units(lengths[b] - grow) != self._length[row]):
                raise InvalidArgument(f"{where}: position {b} (request slot {row}): seq_len {lengths[b]} does not "
                                      f"follow its {self._length[row]} C4 entries (seq_len - {grow} tokens hold "
                                      f"{self.pool.units(max(lengths[b] - grow, 0))})")
        if len(set(rows)) != len(rows):
            raise InvalidArgument(f"{where}: a request slot appears twice in {rows}")
        if len(rows) > self.max_batch:
            raise InvalidArgument(f"{where}: {len(rows)} requests, at most {self.max_batch}")

    def swap_in_selected_blocks(self, req_pool_indices, seq_lens, top_k_blocks, layer_id, sparse_block_size):
        """MiniMax-M3's sparse decode, per layer (minimax_sparse_backend.py _hisparse_swap_in_blocks): top_k_blocks
        int32 [bs, n] block ids (-1 padded), seq_lens [bs] token lengths -> int32 [bs, n x sparse_block_size] slots
        of the main pool's K and V, entry j x block + t for token top_k_blocks[j] x block + t, -1 for a padded block,
        a token at or past seq_len and padding rows (as upstream's load_blocks_to_device_buffer_mha). ESS's step
        runs over those tokens: residency and LRU token-granular, as upstream's kernel."""
        if not self.pool.blocks:
            raise InvalidArgument(f"swap_in_selected_blocks: MiniMax-M3's block swap on the {self.pool.kind} pool "
                                  "(its decode calls swap_in_selected_pages)")
        block = _int("sparse_block_size", sparse_block_size)
        if block < 1:
            raise InvalidArgument(f"swap_in_selected_blocks: sparse_block_size = {block} must be positive")
        layer, B, _ = self._check_swap("swap_in_selected_blocks", req_pool_indices, seq_lens, top_k_blocks, layer_id,
                                       names=("seq_lens", "top_k_blocks"), what="the block top-k's ids")
        if top_k_blocks.dim() != 2 or int(top_k_blocks.shape[0]) != B:
            raise InvalidArgument(f"swap_in_selected_blocks: top_k_blocks has shape {tuple(top_k_blocks.shape)}; "
                                  f"expected [{B}, blocks]")
        tokens = int(top_k_blocks.shape[1]) * block
        if tokens > self.step_k:
            raise InvalidArgument(
                f"swap_in_selected_blocks: {top_k_blocks.shape[1]} blocks of {block} tokens select {tokens}, but the "
                f"HiSparse device buffer holds only {self.device_buffer_size} (device_buffer_size)")
        rows, lengths, step, first = self._batches.slot(layer, req_pool_indices)
        offsets = torch.arange(block, dtype=torch.int32, device=top_k_blocks.device).view(1, 1, block)

        def swap():
            if first:
                self._stage(rows, lengths, req_pool_indices, seq_lens, B)
            ids = top_k_blocks.reshape(B, -1, 1) * block + offsets
            ids.masked_fill_((top_k_blocks.reshape(B, -1, 1) < 0) | (ids >= seq_lens.view(B, 1, 1)), -1)
            self._topk[:B, 0, :tokens].copy_(ids.view(B, tokens))
            self._topk[:B, 0, tokens:].fill_(-1)
            if self._recorder is not None:
                self._recorder.record(layer, req_pool_indices, self._topk[:B, 0])
            step.step(layer, B, self.dev.handle(self.dev.current_stream()))
            _pool_slots(self._physical[:B], self.row_base, self._locs[:B], self._padding[:B])
        self.dev.launch(swap)
        return self._locs[:B, 0, :tokens]

    def destroy(self) -> None:
        if self.decode_split is not None:
            unregister(self.decode_split)
        if self._recorder is not None:
            self._recorder.close()
        self.write_staging_stream.synchronize()
        self.decode_backup_stream.synchronize()
        if self.shared_index is not None:
            self.shared_index.stream.synchronize()   # its steps read the host pool
        self.mem_pool_host.close()
        self.engine.close()

    def get_token_stats(self):
        inner = self.token_to_kv_pool_allocator.hisparse_attn_allocator
        device_capacity = inner.size + self.ess_rows
        device_tokens = inner.size - inner.available_size() + len(self._length) * self.info.rows_per_request
        s = self.engine.stats()
        per_token = self.layer_num * self.info.entry_bytes
        host_capacity = s.host_bytes_capacity // per_token
        host_tokens = s.host_bytes_used // per_token
        return _token_stats_type()(
            device_tokens=device_tokens,
            device_token_usage=device_tokens / device_capacity if device_capacity > 0 else 0.0,
            host_tokens=host_tokens,
            host_token_usage=host_tokens / host_capacity if host_capacity > 0 else 0.0)

    # ---- decode ----
    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu,
                               req_pool_indices_cpu) -> None:
        """ScheduleBatch.prepare_for_decode, after seq_lens += 1 and alloc_decode: backs up the previous step's
        newest entries, extends every request by its new token and points out_cache_loc at the reserved rows.
        DeepSeek-V4's C4 pool: only a request whose step completes an entry (seq_len % 4 == 0) gets it, its
        compressed slot (get_last_loc_compressed) pointed at the reserved row, as upstream's."""
        rows = _ints("req_pool_indices_cpu", req_pool_indices_cpu)
        lengths = _ints("seq_lens_cpu", seq_lens_cpu)
        if len(rows) != len(lengths):
            raise InvalidArgument(f"map_last_loc_to_buffer: {len(rows)} requests with {len(lengths)} lengths")
        if self.num_draft_tokens:
            raise InvalidArgument("map_last_loc_to_buffer: with speculative decoding every step is a verify step "
                                  "(prepare_spec_verify)")
        self._check_batch("map_last_loc_to_buffer", rows, lengths, grow=self.T)
        grows = [self.pool.units(n) - self._length[row] for row, n in zip(rows, lengths)]
        self._check_context(rows, grows)   # before the stale slots below go back
        self._new_forward()
        self._backup_previous_step()
        # The mapping slots the new tokens own (C4: loc // 4, which for a token completing an entry is upstream's
        # get_last_loc_compressed, (loc - 3) // 4; for the others, a group of the request's own page, never another
        # request's: (loc - 3) // 4 of a page's first token names the previous page's last group, which may be
        # another request's completing one, and two writes of one slot in a step would race).
        locs = self.pool.mapping_locs(out_cache_loc.to(torch.int64))
        if self.page_size == 1:
            # alloc_for_decode's page-size-one path (allocator.alloc) gave each new token a device slot of
            # SGLang's too: it goes back, as upstream frees it (this branch synchronizes, as upstream's does).
            previous = self.mem_pool_device.full_to_hisparse_device_index_mapping[locs]
            stale = previous[previous > 0]
            if stale.numel() > 0:
                self.token_to_kv_pool_allocator.free_hisparse_indices(stale)
        self._extend_into_reserved(rows, req_pool_indices, locs, grows, self.pool.entry_steps(seq_lens))
        self._backup_due = (req_pool_indices, seq_lens)
        if self._recorder is not None:
            self._recorder.step(rows, [self._length[row] for row in rows], self._after_the_forward)

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
            # The requests whose step wrote an entry (every one, but for DeepSeek-V4's C4 pool), at their units.
            self._backup_rows[:B].copy_(rows)
            self._backup_lengths[:B].copy_(self.pool.units_of(lengths))
            wrote = self.pool.entry_steps(lengths)
            if wrote is not None:
                self._backup_rows[:B].masked_fill_(~wrote, -1)
            for row in dropped:
                self._backup_rows[:B].masked_fill_(self._backup_rows[:B] == row, -1)
        self._launch_backup(self._write_back, B, stage, self.decode_producer_stream)
        _keep(rows, self.decode_backup_stream)
        _keep(lengths, self.decode_backup_stream)
        self._has_pending_backup = True

    def _launch_backup(self, binding, B, stage, producer=None):
        """On decode_backup_stream, after the current stream (and `producer`): `stage` fills the binding's
        tensors, then every layer's write-back; the backup event is recorded when it ends."""
        def backup():
            stage()
            stream = self.dev.handle(self.decode_backup_stream)
            for layer in range(self.layer_num):
                binding.write_back(layer, B, stream)
        self._on_backup_stream(backup, producer)

    def _on_backup_stream(self, fn, producer=None):
        """fn's device work on decode_backup_stream after the current stream (and `producer`), the backup event
        recorded after it (wait_for_pending_backup makes the next forward wait for that event)."""
        current = self.dev.current_stream()
        with self.dev.stream(self.decode_backup_stream):
            self.decode_backup_stream.wait_stream(current)
            if producer is not None:
                self.decode_backup_stream.wait_stream(producer)
            self.dev.launch(fn)
            self._backup_done_event.record()

    def _after_the_forward(self, fn):
        """fn's device work after the current (schedule) and producer streams, as the backup's; the next forward
        waits for it."""
        self._on_backup_stream(fn, self.decode_producer_stream)
        self._has_pending_backup = True

    def wait_for_pending_backup(self) -> None:
        if not self._has_pending_backup:
            return
        self._backup_done_event.wait(self.dev.current_stream())
        self._has_pending_backup = False

    def _check_swap(self, where, req_pool_indices, seq_lens, top_k, layer_id,
                    names=("compressed_seq_lens", "top_k_result"), what="the DSA indexer's top-k positions"):
        """(layer, B, expected top-k shape of the whole batch) after the checks every swap makes; `names`: the call's
        own names of seq_lens and top_k, `what` the top-k it is handed."""
        layer = self._layer(layer_id)
        for name, t in (("req_pool_indices", req_pool_indices), (names[0], seq_lens), (names[1], top_k)):
            _int_tensor(f"{where}: {name}", t)
        if top_k.dtype != torch.int32:
            # The indexer's top-k is int32 (upstream's swap kernel reads it so); a wider id would be narrowed.
            raise InvalidArgument(f"{where}: {names[1]} is {top_k.dtype}; {what} are int32 (wider ids would be cut to "
                                  "32 bits)")
        B = int(req_pool_indices.shape[0])
        if B > self.max_batch:
            raise InvalidArgument(f"{where}: batch {B} exceeds the {self.max_batch} request slots")
        T = self.T
        if seq_lens.numel() != B * T:
            raise InvalidArgument(f"{where}: {seq_lens.numel()} seq_lens for {B} requests x {T} query tokens")
        return layer, B, ((B, self.step_k) if T == 1 else (B, T, self.step_k))

    def _stage(self, rows, lengths, req_pool_indices, seq_lens, B):
        """A batch's rows and lengths, at its first swap of the forward (device work only: a CUDA graph replays it
        without this Python; num_real_reqs read when it runs).

        Padding: positions at or past num_real_reqs, and SGLang's padding row 0 (req_to_token_pool never gives it to
        a request; graph capture, DP padding and two-batch overlap's micro-batches point positions at it). A
        micro-batch's positions are its own: num_real_reqs counts the whole batch's, so past it a micro-batch's
        positions are padding too, and its other padding is row 0."""
        T = self.T
        rows[:B].copy_(req_pool_indices)
        torch.ge(self._arange[:B], self.num_real_reqs, out=self._padded_rows[:B])
        torch.eq(rows[:B], 0, out=self._row_zero[:B])
        self._padded_rows[:B].logical_or_(self._row_zero[:B])
        rows[:B].masked_fill_(self._padded_rows[:B], -1)
        # A verify step's seq_lens are per query token (L + t + 1): ESS takes each request's last, L + T.
        lengths[:B].copy_(seq_lens.view(B, T)[:, T - 1])
        if self.pool.ratio != 1:
            lengths[:B].clamp_(min=1)   # a request of under 4 tokens: 0 entries, which ESS holds as one (pools.py)

    def swap_first_half(self, req_pool_indices, seq_lens, top_k_half, layer_id):
        """DBA (indexer_split.py): the swap of the batch's first positions (as many as top_k_half has rows), from
        the indexer, before the other half's indexer runs; the layer's swap_in_selected_pages then swaps the rest.
        req_pool_indices and seq_lens are the whole batch's, as swap_in_selected_pages gets them."""
        split = self.decode_split
        if split is None or split.schedule(layer_id) != "dba":
            raise InvalidArgument(f"swap_first_half: layer {layer_id} does not run DBA now (ESS_OVERLAP = "
                                  f"{self.overlap})")
        layer, B, expected = self._check_swap("swap_first_half", req_pool_indices, seq_lens, top_k_half, layer_id)
        b0 = int(top_k_half.shape[0])
        if not 0 < b0 < B or tuple(top_k_half.shape[1:]) != expected[1:]:
            raise InvalidArgument(f"swap_first_half: top-k of shape {tuple(top_k_half.shape)} is not the first "
                                  f"positions of a batch of {list(expected)}")
        split.drop_first_half()   # (forward_decode always takes one: only a failed forward leaves one)
        rows, lengths, step, first = self._batches.slot(layer, req_pool_indices)

        def swap():
            if first:
                self._stage(rows, lengths, req_pool_indices, seq_lens, B)
            self._topk[:b0].view(top_k_half.shape).copy_(top_k_half)
            split.step_part(step, layer, b0, 0, split.first_copy_done)
        self.dev.launch(swap)
        split.first_half = (layer_id, ForwardBatches.key(req_pool_indices), b0)

    def swap_in_selected_pages(self, req_pool_indices, compressed_seq_lens, top_k_result, layer_id):
        """The dsa backend's decode, per layer: top_k_result [bs, K] logical token positions (-1 = padding) ->
        int32 [bs, K] slots of SGLang's device pool (FlashMLA's page_table_1), the misses fetched into them.
        bs may be a CUDA-graph batch: positions at or past num_real_reqs are padding."""
        layer, B, expected = self._check_swap("swap_in_selected_pages", req_pool_indices, compressed_seq_lens,
                                              top_k_result, layer_id)
        if tuple(top_k_result.shape) != expected:
            raise InvalidArgument(f"swap_in_selected_pages: top_k_result has shape {tuple(top_k_result.shape)}; "
                                  f"expected {list(expected)}")
        rows, lengths, step, first = self._batches.slot(layer, req_pool_indices)
        key = ForwardBatches.key(req_pool_indices)
        prefetch = self.shared_index
        if prefetch is not None and prefetch.is_follower(layer):
            # A shared-index layer whose step its leader's swap started (shared_index.py): its rows once done.
            locs = None if first else prefetch.take(layer, key, B, expected)
            if locs is not None:
                if self._recorder is not None:
                    self.dev.launch(lambda: self._recorder.record(layer, req_pool_indices, top_k_result))
                return locs
            # Its leader swapped another batch (a dense leader before two-batch overlap's micro-batches): the
            # follower swaps itself, after whatever the prefetch stream is still doing to its pool.
            prefetch.order_before()
        # DA / DBA: forward_decode armed this layer (overlap.py); its FlashMLA call reads the split this swap leaves.
        # Under DBA the indexer swapped the first b0 positions already (indexer_split.py).
        split = self.decode_split
        da = split is not None and split.armed == layer_id
        b0 = split.take_first_half(layer_id, key, B) if da else 0
        rest = self._batches.offset_step(req_pool_indices, b0) if b0 else step
        if b0 and prefetch is not None:
            prefetch.order_before()   # the second half's scratch set is the prefetch's

        def swap():
            if first:
                self._stage(rows, lengths, req_pool_indices, compressed_seq_lens, B)
            self._topk[b0:B].view(top_k_result[b0:].shape).copy_(top_k_result[b0:])
            if self._recorder is not None:
                self._recorder.record(layer, req_pool_indices, top_k_result)
            if da:
                split.step_part(rest, layer, B - b0, 1 if b0 else 0, split.copy_done)
                split.finish(B, self.row_base)
                return
            step.step(layer, B, self.dev.handle(self.dev.current_stream()))
            _pool_slots(self._physical[:B], self.row_base, self._locs[:B], self._padding[:B])
        self.dev.launch(swap)
        if prefetch is not None and not prefetch.is_follower(layer):
            # A DBA second half's copy (on the DA copy stream) reads scratch set 1 until copy_done.
            prefetch.start(layer, self._batches.index(key), key, rows, lengths, B, top_k_result,
                           after=split.copy_done if b0 else None)
        if da:
            return split.leave(B, expected)
        return self._locs[:B].view(expected)
