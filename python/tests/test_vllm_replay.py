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
  kv write     models/deepseek_v32/attention.py -> model_executor/layers/attention/mla_attention.py
               MLAAttention.update_kv_cache: HiSparseCacheHandle.write_target -> do_kv_cache_update at the
               resident slot mapping; the connector worker's row mirror copies the rows into vLLM's host pool
               (kv_connector/v1/hisparse/worker.py _enqueue_row_dma, eager_host_mirror)
  swap         v1/attention/backends/mla/flashmla_sparse.py _forward_bf16_kv ->
               HiSparseMLAIndexGroup.convert_logical_to_physical_topk(layer, topk[:num_decode_tokens], metadata,
               block_stride_rows=None, return_valid_counts=True) -> HiSparseCacheHandle.swap_in -> runtime.swap_in;
               FlashMLA reads index_group.physical_kv_cache(layer) at the rows returned

Checks: every decode token's rows against the independent LRU model (lru_model.EngineModel, a request's row is
its state index) and every byte FlashMLA would read against the full cache, through condense and reorder,
CUDA-graph padded rows, MTP verify steps with rejected drafts (T > 1), steps vLLM resolves over resident pages,
preemption and state reuse. Mutation tests show the replay fails on a batch-row-as-state mapping and on a layer
counter shared across layers."""
import types

import numpy as np
import pytest
import torch

import ess
from ess.integrations import vllm as adapter
from lru_model import EngineModel
from mock_engine import ENTRY, check_rows
import vllm_upstream

LAYERS, K, CTX, STATES, BLOCK = 2, 16, 384, 5, 64
HOST_BYTES = STATES * CTX * LAYERS * ENTRY   # ESS's host pool: every state's longest request
UP = vllm_upstream.load()


class VllmWorld:
    """The model and vLLM's KV: each request's full cache (what attention reads with everything on the GPU),
    vLLM's host pool (one region per layer, the request's host blocks at fixed places) and resident cache."""

    def __init__(self, seed, T):
        self.rng = np.random.default_rng(seed)
        self.T, self.K = T, K
        self.full, self.length, self.prompt = {}, {}, {}
        self.host = [torch.zeros((STATES * (CTX // BLOCK + 1) * BLOCK, ENTRY), dtype=torch.uint8)
                     for _ in range(LAYERS)]
        self.host_base = {}   # request -> its first host row (vLLM's host blocks, contiguous here)
        self.resident = [torch.zeros((STATES * CTX // BLOCK + 2, BLOCK, ENTRY), dtype=torch.uint8)
                         for _ in range(LAYERS)]
        self._next_host = 0

    def new_request(self, rid, prompt):
        self.full[rid] = self.rng.integers(0, 256, (LAYERS, CTX, ENTRY), dtype=np.uint8)
        self.length[rid], self.prompt[rid] = 0, prompt
        self.host_base[rid] = self._next_host
        self._next_host += CTX // BLOCK * BLOCK + BLOCK

    def computed(self, rid, first, count):
        """The model computed tokens [first, first + count): the row mirror puts them in vLLM's host pool."""
        for layer in range(LAYERS):
            rows = self.host_base[rid] + np.arange(first, first + count)
            self.host[layer][rows] = torch.from_numpy(self.full[rid][layer, first:first + count])
        self.length[rid] = first + count

    def redraw_after(self, rid, position):
        """The drafts past `position` were rejected: the tokens decoded there next are other tokens."""
        self.full[rid][:, position:] = self.rng.integers(0, 256, self.full[rid][:, position:].shape, dtype=np.uint8)

    def read_host(self, rid_of_state):
        def read(state, first, count):
            rid = rid_of_state[state]
            rows = self.host_base[rid] + torch.arange(first, first + count)
            return torch.stack([self.host[layer][rows] for layer in range(LAYERS)])
        return read

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
    def __init__(self, T, slots, seed=1, host_memory=None, writer=True, barrier=None):
        """host_memory, writer, barrier: a rank of a node whose ranks share one host pool (EssDecode)."""
        self.T = T
        self.world = VllmWorld(seed, T)
        rows_per_request = slots + T
        latent = adapter.latent_buffers(LAYERS, STATES, rows_per_request)
        self.engine = ess.Engine(layers=LAYERS, max_requests=STATES, max_context=CTX, topk=K, query_tokens=T,
                                 slots=slots, reserve_newest=True, latent=latent, host_bytes=HOST_BYTES,
                                 host_memory=host_memory)
        self.rid_of_state = {}
        self.decode = adapter.EssDecode(self.engine, latent, STATES, self.world.read_host(self.rid_of_state),
                                        writer=writer, barrier=barrier)
        self.model = EngineModel(LAYERS, slots, T, reserve_newest=True)
        self.model_rows = {}   # request -> state the model admitted it at
        # vllm/v1/hisparse/binding.py bind_hisparse_kv_caches: each layer's handle bound to the resident cache
        # and its slot mapping (block_tables.slot_mappings, int64); the connector then puts ESS's runtime on it
        # (ess/integrations/vllm_connector.py EssConnectorWorker.register_kv_caches).
        self.slot_mapping = torch.full((1024,), -1, dtype=torch.int64)
        self.handles = []
        for layer in range(LAYERS):
            handle = UP["HiSparseCacheHandle"](None)
            # HiSparseCacheHandle.bind_cache's result for contiguous rows (PagedCacheView.bind reads
            # dtype.itemsize, which torch 1.13 lacks): the resident view, its block table and slot mapping.
            resident = self.world.resident[layer]
            handle.view = UP["PagedCacheView"](resident, resident, BLOCK, BLOCK)
            handle.block_table = torch.zeros((STATES, 8), dtype=torch.int32)
            handle.slot_mapping = self.slot_mapping
            handle.source_block_table = torch.zeros((STATES, CTX // BLOCK + 1), dtype=torch.int32)
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

    # ---- one step ----
    def step(self, batch, states, scheduled, finished=(), preempted=(), all_resident=False, pad_to=None,
             accepted=None):
        """batch: request ids in batch order (decodes first); states: their request-state indices; scheduled:
        {rid: (num_computed_tokens, num_scheduled_tokens)}; accepted: {rid: tokens of its verify step kept}."""
        T, w = self.T, self.world
        for rid in finished + tuple(preempted):
            if rid in self.model_rows:
                self.model.release(self.model_rows.pop(rid))
        for b, rid in enumerate(batch):
            self.rid_of_state[states[b]] = rid
        # kv_connector/v1/hisparse/connector.py HiSparseConnector.start_load_kv, then ESS's start_step
        # (vllm_connector.py HiSparseConnector.start_load_kv).
        sched = {rid: adapter.Scheduled(*scheduled[rid]) for rid in batch}
        # vLLM's decode split: the leading rows of at most T tokens (max_decode_query_len).
        decodes = []
        for rid in batch:
            if not 1 <= sched[rid].num_scheduled_tokens <= T:
                break
            decodes.append(rid)
        num_decode_tokens = sum(sched[rid].num_scheduled_tokens for rid in decodes)
        self.decode.start_step(batch, torch.tensor(states, dtype=torch.int32), sched, finished=finished,
                               preempted=preempted, all_context_pages_resident=all_resident,
                               forward=(len(decodes), num_decode_tokens))
        served = self.decode.batch
        num_actual = sum(sched[rid].num_scheduled_tokens for rid in batch)
        padded = pad_to or num_decode_tokens
        req_id_per_token = torch.zeros(max(padded, num_actual), dtype=torch.int32)
        query_start_loc = [0]
        for b, rid in enumerate(batch):
            n = sched[rid].num_scheduled_tokens
            req_id_per_token[query_start_loc[-1]:query_start_loc[-1] + n] = b
            query_start_loc.append(query_start_loc[-1] + n)
        attn = types.SimpleNamespace(
            num_decode_tokens=num_decode_tokens, num_actual_tokens=num_actual, max_query_len=max(
                sched[rid].num_scheduled_tokens for rid in batch), num_reqs=len(batch), num_decodes=len(decodes),
            req_id_per_token=req_id_per_token, block_table=self.handles[0].source_block_table, block_size=BLOCK,
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32))
        # connector.py start_step sets all_context_pages_resident on every handle; worker.py prepare_forward ->
        # HiSparseCacheHandle.prepare_group_for_batch (runtime.begin_forward()).
        for handle in self.handles:
            handle.all_context_pages_resident = all_resident
        self.group.prepare_for_batch(0, attn)
        # The model computes every scheduled token: mla_attention.py update_kv_cache writes decode tokens at the
        # resident slot mapping (HiSparseCacheHandle.write_target); the row mirror copies every row to host.
        slots = torch.full_like(self.slot_mapping, -1)
        for b, rid in enumerate(batch):
            c, n = sched[rid]
            if rid in decodes:
                for t in range(n):
                    slots[query_start_loc[b] + t] = self.resident_next
                    self.resident_next = (self.resident_next + 1) % (self.world.resident[0].shape[0] * BLOCK)
            w.computed(rid, c, n)
        self.slot_mapping.copy_(slots)
        for rid in decodes:
            if served and rid not in self.model_rows:
                self.model_rows[rid] = states[batch.index(rid)]
                self.model.admit(self.model_rows[rid])
        for layer in range(LAYERS):
            # The layer's KV write, then its attention (flashmla_sparse.py _forward_bf16_kv: the decode swap).
            cache, slot_rows, num_rows = self.handles[layer].write_target(num_actual, num_actual)
            flat = cache.reshape(-1, ENTRY)
            for i in range(num_rows):
                if slot_rows[i] >= 0:
                    rid = batch[int(req_id_per_token[i])]
                    position = sched[rid].num_computed_tokens + i - query_start_loc[int(req_id_per_token[i])]
                    flat[slot_rows[i]] = torch.from_numpy(w.full[rid][layer, position])
            # Each decode row's T query rows (the model's view): a row of n < T tokens has its n queries last.
            rows = []
            for rid in decodes:
                r = w.query_rows(rid, w.length[rid])
                r[: T - sched[rid].num_scheduled_tokens] = -1
                rows.append(r)
            topk = torch.full((padded, K), -1, dtype=torch.int32)
            for b, (rid, r) in enumerate(zip(decodes, rows)):
                n = sched[rid].num_scheduled_tokens
                topk[query_start_loc[b]:query_start_loc[b] + n] = torch.from_numpy(r[T - n:].astype(np.int32))
            if padded > num_decode_tokens:   # CUDA-graph padding: whatever the indexer left there
                topk[num_decode_tokens:] = topk[0]
            if not served:
                continue   # vLLM resolves this step over resident pages (index_group.py _convert_once)
            physical, valid = self.group.convert_logical_to_physical_topk(
                layer, topk, attn, block_stride_rows=None, return_valid_counts=True)
            assert physical.dtype == torch.int32 and valid.dtype == torch.int32
            assert tuple(physical.shape) == (padded, K)
            kv = self.group.physical_kv_cache(layer)
            assert kv.shape[1:] == (BLOCK, ENTRY)
            flat = kv.reshape(-1, ENTRY).numpy()
            per_row = np.full((len(decodes), T, K), -1, np.int32)
            for b, rid in enumerate(decodes):
                n = sched[rid].num_scheduled_tokens
                per_row[b, T - n:] = physical[query_start_loc[b]:query_start_loc[b] + n].numpy()
            model_batch = [(rid, self.model_rows[rid]) for rid in decodes]
            check_rows(w, self.model, np.stack(rows), [flat] * LAYERS, layer, model_batch, per_row)
            assert (physical[num_decode_tokens:] == -1).all(), "padded graph rows must come out as -1"
            np.testing.assert_array_equal(valid.numpy(), (physical >= 0).sum(1).numpy())
        # MTP: a verify step keeps `accepted` of its tokens; vLLM decodes other tokens in the others' places.
        for rid, kept in (accepted or {}).items():
            c, n = sched[rid]
            if kept < n:
                w.length[rid] = c + kept
                w.redraw_after(rid, c + kept)
        self.forwards_served += served > 0
        return served


def decode_step(batch, world, T, counts=None):
    """Every request of `batch` decodes T tokens (or counts[rid]: a verify step with fewer drafts) after what its
    last step kept."""
    return {rid: (world.length[rid], (counts or {}).get(rid, T)) for rid in batch}


def prefill(replay, rid, state, prompt, chunk, others=(), other_states=()):
    """The prompt in chunks (chunked prefill), beside decoding requests."""
    w = replay.world
    w.new_request(rid, prompt)
    done = 0
    while done < prompt:
        n = min(chunk, prompt - done)
        scheduled = decode_step(others, w, replay.T)
        scheduled[rid] = (done, n)
        replay.step(list(others) + [rid], list(other_states) + [state], scheduled)
        done += n


@pytest.mark.parametrize("T,slots", [(1, 24), (3, 56)])
def test_decode_replay_matches_the_model_and_the_full_cache(T, slots, **rank):
    """rank: Replay's host_memory / writer / barrier, when a rank of a shared pool runs it (test_vllm_shared_pool)."""
    r = Replay(T, slots, seed=3 + T, **rank)
    w = r.world
    prefill(r, "a", 2, 150, 100)
    prefill(r, "b", 0, 90, 64, others=["a"], other_states=[2])
    prefill(r, "c", 4, 70, 200, others=["b", "a"], other_states=[0, 2])
    batch, states = ["a", "b", "c"], [2, 0, 4]
    for step in range(10):
        # Condense and reorder: the batch rows change, each request keeps its state index.
        rng = np.random.default_rng(step)
        order = rng.permutation(len(batch))
        batch, states = [batch[i] for i in order], [states[i] for i in order]
        # MTP: some verify steps carry fewer drafts, and each keeps part of its tokens.
        counts = {rid: int(rng.integers(1, T + 1)) for rid in batch} if T > 1 and step % 2 else None
        scheduled = decode_step(batch, w, T, counts)
        pad = sum(n for _, n in scheduled.values()) + (T if step % 3 == 0 else 0)   # a graph for a larger batch
        accepted = {rid: int(rng.integers(1, n + 1)) for rid, (_, n) in scheduled.items()} if T > 1 else None
        assert r.step(batch, states, scheduled, pad_to=pad, accepted=accepted) == len(batch)
    assert r.forwards_served == 13   # 3 steps decoded beside the prefills of "b" and "c"
    assert all(h.runtime.steps_served == r.forwards_served for h in r.handles)


def test_rows_of_fewer_than_t_tokens():
    """vLLM's decodes are the rows of at most T tokens: a whole prompt of T tokens (nothing computed yet), the
    last chunk of a chunked prefill, a verify step with fewer drafts. ESS serves each with its queries last and
    its older tokens in the reserved rows beside the new ones."""
    T = 3
    r = Replay(T, 56, seed=17)
    w = r.world
    w.new_request("tiny", 3)
    assert r.step(["tiny"], [1], {"tiny": (0, 3)}) == 1                     # a 3-token prompt, one step
    w.new_request("long", 130)
    for done, n in ((0, 64), (64, 64)):
        scheduled = decode_step(["tiny"], w, T)
        scheduled["long"] = (done, n)
        r.step(["tiny", "long"], [1, 3], scheduled)
    scheduled = decode_step(["tiny"], w, T, {"tiny": 1})
    scheduled["long"] = (128, 2)                                             # the prompt's tail: a decode row
    assert r.step(["tiny", "long"], [1, 3], scheduled) == 2
    for step in range(6):
        counts = {"tiny": 1 + step % 3, "long": 3 - step % 3}
        scheduled = decode_step(["long", "tiny"], w, T, counts)
        accepted = {rid: max(1, n - step % 2) for rid, (_, n) in scheduled.items()}
        assert r.step(["long", "tiny"], [3, 1], scheduled, accepted=accepted) == 2


def test_preemption_and_a_reused_state():
    T = 1
    r = Replay(T, 24, seed=11)
    w = r.world
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
    w.length["a"] = 0
    done = 0
    while done < length_a:
        n = min(120, length_a - done)
        scheduled = decode_step(["c"], w, T)
        scheduled["a"] = (done, n)
        r.step(["c", "a"], [1, 0], scheduled)
        done += n
    for _ in range(3):
        r.step(["a", "c"], [0, 1], decode_step(["a", "c"], w, T))
    assert r.decode.state_of == {"a": 0, "c": 1}


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


def test_a_stale_state_mapping_fails_the_replay(monkeypatch):
    """Mutation: the batch row taken as the request's state (no refresh after condense and reorder)."""
    start = adapter.EssDecode.start_step

    def batch_rows(self, request_ids, request_state_indices, *a, **k):
        return start(self, request_ids, torch.arange(len(request_ids), dtype=torch.int32), *a, **k)

    monkeypatch.setattr(adapter.EssDecode, "start_step", batch_rows)
    with pytest.raises((AssertionError, ess.EssError)):
        test_decode_replay_matches_the_model_and_the_full_cache(1, 24)


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
        test_decode_replay_matches_the_model_and_the_full_cache(1, 24)
