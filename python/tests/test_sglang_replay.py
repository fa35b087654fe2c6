"""SGLang 0.5.23's decode loop replayed through ess.integrations.sglang.HiSparseCoordinator on CPU torch,
each step in upstream's order and citing the upstream function it stands for (sglang/srt/...):

  prefill      ScheduleBatch.prepare_for_extend -> mem_cache/allocation.py alloc_for_extend
               (allocate_spec_scratch, HiSparseTokenToKVPoolAllocator.alloc_extend); the model writes the
               prompt's KV with set_mla_kv_buffer(out_cache_loc)
  staging      batch_result_processor.process_batch_result_prefill -> admit_request_into_staging
  ready        scheduler.get_next_batch_to_run -> collect_ready_reqs
  decode prep  ScheduleBatch.prepare_for_decode: alloc_for_decode, seq_lens += 1, map_last_loc_to_buffer
               (5 positional)
  forward      model_runner._forward_raw: wait_for_pending_backup, num_real_reqs.fill_(bs);
               decode_cuda_graph_runner.load_batch pads to the graph batch and num_real_reqs.fill_(raw_bs);
               per layer the model's set_mla_kv_buffer(out_cache_loc) then dsa_backend.forward_decode:
               swap_in_selected_pages(req_pool_indices, seq_lens, topk_indices, layer_id) -> FlashMLA reads
               kv_buffer[layer][page_table_1]
  overlap      event_loop_overlap: step N+1 is prepared and launched before step N's result is processed,
               so a request finished at step N is still in step N+1 and is released after it
  finish       batch_result_processor._handle_finish_state_updated_req -> request_finished, then
               release_kv_cache -> allocator.free(req_to_token[idx, :kv_allocated_len])
  retract      schedule_batch.release_req -> retract_req (mid-decode, and while staging)

Checks: every page table row against the independent LRU model (lru_model.py) and every byte FlashMLA
would read against the request's full cache (attention over those bytes is then bit-identical to
attention over the full cache); every host entry at the end; ESS's device rows never handed to
SGLang's allocator. The mutation tests show the replay fails when the remap is ignored,
num_real_reqs is read early, or the current step's rows are written back."""
import sys
import types

import numpy as np
import pytest
import torch

import ess
from ess.integrations import sglang as adapter
from lru_model import EngineModel
from sglang_pools import ENTRY, HiSparseAllocator, HiSparseDevicePool, ReqToTokenPool

LAYERS, K, SLOTS, PAGE, REQ_SLOTS, CTX = 3, 16, 24, 8, 6, 512
POOL, RATIO = 1024, 4


class Req:
    def __init__(self, rid, idx, n):
        self.rid = rid
        self.kv = types.SimpleNamespace(req_pool_idx=idx, kv_allocated_len=n)
        self.extend_end = n
        self.hisparse_staging = False


