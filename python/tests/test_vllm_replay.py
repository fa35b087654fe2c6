"""vLLM 0.33.0's HiSparse decode replayed over ESS's runtime on CPU torch, in upstream's order, each step citing
the upstream function it stands for (vllm/...). The handles and the index group are upstream's own classes,
compiled from the pinned source (vllm_upstream.py), so every call they make on ESS's runtime is vLLM's.

  schedule     v1/core/sched/scheduler.py Scheduler.schedule -> SchedulerOutput (scheduled_new_reqs,
               scheduled_cached_reqs, num_scheduled_tokens, finished_req_ids, preempted_req_ids); the connector
               metadata's all_context_pages_resident (kv_connector/v1/hisparse/connector.py build_connector_meta)
  batch        v1/worker/gpu/model_runner.py: the input batch, decodes first, condensed and reordered between
               steps; idx_mapping = each batch row's request-state index
  load         v1/worker/gpu/kv_connector.py ActiveKVConnector.pre_forward -> _build_load_kwargs ->
               HiSparseConnector.start_load_kv(request_state_indices=idx_mapping, request_ids=req_ids, ...):
               upstream's worker start_step + prepare_forward (HiSparseCacheHandle.prepare_group_for_batch ->
               _prepare_for_batch -> runtime.begin_forward()), then ESS's EssDecode.start_step
               (ess/integrations/vllm_connector.py)
  blocks       v1/core/sched/scheduler.py allocates each scheduled token's host block (prefix-cache hits share a
               request's full blocks; a preempted or finished request's blocks go back and are handed out again);
               v1/worker/gpu/block_table.py BlockTables.gather_block_tables fills the forward's table per batch
               row (row b = the blocks of batch row b's state), the handles' source_block_table
  kv write     models/deepseek_v32/attention.py -> model_executor/layers/attention/mla_attention.py
               MLAAttention.update_kv_cache: HiSparseCacheHandle.write_target -> do_kv_cache_update at the
               resident slot mapping; after the forward the connector worker's row mirror has copied the rows into
               vLLM's host pool (kv_connector/v1/hisparse/worker.py _enqueue_row_dma, eager_host_mirror), which
               ESS's engine sits on (foreign pages: one copy of the context in host memory)
  swap         v1/attention/backends/mla/flashmla_sparse.py _forward_bf16_kv ->
               HiSparseMLAIndexGroup.convert_logical_to_physical_topk(layer, topk[:num_decode_tokens], metadata,
               block_stride_rows=None, return_valid_counts=True) -> HiSparseCacheHandle.swap_in -> runtime.swap_in;
               FlashMLA reads index_group.physical_kv_cache(layer) at the rows returned

  split        model_executor/layers/attention/sparse_mla_attention.py build: the forward's decode split
               (v1/attention/backends/utils.py split_decodes_and_prefills, upstream's own) and seq_lens, padded
               under a FULL graph (v1/worker/gpu/model_states/default.py prepare_attn), which start_load_kv gets
               as attn_metadata or through the forward context

Checks: every decode token's rows against the independent LRU model (lru_model.EngineModel, a request's row is
its state index) and every byte FlashMLA would read against the full cache, through condense and reorder,
FULL CUDA graphs with padded requests, MTP verify steps with rejected drafts (T > 1) under async scheduling,
rows of fewer than T tokens, requests on a shared prefix's blocks, steps vLLM resolves over resident pages,
preemption with its blocks handed to another request, and state reuse. Mutation tests show the replay fails on
a batch-row-as-state mapping, on the host block table read by state instead of batch row, on a second host
pool, on a layer counter shared across layers, on lengths from the scheduler's counts and on the batch's own
decode split."""
import types

import numpy as np
import pytest
import torch

import ess
from ess.integrations import vllm as adapter, vllm_indexer_split
from lru_model import EngineModel
from mock_engine import ENTRY, check_rows
from recording_device import RecordingDevice
import vllm_upstream

