"""ESS under vLLM's HiSparse (vllm==0.33.0): the decode swap of every target-model sparse MLA layer.

In vLLM 0.33.0 each HiSparse attention layer owns a cache handle (vllm/v1/hisparse/runtime.py,
HiSparseCacheHandle) whose `runtime` (HiSparseRuntime) decides which of a decode token's logical top-k
rows are in the GPU hot buffer, copies the misses in from the host pool and returns the physical rows
FlashMLA reads (`swap_in`). Here `HiSparseRuntime` is ESS's: one ESS engine layer per handle, the LRU
rows of each request in ESS's own device buffer, the misses copied from ESS's Total Memory Pool, each
step's newest entries written back to it. `ess.integrations.vllm_connector.HiSparseConnector` (loaded by
vLLM through `kv_connector_module_path`) puts these runtimes on the handles when vLLM registers its KV
caches, and drives `EssDecode` from the connector's `start_load_kv`.

What stays vLLM's: the scheduler-side coordinator (host blocks, prefix publication, spills), the host
pool it addresses (prefill writes and reads it, the connector mirrors every written row into it), the
resident pages and the prefill staging. ESS's Total Memory Pool is a second copy of the decoding
requests' context (docs/integration.md says why and what joining the two needs).

Rows and requests. A request's ESS pool row (and ESS request id) is its stable request-state index
(vLLM's input_batch.idx_mapping of its batch row), not its batch row: vLLM condenses and reorders the
batch between steps and refreshes the mapping in start_load_kv, so ESS positions are batch rows and
`rows[b]` names the state. Decode rows come first in vLLM's batch, at most T tokens each (T = 1 + the
speculative tokens, vLLM's max_decode_query_len); start_step maps each decode token to its batch row, its
staged query and its reserved row, and tokens at or past num_valid_rows are CUDA-graph padding."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from .._errors import InvalidArgument
from ..engine import Engine
from ._shared_pool import SharedHostPool, available_host_memory, check_host_memory

__all__ = ["VLLM_VERSION", "HotView", "latent_buffers", "Scheduled", "scheduled_from_output", "EssDecode",
           "HiSparseRuntime", "SharedHostPool", "available_host_memory", "check_host_memory"]

VLLM_VERSION = "0.33.0"   # the release whose call sites these classes are checked against
ENTRY_BYTES = 656         # vLLM's fp8_ds_mla row (FP8_DS_MLA_ROW_BYTES), ESS's DeepSeek-V3.2 entry
KERNEL_BLOCK = 64         # FlashMLA sparse's KV block size: attention_cache is [-1, 64, 656]


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
    rows = max_num_reqs * rows_per_request + 1
    blocks = -(-rows // KERNEL_BLOCK)
    return [torch.zeros((blocks, KERNEL_BLOCK, ENTRY_BYTES), dtype=torch.uint8, device=device)
            for _ in range(layers)]


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


class EssDecode:
    """The per-worker decode state: one ESS engine for every target-model HiSparse layer, the staging tensors its
    bound step reads (fixed addresses: the step can be captured in vLLM's FULL decode graphs), and the request
    bookkeeping start_step does before each forward.

    read_host(state_index, first_token, count) -> uint8 [layers, count, 656] host tensor: the request's entries
    from vLLM's host pool (where its prefill and every step ESS did not serve left them). synchronize(): waits
    for the work already enqueued (the previous forward's copies out of ESS's host pool), called before a
    step frees host pages that work may still read.

    One host pool per node (attention TP: every rank decodes the same requests): each rank's engine maps the
    same region (SharedHostPool; ess_config.host_memory) and makes the same request calls, so a request has the
    same pages on every rank. The writer (writer=True, one rank) writes the pool, entries and write-backs; the
    others only read it. barrier(): all the ranks' barrier; start_step calls it after every rank has handed out
    this step's pages and again after the writer's copies, and the writer synchronizes its write-back first."""

    def __init__(self, engine: Engine, latent: Sequence[torch.Tensor], max_num_reqs: int,
                 read_host: Callable[[int, int, int], torch.Tensor], device="cpu",
                 synchronize: Callable[[], None] = lambda: None, writer: bool = True,
                 barrier: Optional[Callable[[], None]] = None):
        info = engine.info
        if not info.reserve_newest:
            raise InvalidArgument("EssDecode: the engine needs reserve_newest=True (each step's newest entries are "
                                  "copied into ESS's reserved rows)")
        if not 1 <= max_num_reqs <= info.max_requests:
            raise InvalidArgument(f"EssDecode: max_num_reqs = {max_num_reqs} outside [1, max_requests = "
                                  f"{info.max_requests}]")
        if len(latent) != info.layers:
            raise InvalidArgument(f"EssDecode: {len(latent)} latent buffers for {info.layers} layers")
        self.engine, self.info, self.latent = engine, info, list(latent)
        self.max_num_reqs, self.read_host, self.device = max_num_reqs, read_host, torch.device(device)
        self.synchronize, self.writer, self.barrier = synchronize, bool(writer), barrier
        T, K = info.query_tokens, info.topk
        i32 = dict(dtype=torch.int32, device=self.device)
        self.rows = torch.full((max_num_reqs,), -1, **i32)          # batch row -> state index (ESS row), -1
        self.lengths = torch.zeros((max_num_reqs,), **i32)
        self.topk = torch.full((max_num_reqs, T, K), -1, **i32)
        self.physical = torch.full((max_num_reqs, T, K), -1, **i32)
        self.counts = torch.zeros((max_num_reqs, 2), **i32)
        self.step_binding = engine.bind_step(self.rows, self.topk, self.lengths, self.physical, counts=self.counts)
        self.write_back_binding = engine.bind_write_back(self.rows, self.lengths)
        self.max_swap_rows = max_num_reqs * T
        # Where each decode token's newest entry goes: its request's reserved row t (int64, as vLLM's slot
        # mappings are); the scratch row for padding.
        self.scratch_row = max_num_reqs * info.rows_per_request
        self.slot_mapping = torch.full((self.max_swap_rows,), self.scratch_row, dtype=torch.int64, device=self.device)
        # Per decode token i of the step: its batch row (-1: none), its row of the staged [B x T] queries; per
        # staged query: its token (-1: padding).
        i64 = dict(dtype=torch.int64, device=self.device)
        self.token_row = torch.full((self.max_swap_rows,), -1, **i64)
        self.token_flat = torch.zeros((self.max_swap_rows,), **i64)
        self.query_token = torch.full((self.max_swap_rows,), -1, **i64)
        self.token_index = torch.arange(self.max_swap_rows, **i64)
        self.request_state_indices = torch.full((max_num_reqs,), -1, **i32)
        self.batch = 0              # ESS positions staged for this step
        self.pending = 0            # positions whose newest entries are still to be written back
        self.state_of: Dict[str, int] = {}     # vLLM request id -> state index (ESS request id and row)
        self.length_of: Dict[int, int] = {}    # state index -> tokens in ESS

    # ---- before each forward (the connector's start_load_kv) ----
    def start_step(self, request_ids: Sequence[str], request_state_indices, scheduled: Mapping[str, Scheduled],
                   finished: Iterable[str] = (), preempted: Iterable[str] = (),
                   all_context_pages_resident: bool = False, forward: Optional[Tuple[int, int]] = None):
        """request_ids: the batch's request ids in batch order (input_batch.req_ids); request_state_indices: each
        batch row's state index (input_batch.idx_mapping); scheduled: this step's requests; finished / preempted:
        the scheduler output's finished_req_ids / preempted_req_ids; all_context_pages_resident: the connector
        metadata's; forward: the forward's (num_decodes, num_decode_tokens) when its attention metadata is known.

        Decode rows are the batch's leading rows of at most T tokens (vLLM's split: decodes first, up to
        max_decode_query_len tokens each); a row of n < T tokens is served with its n queries as the last n of
        its T (the others padding) and its T - n older tokens copied into the reserved rows beside its n new
        ones. When every context page is resident and the batch has other rows, vLLM's index group resolves
        the decode tokens over resident pages instead of calling swap_in (index_group.py
        convert_logical_to_physical_topk): ESS serves no row then and catches its requests up from vLLM's host
        pool at their next ESS step.

        The batch (and `forward` against it) is checked before anything changes; an engine refusal part-way
        (ESS's host pool full) raises with the requests before it admitted."""
        T = self.info.query_tokens
        states = [int(s) for s in torch.as_tensor(request_state_indices).reshape(-1).tolist()]
        if len(states) < len(request_ids):
            raise InvalidArgument(f"start_step: {len(request_ids)} batch requests but {len(states)} state indices")
        if len(request_ids) > self.max_num_reqs:
            raise InvalidArgument(f"start_step: {len(request_ids)} batch requests exceed max_num_seqs = "
                                  f"{self.max_num_reqs}")
        finished, preempted = set(finished), set(preempted)
        seen = {}
        for b, rid in enumerate(request_ids):
            s = states[b]
            if not 0 <= s < self.max_num_reqs:
                raise InvalidArgument(f"start_step: batch row {b} (request {rid!r}): state index {s} outside "
                                      f"[0, {self.max_num_reqs})")
            if s in seen:
                raise InvalidArgument(f"start_step: state index {s} is batch rows {seen[s]} and {b}")
            seen[s] = b
            if rid not in scheduled:
                raise InvalidArgument(f"start_step: batch row {b}: request {rid!r} is not scheduled")
        decodes = 0
        while decodes < len(request_ids) and 1 <= scheduled[request_ids[decodes]][1] <= T:
            decodes += 1
        swap_path = not (all_context_pages_resident and decodes < len(request_ids))
        positions = []     # (batch row, request id, state, num_computed_tokens, tokens this step)
        for b in range(decodes if swap_path else 0):
            rid, s = request_ids[b], states[b]
            c, n = scheduled[rid]
            if c + n > self.info.max_context:
                raise InvalidArgument(f"start_step: request {rid!r} reaches {c + n} tokens; the engine holds "
                                      f"max_context = {self.info.max_context}")
            if c + n < T:
                raise InvalidArgument(f"start_step: request {rid!r} decodes with {c + n} tokens, fewer than T = {T}: "
                                      "ESS's step and write-back (reserve_newest) serve a request of at least T tokens")
            positions.append((b, rid, s, c, n))
        if forward is not None and swap_path and tuple(forward) != (len(positions), sum(p[4] for p in positions)):
            raise InvalidArgument(f"start_step: the forward has {forward[0]} decode rows of {forward[1]} tokens; "
                                  f"the batch's leading rows of at most T = {T} tokens are {len(positions)} of "
                                  f"{sum(p[4] for p in positions)}")
        # The previous step's newest entries go to the host pool first (a finished request's too: harmless); with
        # a shared pool they must have landed before the barrier below lets the other ranks on.
        self.flush()
        if self.barrier is not None and self.writer:
            self.synchronize()
        if any(rid in finished or rid in preempted for rid in self.state_of) or \
                any((rid in self.state_of and (self.state_of[rid] != s or c < self.length_of[s] - T)) or
                    (rid not in self.state_of and s in self.length_of) for _, rid, s, c, _ in positions):
            self.synchronize()   # pages are freed below; the previous forward may still be reading them
        for rid in list(self.state_of):
            if rid in finished or rid in preempted:
                self._release(rid)
        copies = []   # (state, first token, count) to copy from vLLM's host pool
        for b, rid, s, c, n in positions:
            if self.state_of.get(rid, s) != s:     # vLLM gave the request another state index
                self._release(rid)
            if rid not in self.state_of and s in self.length_of:
                self._release_state(s)              # the state's previous request left without notice
            if rid in self.state_of:
                L = self.length_of[s]
                if c < L - T:                       # vLLM went back further than a step's drafts: start over
                    self._release(rid)
                elif c < L:                         # drafts of the last verify step that were not accepted
                    self.engine.truncate(s, c)
                    self.length_of[s] = c
            if rid not in self.state_of:
                self.engine.admit(s, c if c else n, s)
                self.state_of[rid], self.length_of[s] = s, c if c else n
                copies.append((s, 0, c))
            elif c > self.length_of[s]:             # tokens of steps ESS did not serve
                L = self.length_of[s]
                self.engine.extend(s, c - L)
                self.length_of[s] = c
                copies.append((s, L, c - L))
            if c:
                self.engine.extend(s, n)
            self.length_of[s] = c + n
        # Shared pool: every rank has handed out (and zeroed) this step's pages before the writer writes, and
        # the writer's entries are in before any rank's forward reads them.
        if self.barrier is not None:
            self.barrier()
        if self.writer:
            for s, first, count in copies:
                self._copy_from_host(s, first, count)
        if self.barrier is not None and copies:
            self.barrier()
        self._stage(request_ids, states, positions)

    def _stage(self, request_ids, states, positions):
        """The step's rows, lengths and per-token maps, and the older tokens of short rows in the reserved rows."""
        T, rpr, S = self.info.query_tokens, self.info.rows_per_request, self.info.slots
        rows = torch.full((self.max_num_reqs,), -1, dtype=torch.int32)
        lengths = torch.zeros((self.max_num_reqs,), dtype=torch.int32)
        token_row = torch.full((self.max_swap_rows,), -1, dtype=torch.int64)
        token_flat = torch.zeros((self.max_swap_rows,), dtype=torch.int64)
        token_slot = torch.full((self.max_swap_rows,), self.scratch_row, dtype=torch.int64)
        query_token = torch.full((self.max_swap_rows,), -1, dtype=torch.int64)
        if any(n < T for *_, n in positions):
            self.synchronize()   # the write-back just issued holds some of the older tokens read below
        i = 0
        for b, _, s, c, n in positions:
            rows[b], lengths[b] = s, c + n
            for t in range(n):
                q = T - n + t                       # the n queries are the last n of the row's T
                token_row[i], token_flat[i], token_slot[i] = b, b * T + q, s * rpr + S + q
                query_token[b * T + q] = i
                i += 1
            for q in range(T - n):                  # the row's older tokens among its T newest
                position = c + n - T + q
                if position >= 0:
                    for layer in range(self.info.layers):
                        entry = self.engine.read_entries(s, layer, position, torch.empty((1, ENTRY_BYTES),
                                                                                         dtype=torch.uint8))
                        self.latent[layer].view(-1, ENTRY_BYTES)[s * rpr + S + q].copy_(entry[0])
        state_rows = torch.full((self.max_num_reqs,), -1, dtype=torch.int32)
        state_rows[: len(request_ids)] = torch.tensor(states[: len(request_ids)], dtype=torch.int32)
        for staged, value in ((self.rows, rows), (self.lengths, lengths), (self.token_row, token_row),
                              (self.token_flat, token_flat), (self.slot_mapping, token_slot),
                              (self.query_token, query_token), (self.request_state_indices, state_rows)):
            staged.copy_(value)
        self.batch = len(positions)
        self.pending = len(positions)

    def flush(self):
        """Writes the last step's newest entries back to ESS's host pool (every layer); a reader rank of a shared
        pool leaves that to the writer."""
        if self.pending and self.writer:
            for layer in range(self.info.layers):
                self.write_back_binding.write_back(layer, self.pending)
        self.pending = 0

    def finish(self, request_id: str):
        """Forgets a request now (a finished one is otherwise released at the next start_step)."""
        if request_id not in self.state_of:
            raise InvalidArgument(f"finish: request {request_id!r} is not in ESS")
        self.flush()
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
        if s in self.length_of:
            self.engine.release(s)
            del self.length_of[s]
        for rid, state in list(self.state_of.items()):
            if state == s:
                del self.state_of[rid]

    def _copy_from_host(self, s, first, count):
        if count == 0:
            return
        entries = self.read_host(s, first, count)
        if tuple(entries.shape) != (self.info.layers, count, self.info.entry_bytes):
            raise InvalidArgument(f"read_host({s}, {first}, {count}) gave shape {tuple(entries.shape)}; "
                                  f"[{self.info.layers}, {count}, {self.info.entry_bytes}] expected")
        for layer in range(self.info.layers):
            self.engine.write_entries(s, layer, first, entries[layer].contiguous())


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
        latent = decode.latent[layer]
        self.decode, self.layer, self.handle, self.upstream = decode, layer, handle, upstream
        self._hot = HotView(latent, latent.view(-1, KERNEL_BLOCK, ENTRY_BYTES), KERNEL_BLOCK, KERNEL_BLOCK)
        self._flat = latent.view(-1, ENTRY_BYTES)
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
        in the batch), whose rows are in upstream's hot slab."""
        h = self.handle
        if self.upstream is not None and h.all_context_pages_resident and h.num_decode_tokens < h.num_actual_tokens:
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
        """Prefill context from vLLM's host pool (index_group.py stage_prefill_rows): vLLM's own path."""
        if self.upstream is None:
            raise InvalidArgument("gather_prefill_cache: prefill reads vLLM's host pool through vLLM's runtime; "
                                  "this runtime has none")
        return self.upstream.gather_prefill_cache(kv_cache, plan, resident_cache=resident_cache)

    def reset_hot_state(self) -> None:
        self.decode.reset()
        if self.upstream is not None:
            self.upstream.reset_hot_state()

    # ---- the decode swap ----
    def swap_in(self, *, resident, req_id_per_token: torch.Tensor, block_table, logical_topk_indices: torch.Tensor,
                block_size: int, num_valid_rows: torch.Tensor, return_valid_counts: bool = False,
                attention_indices_out: Optional[torch.Tensor] = None,
                valid_counts_out: Optional[torch.Tensor] = None):
        """HiSparseCacheHandle.swap_in's call: logical_topk_indices [n, K] (-1 = padding) of the step's first n
        decode tokens -> int32 [n, K] rows of `hot.attention_cache` (-1 for padding and for rows at or past
        num_valid_rows), with return_valid_counts also int32 [n] counts of rows >= 0.

        The newest entries the model just wrote at resident.slot_mapping (vLLM's resident cache) are copied into
        the request's reserved rows first. block_table (vLLM's host block table) and block_size describe vLLM's
        host pool: ESS reads its own. Everything is checked before anything runs; a refused call serves nothing."""
        d = self.decode
        T, K = d.info.query_tokens, d.info.topk
        n = int(logical_topk_indices.shape[0])
        if logical_topk_indices.dim() != 2 or logical_topk_indices.shape[1] != K:
            raise InvalidArgument(f"swap_in (layer {self.layer}): logical_topk_indices has shape "
                                  f"{tuple(logical_topk_indices.shape)}; [n, K = {K}] expected")
        if not 1 <= n <= min(d.max_swap_rows, req_id_per_token.shape[0]):
            raise InvalidArgument(f"swap_in (layer {self.layer}): {n} token rows; from 1 to max_swap_rows = "
                                  f"{d.max_swap_rows} and req_id_per_token's {req_id_per_token.shape[0]}")
        if block_size != KERNEL_BLOCK:
            raise InvalidArgument(f"swap_in (layer {self.layer}): block_size = {block_size}; ESS's attention cache "
                                  f"has blocks of {KERNEL_BLOCK} rows")
        for name, out, shape in (("attention_indices_out", attention_indices_out, (n, K)),
                                 ("valid_counts_out", valid_counts_out, (n,))):
            if out is not None and (tuple(out.shape) != shape or out.dtype != torch.int32):
                raise InvalidArgument(f"swap_in (layer {self.layer}): {name} is {out.dtype} {tuple(out.shape)}; "
                                      f"int32 {shape} expected")
        if self.layers_served:
            raise InvalidArgument(f"swap_in (layer {self.layer}): called twice in one forward (begin_forward "
                                  "starts one)")
        B = d.max_num_reqs   # every staged row (start_step's maps say which tokens fill which): a fixed shape
        # Token i is valid when start_step staged it for batch row req_id_per_token[i] and it is before
        # num_valid_rows (the rest is CUDA-graph padding).
        i = d.token_index[:n]
        row = d.token_row[:n]
        valid = (i < num_valid_rows.reshape(-1)[:1].to(torch.int64)) & (row >= 0) & \
            (req_id_per_token[:n].to(torch.int64) == row)
        # The newest entries the model just wrote into the reserved rows (padding: into the scratch row).
        src_rows = resident.slot_mapping[:n].to(torch.int64)
        use = valid & (src_rows >= 0)
        src_flat = resident.view.cache.reshape(-1, ENTRY_BYTES)
        dst = torch.where(use, d.slot_mapping[:n], torch.full_like(i, d.scratch_row))
        self._flat.index_copy_(0, dst, src_flat.index_select(0, torch.where(use, src_rows, torch.zeros_like(i))))
        # The step's queries, staged [B, T, K]: staged query j is token query_token[j] (-1: padding).
        source = d.query_token
        at = source.clamp(0, n - 1)
        take = (source >= 0) & (source < n) & valid.index_select(0, at)
        picked = logical_topk_indices.to(torch.int32).index_select(0, at)
        d.topk.view(B * T, K).copy_(torch.where(take.unsqueeze(1), picked, torch.full_like(picked, -1)))
        d.step_binding.step(self.layer, B)
        physical = d.physical.view(B * T, K).index_select(0, d.token_flat[:n])
        physical = torch.where(valid.unsqueeze(1), physical, torch.full_like(physical, -1))
        self.layers_served += 1
        self.steps_served += 1
        out = physical if attention_indices_out is None else attention_indices_out.copy_(physical)
        if not return_valid_counts:
            return out
        counts = (physical >= 0).sum(dim=1).to(torch.int32)
        return out, (counts if valid_counts_out is None else valid_counts_out.copy_(counts))