class World:
    """SGLang's side (pools, requests, the model's bytes) and the checks."""

    T = 1            # query tokens per request per step (the draft tokens of a verify step)
    SLOTS = SLOTS
    # resolve_shared_index_layers' pattern (GLM-5.2's index sharing): a shared layer reuses the top-k tensor of the
    # layer before it (forward_mla.py: prev_topk_indices), None for a model without sharing.
    SHARED = None
    shared_swaps = 0   # swaps of shared layers

    def __init__(self, seed, cls=adapter.HiSparseCoordinator, graph_pad=True, page=PAGE):
        self.rng = np.random.default_rng(seed)
        self.req_to_token_pool = ReqToTokenPool(REQ_SLOTS, CTX)
        self.device_pool = HiSparseDevicePool(POOL, page, LAYERS)
        self.allocator = HiSparseAllocator(POOL, page, self.device_pool, RATIO)
        # model_runner.maybe_init_hisparse_coordinator: the keywords it passes.
        self.coord = cls(req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
                         top_k=K, device_buffer_size=self.SLOTS, device="cpu", tp_group=None,
                         host_to_device_ratio=RATIO, swap_in_block_size=960, shared_index_layers=self.SHARED,
                         num_draft_tokens=0 if self.T == 1 else self.T)
        # scheduler.init_hisparse_coordinator
        self.coord.set_decode_producer_stream(self.coord.dev.Stream())
        self.model = EngineModel(LAYERS, self.SLOTS, self.T, reserve_newest=True, warmup_windows=32)
        self.full = {}       # rid -> [layers, CTX, E] the bytes every token's KV has
        self.length = {}     # rid -> tokens (prompt + decoded)
        self.reqs = {}       # rid -> Req
        self.running = []    # rids in decode
        self.graph_pad = graph_pad
        self.next_rid = 0
        self.rows_checked = 0

    # ---- prefill and staging ----
    def prefill(self, n, rid=None, idx=None):
        if rid is None:
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            self.full[rid] = self.rng.integers(0, 256, (LAYERS, CTX, ENTRY), dtype=np.uint8)
        used = {r.kv.req_pool_idx for r in self.reqs.values()}
        idx = min(set(self.req_to_token_pool.free_slots) - used) if idx is None else idx
        req = Req(rid, idx, n)
        # alloc_for_extend: speculative scratch (none here), then logical ids and device slots.
        self.coord.allocate_spec_scratch([idx])
        locs = self.allocator.alloc_extend(n)
        self.req_to_token_pool.req_to_token[idx, :n] = locs.to(torch.int32)
        for layer in range(LAYERS):  # the prefill forward's KV write
            self.device_pool.set_mla_kv_buffer(layer, locs, torch.from_numpy(self.full[rid][layer, :n]))
        self.reqs[rid], self.length[rid] = req, n
        # process_batch_result_prefill
        self.coord.admit_request_into_staging(req)
        assert req.hisparse_staging
        self.check_host_slots(idx, n)
        return rid

    def check_host_slots(self, idx, n):
        """What SGLang reads of the host pool's tables after admission, as upstream's alloc_paged_token_slots
        leaves them: n tokens' slots, page-rounded, distinct; -1 past them; the rounded allocated length."""
        end = -(-n // self.coord.page_size) * self.coord.page_size if n else 0
        row = self.coord.req_to_host_pool[idx]
        assert int(self.coord.req_to_host_pool_allocated_len[idx]) == end
        assert bool((row[:end] >= 0).all()) and bool((row[end:] == -1).all())
        assert len(set(row[:end].tolist())) == end

    def collect(self):
        """get_next_batch_to_run: staged requests join decode (as upstream, after alloc_device_buffer)."""
        for req in self.coord.collect_ready_reqs():
            assert not req.hisparse_staging
            self.model.admit(req.kv.req_pool_idx)
            self.model.follow(req.kv.req_pool_idx, *self.coord.engine.residency(req.kv.req_pool_idx))
            n = self.length[req.rid]
            keep = min(n, self.SLOTS)
            ids = list(range(n - keep, n))     # the first residency: the prompt's last `slots` tokens
            flat = [-1] * ((-keep) % K) + ids
            windows = [flat[i:i + K] for i in range(0, len(flat), K)]
            self.model.warmup(req.kv.req_pool_idx, [windows] * LAYERS)
            self.running.append(req.rid)

    # ---- one decode step ----
    def prepare_decode(self):
        """ScheduleBatch.prepare_for_decode for the running batch."""
        rids = list(self.running)
        self.rng.shuffle(rids)
        bs = len(rids)
        out_cache_loc = self.allocator.alloc_decode(bs)
        for rid, loc in zip(rids, out_cache_loc.tolist()):
            req = self.reqs[rid]
            self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, self.length[rid]] = loc
            self.length[rid] += 1
            req.kv.kv_allocated_len = self.length[rid]
        idx = torch.tensor([self.reqs[r].kv.req_pool_idx for r in rids], dtype=torch.int64)
        seq_lens = torch.tensor([self.length[r] for r in rids], dtype=torch.int64)
        # seq_lens and seq_lens_cpu are new tensors after += 1; the call passes 5 positionals.
        self.coord.map_last_loc_to_buffer(seq_lens, out_cache_loc, idx, seq_lens.clone(), idx.clone())
        for rid in rids:   # the host slots grow with the request
            self.check_host_slots(self.reqs[rid].kv.req_pool_idx, self.length[rid])
        return types.SimpleNamespace(rids=rids, out_cache_loc=out_cache_loc, idx=idx, seq_lens=seq_lens, grow=0)

    def forward(self, batch):
        """model_runner._forward_raw over the batch, padded as the CUDA-graph runner pads it."""
        coord, bs = self.coord, len(batch.rids)
        coord.wait_for_pending_backup()
        coord.num_real_reqs.fill_(bs)
        pad = int(self.rng.integers(0, 3)) if self.graph_pad else 0
        pad = min(pad, REQ_SLOTS + 1 - bs)
        # Padded positions point at SGLang's padding row 0. The CUDA-graph runner's load_batch then fills
        # num_real_reqs with the real batch; eager DP padding (_prepare_eager_forward_batch) with the padded
        # one, so that only row 0 says a position is padding.
        idx = torch.cat([batch.idx, torch.zeros(pad, dtype=torch.int64)])
        seq_lens = torch.cat([batch.seq_lens, torch.ones(pad, dtype=torch.int64)])
        coord.num_real_reqs.fill_(bs if self.rng.random() < 0.5 else bs + pad)
        for layer in range(LAYERS):
            # The layer's KV write of this step's token, then the indexer's top-k and the swap.
            new = torch.from_numpy(np.stack([self.full[r][layer, self.length[r] - 1] for r in batch.rids]))
            self.device_pool.set_mla_kv_buffer(layer, batch.out_cache_loc, new)
            if not (self.SHARED and self.SHARED[layer]):
                rows = [self.query(r) for r in batch.rids] + [[0] + [-1] * (K - 1)] * pad
                topk = torch.tensor(rows, dtype=torch.int32)   # dsa_indexer.py: the top-k positions are int32
            else:
                self.shared_swaps += 1
            table = coord.swap_in_selected_pages(idx, seq_lens, topk, layer)
            assert table.dtype == torch.int32 and tuple(table.shape) == (bs + pad, K)
            self.check(layer, batch, rows, table)

    def query(self, rid):
        n = self.length[rid]
        k = min(K, n)
        ids = self.rng.choice(n, k, replace=False)
        if self.rng.random() < 0.5:
            ids = np.unique(np.concatenate([[n - 1], ids]))[:k]
        return ids.tolist() + [-1] * (K - k)

    def check(self, layer, batch, rows, table):
        """rows[b]: the T query tokens' ids of position b ([K] when T = 1); table likewise."""
        kv = self.device_pool.kv_buffer[layer][:, 0].numpy()
        base = self.coord.row_base
        for b, rid in enumerate(batch.rids):
            idx = self.reqs[rid].kv.req_pool_idx
            queries = [rows[b]] if self.T == 1 else rows[b]
            got_rows = [table[b].tolist()] if self.T == 1 else table[b].tolist()
            self.model.follow(idx, *self.coord.engine.residency(idx))   # ESS_RESIDENCY: whole or sparse now
            expected, _, _ = self.model.step(idx, layer, self.length[rid] + batch.grow, queries)
            for t, (query, got, exp) in enumerate(zip(queries, got_rows, expected)):
                want = [-1 if e < 0 else e + base for e in exp]
                assert got == want, f"layer {layer} request {rid} query {t}: page table {got} vs the model's {want}"
                for i, slot in zip(query, got):
                    if i >= 0 and not np.array_equal(kv[slot], self.full[rid][layer, i]):
                        raise AssertionError(f"layer {layer} request {rid} token {i}: slot {slot} holds other "
                                             "bytes than the full cache")
            self.rows_checked += 1
        for b in range(len(batch.rids), table.shape[0]):
            assert (table[b] == -1).all(), f"padded position {b}: {table[b].tolist()}"

    def step(self):
        self.forward(self.prepare_decode())

    # ---- results ----
    def finish(self, rid):
        """_handle_finish_state_updated_req -> request_finished, then release_kv_cache."""
        self._drop(rid, self.coord.request_finished)

    def retract(self, rid):
        """release_req -> retract_req; the request goes back to the waiting queue and is prefilled again.
        Returns its length."""
        return self._drop(rid, self.coord.retract_req)

    def _drop(self, rid, coordinator_call):
        req = self.reqs.pop(rid)
        coordinator_call(req)
        self.check_host_slots(req.kv.req_pool_idx, 0)   # upstream's request_finished frees them
        self.release_kv(req)
        if rid in self.running:
            self.running.remove(rid)
            self.model.release(req.kv.req_pool_idx)
        return self.length.pop(rid)

    @classmethod
    def one_running(cls, seed, n=40):
        """A world with one request of n tokens in decode: (world, its req_pool_idx, ESS's (row, length))."""
        w = cls(seed)
        w.prefill(n)
        w.collect()
        idx = w.reqs[w.running[0]].kv.req_pool_idx
        return w, idx, w.coord.engine.request(idx)

    def release_kv(self, req):
        idx = req.kv.req_pool_idx
        self.allocator.free(self.req_to_token_pool.req_to_token[idx, :req.kv.kv_allocated_len].to(torch.int64))
        inner = self.allocator.hisparse_attn_allocator
        assert len(inner.free_pages) == 0 or int(inner.free_pages.max()) <= inner.num_pages, \
            "ESS's rows were handed to SGLang's allocator"

    def check_host(self):
        self.coord.wait_for_pending_backup()
        self.coord.decode_backup_stream.synchronize()
        for rid in self.running:
            # Decode: the last token's entry is backed up by the next step; a verify step's are all committed.
            idx, n = self.reqs[rid].kv.req_pool_idx, self.length[rid] - (1 if self.T == 1 else 0)
            for layer in range(LAYERS):
                back = self.coord.engine.read_entries(idx, layer, 0, np.empty((n, ENTRY), np.uint8))
                np.testing.assert_array_equal(back, self.full[rid][layer, :n],
                                              err_msg=f"request {rid} layer {layer}: host pool")