LAYERS, K, CTX, STATES, BLOCK = 2, 16, 384, 5, 64
HOST_BLOCKS = STATES * (CTX // BLOCK + 1) + 4   # vLLM's host pool: every state's longest request, and spare
HOST_BYTES = -(-LAYERS * HOST_BLOCKS * BLOCK * ENTRY // 4096) * 4096   # padded to 4 KiB, as vLLM registers it
UP = vllm_upstream.load()
HOT_IN_PLACE = 1 << 40   # check_regions: a row read in place, marked apart from the model's rows
# vLLM's residency table and state indices are int32; torch 1.x (Debian's) indexes with int64 only.
INDEX = torch.int64 if torch.__version__ < "2" else torch.int32


def host_region(buffer=None):
    """vLLM's host pool: one 4 KiB-aligned allocation (allocate_pinned_host_pool's `registered`, or the node's
    shared region when `buffer` is given) holding every layer's host cache, the layers in reverse order."""
    if buffer is None:
        raw = torch.zeros(HOST_BYTES + 4096, dtype=torch.uint8)
        start = (-raw.data_ptr()) % 4096
        backing = raw[start:start + HOST_BYTES]
    else:
        backing = torch.frombuffer(buffer, dtype=torch.uint8)[:HOST_BYTES]
    per_layer = HOST_BLOCKS * BLOCK * ENTRY
    host = [backing[(LAYERS - 1 - l) * per_layer:(LAYERS - l) * per_layer].view(HOST_BLOCKS * BLOCK, ENTRY)
            for l in range(LAYERS)]
    return backing, host


class VllmWorld:
    """The model and vLLM's KV: each request's full cache (what attention reads with everything on the GPU),
    vLLM's host pool (per layer, each request's host blocks where the block pool put them) with its block tables,
    and the resident cache. mirror=False: another rank's world, whose host pool rank 0 writes."""

    def __init__(self, seed, T, region=None, mirror=True, slab_blocks=None):
        self.rng = np.random.default_rng(seed)
        self.T, self.K, self.mirror = T, K, mirror
        self.full, self.length, self.prompt = {}, {}, {}
        self.backing, self.host = host_region(region)
        self.free_blocks = [int(b) for b in self.rng.permutation(HOST_BLOCKS)]   # handed out from the end
        self.block_refs = {}
        self.blocks = {}      # request -> its host blocks (v1/core/kv_cache_manager.py's block table)
        # The resident cache as vllm/v1/hisparse/runtime.py PagedCacheView.bind views it: a slab whose blocks
        # interleave another KV group's (vllm/v1/hisparse/layout.py: the block stride spans every group), so the
        # layer's view is strided; the other group holds bytes no decode may read.
        blocks = slab_blocks or STATES * CTX // BLOCK + 2
        self.resident_slabs = [torch.from_numpy(self.rng.integers(0, 256, blocks * 2 * BLOCK * ENTRY, dtype=np.uint8))
                               for _ in range(LAYERS)]
        self.resident = [torch.as_strided(slab, (blocks, BLOCK, ENTRY), (2 * BLOCK * ENTRY, ENTRY, 1), BLOCK * ENTRY)
                         for slab in self.resident_slabs]
        # The forward's host block table (the handles' source_block_table): one row per batch row.
        self.source_block_table = torch.zeros((STATES, CTX // BLOCK + 1), dtype=torch.int32)
        # Hot regions (use_slab): the slab's blocks as vLLM's GPU block pool hands them out (block 0 the null
        # block), each request's resident pages (None: lost, read from the host) and hot region, and the residency
        # table the worker keeps from the scheduler's updates (v1/hisparse/binding.py: [resident groups, state rows,
        # pages], block 0 for a page read from the host).
        self.slab = False

    def use_slab(self, region_blocks):
        """One resident group and one hot group per layer (v1/hisparse/layout.py packs as many layers in a group as
        one indexer page holds: one, at these sizes), their blocks from one GPU block pool (block 0 the null block)."""
        self.slab, self.region_blocks = True, region_blocks
        blocks = self.resident[0].shape[0]
        self.gpu_free = [int(b) for b in self.rng.permutation(np.arange(1, blocks))]
        self.resident_pages, self.hot, self.synced = {}, {}, {}   # rid -> per group: pages / hot region / sent
        self.hot_given = set()   # requests whose hot regions the scheduler output carried
        self.residency = torch.zeros((LAYERS, STATES, CTX // BLOCK + 1), dtype=INDEX)

    def ensure_resident(self, rid, tokens):
        """v1/core: each resident group's blocks for the request's first `tokens` tokens (a new page each 64)."""
        for pages in self.resident_pages.setdefault(rid, [[] for _ in range(LAYERS)]):
            while len(pages) * BLOCK < tokens:
                pages.append(self.gpu_free.pop())

    def slot(self, rid, position, group):
        """The resident slot mapping of a token in a group (block_tables.slot_mappings of that resident group)."""
        return self.resident_pages[rid][group][position // BLOCK] * BLOCK + position % BLOCK

    def go_hot(self, rid):
        """coordinator.py update_residency -> HiSparseHotManager.require_hot (every hot group's): the request gets its
        hot regions (all their blocks at once); its clean pages are unpinned and, here at once, reused
        (coordinator.py _lose_page: read from the host from now on), except the ACTIVE_TAIL_PAGES
        (v1/hisparse/types.py: 2) still being written. A lost page's block goes back to the pool, is scribbled on and
        handed out again first."""
        self.hot[rid] = [[self.gpu_free.pop() for _ in range(self.region_blocks)] for _ in range(LAYERS)]
        self.unpin_clean(rid)

    def unpin_clean(self, rid):
        """coordinator.py update_residency of a request with a hot region (every step): its pages but the last
        ACTIVE_TAIL_PAGES are unpinned and, here at once, reused (lost, scribbled on, handed out again first)."""
        for group, pages in enumerate(self.resident_pages[rid]):
            for page in range(max(0, len(pages) - adapter.ACTIVE_TAIL_PAGES)):
                if pages[page] is None:
                    continue
                block, pages[page] = pages[page], None
                self.resident[group][block] = torch.from_numpy(self.rng.integers(0, 256, (BLOCK, ENTRY),
                                                                                 dtype=np.uint8))
                self.gpu_free.append(block)

    def free_slab(self, rid):
        blocks = [b for region in self.hot.pop(rid, []) for b in region]
        blocks += [b for pages in self.resident_pages.pop(rid, []) for b in pages if b is not None]
        self.gpu_free.extend(blocks)
        self.synced.pop(rid, None)
        self.hot_given.discard(rid)

    def residency_updates(self, batch):
        """coordinator.py take_residency_updates: each scheduled request's pages whose block changed since it was
        last sent (SparseKVResidencyUpdate: pages, block ids per resident group; the null block for a lost page)."""
        updates = {}
        for rid in batch:
            groups = self.resident_pages.get(rid, [[] for _ in range(LAYERS)])
            now = [tuple(pages[p] or 0 for pages in groups) for p in range(len(groups[0]))]
            sent = self.synced.setdefault(rid, {})
            changed = [p for p, blocks in enumerate(now) if sent.get(p) != blocks]
            if changed:
                updates[rid] = types.SimpleNamespace(
                    pages=changed, block_ids=tuple([now[p][g] for p in changed] for g in range(LAYERS)))
                sent.update({p: now[p] for p in changed})
        return updates

    def hot_output(self, batch, fresh):
        """The scheduler output's blocks of each hot group (source_blocks_from_output): a new request's list, a
        cached one's region once, when it is allocated."""
        out = [{} for _ in range(LAYERS)]
        for rid in batch:
            for g in range(LAYERS):
                if rid in fresh:
                    out[g][rid] = (list(self.hot[rid][g]) if rid in self.hot else [], True)
                elif rid in self.hot and rid not in self.hot_given:
                    out[g][rid] = (list(self.hot[rid][g]), False)
            self.hot_given.discard(rid)
            if rid in self.hot:
                self.hot_given.add(rid)
        return out

    def new_request(self, rid, prompt, prefix_of=None, prefix=0):
        """prefix_of, prefix: the request's first `prefix` tokens (whole blocks) are request prefix_of's, a
        prefix-cache hit: their blocks are shared and nothing is recomputed."""
        self.full[rid] = self.rng.integers(0, 256, (LAYERS, CTX, ENTRY), dtype=np.uint8)
        self.length[rid], self.prompt[rid], self.blocks[rid] = 0, prompt, []
        if prefix_of is not None:
            assert prefix % BLOCK == 0
            self.full[rid][:, :prefix] = self.full[prefix_of][:, :prefix]
            for block in self.blocks[prefix_of][:prefix // BLOCK]:
                self.blocks[rid].append(block)
                self.block_refs[block] += 1
            self.length[rid] = prefix

    def allocate(self, rid, tokens):
        """The scheduler's blocks for the request's first `tokens` tokens (kv_cache_manager allocate_slots)."""
        while len(self.blocks[rid]) * BLOCK < tokens:
            block = self.free_blocks.pop()
            self.block_refs[block] = 1
            self.blocks[rid].append(block)

    def free(self, rid):
        """A finished or preempted request's blocks go back to the pool (freed last, handed out first), and with
        hot regions its GPU blocks."""
        if self.slab:
            self.free_slab(rid)
        for block in reversed(self.blocks.pop(rid, [])):
            self.block_refs[block] -= 1
            if self.block_refs[block] == 0:
                self.free_blocks.append(block)
        self.blocks[rid] = []

    def gather(self, batch):
        """block_table.py gather_block_tables: row b of the forward's table holds batch row b's blocks."""
        self.source_block_table.zero_()
        for b, rid in enumerate(batch):
            blocks = self.blocks[rid]
            self.source_block_table[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    def computed(self, rid, first, count):
        """The model computed tokens [first, first + count)."""
        self.length[rid] = first + count

    def mirrored(self, rid, first, count):
        """The row mirror put tokens [first, first + count) in vLLM's host pool (after the forward)."""
        if not self.mirror:
            return
        tokens = np.arange(first, first + count)
        rows = np.array(self.blocks[rid], dtype=np.int64)[tokens // BLOCK] * BLOCK + tokens % BLOCK
        for layer in range(LAYERS):
            self.host[layer][torch.from_numpy(rows)] = torch.from_numpy(self.full[rid][layer, first:first + count])

    def check_host_pool(self, requests):
        """vLLM's host pool holds each request's computed tokens as the full cache has them: what its prefill
        staging (index_group.py stage_prefill_rows, gather_fp8_prefill) reads for a chunk or a resumed request,
        and what ESS's decode reads; ESS writes none of it."""
        for rid in requests:
            tokens = np.arange(self.length[rid])
            rows = np.array(self.blocks[rid], dtype=np.int64)[tokens // BLOCK] * BLOCK + tokens % BLOCK
            for layer in range(LAYERS):
                np.testing.assert_array_equal(self.host[layer][torch.from_numpy(rows)].numpy(),
                                              self.full[rid][layer, :self.length[rid]],
                                              err_msg=f"request {rid} layer {layer}: vLLM's host pool")

    def redraw_after(self, rid, position):
        """The drafts past `position` were rejected: the tokens decoded there next are other tokens."""
        self.full[rid][:, position:] = self.rng.integers(0, 256, self.full[rid][:, position:].shape, dtype=np.uint8)

    def query_rows(self, rid, n):
        """T rows of up to K distinct ids in [0, n), the newest often among them, a -1 tail."""
        T = self.T
        rows = np.full((T, K), -1, np.int64)
        for t in range(T):
            k = min(int(self.rng.integers(K // 2, K + 1)), n)
            ids = self.rng.choice(n, k, replace=False)
            if self.rng.random() < 0.5:
                ids = np.unique(np.concatenate([np.arange(max(0, n - T), n), ids]))[:k]
                self.rng.shuffle(ids)
            rows[t, :k] = ids
        return rows


class Replay:
    def __init__(self, T, slots, seed=1, region=None, mirror=True, barrier=None, uniform=True,
                 async_scheduling=True, counts_run_ahead=True, blocks_from_output=False, hot_regions=0,
                 slab_blocks=64, adaptive=False, overlap=None):
        """region, mirror, barrier: a rank of a node whose ranks share vLLM's host pool (a shared-memory region
        rank 0's mirror writes, every rank's ESS reads); barrier() runs at the start of every step, after the
        previous step's mirror. uniform: the backend's require_uniform_decodes (FlashMLA sparse's: True).
        async_scheduling: vLLM's default (config/vllm.py), the scheduler's counts a step behind on rejections.
        counts_run_ahead: EssDecode's (the connector sets it under async scheduling with speculative decoding).
        blocks_from_output: ESS is given each step's new host blocks as the scheduler output has them (the
        connector's source_blocks_from_output: a new request's whole list, a cached one's new blocks), not the
        forward's table. hot_regions: ESS's rows in vLLM's hot regions of this many blocks (slots: the region's rows
        less T), in the resident slab (slab_blocks vLLM blocks); requests without one read in place through the
        residency table. adaptive: vLLM's adaptive verification (step's `admitted`). overlap: every layer's schedule
        (da: the swap armed and its rows taken in two parts, as vllm_overlap.py's FlashMLA wrapper takes them; dba:
        also the batch's first half swapped from the indexer first, as vllm_indexer_split.py swaps it)."""
        self.T, self.barrier, self.uniform, self.async_scheduling = T, barrier, uniform, async_scheduling
        self.hot_regions = hot_regions
        self.rejected = {}   # request -> drafts its last verify step rejected, which the scheduler still counts
        self.blocks_from_output, self.blocks_given = blocks_from_output, {}
        self.world = VllmWorld(seed, T, region, mirror, slab_blocks=slab_blocks if hot_regions else None)
        rows_per_request = slots + T
        # The attention view of each layer's slab (PagedCacheView.bind's attention_cache: the slab's rows from the
        # layer's first block on, a vLLM block every 2 x 64 rows).
        self.attention = [slab[BLOCK * ENTRY:][: (slab.shape[0] // ENTRY - BLOCK) // BLOCK * BLOCK * ENTRY]
                          .view(-1, BLOCK, ENTRY) for slab in self.world.resident_slabs]
        if hot_regions:
            assert rows_per_request == hot_regions * BLOCK, "ESS's rows fill the hot region"
            self.world.use_slab(hot_regions)
            latent = self.attention
        else:
            latent = adapter.latent_buffers(LAYERS, STATES, rows_per_request)
        # vllm_connector.py EssConnectorWorker.register_kv_caches: ESS's engine on vLLM's host pool.
        pages = adapter.host_pool_layout(self.world.backing, self.world.host)
        self.engine = ess.Engine(layers=LAYERS, max_requests=STATES, max_context=CTX, topk=K, query_tokens=T,
                                 slots=slots, reserve_newest=True, latent=latent,
                                 host_memory=self.world.backing.numpy(), foreign_pages=pages,
                                 region_blocks=hot_regions, region_group=list(range(LAYERS)) if hot_regions else None)
        self.decode = adapter.EssDecode(self.engine, latent, STATES, self.world.source_block_table,
                                        counts_run_ahead=counts_run_ahead,
                                        attention_block_stride=2 * BLOCK if hot_regions else BLOCK,
                                        region_group=list(range(LAYERS)) if hot_regions else None,
                                        adaptive_verification=adaptive,
                                        overlap=None if overlap is None else [overlap] * LAYERS)
        self.model_region = {}   # hot regions: request -> the region the model's LRU started on
        # vLLM's null block (block 0 of each layer's slab), which ESS may rewrite only with its own bytes.
        self.null_block = [slab[0].clone() for slab in self.world.resident] if hot_regions else None
        self.straddles = 0   # steps whose decode split cut a row's tokens (adaptive verification's device split)
        self.rows_checked = {"hot": 0, "in place": 0}
        self.fetched_checked = 0   # DA: fetched rows checked against the model's misses
        self.dba_splits = self.dba_as_da = 0   # DBA: layers whose swap the indexer split, and those it did not
        self.hot_ids_in_place = 0  # ids of rows with a hot region read in place (their pages still resident)   # hot regions: decode row-layers checked of each kind
        self.model = EngineModel(LAYERS, slots, T, reserve_newest=True)
        self.model_rows = {}   # request -> state the model admitted it at
        # vllm/v1/hisparse/binding.py bind_hisparse_kv_caches: each layer's handle bound to the resident cache
        # and its slot mapping (block_tables.slot_mappings, int64), its source block table the forward's host
        # block table; the connector then puts ESS's runtime on it.
        # (One per layer: with hot regions each layer is a resident group of its own, with its own slot mapping.)
        self.slot_mappings = [torch.full((1024,), -1, dtype=torch.int64) for _ in range(LAYERS)]
        self.handles = []
        for layer in range(LAYERS):
            handle = UP["HiSparseCacheHandle"](None)
            # HiSparseCacheHandle.bind_cache's result (PagedCacheView.bind's, built here as it builds it: bind
            # reads dtype.itemsize, which torch 1.13 lacks): the strided resident view, the attention view of the
            # whole slab from the layer's first block (block stride 2 x 64 rows), its block table and slot mapping.
            resident = self.world.resident[layer]
            handle.view = UP["PagedCacheView"](resident, self.attention[layer], BLOCK, 2 * BLOCK)
            # binding.py: the handle's block table is the residency table of its resident group (by state row).
            handle.block_table = self.world.residency[layer] if hot_regions else torch.zeros((STATES, 8), dtype=torch.int32)
            handle.slot_mapping = self.slot_mappings[layer if hot_regions else 0]
            handle.source_block_table = self.world.source_block_table
            handle.runtime = adapter.HiSparseRuntime(self.decode, layer, handle)
            self.handles.append(handle)
        # v1/attention/backends/mla/index_group.py SparseMLAIndexGroupBuilder.register_layer: one index group
        # (the layers share the indexer's result), its caches the handles.
        topk_buffer = torch.full((STATES * T, K), -1, dtype=torch.int32)
        self.group = UP["HiSparseMLAIndexGroup"](
            logical_topk_indices=topk_buffer, physical_topk_indices=torch.empty_like(topk_buffer),
            valid_topk_counts=torch.empty(STATES * T + 1, dtype=torch.int32), side_stream=None,
            logical_topk_ready=None, physical_topk_ready=None, has_indexer=True, caches=self.handles)
        for handle in self.handles:
            handle.index_group_caches = self.handles
        self.resident_next = 0
        self.forwards_served = 0
        self.worker_requests = set()   # the requests the worker has (v1/worker/gpu/states.py add_requests)
        self.handed = {}   # request -> per step it was served: ([layers, T, K] ids the model selected, length)

    def no_forward(self, finished=(), preempted=()):
        """A step with no tokens scheduled (v1/core/sched/scheduler.py schedule: a request preempted itself for
        blocks and nothing else runs): model_runner.py execute_model frees the finished and preempted requests'
        states (finish_requests) and returns kv_connector.no_forward, whose pre_forward brings start_load_kv no
        request_ids; only get_finished(finished_req_ids) reaches the connector (ActiveKVConnector.post_forward)."""
        for rid in tuple(finished) + tuple(preempted):
            if rid in self.model_rows:
                self.model.release(self.model_rows.pop(rid))
            self.model_region.pop(rid, None)
            self.world.free(rid)
            self.worker_requests.discard(rid)
        self.decode.note_finished(finished)

    # ---- one step ----
    def step(self, batch, states, scheduled, finished=(), preempted=(), all_resident=False, pad_reqs=None,
             accepted=None, new_blocks=None, admitted=None):
        """batch: request ids in batch order (decodes first); states: their request-state indices; scheduled:
        {rid: (tokens computed before this step, tokens scheduled)}; pad_reqs: a FULL CUDA graph captured for this
        many requests (a uniform decode batch only); accepted: {rid: tokens of its verify step kept}; admitted:
        adaptive verification, {rid: tokens the model runner keeps of the scheduled ones} (adaptive_admitted)."""
        T, w = self.T, self.world
        self.full_graph = pad_reqs is not None
        if self.barrier is not None:
            self.barrier()
        for rid in tuple(finished) + tuple(preempted):
            if rid in self.model_rows:
                self.model.release(self.model_rows.pop(rid))
            self.model_region.pop(rid, None)
            w.free(rid)
            self.worker_requests.discard(rid)
        # scheduled_new_reqs: the requests new to the worker (first scheduled, or resumed after preemption under
        # model runner v2), their blocks handed out afresh (the connector's fresh_from_output).
        fresh = [rid for rid in batch if rid not in self.worker_requests]
        self.worker_requests.update(batch)
        # The scheduler's host blocks for this step's tokens, then the forward's table per batch row.
        for rid in batch:
            w.allocate(rid, sum(scheduled[rid]) + self.rejected.get(rid, 0))
        w.gather(batch)
        if self.blocks_from_output and new_blocks is None:   # v1/core/sched/output.py: block_ids / new_block_ids
            new_blocks = {}
            for rid in tuple(finished) + tuple(preempted):
                self.blocks_given.pop(rid, None)
            for rid in batch:
                blocks, given = w.blocks[rid], 0 if rid in fresh else self.blocks_given.get(rid, 0)
                if rid in fresh or len(blocks) > given:
                    new_blocks[rid] = (list(blocks[given:]), rid in fresh)
                self.blocks_given[rid] = len(blocks)
            new_blocks = self.seen_new_blocks(new_blocks)
        # v1/core/sched/scheduler.py: num_computed_tokens counts a verify step's drafts as kept until its output
        # returns; with async scheduling that is after the next step is scheduled (the scheduler rolls back
        # then), so the next step's count is over by the drafts the previous step rejected. The device's
        # seq_lens (v1/worker/gpu/model_runner.py prepare_pos_seq_lens, from num_computed_tokens.gpu) are true.
        sched = {rid: adapter.Scheduled(c + self.rejected.get(rid, 0), n) for rid, (c, n) in scheduled.items()}
        R = len(batch)
        # Each row's tokens: the scheduler's; under adaptive verification the device's (the drafts the model runner
        # keeps, v1/worker/gpu/model_runner.py prepare_inputs -> reallocate_drafts: query_start_loc on the device)
        # and the host's (compact_batch: the same total, spread evenly over the verify rows).
        query_lens = [scheduled[rid][1] for rid in batch]
        host_lens = query_lens
        if admitted:
            query_lens = [admitted.get(rid, n) for rid, n in zip(batch, query_lens)]
            drafts = np.array([scheduled[rid][1] - 1 if scheduled[rid][0] >= w.prompt[rid] else 0 for rid in batch])
            upper = np.array(host_lens)
            budget = sum(query_lens) - int((upper - drafts).sum())   # the drafts the device keeps
            host_lens = UP["AdaptiveVerificationManager.compact_batch"](
                types.SimpleNamespace(_batch_budget=(None, None, budget), num_bonus_tokens=1),
                drafts, upper, np.arange(R + 1))[0].tolist()
            assert sum(host_lens) == sum(query_lens)
        n_of = dict(zip(batch, query_lens))   # the tokens each row computes
        seq_lens = [scheduled[rid][0] + n_of[rid] for rid in batch]
        num_actual = sum(query_lens)
        # v1/worker/gpu/model_states/default.py prepare_attn: a FULL graph's metadata has the padded request and
        # token counts (its padded requests' queries empty: model_runner.py pads query_start_loc with the real
        # count); eager and piecewise the real ones.
        if pad_reqs is not None:
            assert pad_reqs >= R and len(set(host_lens)) == 1, "FULL graphs replay uniform decode batches"
            num_reqs, num_tokens = pad_reqs, pad_reqs * host_lens[0]
        else:
            num_reqs, num_tokens = R, num_actual
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens), np.full(num_reqs - R, num_actual)])
        host_start_loc = np.concatenate([[0], np.cumsum(host_lens), np.full(num_reqs - R, num_actual)])
        common = types.SimpleNamespace(max_query_len=max(host_lens), num_reqs=num_reqs, num_actual_tokens=num_tokens,
                                       query_start_loc_cpu=torch.from_numpy(host_start_loc.astype(np.int32)))
        # model_executor/layers/attention/sparse_mla_attention.py build: split_decodes_and_prefills(decode_threshold
        # = max_decode_query_len, require_uniform: FlashMLA sparse's require_uniform_decodes).
        num_decodes, _, num_decode_tokens, _ = UP["split_decodes_and_prefills"](
            common, decode_threshold=T, require_uniform=self.uniform, treat_short_extends_as_decodes=True)
        decodes = batch[:min(num_decodes, R)]
        if admitted:   # ESS serves every verify row; the split is the host's spread, which may cut a row's tokens
            decodes = batch[:next((b for b, rid in enumerate(batch) if not 1 <= scheduled[rid][1] <= T), R)]
        # Each decode row's tokens in the swap (the split's first num_decode_tokens tokens: all of them unless
        # adaptive verification's device split straddles it), and those of real rows (the rest graph padding).
        swapped = {rid: min(n_of[rid], max(0, num_decode_tokens - int(query_start_loc[b])))
                   for b, rid in enumerate(decodes)}
        real_decode_tokens = min(int(query_start_loc[len(decodes)]), num_decode_tokens)
        self.straddles += any(0 < n < n_of[rid] for rid, n in swapped.items())
        req_id_per_token = torch.zeros(max(num_tokens, num_actual), dtype=torch.int32)
        for b in range(R):
            req_id_per_token[query_start_loc[b]:query_start_loc[b + 1]] = b
        attn = types.SimpleNamespace(
            num_decode_tokens=num_decode_tokens, num_actual_tokens=num_tokens, max_query_len=max(query_lens),
            num_reqs=num_reqs, num_decodes=num_decodes, req_id_per_token=req_id_per_token,
            block_table=self.handles[0].source_block_table, block_size=BLOCK,
            seq_lens=torch.tensor(seq_lens + [0] * (num_reqs - R), dtype=torch.int32),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)))
        hot_blocks = None
        if self.hot_regions:
            # The resident pages of this step's tokens, and worker.py start_step's update_hisparse_residency (upstream's
            # own) from the scheduler's residency updates; the scheduler output's hot group blocks.
            # The pages reach the scheduler's count (ahead by rejected drafts, and untrimmed under adaptive
            # verification) and its lookahead slots (up to T: DSpark's and DFlash's num_lookahead_tokens); a request
            # with a hot region keeps only the last ACTIVE_TAIL_PAGES of them resident.
            for rid in batch:
                w.ensure_resident(rid, sched[rid].num_computed_tokens + sched[rid].num_scheduled_tokens + T)
                if rid in w.hot:
                    w.unpin_clean(rid)
            UP["update_hisparse_residency"](w.residency, w.residency_updates(batch), batch,
                                            torch.tensor(states, dtype=INDEX))
            hot_blocks = self.seen_hot_blocks(w.hot_output(batch, set(fresh)))
        # kv_connector/v1/hisparse/connector.py HiSparseConnector.start_load_kv, then ESS's start_step
        # (vllm_connector.py HiSparseConnector.start_load_kv, with the forward's leader-layer metadata).
        self.decode.start_step(batch, torch.tensor(states, dtype=torch.int32), sched, finished=finished,
                               preempted=preempted, fresh=self.seen_fresh(fresh),
                               all_context_pages_resident=all_resident,
                               attn_metadata=self.seen_metadata(attn, sched, batch), new_blocks=new_blocks,
                               hot_blocks=hot_blocks)
        served = self.decode.batch
        assert served == (0 if all_resident and len(decodes) < R else len(decodes)), "ESS staged other decode rows"
        # The engine's lengths are the device's (the forward's seq_lens: the scheduler's counts run ahead by rejected
        # drafts, and under adaptive verification count trimmed ones).
        assert self.decode.lengths[:served].tolist() == seq_lens[:served], "the step's lengths are not the device's"
        # connector.py start_step sets all_context_pages_resident on every handle; worker.py prepare_forward ->
        # HiSparseCacheHandle.prepare_group_for_batch (runtime.begin_forward()).
        for handle in self.handles:
            handle.all_context_pages_resident = all_resident
        self.group.prepare_for_batch(0, attn)
        # The model computes every scheduled token: mla_attention.py update_kv_cache writes decode tokens at the
        # resident slot mapping (HiSparseCacheHandle.write_target); the row mirror lands after the forward.
        slots = torch.full((LAYERS, self.slot_mappings[0].shape[0]), -1, dtype=torch.int64)
        for b, rid in enumerate(batch):
            c, n = scheduled[rid][0], n_of[rid]
            if self.hot_regions:   # every computed token lands on its resident page of each group
                for t in range(n):
                    for g in range(LAYERS):
                        slots[g, query_start_loc[b] + t] = w.slot(rid, c + t, g)
            elif rid in decodes:
                for t in range(n):
                    slots[:, query_start_loc[b] + t] = self.resident_next
                    self.resident_next = (self.resident_next + 1) % (self.world.resident[0].shape[0] * BLOCK)
            w.computed(rid, c, n)
        for g, mapping in enumerate(self.slot_mappings):
            mapping.copy_(slots[g] if self.hot_regions else slots[0])
        for rid in decodes:
            if self.hot_regions:   # the model's LRU starts (anew) when a request's rows are placed in a region
                if served and rid in w.hot and self.model_region.get(rid) != w.hot[rid]:
                    if rid in self.model_rows:
                        self.model.release(self.model_rows.pop(rid))
                    self.model_rows[rid] = states[batch.index(rid)]
                    self.model.admit(self.model_rows[rid])
                    self.model_region[rid] = list(w.hot[rid])
            elif served and rid not in self.model_rows:
                self.model_rows[rid] = states[batch.index(rid)]
                self.model.admit(self.model_rows[rid])
        for layer in range(LAYERS):
            # The layer's KV write, then its attention (flashmla_sparse.py _forward_bf16_kv: the decode swap).
            cache, slot_rows, num_rows = self.handles[layer].write_target(num_actual, num_actual)
            for i in range(num_rows):
                if slot_rows[i] >= 0:
                    rid = batch[int(req_id_per_token[i])]
                    position = scheduled[rid][0] + i - query_start_loc[int(req_id_per_token[i])]
                    slot = int(slot_rows[i])
                    cache[slot // BLOCK, slot % BLOCK] = torch.from_numpy(w.full[rid][layer, position])
            # Each decode row's T query rows (the model's view): a row of n < T tokens in the swap has them last.
            rows = []
            topk = torch.full((max(num_decode_tokens, 1), K), -1, dtype=torch.int32)
            for b, rid in enumerate(decodes):
                r, n = w.query_rows(rid, w.length[rid]), swapped[rid]
                r[: T - n] = -1
                rows.append(r)
                topk[query_start_loc[b]:query_start_loc[b] + n] = torch.from_numpy(r[T - n:].astype(np.int32))
            if num_decode_tokens > real_decode_tokens:   # CUDA-graph padding: whatever the indexer left there
                topk[real_decode_tokens:] = topk[0]
            if not served:
                continue   # vLLM resolves this step over resident pages (index_group.py _convert_once)
            for rid, r in zip(decodes, rows):
                if layer == 0:
                    self.handed.setdefault(rid, []).append((np.full((LAYERS, T, K), -1, np.int32), seq_lens[batch.index(rid)]))
                self.handed[rid][-1][0][layer] = r
            fetched = None
            if self.decode.overlap is not None and self.decode.overlap.runs_dba(layer):
                self.first_half(layer, topk[:num_decode_tokens], attn)
            if self.decode.overlap is not None:
                # flashmla_sparse.py _host_backed_fp8_decode (armed by vllm_overlap.py): the swap without valid counts,
                # its resident rows returned and its fetched rows taken by the kernel's wrapper, for Attn1.
                physical, fetched = self.swap_da(layer, topk[:num_decode_tokens], attn,
                                                 [batch[int(b)] if i < real_decode_tokens else None
                                                  for i, b in enumerate(req_id_per_token[:num_decode_tokens])])
                fetched_rows = np.full((len(decodes), T, K), -1, np.int32)
                for b, rid in enumerate(decodes):
                    n = swapped[rid]
                    fetched_rows[b, T - n:] = fetched[query_start_loc[b]:query_start_loc[b] + n].numpy()
            else:
                physical, valid = self.group.convert_logical_to_physical_topk(
                    layer, topk[:num_decode_tokens], attn, block_stride_rows=None, return_valid_counts=True)
            assert physical.dtype == torch.int32 and (fetched is not None or valid.dtype == torch.int32)
            assert tuple(physical.shape) == (num_decode_tokens, K)
            kv = self.group.physical_kv_cache(layer)
            assert kv.shape[1:] == (BLOCK, ENTRY)
            flat = kv.reshape(-1, ENTRY).numpy()
            per_row = np.full((len(decodes), T, K), -1, np.int32)
            for b, rid in enumerate(decodes):
                n = swapped[rid]
                per_row[b, T - n:] = physical[query_start_loc[b]:query_start_loc[b] + n].numpy()
            if self.hot_regions:
                self.check_regions(decodes, rows, flat, layer, per_row, fetched_rows if fetched is not None else None)
            else:
                model_batch = [(rid, self.model_rows[rid]) for rid in decodes]
                check_rows(w, self.model, np.stack(rows), [flat] * LAYERS, layer, model_batch, per_row)
            assert (physical[real_decode_tokens:] == -1).all(), "padded graph rows must come out as -1"
            if fetched is None:
                np.testing.assert_array_equal(valid.numpy(), (physical >= 0).sum(1).numpy())
            else:
                assert (fetched[real_decode_tokens:] == -1).all(), "padded graph rows must come out as -1"
        # The row mirror of every computed row has landed in vLLM's host pool by the next step.
        for rid in batch:
            w.mirrored(rid, scheduled[rid][0], n_of[rid])
        # MTP: a verify step keeps `accepted` of its tokens (of those computed); vLLM decodes other tokens in the
        # others' places. The scheduler counted every scheduled token (the trimmed drafts count as rejected).
        self.rejected = {}
        for rid, kept in (accepted or {}).items():
            c, n = scheduled[rid]
            if kept < n:
                w.length[rid] = c + kept
                w.redraw_after(rid, c + kept)
                if self.async_scheduling:
                    self.rejected[rid] = n - kept
        self.forwards_served += served > 0
        if self.null_block is not None:
            for layer, slab in enumerate(w.resident):
                assert torch.equal(slab[0], self.null_block[layer]), f"layer {layer}: vLLM's null block was written"
        return served

    def first_half(self, layer, topk, attn):
        """A DBA layer's indexer split (vllm_indexer_split.py): where the batch is pure decode of at least two rows
        of one token count (vLLM's indexer metadata, Halves.of), the first ceil(R / 2) rows' top-k swapped from the
        indexer (HiSparseRuntime.swap_first_half, with the layer's attention metadata), before the layer's decode,
        where ESS serves rows. A FULL graph replays the split its capture made: over its capture batch, R requests
        of the graph's query length each (some of them padding now)."""
        R = attn.num_decodes
        if self.full_graph:
            decode_lens = torch.full((R,), attn.num_decode_tokens // R, dtype=torch.int32)
        else:
            decode_lens = attn.query_start_loc[1:R + 1] - attn.query_start_loc[:R]
        uniform = bool((decode_lens == decode_lens[0]).all())   # (indexer.py build: native rows, padded if not)
        metadata = types.SimpleNamespace(
            num_prefills=attn.num_reqs - attn.num_decodes, num_decodes=attn.num_decodes,
            num_decode_tokens=attn.num_decode_tokens,
            decode=types.SimpleNamespace(requires_padding=not uniform, decode_lens=decode_lens, global_seq_lens=None,
                                         indices=None, decode_is_uniform=uniform))
        halves = vllm_indexer_split.Halves.of(metadata)
        if halves is None or self.decode.batch == 0:
            self.dba_as_da += 1
            return
        self.handles[layer].runtime.swap_first_half(
            resident=self.handles[layer], req_id_per_token=attn.req_id_per_token,
            logical_topk_indices=topk[:halves.t0], block_size=attn.block_size,
            num_valid_rows=attn.query_start_loc[-1:], requests=halves.r0)
        self.dba_splits += 1

    def swap_da(self, layer, topk, attn, request_of_token):
        """A DA layer's swap as vllm_overlap.py's wrappers of FlashMLA's FP8 decode make it: armed, without valid
        counts, its resident rows returned and its fetched rows taken (for Attn1). Returns both, [n, K]."""
        overlap = self.decode.overlap
        overlap.armed = layer
        resident = self.group.convert_logical_to_physical_topk(layer, topk, attn, block_stride_rows=None,
                                                               return_valid_counts=False)
        overlap.armed = None
        fetched = overlap.take(resident)
        assert fetched is not None and overlap.pending is None
        return resident, fetched

    def check_regions(self, decodes, rows, flat, layer, physical, fetched=None):
        """Hot regions: a request with a hot region through the model's LRU, its rows (the model's row x
        rows_per_request + slot) in its region's blocks (vLLM block k at attention row 2k x 64); one without read in
        place at its resident pages; every byte against the full cache. fetched (DA): each row's fetched part, which
        must be the rows of the model's misses (none read in place)."""
        w = self.world
        rpr = self.model.rows_per_request
        for b, rid in enumerate(decodes):
            q = rows[b]
            if rid in w.hot:
                # Ids on pages vLLM still holds resident (its residency table, by state) are read in place there;
                # the others go through the model's LRU, its rows in the request's region.
                s, region = self.model_rows[rid], w.hot[rid][layer]
                res = w.residency[layer][s].tolist()
                still = lambda i: i >= 0 and i // BLOCK < len(res) and res[i // BLOCK] > 0
                lru = [[-1 if still(i) else int(i) for i in r] for r in q]
                self.hot_ids_in_place += sum(still(int(i)) for r in q for i in r)
                model_rows, _, misses = self.model.step(s, layer, w.length[rid], lru)
                model_rows = [[res[i // BLOCK] * 2 * BLOCK + i % BLOCK + HOT_IN_PLACE if still(i) else p
                               for i, p in zip(r, m)] for r, m in zip(q.tolist(), model_rows)]
                if fetched is not None:
                    fetched_rows = {int(r) for r in fetched[b].ravel() if r >= 0}
                    assert len(fetched_rows) == misses, f"layer {layer} request {rid}: fetched {fetched_rows}, " \
                                                        f"{misses} misses"
                    self.fetched_checked += misses
                at = lambda p: -1 if p < 0 else p - HOT_IN_PLACE if p >= HOT_IN_PLACE else \
                    region[(p - s * rpr) // BLOCK] * 2 * BLOCK + (p - s * rpr) % BLOCK
                want = np.array([[at(p) for p in r] for r in model_rows])
            else:
                pages = w.resident_pages[rid][layer]
                assert fetched is None or (fetched[b] == -1).all(), f"layer {layer} request {rid}: fetched in place"
                want = np.where(q >= 0, np.array([[pages[t // BLOCK] * 2 * BLOCK + t % BLOCK if t >= 0 else -1
                                                   for t in r] for r in q]), -1)
            if fetched is not None:   # DA: each query's resident and fetched rows, compacted: as sets
                for t in range(self.T):
                    parts = [[int(v) for v in part[b][t] if v >= 0] for part in (physical, fetched)]
                    assert not set(parts[0]) & set(parts[1]), f"layer {layer} request {rid}: resident and fetched"
                    assert sorted(parts[0] + parts[1]) == sorted(int(v) for v in want[t] if v >= 0), \
                        f"layer {layer} request {rid} query {t}: {parts} against the model's {want[t]}"
                physical = np.array(physical)
                physical[b] = want   # (checked as sets: the bytes below are those of the model's rows)
            np.testing.assert_array_equal(physical[b], want, err_msg=f"layer {layer} request {rid} "
                                                                      f"({'hot' if rid in w.hot else 'in place'})")
            self.rows_checked["hot" if rid in w.hot else "in place"] += 1
            for t in range(self.T):
                for k in range(K):
                    i = q[t][k]
                    if i >= 0 and not np.array_equal(flat[physical[b][t][k]], w.full[rid][layer][i]):
                        raise AssertionError(f"layer {layer} request {rid} id {i}: row {physical[b][t][k]} holds other "
                                             "bytes than the full cache")

    def seen_hot_blocks(self, hot_blocks):
        """The hot group's blocks ESS's start_step is given; a mutation replaces them."""
        return hot_blocks

    def seen_metadata(self, attn, sched, batch):
        """The metadata ESS's start_step is given (the connector's leader_metadata); a mutation replaces it."""
        return attn

    def seen_new_blocks(self, new_blocks):
        """The new host blocks ESS's start_step is given (blocks_from_output); a mutation replaces them."""
        return new_blocks

    def seen_fresh(self, fresh):
        """The requests ESS's start_step is told are handed their blocks afresh; a mutation replaces them."""
        return fresh


def decode_step(batch, world, T, counts=None):
    """Every request of `batch` decodes T tokens (or counts[rid]: a verify step with fewer drafts) after what its
    last step kept."""
    return {rid: (world.length[rid], (counts or {}).get(rid, T)) for rid in batch}


def prefill(replay, rid, state, prompt, chunk, others=(), other_states=()):
    """The prompt in chunks (chunked prefill), beside decoding requests."""
    replay.world.new_request(rid, prompt)
    recompute(replay, rid, state, prompt, chunk, others, other_states)


def recompute(replay, rid, state, length, chunk, others=(), other_states=()):
    """The request's first `length` tokens computed in chunks from 0 (a prompt's prefill, or a preempted request
    resumed), beside decoding requests."""
    w = replay.world
    w.length[rid] = 0
    done = 0
    while done < length:
        n = min(chunk, length - done)
        scheduled = decode_step(others, w, replay.T)
        scheduled[rid] = (done, n)
        replay.step(list(others) + [rid], list(other_states) + [state], scheduled)
        done += n


def three_requests(r):
    """a, b and c prefilled in chunks beside the ones decoding already; their batch and state indices."""
    prefill(r, "a", 2, 150, 100)
    prefill(r, "b", 0, 90, 64, others=["a"], other_states=[2])
    prefill(r, "c", 4, 70, 200, others=["b", "a"], other_states=[0, 2])
    return ["a", "b", "c"], [2, 0, 4]


def decode_steps(r, steps, hot):
    """three_requests, then `steps` shuffled decode steps, request hot[step] moved to a hot region before that
    step."""
    batch, states = three_requests(r)
    for step in range(steps):
        if step in hot:
            r.world.go_hot(hot[step])
        batch, states, _ = shuffled_decode_step(r, batch, states, step)
    return batch, states


def shuffled_decode_step(r, batch, states, step):
    """One decode step of every request of `batch`, condensed and reordered (the batch rows change, each request
    keeps its state index); with MTP some verify steps carry fewer drafts (a batch vLLM's uniform split cuts after its
    first rows of the first row's length) and each keeps part of its tokens; every third uniform step a FULL graph
    captured for a larger batch. Returns the new order and the draft counts (None: T each)."""
    T, rng = r.T, np.random.default_rng(step)
    order = rng.permutation(len(batch))
    batch, states = [batch[i] for i in order], [states[i] for i in order]
    counts = {rid: int(rng.integers(1, T + 1)) for rid in batch} if T > 1 and step % 2 else None
    scheduled = decode_step(batch, r.world, T, counts)
    uniform = len({n for _, n in scheduled.values()}) == 1
    pad = len(batch) + 1 if uniform and step % 3 == 0 else None
    accepted = {rid: int(rng.integers(1, n + 1)) for rid, (_, n) in scheduled.items()} if T > 1 else None
    assert r.step(batch, states, scheduled, pad_reqs=pad, accepted=accepted) >= 1
    return batch, states, counts


@pytest.mark.parametrize("T,slots,async_scheduling,from_output",
                         [(1, 24, True, False), (3, 56, True, False), (3, 56, False, False), (3, 56, True, True)])
def test_decode_replay_matches_the_model_and_the_full_cache(T, slots, async_scheduling, from_output, **rank):
    """rank: Replay's host_memory / writer / barrier, when a rank of a shared pool runs it (test_vllm_shared_pool).
    from_output: the host blocks from the scheduler's output, and then (async scheduling with drafts) a step of T
    tokens per request reads nothing back from the device."""
    r = Replay(T, slots, seed=3 + T, async_scheduling=async_scheduling, blocks_from_output=from_output, **rank)
    w = r.world
    batch, states = three_requests(r)
    for step in range(10):
        reads = r.decode.device_reads
        batch, states, counts = shuffled_decode_step(r, batch, states, step)
        if from_output and step > 0 and counts is None:   # every request known, every row T tokens
            assert r.decode.device_reads == reads, f"step {step} read the device back"
    assert r.forwards_served == 13   # 3 steps decoded beside the prefills of "b" and "c"
    assert all(h.runtime.steps_served == r.forwards_served for h in r.handles)
    if w.mirror:
        w.check_host_pool(batch)


@pytest.mark.parametrize("T,mutated,hot", [(1, False, False), (3, False, False), (1, True, False), (3, False, True)])
def test_the_recorded_trace_is_the_top_k_vllm_handed(tmp_path, monkeypatch, T, mutated, hot):
    """ESS_RECORD_TRACE under vLLM: each served request's every layer and query token as the model selected them
    (a row of n < T tokens with its first T - n queries padding), and the length its step's last query sees;
    written when the decode state closes (the connector's shutdown). mutated: batch rows taken for the state
    indices requests are recorded by. hot: with hot regions (a request read in place, then one in a hot region,
    whose ids on resident pages ESS's LRU never sees: the trace still has them)."""
    path = tmp_path / "recorded.safetensors"
    monkeypatch.setenv("ESS_RECORD_TRACE", str(path))
    monkeypatch.setenv("ESS_RECORD_REQUESTS", "2")
    monkeypatch.setenv("ESS_RECORD_STEPS", "5")
    if mutated:   # batch rows taken for state indices: the rows recorded are other requests'
        from ess.integrations.topk_recorder import TopkRecorder
        record = TopkRecorder.record
        monkeypatch.setattr(TopkRecorder, "record", lambda self, layer, rows, topk: record(
            self, layer, torch.where(rows >= 0, torch.arange(rows.shape[0], dtype=rows.dtype), rows), topk))
    r = Replay(T, BLOCK - T if hot else 24 if T == 1 else 56, seed=8, hot_regions=1 if hot else 0)
    w = r.world
    batch, states = three_requests(r)
    for step in range(6):
        if hot and step == 0:   # (the trace's steps of "a" end after its next two)
            w.go_hot("a")
        counts = {rid: 1 + (step + i) % T for i, rid in enumerate(batch)} if T > 1 else None
        scheduled = decode_step(batch, w, T, counts)
        r.step(batch, states, scheduled, accepted={rid: n for rid, (_, n) in scheduled.items()} if T > 1 else None)
    if mutated:
        with pytest.raises((AssertionError, ValueError)):
            r.decode.close()
            check_recorded(r, path)
        return
    r.decode.close()
    check_recorded(r, path)


def check_recorded(r, path):
    import ess_trace
    _, recorded = ess_trace.read_trace(str(path))
    assert sorted(x["id"] for x in recorded) == ["a", "b"]   # the first two to decode
    for x in recorded:
        want = r.handed[x["id"]][:5]
        np.testing.assert_array_equal(x["topk"], np.stack([ids for ids, _ in want]))
        np.testing.assert_array_equal(x["lengths"], [length for _, length in want])


@pytest.mark.parametrize("uniform", [True, False])
def test_rows_of_fewer_than_t_tokens(uniform):
    """Rows of at most T tokens: a whole prompt of T tokens or fewer (nothing computed yet), the last chunk of a
    chunked prefill, a verify step with fewer drafts. vLLM's split makes them decodes (FlashMLA sparse: the
    leading rows of the first row's length; uniform=False, another backend's: the leading rows of at most T
    tokens) and ESS serves each with its queries last and its older tokens in the reserved rows beside the new
    ones, a request of fewer than T tokens too; a row vLLM's split leaves to prefill is caught up later."""
    T = 3
    r = Replay(T, 56, seed=17, uniform=uniform)
    w = r.world
    w.new_request("one", 1)
    assert r.step(["one"], [2], {"one": (0, 1)}) == 1                       # a 1-token prompt: fewer than T
    assert r.step(["one"], [2], decode_step(["one"], w, T, {"one": 1})) == 1   # 2 tokens, still fewer than T
    r.step(["one"], [2], decode_step(["one"], w, T), finished=())
    w.new_request("tiny", 3)
    assert r.step(["tiny"], [1], {"tiny": (0, 3)}, finished=("one",)) == 1   # a 3-token prompt, one step
    w.new_request("long", 130)
    for done, n in ((0, 64), (64, 64)):
        scheduled = decode_step(["tiny"], w, T)
        scheduled["long"] = (done, n)
        r.step(["tiny", "long"], [1, 3], scheduled)
    scheduled = decode_step(["tiny"], w, T, {"tiny": 1})
    scheduled["long"] = (128, 2)                                             # the prompt's tail
    assert r.step(["tiny", "long"], [1, 3], scheduled) == (1 if uniform else 2)
    for step in range(6):
        counts = {"tiny": 1 + step % 3, "long": 3 - step % 3}
        scheduled = decode_step(["long", "tiny"], w, T, counts)
        accepted = {rid: max(1, n - step % 2) for rid, (_, n) in scheduled.items()}
        assert r.step(["long", "tiny"], [3, 1], scheduled, accepted=accepted) == (
            2 if not uniform or step % 3 == 1 else 1)


def test_preemption_and_a_reused_state():
    T = 1
    r = Replay(T, 24, seed=11)
    w = r.world

    def waited():   # releases and adoptions are ordered on the forward's stream: no row waits on the host
        raise AssertionError("start_step waited for the device")
    r.decode.synchronize = waited
    prefill(r, "a", 1, 100, 60)
    prefill(r, "b", 3, 80, 200, others=["a"], other_states=[1])
    for _ in range(3):
        r.step(["a", "b"], [1, 3], decode_step(["a", "b"], w, T))
    # "a" is preempted (its blocks freed, recomputed later); "c" takes its state while "a" waits.
    r.step(["b"], [3], decode_step(["b"], w, T), preempted=("a",))
    assert "a" not in r.decode.state_of
    prefill(r, "c", 1, 70, 200, others=["b"], other_states=[3])
    for _ in range(2):
        r.step(["c", "b"], [1, 3], decode_step(["c", "b"], w, T))
    # "b" finishes; "a" resumes at a new state and recomputes its context (num_computed_tokens from 0).
    length_a = w.length["a"]
    r.step(["c"], [1], decode_step(["c"], w, T), finished=("b",))
    recompute(r, "a", 0, length_a, 120, others=["c"], other_states=[1])
    for _ in range(3):
        r.step(["a", "c"], [0, 1], decode_step(["a", "c"], w, T))
    assert r.decode.state_of == {"a": 0, "c": 1}


def test_preemption_in_a_step_without_a_forward():
    """A request preempted in a step with nothing else scheduled (its preempted_req_ids never reach ESS: no
    start_load_kv with a batch) resumes on the same state index (v1/worker/gpu/states.py hands indices out last
    freed first) over other blocks, its old ones another request's by then; its resumption is a new request to
    the worker (scheduled_new_reqs), and ESS starts it over instead of reading the other request's entries."""
    T = 1
    r = Replay(T, 24, seed=11)
    w = r.world
    prefill(r, "a", 1, 150, 150)
    for _ in range(2):
        r.step(["a"], [1], decode_step(["a"], w, T))
    length_a = w.length["a"]
    r.no_forward(preempted=("a",))
    assert "a" in r.decode.state_of    # ESS has not seen it go
    # "x" takes the blocks "a" freed (the pool hands out the last freed first) while "a" waits.
    prefill(r, "x", 0, 150, 150)
    r.step(["x"], [0], decode_step(["x"], w, T))
    # "a" resumes on its state index and recomputes its context over new blocks, then decodes.
    recompute(r, "a", 1, length_a, 150, others=["x"], other_states=[0])
    for _ in range(3):
        r.step(["a", "x"], [1, 0], decode_step(["a", "x"], w, T))
    assert r.decode.state_of == {"a": 1, "x": 0}


def test_a_resumed_request_not_started_over_fails_the_replay(monkeypatch):
    """Mutation: the requests handed their blocks afresh not told to ESS."""
    monkeypatch.setattr(Replay, "seen_fresh", lambda self, fresh: ())
    with pytest.raises((AssertionError, ess.EssError)):
        test_preemption_in_a_step_without_a_forward()


def test_steps_vllm_resolves_over_resident_pages_are_caught_up():
    """All context pages resident and a prefill in the batch: vLLM does not call swap_in (index_group.py
    convert_logical_to_physical_topk's _convert_once). ESS serves nothing then, physical_kv_cache is vLLM's
    slab, and the next ESS step copies the tokens it missed from vLLM's host pool."""
    T = 1
    r = Replay(T, 24, seed=5)
    w = r.world
    prefill(r, "a", 0, 100, 100)
    r.step(["a"], [0], decode_step(["a"], w, T))
    w.new_request("b", 90)
    scheduled = decode_step(["a"], w, T)
    scheduled["b"] = (0, 90)
    assert r.step(["a", "b"], [0, 1], scheduled, all_resident=True) == 0
    upstream_hot = types.SimpleNamespace(attention_cache="vLLM's slab")
    runtime = r.handles[0].runtime
    runtime.upstream = types.SimpleNamespace(hot=upstream_hot)
    r.handles[0].num_decode_tokens, r.handles[0].num_actual_tokens = 1, 91
    assert runtime.hot is upstream_hot
    runtime.upstream = None
    for _ in range(3):
        assert r.step(["a", "b"], [0, 1], decode_step(["a", "b"], w, T)) == 2


def test_requests_on_a_shared_prefix_read_its_blocks():
    """A prefix-cache hit: the second request's first blocks are the first one's (vLLM's blocks, shared, not
    recomputed); ESS adopts them for both and reads the shared entries through either."""
    T = 2
    r = Replay(T, 40, seed=29)
    w = r.world
    prefill(r, "p1", 3, 200, 120)
    for _ in range(2):
        r.step(["p1"], [3], decode_step(["p1"], w, T))
    w.new_request("p2", 190, prefix_of="p1", prefix=128)
    scheduled = decode_step(["p1"], w, T)
    scheduled["p2"] = (128, 62)                      # num_computed_tokens: the cached prefix
    r.step(["p1", "p2"], [3, 0], scheduled)
    assert w.blocks["p2"][:2] == w.blocks["p1"][:2]
    for step in range(4):
        batch, states = (["p2", "p1"], [0, 3]) if step % 2 else (["p1", "p2"], [3, 0])
        assert r.step(batch, states, decode_step(batch, w, T)) == 2
    assert r.engine.stats().host_bytes_shared == 2 * LAYERS * BLOCK * ENTRY
    w.check_host_pool(["p1", "p2"])


def test_the_host_block_table_read_by_state_fails_the_replay(monkeypatch):
    """Mutation: the forward's host block table taken as indexed by state (vLLM gathers it per batch row)."""
    def by_state(self, batch):
        self.source_block_table.zero_()
        for rid in batch:
            state = next(s for s, r in self._states.items() if r == rid)
            self.source_block_table[state, :len(self.blocks[rid])] = torch.tensor(self.blocks[rid], dtype=torch.int32)

    step = Replay.step

    def remember(self, batch, states, *a, **k):
        self.world._states = dict(zip(states, batch))
        return step(self, batch, states, *a, **k)

    monkeypatch.setattr(VllmWorld, "gather", by_state)
    monkeypatch.setattr(Replay, "step", remember)
    with pytest.raises(AssertionError, match="holds other bytes than the full cache"):
        test_decode_replay_matches_the_model_and_the_full_cache(1, 24, True, False)


def test_a_second_copy_of_the_host_pool_fails_the_replay(monkeypatch):
    """Mutation: ESS's engine on a copy of vLLM's host pool taken at start (a second pool, not vLLM's): the rows
    vLLM's mirror adds later are not in it."""
    layout = adapter.host_pool_layout

    def copied(backing, host):
        copy, _ = host_region()
        copy.copy_(backing)
        monkeypatch.setattr(backing, "numpy", lambda: copy.numpy())
        return layout(backing, host)

    monkeypatch.setattr(adapter, "host_pool_layout", copied)
    with pytest.raises(AssertionError, match="holds other bytes than the full cache"):
        test_decode_replay_matches_the_model_and_the_full_cache(1, 24, True, False)


def test_a_stale_state_mapping_fails_the_replay(monkeypatch):
    """Mutation: the batch row taken as the request's state (no refresh after condense and reorder)."""
    start = adapter.EssDecode.start_step

    def batch_rows(self, request_ids, request_state_indices, *a, **k):
        return start(self, request_ids, torch.arange(len(request_ids), dtype=torch.int32), *a, **k)

    monkeypatch.setattr(adapter.EssDecode, "start_step", batch_rows)
    with pytest.raises((AssertionError, ess.EssError)):
        test_decode_replay_matches_the_model_and_the_full_cache(1, 24, True, False)


def test_a_layer_counter_mix_up_fails_the_replay(monkeypatch):
    """Mutation: the layer taken from the runtime's per-forward call count (upstream's row-window counter
    _swap_step), which is 0 on every layer."""
    swap = adapter.HiSparseRuntime.swap_in

    def counted(self, **kw):
        layer, self.layer = self.layer, self.layers_served   # the runtime's per-forward call count: 0
        try:
            return swap(self, **kw)
        finally:
            self.layer = layer

    monkeypatch.setattr(adapter.HiSparseRuntime, "swap_in", counted)
    with pytest.raises((AssertionError, ess.EssError)):
        test_decode_replay_matches_the_model_and_the_full_cache(1, 24, True, False)


def test_lengths_from_the_scheduler_fail_the_replay(monkeypatch):
    """Mutation: the decode rows' lengths from the scheduler's num_computed_tokens (seq_lens made from it), which
    under async scheduling still counts the drafts the previous verify step rejected."""
    def from_scheduler(self, attn, sched, batch):
        seq_lens = torch.tensor([sum(sched[rid]) for rid in batch] + [0] * (attn.num_reqs - len(batch)),
                                dtype=torch.int32)
        return types.SimpleNamespace(**{**vars(attn), "seq_lens": seq_lens})

    monkeypatch.setattr(Replay, "seen_metadata", from_scheduler)
    test_decode_replay_matches_the_model_and_the_full_cache(3, 56, False, False)   # synchronous: the counts are true
    with pytest.raises((AssertionError, ess.EssError)):
        test_decode_replay_matches_the_model_and_the_full_cache(3, 56, True, False)


def test_the_batchs_own_decode_split_fails_the_replay(monkeypatch):
    """Mutation: the forward's decode split ignored (ESS's leading rows of at most T tokens instead of FlashMLA
    sparse's uniform split, and a FULL graph's padded counts refused): rows vLLM leaves to prefill are staged, a
    padded graph is refused."""
    monkeypatch.setattr(Replay, "seen_metadata", lambda self, attn, sched, batch: None)
    with pytest.raises((AssertionError, ess.EssError)):
        test_decode_replay_matches_the_model_and_the_full_cache(3, 56, False, False)


def test_new_blocks_taken_for_the_whole_list_fail_the_replay(monkeypatch):
    """Mutation: a cached request's new blocks taken as its whole list (replace where the scheduler output appends):
    ESS's copy of the host block table loses the request's earlier blocks, and the replay says so."""
    monkeypatch.setattr(Replay, "seen_new_blocks",
                        lambda self, new_blocks: {rid: (blocks, True) for rid, (blocks, _) in new_blocks.items()})
    with pytest.raises((AssertionError, ess.EssError)):
        test_decode_replay_matches_the_model_and_the_full_cache(3, 56, True, True)


@pytest.mark.parametrize("T", [1, 3])
def test_hot_regions_hold_esss_rows_and_resident_requests_are_read_in_place(T):
    """ESS's rows in vLLM's hot regions (the engine's regions, over the resident slab vLLM's hot cache shares): a
    request without a hot region is read in place at its resident pages through the residency table (upstream's
    update_hisparse_residency keeps it), with no ESS row; once vLLM gives it a hot region (require_hot, its blocks
    in the scheduler output) its rows, reserved rows included, are placed there, its LRU starting empty, while its
    older resident pages are lost and reused under it. Through condense and reorder, FULL graphs, drafts, a
    request finishing and its state reused, every row against the model (or the residency table) and every byte
    against the full cache."""
    r = Replay(T, BLOCK - T, seed=41 + T, hot_regions=1)
    w = r.world
    batch, states = three_requests(r)
    hot_at = {2: "a", 4: "c", 7: "b"}
    for step in range(12):
        if step in hot_at:
            w.go_hot(hot_at[step])
        if step == 9:   # "c" finishes; "d" takes its state and decodes in place, then goes hot too
            i = batch.index("c")
            del batch[i], states[i]
            w.new_request("d", 90)
            r.step(batch + ["d"], states + [4], {**decode_step(batch, w, T), "d": (0, 90)}, finished=("c",))
            batch, states = batch + ["d"], states + [4]
            continue
        if step == 10:
            w.go_hot("d")
        batch, states, _ = shuffled_decode_step(r, batch, states, step)
        # ESS knows every hot region from the scheduler output, and places a request's rows there once it serves it.
        for g in range(LAYERS):
            assert {rid: b for rid, b in r.decode.hot_of[g].items() if b} == \
                {rid: w.hot[rid][g] for rid in batch if rid in w.hot}
        placed = {rid for rid in batch if r.decode.state_of.get(rid) in r.decode.placed}
        assert placed <= set(w.hot), "ESS placed a request vLLM did not make hot"
    assert set(w.hot) == {"a", "b", "d"}
    assert min(r.rows_checked.values()) > 20 and r.hot_ids_in_place > 20, (r.rows_checked, r.hot_ids_in_place)
    w.check_host_pool(batch)


def test_ids_on_resident_pages_served_through_the_lru_fail_the_replay(monkeypatch):
    """Mutation: a request with a hot region served wholly through ESS's LRU, the pages vLLM still holds resident
    (its newest entries' among them) ignored: the rows are not vLLM's resident ones (and, past the window, the
    reserved rows the engine reads were never written)."""
    monkeypatch.setattr(adapter.HiSparseRuntime, "_still_resident",
                        staticmethod(lambda valid, state, inside, blocks: torch.zeros_like(inside)))
    with pytest.raises(AssertionError):
        test_hot_regions_hold_esss_rows_and_resident_requests_are_read_in_place(3)


def test_resident_pages_of_hot_rows_looked_up_by_batch_row_fail_the_replay(monkeypatch):
    """Mutation: a hot row's resident pages looked up in vLLM's residency table by the token's batch row instead of
    its request's state index (rows read in place whole keep theirs)."""
    lookup = adapter.HiSparseRuntime._resident_rows

    def by_batch_row(self, resident, state, logical):
        d, mapped = self.decode, state
        for b in range(d.max_num_reqs):   # the state of an ESS row b -> b
            mapped = torch.where((d.rows[b] >= 0) & (state == d.rows[b]), torch.full_like(state, b), mapped)
        return lookup(self, resident, mapped, logical)

    monkeypatch.setattr(adapter.HiSparseRuntime, "_resident_rows", by_batch_row)
    with pytest.raises(AssertionError):
        test_hot_regions_hold_esss_rows_and_resident_requests_are_read_in_place(3)


def test_the_residency_table_read_by_batch_row_fails_the_replay(monkeypatch):
    """Mutation: a row read in place looked up in vLLM's residency table by its batch row (a stale idx_mapping
    gather) instead of its state index."""
    stage = adapter.EssDecode._stage

    def by_batch_row(self, R, states, positions):
        stage(self, R, states, positions)
        rows = torch.arange(self.in_place_state.shape[0], dtype=self.in_place_state.dtype)
        self.in_place_state.copy_(torch.where(self.in_place_state >= 0, rows, self.in_place_state))

    monkeypatch.setattr(adapter.EssDecode, "_stage", by_batch_row)
    with pytest.raises(AssertionError):
        test_hot_regions_hold_esss_rows_and_resident_requests_are_read_in_place(1)


def test_hot_regions_not_told_to_ess_fail_the_replay(monkeypatch):
    """Mutation: the scheduler output's hot group blocks never reach ESS: requests vLLM moved to host reads are
    read in place at pages vLLM has reused."""
    monkeypatch.setattr(Replay, "seen_hot_blocks", lambda self, hot_blocks: [{} for _ in hot_blocks])
    with pytest.raises(AssertionError):
        test_hot_regions_hold_esss_rows_and_resident_requests_are_read_in_place(1)


def adaptive_admitted(r, batch, states, scheduled, confidences, rng):
    """v1/worker/gpu/spec_decode/adaptive_verification.py reallocate_drafts: the tokens each verify row keeps this
    step, decided on the device by upstream's own _assign_draft_token_budget (the best `budget` draft slots by the
    survival probability of each request's confidences, by state index); the budget (get_num_tokens' choice from
    its cost tables) drawn below the scheduled drafts, or all of them, or none. None without drafts."""
    verify = [b for b, rid in enumerate(batch) if scheduled[rid][1] > 1 and scheduled[rid][0] >= r.world.prompt[rid]]
    if not verify:
        return None
    drafts = [scheduled[batch[b]][1] - 1 for b in verify]
    budget = int(rng.choice([0, sum(drafts), int(rng.integers(1, sum(drafts) + 1))]))
    capacities = torch.tensor(drafts, dtype=torch.int32)
    if budget == 0:
        capacities.zero_()
    elif budget < sum(drafts):
        UP["_assign_draft_token_budget"](confidences, torch.tensor([states[b] for b in verify], dtype=INDEX),
                                         capacities, budget, r.T - 1)
    return {batch[b]: 1 + int(c) for b, c in zip(verify, capacities)}


@pytest.mark.parametrize("uniform", [True, False])
def test_adaptive_verification_rows_decided_on_the_device(uniform):
    """vLLM's adaptive verification (enable_adaptive_verification): the model runner trims each verify row's drafts on
    the device (upstream's _assign_draft_token_budget), so a row's tokens, its seq_len and req_id_per_token are known
    there only; the host has the scheduler's counts and the trimmed total spread evenly over the verify rows (upstream's
    compact_batch), from which the forward's decode split is made: FlashMLA's uniform split (uniform) then cuts
    where the host's spread changes, through a row's tokens on the device. ESS stages every verify row, maps the
    swap's tokens from req_id_per_token and fills the reserved rows from vLLM's resident tail pages at the device's
    lengths: every row against the model, every byte against the full cache, with no read from the device once
    every request is known, through condense and reorder, rejected drafts under async scheduling, hot regions
    handed out mid-run and rows read in place."""
    T = 3
    r = Replay(T, BLOCK - T, seed=61, hot_regions=1, adaptive=True, uniform=uniform, blocks_from_output=True)
    w = r.world
    batch, states = three_requests(r)
    rng = np.random.default_rng(7)
    confidences = torch.from_numpy(rng.uniform(0.05, 1.0, (STATES, T - 1)).astype(np.float32))
    trimmed = 0
    for step in range(16):
        if step in (3, 8):
            w.go_hot({3: "a", 8: "c"}[step])
        order = rng.permutation(len(batch))
        batch, states = [batch[i] for i in order], [states[i] for i in order]
        scheduled = decode_step(batch, w, T)
        admitted = adaptive_admitted(r, batch, states, scheduled, confidences, rng)
        trimmed += sum(n < T for n in admitted.values())
        accepted = {rid: int(rng.integers(1, n + 1)) for rid, n in admitted.items()}
        reads = r.decode.device_reads
        assert r.step(batch, states, scheduled, accepted=accepted, admitted=admitted) == len(batch)
        assert step == 0 or r.decode.device_reads == reads, f"step {step} read the device back"   # "c" new at 0
    assert trimmed > 10 and (r.straddles >= 2 if uniform else r.straddles == 0), (trimmed, r.straddles)
    assert min(r.rows_checked.values()) > 20, r.rows_checked
    w.check_host_pool(batch)


def test_adaptive_verification_taken_as_exact_counts_is_refused(monkeypatch):
    """Mutation: ESS not told of adaptive verification takes the scheduler's counts as the rows' tokens: the
    forward's trimmed decode tokens are refused (never served silently)."""
    init = adapter.EssDecode.__init__
    monkeypatch.setattr(adapter.EssDecode, "__init__", lambda self, *a, adaptive_verification=False, **k:
                        init(self, *a, **k))
    with pytest.raises(ess.InvalidArgument, match="decode rows of"):
        test_adaptive_verification_rows_decided_on_the_device(False)



def test_adaptive_lengths_from_the_scheduler_fail_the_replay(monkeypatch):
    """Mutation: the rows' lengths from the scheduler's counts (untrimmed, and ahead by rejected drafts) instead of
    the forward's seq_lens: the engine's step is not the device's."""
    monkeypatch.setattr(Replay, "seen_metadata", lambda self, attn, sched, batch: types.SimpleNamespace(**{
        **vars(attn), "seq_lens": torch.tensor([sum(sched[rid]) for rid in batch] + [0] * (attn.num_reqs - len(batch)),
                                               dtype=torch.int32)}))
    with pytest.raises((AssertionError, ess.EssError), match="lengths"):
        test_adaptive_verification_rows_decided_on_the_device(False)


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_da_overlap_splits_each_swap_into_resident_and_fetched_rows(adaptive):
    """ESS_OVERLAP=da under vLLM (vllm_overlap.py): the swap, armed as FlashMLA's FP8 decode arms it, returns each
    token's rows that were in place before the step and leaves those its step copies in; the two never overlap, the
    fetched ones are the model's misses (none for a row read in place), and together they are every row the model
    gives, holding the full cache's bytes. With hot regions handed out mid-run, drafts, FULL graphs and adaptive
    verification. (The order on the GPU: Attn0 beside the copy, Attn1 after its event, is docs/gpu-validation.md's.)"""
    T = 3
    r = Replay(T, BLOCK - T, seed=71, hot_regions=1, overlap="da", adaptive=adaptive, blocks_from_output=True)
    w = r.world
    batch, states = three_requests(r)
    rng = np.random.default_rng(9)
    confidences = torch.from_numpy(rng.uniform(0.05, 1.0, (STATES, T - 1)).astype(np.float32))
    for step in range(12):
        if step in (2, 6):
            w.go_hot({2: "b", 6: "a"}[step])
        if adaptive:
            order = rng.permutation(len(batch))
            batch, states = [batch[i] for i in order], [states[i] for i in order]
            scheduled = decode_step(batch, w, T)
            admitted = adaptive_admitted(r, batch, states, scheduled, confidences, rng)
            r.step(batch, states, scheduled, admitted=admitted,
                   accepted={rid: int(rng.integers(1, n + 1)) for rid, n in admitted.items()})
        else:
            batch, states, _ = shuffled_decode_step(r, batch, states, step)
    assert r.fetched_checked > 50 and min(r.rows_checked.values()) > 10, (r.fetched_checked, r.rows_checked)


@pytest.mark.parametrize("T", [1, 3])
def test_the_dba_overlap_swaps_the_first_half_from_the_indexer(T):
    """ESS_OVERLAP=dba under vLLM (vllm_indexer_split.py): a pure decode batch of one token count has its first
    ceil(R / 2) rows swapped from the indexer (swap_first_half) and the rest by the layer's swap, on a step bound to
    the rows after them; the swap returns both halves' resident rows and leaves both halves' fetched ones, every row
    checked against the model as under DA. A batch the split does not apply to (a prefill beside, a batch of one, rows
    of different token counts) runs the layer as DA; a FULL graph's replay runs its capture's split (over the
    captured batch size: padded rows among either half)."""
    r = Replay(T, BLOCK - T, seed=75 + T, hot_regions=1, overlap="dba", blocks_from_output=True)
    batch, states = decode_steps(r, 12, {2: "b", 6: "a"})
    assert 2 * len(batch) - 1 == STATES
    for _ in range(2):   # a FULL graph captured for 2R - 1 requests: its first half holds every real row
        r.step(batch, states, decode_step(batch, r.world, T), pad_reqs=STATES)
    # Split: the uniform steps, FULL-graph padding or not (T = 3: every other step has fewer drafts on some rows).
    assert r.dba_splits >= (14 if T == 1 else 8) * LAYERS and r.dba_as_da > 0, (r.dba_splits, r.dba_as_da)
    assert r.decode.overlap.first_half is None
    assert r.fetched_checked > 30 and min(r.rows_checked.values()) > 10, (r.fetched_checked, r.rows_checked)


def test_a_dba_second_half_stepped_from_the_first_row_fails_the_replay(monkeypatch):
    """Mutation: the second half's step bound to the batch's first rows (the first half's): the first half is swapped
    twice and the second never; the replay's model of each row's LRU catches it."""
    monkeypatch.setattr(adapter.DecodeOverlap, "offset_step", lambda self, decode, first: decode.step_binding)
    r = Replay(1, BLOCK - 1, seed=77, hot_regions=1, overlap="dba", blocks_from_output=True)
    batch, states = three_requests(r)
    for rid in ("a", "b", "c"):
        r.world.go_hot(rid)
    with pytest.raises(AssertionError):
        for step in range(4):
            batch, states, _ = shuffled_decode_step(r, batch, states, step)


def test_a_stale_first_half_is_dropped_and_a_bad_one_refused(caplog):
    """swap_first_half is refused by name on a layer that does not run DBA and for a first half that is not one
    (before anything runs); a first half its layer's swap never took (a failed forward) is dropped with a warning,
    and the next swap of the layer swaps every row."""
    r = Replay(1, BLOCK - 1, seed=79, hot_regions=1, overlap="dba", blocks_from_output=True)
    batch, states = three_requests(r)
    runtime = r.handles[0].runtime
    args = dict(resident=r.handles[0], req_id_per_token=torch.zeros(4, dtype=torch.int32), block_size=BLOCK,
                num_valid_rows=torch.tensor([4]), logical_topk_indices=torch.full((2, K), -1, dtype=torch.int32))
    with pytest.raises(ess.InvalidArgument, match=r"a first half of 1 to"):
        runtime.swap_first_half(requests=3, **args)
    with pytest.raises(ess.InvalidArgument, match=r"\[n, K = "):
        runtime.swap_first_half(requests=1, **dict(args, logical_topk_indices=torch.zeros((2, 3), dtype=torch.int32)))
    r.decode.overlap.schedules[1] = "da"
    with pytest.raises(ess.InvalidArgument, match="does not run DBA"):
        r.handles[1].runtime.swap_first_half(requests=1, **args)
    assert r.decode.overlap.first_half is None
    runtime.swap_first_half(requests=1, **args)   # a first half no decode takes: its step ends
    assert r.decode.overlap.first_half is not None
    with caplog.at_level("WARNING", logger="ess.integrations"):
        for step in range(2):
            batch, states, _ = shuffled_decode_step(r, batch, states, step)
    assert "first half was never taken" in caplog.text


def test_a_da_swap_not_armed_by_flashmlas_decode_is_refused():
    """A DA layer's swap from another decode path (not FlashMLA's FP8 decode, which reads the two parts) is refused by
    name, before anything runs."""
    r = Replay(1, BLOCK - 1, seed=73, hot_regions=1, overlap="da")
    prefill(r, "a", 2, 90, 100)
    r.decode.overlap.runs_da = lambda layer: True
    with pytest.raises(ess.InvalidArgument, match="needs vLLM's FlashMLA sparse FP8 decode"):
        r.handles[0].runtime.swap_in(resident=r.handles[0], req_id_per_token=torch.zeros(1, dtype=torch.int32),
                                     block_table=r.world.source_block_table,
                                     logical_topk_indices=torch.zeros((1, K), dtype=torch.int32), block_size=BLOCK,
                                     num_valid_rows=torch.tensor([1]))
    assert r.handles[0].runtime.layers_served == 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_each_steps_newest_entries_come_from_vllms_last_two_pages(adaptive):
    """A request with a hot region keeps only its last two resident pages (coordinator.py: ACTIVE_TAIL_PAGES), its
    pages reaching the scheduler's count plus lookahead slots; over more than a page of MTP steps with rejected
    drafts (and trimmed ones under adaptive verification) every query selects the step's T newest ids, which ESS
    reads from those pages into its reserved rows: every byte against the full cache at each page boundary."""
    T = 3
    r = Replay(T, BLOCK - T, seed=97, hot_regions=1, adaptive=adaptive, blocks_from_output=True)
    w = r.world
    query_rows = w.query_rows

    def with_the_newest(rid, n):   # every query row selects the T newest ids
        rows = query_rows(rid, n)
        newest = list(range(max(0, n - T), n))
        for t in range(T):
            ids = newest + [int(i) for i in rows[t] if i >= 0 and i not in newest]
            rows[t] = (ids + [-1] * K)[:K]
        return rows

    w.query_rows = with_the_newest
    batch, states = three_requests(r)
    w.go_hot("a")
    w.go_hot("c")
    rng = np.random.default_rng(11)
    confidences = torch.from_numpy(rng.uniform(0.05, 1.0, (STATES, T - 1)).astype(np.float32))
    start = dict(w.length)
    for step in range(60):
        scheduled = decode_step(batch, w, T)
        admitted = adaptive_admitted(r, batch, states, scheduled, confidences, rng) if adaptive else None
        kept = admitted or {rid: n for rid, (_, n) in scheduled.items()}
        r.step(batch, states, scheduled, admitted=admitted,
               accepted={rid: int(rng.integers(1, n + 1)) for rid, n in kept.items()})
    assert min(w.length[rid] - start[rid] for rid in ("a", "c")) > BLOCK   # past a page boundary each
    assert r.rows_checked["hot"] > 100, r.rows_checked


class CudaRecordingDevice(RecordingDevice):
    """The recording device as CUDA (its streams' handles the streams themselves): a split swap's step then asks for
    streams and events (CopySplit.step_part)."""
    is_cuda = True

    @staticmethod
    def handle(stream):
        return stream


class RecordedStep:
    """A step binding whose step_async logs its streams and event, then runs the host step."""

    def __init__(self, step, log, first):
        self.step, self.log, self.first = step, log, first

    def step_async(self, layer, n, part, stream=None, copy_stream=None, done=None):
        self.log.add("step", layer, self.first, n, part, stream, copy_stream, done)
        self.step.step_async(layer, n, part)


def test_dba_asks_cudas_streams_for_the_order_its_overlap_needs(monkeypatch):
    """Each DBA layer of a split step: the first half's decision on the forward's stream, its copy on the copy stream
    recording the first-half event; the second half's on a step bound from the first half's last row, its copy on
    the same copy stream recording the copy event (which Attn1 waits for, vllm_overlap.py: the copies in order on
    one stream, it covers both). A DA layer (or a DBA layer the indexer did not split) steps every row once."""
    device = CudaRecordingDevice()
    monkeypatch.setattr(adapter._device, "for_device", lambda name: device)
    bound = adapter.DecodeOverlap.offset_step
    monkeypatch.setattr(adapter.DecodeOverlap, "offset_step",
                        lambda self, decode, first: RecordedStep(bound(self, decode, first), device.log, first))
    r = Replay(1, BLOCK - 1, seed=83, hot_regions=1, overlap="dba", blocks_from_output=True)
    overlap = r.decode.overlap
    r.decode.step_binding = RecordedStep(r.decode.step_binding, device.log, 0)
    batch, states = three_requests(r)
    r.world.go_hot("a")
    r.world.go_hot("c")
    device.log.entries.clear()
    before = r.dba_splits
    batch, states, _ = shuffled_decode_step(r, batch, states, 1)   # uniform, no graph padding: split
    assert r.dba_splits == before + LAYERS
    steps = [e for e in device.log.entries if e[0] == "step"]
    current, copy = device.current_stream(), overlap.copy_stream
    assert len(steps) == 2 * LAYERS and copy is not current
    for layer in range(LAYERS):
        first, second = steps[2 * layer:2 * layer + 2]
        assert first[1:] == (layer, 0, 2, 0, current, copy, overlap.first_copy_done), first
        assert second[1:] == (layer, 2, STATES - 2, 1, current, copy, overlap.copy_done), second
    device.log.entries.clear()
    prefill(r, "d", 1, 40, 100, others=batch, other_states=states)   # decodes beside a prefill: not split
    steps = [e for e in device.log.entries if e[0] == "step"]
    assert steps and all(e[2:] == (0, STATES, 0, current, copy, overlap.copy_done) for e in steps), steps