def replay(cls=adapter.HiSparseCoordinator, seed=0, steps=14, graph_pad=True, page=PAGE, world=World):
    """The overlap scheduler's loop over a changing batch; raises AssertionError on any difference."""
    w = world(seed, cls, graph_pad, page)
    for n in (40, 90, 23):
        w.prefill(n)
    w.collect()
    pending_finish = []   # finished at step N, released after step N+1 launched (overlap)
    for step in range(steps):
        if step == 3:
            w.prefill(70)                      # arrives mid-run
        if step == 5:
            rid = w.prefill(30)                # retracted while staging
            w.retract(rid)
        w.collect()
        w.step()
        for rid in pending_finish:             # process_batch_result of step N after step N+1's launch
            w.finish(rid)
        pending_finish = []
        if step == 4:
            pending_finish.append(w.running[0])
        if step == 8:                          # retract mid-decode, then prefill it again at its length
            rid = w.running[-1]
            n = w.retract(rid)
            w.prefill(n, rid=rid)
    for rid in pending_finish:
        w.finish(rid)
    w.check_host()
    for rid in list(w.reqs):
        w.finish(rid)
    assert w.coord.engine.stats().requests == 0 and not w.coord._length
    inner = w.allocator.hisparse_attn_allocator
    assert inner.available_size() == inner.size, \
        f"SGLang's device allocator has {inner.size - inner.available_size()} slots still in use after every request"
    assert w.rows_checked > 100
    w.stats = w.coord.engine.stats()
    w.coord.destroy()
    return w


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_in_upstream_order(seed):
    replay(seed=seed)


def test_replay_without_graph_padding():
    replay(seed=5, graph_pad=False)


@pytest.mark.parametrize("seed", [0, 3])
def test_replay_with_adaptive_residency(seed, monkeypatch):
    """ESS_RESIDENCY=adaptive: requests whole while ESS's rows are free (their ids read in place), demoted when an
    admission needs a row (a request arriving mid-run, a retracted one prefilled again), promoted back as requests
    finish; the page tables follow the model, every row read holds its token's bytes, the host pool is complete."""
    monkeypatch.setenv("ESS_RESIDENCY", "adaptive")
    st = replay(seed=seed).stats
    assert st.whole_steps > 0 and st.sparse_steps > 0, st
    assert st.demotions > 0 and st.promotions > 0, st


def test_adaptive_residency_demotes_a_stepping_whole_request(monkeypatch):
    """A whole request that has decoded (its query rows recorded) is demoted when later admissions need its rows;
    the model replays what it recorded and the page tables, bytes and host pool must still agree; finishes then
    promote requests back."""
    monkeypatch.setenv("ESS_RESIDENCY", "adaptive")
    w = World(7)
    replayed = []
    follow = w.model.follow

    def counting_follow(row, whole, units):
        if not whole and row in w.model.units and any(w.model.recorded[(row, layer)] for layer in range(LAYERS)):
            replayed.append(row)
        follow(row, whole, units)
    w.model.follow = counting_follow
    for n in (40, 60, 30, 20):      # a rising load: 2, 3, 2 and 1 rows of SLOTS tokens, REQ_SLOTS rows in all
        w.prefill(n)
        w.collect()
        for _ in range(3):
            w.step()
    for rid in list(w.running)[:2]:  # and falling
        w.finish(rid)
        w.step()
    for _ in range(3):
        w.step()
    w.check_host()
    st = w.coord.engine.stats()
    assert replayed, f"no whole request that had decoded was demoted: {st}"
    assert st.promotions > 0 and st.whole_steps > 0 and st.sparse_steps > 0, st
    for rid in list(w.reqs):
        w.finish(rid)
    w.coord.destroy()


def test_residency_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ESS_RESIDENCY", "full")
    with pytest.raises(ess.InvalidArgument, match="ESS_RESIDENCY = 'full': one of sparse, whole, adaptive"):
        World(0)


def test_replay_with_page_size_one():
    """alloc_for_decode's page-size-one path maps each new token to a device slot of SGLang's, which the
    remap must give back (the replay checks the allocator is whole at the end)."""
    replay(seed=6, page=1)


class TboWorld(World):
    """Two-batch overlap (batch_overlap/two_batch_overlap.py): the model's first DENSE layers run on the whole
    batch (deepseek_v2.py: first_k_dense_replace), every other layer once per micro-batch, A(l) then B(l) on one
    stream (batch_overlap/operations.py execute_overlapped_operations), each micro-batch the first or the second
    half of the requests (split_seq_index = bs // 2) with its own req_pool_indices, seq_lens and out_cache_loc:
    eager, copies padded with row 0 to one length (TboForwardBatchPreparer.filter_batch,
    ForwardBatch._pad_tbo_child_inputs), a micro-batch without requests not run (deepseek_v2.py); under a CUDA
    graph, views of the graph's static buffers split at the graph batch's half
    (TboAttnBackend._dispatch_children_from_replay_view). num_real_reqs holds the whole batch's count."""

    DENSE = 1
    tbo_layers = 0   # layers run per micro-batch

    def forward(self, batch):
        coord, bs = self.coord, len(batch.rids)
        coord.wait_for_pending_backup()
        coord.num_real_reqs.fill_(bs)
        whole, halves = micro_batches(self.rng, batch.idx, batch.seq_lens, 1)
        carried = {}   # micro-batch -> its last indexer's (rows, top-k tensor)
        for layer in range(LAYERS):
            for part_idx, part_lens, positions in ([whole] if layer < self.DENSE else halves):
                real = [p for p in positions if p is not None and p < bs]
                part = types.SimpleNamespace(rids=[batch.rids[p] for p in real], grow=batch.grow)
                if real:   # the micro-batch's layer writes its own tokens' KV, then its indexer and swap
                    new = torch.from_numpy(np.stack([self.full[r][layer, self.length[r] - 1] for r in part.rids]))
                    self.device_pool.set_mla_kv_buffer(layer, batch.out_cache_loc[real], new)
                if not (self.SHARED and self.SHARED[layer]):
                    rows = [self.query(r) for r in part.rids] + [[0] + [-1] * (K - 1)] * (len(positions) - len(real))
                    carried[id(positions)] = rows, torch.tensor(rows, dtype=torch.int32)
                else:
                    self.shared_swaps += 1
                    if id(positions) not in carried:   # a dense leader's whole batch: this micro-batch's rows of it
                        whole_rows = carried[id(whole[2])][0]
                        rows = [whole_rows[p] if p is not None and p < bs else [0] + [-1] * (K - 1) for p in positions]
                        carried[id(positions)] = rows, torch.tensor(rows, dtype=torch.int32)
                rows, topk = carried[id(positions)]
                table = coord.swap_in_selected_pages(part_idx, part_lens, topk, layer)
                assert tuple(table.shape) == (len(positions), K)
                self.check(layer, part, rows, table)
            self.tbo_layers += layer >= self.DENSE


def micro_batches(rng, idx, seq_lens, T):
    """The whole batch and its two micro-batches, (req_pool_indices, seq_lens, positions) each: positions are the
    whole batch's request positions, None or past the batch for padding; seq_lens have T per request (a verify
    step's per-token lengths when T > 1). At random, a CUDA graph's (the batch padded with row 0, its halves
    views of the padded buffers) or eager ones (each half a copy padded with row 0 to one length; a half without
    requests not run)."""
    bs = int(idx.shape[0])
    zeros, ones = (lambda n: torch.zeros(n, dtype=idx.dtype)), (lambda n: torch.ones(n * T, dtype=seq_lens.dtype))
    if rng.random() < 0.5:
        pad = min(int(rng.integers(0, 3)), REQ_SLOTS + 1 - bs)
        idx, seq_lens = torch.cat([idx, zeros(pad)]), torch.cat([seq_lens, ones(pad)])
        half = (bs + pad) // 2
        return (idx, seq_lens, list(range(bs + pad))), [
            (idx[:half], seq_lens[:half * T], list(range(half))),
            (idx[half:], seq_lens[half * T:], list(range(half, bs + pad)))]
    half = bs // 2
    width = max(half, bs - half)
    halves = []
    for lo, hi in ((0, half), (half, bs)):
        if hi > lo:
            n = hi - lo
            halves.append((torch.cat([idx[lo:hi], zeros(width - n)]),
                           torch.cat([seq_lens[lo * T:hi * T], ones(width - n)]),
                           list(range(lo, hi)) + [None] * (width - n)))
    return (idx, seq_lens, list(range(bs))), halves


@pytest.mark.parametrize("seed", [0, 3])
def test_replay_with_two_batch_overlap(seed):
    """Each micro-batch's swap serves its own requests' bytes, eager and under a CUDA graph's views."""
    w = replay(seed=seed, world=TboWorld)
    assert w.tbo_layers > 20


class SharedIndexWorld(World):
    SHARED = [False, True, True]   # layer 0's indexer serves layers 1 and 2


class SharedIndexTboWorld(TboWorld):
    SHARED = [False, False, True]  # the dense layer 0 on the whole batch; layer 1 leads layer 2 per micro-batch


class DenseLeaderTboWorld(TboWorld):
    SHARED = [False, True, True]   # the dense layer 0 leads layers 1 and 2, which run per micro-batch


@pytest.mark.parametrize("world,seed", [(SharedIndexWorld, 0), (SharedIndexWorld, 4), (SharedIndexTboWorld, 0)])
def test_replay_with_shared_index_layers(world, seed):
    """GLM-5.2's index sharing: a shared layer's step starts at its leader's swap (shared_index.py) and serves what
    the independent LRU model of that layer's pool says, with CUDA-graph padding and under two-batch overlap."""
    w = replay(seed=seed, world=world)
    assert w.shared_swaps > 20 and w.coord.shared_index.prefetched == w.shared_swaps


def test_followers_of_a_dense_leader_under_two_batch_overlap_swap_themselves():
    """A dense leader swaps the whole batch, its followers run per micro-batch (a pairing SGLang refuses with index
    sharing): the prefetch of the whole batch serves no micro-batch, each follower swaps itself after it, and every
    table is still the LRU model's (the prefetch's step touched the same ids of each request's pool first: the
    same decisions, then all hits)."""
    w = replay(seed=2, world=DenseLeaderTboWorld)
    assert w.shared_swaps > 20 and w.coord.shared_index.prefetched == 0



class StagesOncePerForward(adapter.HiSparseCoordinator):
    """Every swap of a forward reads the rows staged at its first (the adapter before two-batch overlap)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        slot, same = self._batches.slot, torch.zeros(1)
        self._batches.slot = lambda layer, req_pool_indices: slot(layer, same)


def test_micro_batches_reading_the_whole_batchs_rows_fail_the_replay():
    replay(StagesOncePerForward, seed=0)   # one batch a forward: the same as staging per batch
    with pytest.raises((AssertionError, ess.EssError)):
        replay(StagesOncePerForward, seed=0, world=TboWorld)


# ---- the replay fails when the adapter does what the old one did ----
class IgnoresRemap(adapter.HiSparseCoordinator):
    """map_last_loc_to_buffer leaves out_cache_loc unmapped: the model's write lands in the padding sink."""

    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, *rest):
        mapping = self.mem_pool_device.full_to_hisparse_device_index_mapping
        saved = mapping.clone()
        super().map_last_loc_to_buffer(seq_lens, out_cache_loc, *rest)
        mapping.copy_(saved)


class ReadsNumRealEarly(adapter.HiSparseCoordinator):
    """num_real_reqs read when the step is prepared, not when the swap runs (fill_ before a replay is lost)."""

    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, *rest):
        super().map_last_loc_to_buffer(seq_lens, out_cache_loc, *rest)
        self._early = int(self.num_real_reqs.item())

    def swap_in_selected_pages(self, req_pool_indices, seq_lens, top_k_result, layer_id):
        now = self.num_real_reqs.clone()
        self.num_real_reqs.fill_(getattr(self, "_early", 0))
        try:
            return super().swap_in_selected_pages(req_pool_indices, seq_lens, top_k_result, layer_id)
        finally:
            self.num_real_reqs.copy_(now)


class WritesBackCurrentStep(adapter.HiSparseCoordinator):
    """wait_for_pending_backup (before the forward) writes back the step about to run, from reserved rows the
    model has not written yet, and counts it as done: the old adapter's flush."""

    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu, idx_cpu):
        super().map_last_loc_to_buffer(seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu, idx_cpu)
        self._current = (req_pool_indices.clone(), seq_lens.clone())

    def wait_for_pending_backup(self):
        super().wait_for_pending_backup()
        current, self._current = getattr(self, "_current", None), None
        if current is not None:
            rows, lengths = current
            B = rows.shape[0]
            self._backup_rows[:B].copy_(rows)
            self._backup_lengths[:B].copy_(lengths)
            for layer in range(self.layer_num):
                self._write_back.write_back(layer, B, None)
            self._flushed = True

    def _backup_previous_step(self):
        if getattr(self, "_flushed", False):   # already "written back"
            self._flushed = False
            self._backup_due = None
        super()._backup_previous_step()


class LeavesHostSlotsUnfilled(adapter.HiSparseCoordinator):
    """Staging admits the request to ESS but leaves req_to_host_pool as it was (-1), as ESS once did."""

    def admit_request_into_staging(self, req):
        super().admit_request_into_staging(req)
        idx = req.kv.req_pool_idx
        self.req_to_host_pool[idx].fill_(-1)
        self.req_to_host_pool_allocated_len[idx] = 0


class KeepsHostSlotsAfterFinish(adapter.HiSparseCoordinator):
    """request_finished leaves the request's host slots in req_to_host_pool (a later request would read them)."""

    def _forget_host_slots(self, idx):
        pass


@pytest.mark.parametrize("cls", [IgnoresRemap, ReadsNumRealEarly, WritesBackCurrentStep, LeavesHostSlotsUnfilled,
                                 KeepsHostSlotsAfterFinish])
def test_the_replay_catches(cls):
    with pytest.raises((AssertionError, ess.InvalidArgument)):
        replay(cls, seed=0)


# ---- the top-k recorder (ESS_RECORD_TRACE) ----
class LogsTheTopk(adapter.HiSparseCoordinator):
    """What SGLang hands the swap, by request (rid, admission), per step: the ids of every layer and the length
    the step's last query token sees; the oracle of the recorder's trace."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.handed, self.open, self.admitted = {}, {}, 0

    def collect_ready_reqs(self):
        ready = super().collect_ready_reqs()
        for req in ready:
            self.admitted += 1
            self.open[req.kv.req_pool_idx] = key = (req.rid, self.admitted)
            self.handed[key] = []
        return ready

    def request_finished(self, req):
        super().request_finished(req)
        self.open.pop(req.kv.req_pool_idx, None)

    def _new_step(self, rows):
        for row in rows:
            if row in self.open:
                self.handed[self.open[row]].append((np.full((LAYERS, self.T, K), -1, np.int32), self._length[row]))

    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, *rest):
        super().map_last_loc_to_buffer(seq_lens, out_cache_loc, req_pool_indices, *rest)
        self._new_step(req_pool_indices.tolist())

    def prepare_spec_verify(self, batch):
        super().prepare_spec_verify(batch)
        self._new_step([req.kv.req_pool_idx for req in batch.reqs])

    def swap_in_selected_pages(self, req_pool_indices, seq_lens, top_k_result, layer_id):
        table = super().swap_in_selected_pages(req_pool_indices, seq_lens, top_k_result, layer_id)
        for b, row in enumerate(req_pool_indices.tolist()):
            if row in self.open:
                self.handed[self.open[row]][-1][0][layer_id] = top_k_result[b].view(self.T, K).numpy()
        return table


def recorded_and_handed(tmp_path, monkeypatch, world, requests=3, steps=6, seed=1):
    path = tmp_path / "recorded.safetensors"
    monkeypatch.setenv("ESS_RECORD_TRACE", str(path))
    monkeypatch.setenv("ESS_RECORD_REQUESTS", str(requests))
    monkeypatch.setenv("ESS_RECORD_STEPS", str(steps))
    w = replay(LogsTheTopk, seed=seed, world=world)
    import ess_trace
    metadata, recorded = ess_trace.read_trace(str(path))
    return w.coord, metadata, recorded


@pytest.mark.parametrize("world", [World, TboWorld])
def test_the_recorded_trace_is_the_top_k_sglang_handed(tmp_path, monkeypatch, world):
    """The first ESS_RECORD_REQUESTS requests to enter decode, each its first ESS_RECORD_STEPS steps: every layer's
    ids and the step's length as the swap was handed them (micro-batches included), in the trace's format."""
    coord, metadata, recorded = recorded_and_handed(tmp_path, monkeypatch, world)
    assert metadata["ess.layers"] == str(LAYERS) and metadata["ess.topk"] == str(K)
    assert metadata["ess.synthetic"] == "false" and "sglang 0.5.23" in metadata["ess.provenance"]
    expect_recorded(coord, recorded)


def expect_recorded(coord, recorded, requests=3, steps=6):
    expected = sorted(coord.handed.items(), key=lambda item: item[0][1])[:requests]
    assert sorted(r["id"] for r in recorded) == sorted(str(rid) for (rid, _), _ in expected)
    by_id = {r["id"]: r for r in recorded}
    for (rid, _), handed in expected:
        got, want = by_id[str(rid)], handed[:steps]
        assert got["topk"].shape == (len(want), LAYERS, coord.T, K)
        np.testing.assert_array_equal(got["topk"], np.stack([ids for ids, _ in want]))
        np.testing.assert_array_equal(got["lengths"], [length for _, length in want])


def test_a_recorder_taking_positions_for_requests_fails(tmp_path, monkeypatch):
    """Mutation: a call's positions taken as the recorded requests (a micro-batch's first rows are not the
    batch's)."""
    from ess.integrations.topk_recorder import TopkRecorder

    def by_position(self, layer, req_pool_indices, top_k_result):
        B = int(req_pool_indices.shape[0])
        at = torch.arange(B)
        slots = torch.where(at < self.requests, at, torch.full_like(at, self._trash))
        self._ids[layer].index_copy_(0, slots, top_k_result.view(B, self.T, self.K))
    monkeypatch.setattr(TopkRecorder, "record", by_position)
    with pytest.raises((AssertionError, ValueError)):
        coord, _, recorded = recorded_and_handed(tmp_path, monkeypatch, TboWorld)
        expect_recorded(coord, recorded)


def test_the_recorder_refuses_bad_settings_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("ESS_RECORD_TRACE", str(tmp_path / "no-such-folder" / "t.safetensors"))
    with pytest.raises(ess.InvalidArgument, match="ESS_RECORD_TRACE = .*does not exist"):
        build()
    monkeypatch.setenv("ESS_RECORD_TRACE", str(tmp_path / "t.safetensors"))
    monkeypatch.setenv("ESS_RECORD_STEPS", "many")
    with pytest.raises(ess.InvalidArgument, match="ESS_RECORD_STEPS = 'many': an integer expected"):
        build()


# ---- refusals at construction ----
def build(**overrides):
    req_to_token_pool = ReqToTokenPool(REQ_SLOTS, CTX)
    pool = HiSparseDevicePool(POOL, PAGE, LAYERS)
    allocator = HiSparseAllocator(POOL, PAGE, pool, RATIO)
    kwargs = dict(req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator, top_k=K,
                  device_buffer_size=SLOTS, device="cpu", tp_group=None)
    kwargs.update(overrides)
    return adapter.HiSparseCoordinator(**kwargs), allocator


def test_refusals_name_what_is_not_served():
    with pytest.raises(ess.InvalidArgument, match="device_buffer_size = 24 < num_draft_tokens 3 x top_k 16"):
        build(num_draft_tokens=3)
    _, allocator = build()
    with pytest.raises(ess.InvalidArgument, match="one coordinator per pool"):
        build(token_to_kv_pool_allocator=allocator)   # its rows are taken: a second coordinator is refused
    used = HiSparseAllocator(POOL, PAGE, HiSparseDevicePool(POOL, PAGE, LAYERS), RATIO)
    used.alloc_extend(10)
    with pytest.raises(ess.InvalidArgument, match="before any allocation; 16 of its 1024 slots are in use"):
        build(token_to_kv_pool_allocator=used)
    small = HiSparseDevicePool(64, PAGE, LAYERS)
    with pytest.raises(ess.InvalidArgument, match="ESS needs 176 of them"):
        build(token_to_kv_pool_allocator=HiSparseAllocator(64, PAGE, small, RATIO))
    # What is left must hold a prompt of the context length: else SGLang could accept one it never schedules.
    tight = HiSparseDevicePool(600, PAGE, LAYERS)
    with pytest.raises(ess.InvalidArgument, match="SGLang needs 512 \\(the context length, for a prefill\\) left"):
        build(token_to_kv_pool_allocator=HiSparseAllocator(600, PAGE, tight, RATIO))


def test_a_bad_step_changes_nothing():
    w, idx, before = World.one_running(3)
    with pytest.raises(ess.InvalidArgument, match="seq_len 45"):
        w.coord.map_last_loc_to_buffer(torch.tensor([45]), torch.tensor([8]), torch.tensor([idx]),
                                       torch.tensor([45]), torch.tensor([idx]))
    with pytest.raises(ess.InvalidArgument, match="request slot 5 is not in ESS"):
        w.coord.map_last_loc_to_buffer(torch.tensor([41]), torch.tensor([8]), torch.tensor([5]),
                                       torch.tensor([41]), torch.tensor([5]))
    assert w.coord.engine.request(idx) == before
    with pytest.raises(ess.InvalidArgument, match="layer_id 7"):
        w.coord.swap_in_selected_pages(torch.tensor([idx]), torch.tensor([41]), torch.zeros((1, K)), 7)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(top_k=0), ess.InvalidArgument, "top_k = 0: the index top-k must be at least 1"),
    (dict(top_k=-3), ess.InvalidArgument, "top_k = -3"),
    (dict(device_buffer_size=8), ess.InvalidArgument, "device_buffer_size = 8 < top_k 16"),
    (dict(host_to_device_ratio=0), ess.InvalidArgument, "host_to_device_ratio = 0.0"),
    (dict(host_to_device_ratio=-2), ess.InvalidArgument, "host_to_device_ratio = -2.0"),
    (dict(host_to_device_ratio=float("nan")), ess.InvalidArgument, "host_to_device_ratio = nan"),
    (dict(host_to_device_ratio="2"), ess.InvalidType, "host_to_device_ratio = '2'"),
    (dict(host_to_device_ratio=1e-6), ess.InvalidArgument, "host_to_device_ratio = 1e-06"),
    (dict(device_buffer_size=10**9), ess.InvalidArgument, "device_buffer_size"),
])
def test_a_refused_constructor_takes_nothing(overrides, error, match):
    """Settings are checked before ESS takes its rows from SGLang's allocator: the allocator is as it was,
    and a coordinator with good settings is built on it."""
    _refused_constructor_takes_nothing(overrides, error, match)


def test_a_constructor_failing_after_the_claim_gives_the_rows_back(monkeypatch):
    def refuse(**kwargs):
        raise ess.InvalidArgument("ess_engine_create: no memory for the host pool")
    monkeypatch.setattr(sys.modules[adapter.HiSparseCoordinator.__init__.__module__], "Engine", refuse)
    _refused_constructor_takes_nothing({}, ess.InvalidArgument,
                                       "hisparse settings top_k = 16, device_buffer_size = 24, host_to_device_ratio = 4")


def _refused_constructor_takes_nothing(overrides, error, match):
    req_to_token_pool = ReqToTokenPool(REQ_SLOTS, CTX)
    pool = HiSparseDevicePool(POOL, PAGE, LAYERS)
    allocator = HiSparseAllocator(POOL, PAGE, pool, RATIO)
    inner = allocator.hisparse_attn_allocator
    size, pages, free, size_hisparse = inner.size, inner.num_pages, inner.free_pages.clone(), allocator._size_hisparse
    kwargs = dict(req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator, top_k=K,
                  device_buffer_size=SLOTS, device="cpu", tp_group=None, host_to_device_ratio=RATIO)
    with pytest.raises(error, match=match):
        adapter.HiSparseCoordinator(**dict(kwargs, **overrides))
    assert (inner.size, inner.num_pages, allocator._size_hisparse) == (size, pages, size_hisparse)
    assert torch.equal(inner.free_pages, free) and getattr(inner, "ess_rows", None) is None
    if not overrides:
        return
    adapter.HiSparseCoordinator(**kwargs).destroy()


def test_wide_top_k_ids_are_refused():
    """int64 top-k ids would be cut to the int32 the step reads (2**32 + 5 would serve token 5's bytes)."""
    w, idx, before = World.one_running(3)
    topk = torch.full((1, K), -1, dtype=torch.int64)
    topk[0, 0] = 2**32 + 5
    with pytest.raises(ess.InvalidArgument, match="top_k_result is torch.int64"):
        w.coord.swap_in_selected_pages(torch.tensor([idx]), torch.tensor([41]), topk, 0)
    assert w.coord.engine.request(idx) == before


def test_floats_are_not_request_slots_or_token_ids():
    """A request slot 1.5, a float seq_len, float top-k ids or a float layer are refused by name (InvalidType),
    never truncated, and nothing changes."""
    w, idx, before = World.one_running(3)
    with pytest.raises(ess.InvalidType, match="req_pool_indices_cpu: torch.float32"):
        w.coord.map_last_loc_to_buffer(torch.tensor([42]), torch.tensor([8]), torch.tensor([idx]),
                                       torch.tensor([42]), torch.tensor([1.5]))
    with pytest.raises(ess.InvalidType, match="seq_lens_cpu: torch.float32"):
        w.coord.map_last_loc_to_buffer(torch.tensor([42]), torch.tensor([8]), torch.tensor([idx]),
                                       torch.tensor([42.0]), torch.tensor([idx]))
    with pytest.raises(ess.InvalidType, match="top_k_result: torch.float32"):
        w.coord.swap_in_selected_pages(torch.tensor([idx]), torch.tensor([41]), torch.zeros((1, K)), 0)
    with pytest.raises(ess.InvalidType, match="layer_id = 0.5"):
        w.coord.swap_in_selected_pages(torch.tensor([idx]), torch.tensor([41]), torch.zeros((1, K), dtype=torch.int32),
                                       0.5)
    with pytest.raises(ess.InvalidType, match="top_k = 16.5"):
        build(top_k=16.5)
    assert w.coord.engine.request(idx) == before


def test_token_stats_are_upstreams_type():
    w, _, _ = World.one_running(4)
    s = w.coord.get_token_stats()
    assert s.device_tokens == SLOTS + 1 and 0 < s.device_token_usage < 1
    assert s.host_tokens >= 40 and 0 < s.host_token_usage < 1
    assert type(s) is adapter._token_stats_type()   # SGLang's own type where SGLang imports


def sglang_context(monkeypatch, exec_bag, disaggregation_mode="null"):
    """SGLang's runtime context (srt/runtime_context.py): its exec bag as given, get_disagg()'s mode."""
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_disagg = lambda: types.SimpleNamespace(disaggregation_mode=disaggregation_mode)
    context.get_exec = lambda: exec_bag
    srt = types.ModuleType("sglang.srt")
    srt.runtime_context = context
    package = types.ModuleType("sglang")
    package.srt = srt
    for name, module in (("sglang", package), ("sglang.srt", srt), ("sglang.srt.runtime_context", context)):
        monkeypatch.setitem(sys.modules, name, module)


def test_two_batch_overlap_is_served(monkeypatch):
    """0.5.23 keeps it at get_exec().overlap.enable_two_batch_overlap: nothing in ESS depends on it (each batch a
    forward swaps for is staged apart, test_replay_with_two_batch_overlap), so a server with it on builds ESS."""
    sglang_context(monkeypatch, types.SimpleNamespace(overlap=types.SimpleNamespace(enable_two_batch_overlap=True)))
    build()


def test_a_coordinator_built_before_settings_are_published_serves(monkeypatch):
    """SGLang builds its pools and a coordinator without a server too (its unit tests, tools), before any settings
    namespace is published (runtime_context.config_bag raises "config namespace ... not published"); upstream's
    constructor reads none. ESS's reads the disaggregation mode as not decode then (the stricter device budget),
    and serves; a namespace that fails otherwise is not taken for "no server"."""
    def unpublished():
        raise ValueError("config namespace 'disagg' not published")
    sglang_context(monkeypatch, None)
    context = sys.modules["sglang.srt.runtime_context"]
    context.get_disagg = unpublished
    w = World(0)
    assert not w.coord.pd_decode
    w.prefill(40)
    w.collect()
    w.step()
    context.get_disagg = lambda: (_ for _ in ()).throw(ValueError("config namespace 'disagg' is not valid"))
    with pytest.raises(ValueError, match="is not valid"):
        build()


def test_a_page_size_not_dividing_64_is_refused():
    """ESS's host pages hold 64 tokens; SGLang's page-rounded host slots must fall within them."""
    pool = HiSparseDevicePool(POOL, 128, LAYERS)
    with pytest.raises(ess.InvalidArgument, match="page size 128: ESS's host pages hold 64 tokens"):
        build(token_to_kv_pool_allocator=HiSparseAllocator(POOL, 128, pool, RATIO))


def test_speculative_decoding_at_page_size_1_is_refused():
    """mem_cache/allocation.py alloc_for_spec_decode: at page size 1 each draft token gets a device slot of its
    own (alloc_token_slots), which ESS's reserved rows would orphan every verify step."""
    pool = HiSparseDevicePool(POOL, 1, LAYERS)
    with pytest.raises(ess.InvalidArgument, match="num_draft_tokens = 2 with page size 1"):
        build(token_to_kv_pool_allocator=HiSparseAllocator(POOL, 1, pool, RATIO), device_buffer_size=2 * K,
              num_draft_tokens=2)
    pool = HiSparseDevicePool(POOL, 1, LAYERS)
    build(token_to_kv_pool_allocator=HiSparseAllocator(POOL, 1, pool, RATIO))   # without drafts: served
