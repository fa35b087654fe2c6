"""SGLang 0.5.23's PD decode side (disaggregation_mode = decode) replayed through
ess.integrations.sglang.HiSparseCoordinator on CPU torch: the prefill's KV arrives by the transfer backend
straight into ESS's host pool, each step citing the upstream function it stands for (sglang/srt/...):

  kv manager   disaggregation/decode.py DecodePreallocQueue._init_kv_manager: with hisparse the transfer
               registers coordinator.mem_pool_host (get_kv_transfer_buf_infos -> get_contiguous_buf_infos)
  pre-alloc    decode.py DecodePreallocQueue._pre_alloc (hisparse branch): alloc_for_decode_prealloc_hisparse
               (logical ids only, kv_allocated_len = fill_len), then mem_pool_host.alloc_paged_token_slots(
               req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx, 0, host_token_len(fill_len))
  transfer     decode.py _transfer_page_indices (mem_cache/common.py kv_to_page_indices) on the host slots;
               the prefill side's mooncake/conn.py _send_kvcache_generic writes each run of pages of every
               layer at dst_ptr + page x item_len (group_concurrent_contiguous), whole pages
  admission    scheduler's process_decode_queue: pop_transferred -> admit_request_direct, then the request
               is in the waiting queue and decodes (the decode loop of test_sglang_replay.py)
  failure      decode.py _release_request: request_finished, then release_kv_cache

Checks: the page tables against the independent LRU model and every byte FlashMLA reads against the
prefill's KV (as in test_sglang_replay.py), the host pool at the end, and that a failed transfer leaves
nothing of the request in ESS. The mutation test shows the replay fails when the host pool describes
another layout than the one it has."""
import ctypes
import types

import numpy as np
import pytest
import torch

import ess
from ess.integrations import sglang as adapter
from sglang_pools import ENTRY
from test_sglang_replay import CTX, K, LAYERS, World, Req, sglang_context


@pytest.fixture
def pd_decode(monkeypatch):
    """SGLang's runtime context (srt/runtime_context.py get_disagg().disaggregation_mode) says decode."""
    # 0.5.23 nests the overlap settings (srt/arg_groups/fields/exec_.py ExecOverlap, _NS_PATH "exec.overlap").
    sglang_context(monkeypatch, types.SimpleNamespace(overlap=types.SimpleNamespace(enable_two_batch_overlap=False)),
                   disaggregation_mode="decode")


def group_concurrent_contiguous(src, dst):
    """mooncake/conn.py's helper: runs where both sides' page indices advance by one."""
    runs, start = [], 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append((int(src[start]), int(dst[start]), i - start))
            start = i
    return runs


class PdWorld(World):
    """The decode side: requests arrive by transfer, never by a prefill forward."""

    def __init__(self, seed, cls=adapter.HiSparseCoordinator, graph_pad=True, page=8):
        super().__init__(seed, cls, graph_pad, page)
        self.page = page
        # _init_kv_manager: the transfer engine registers what get_contiguous_buf_infos returns.
        self.dst_ptrs, self.dst_lens, self.item_lens = self.coord.mem_pool_host.get_contiguous_buf_infos()
        assert len(self.dst_ptrs) == LAYERS == len(self.item_lens)
        self.receiving = {}   # rid -> (req, host slots)

    def pre_alloc(self, n):
        """_pre_alloc's hisparse branch: logical ids (alloc_logical_only), then the host slots to receive into."""
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.full[rid] = self.rng.integers(0, 256, (LAYERS, CTX, ENTRY), dtype=np.uint8)
        used = {r.kv.req_pool_idx for r in self.reqs.values()}
        idx = min(set(self.req_to_token_pool.free_slots) - used)
        req = Req(rid, idx, n)
        kv_loc = self.allocator.logical_attn_allocator.alloc(n)
        req.kv.kv_allocated_len = n
        coord = self.coord
        host_indices = coord.mem_pool_host.alloc_paged_token_slots(
            coord.req_to_host_pool, coord.req_to_host_pool_allocated_len, req.kv.req_pool_idx, 0,
            coord.host_token_len(n))
        self.req_to_token_pool.req_to_token[idx, :n] = kv_loc.to(torch.int32)
        self.reqs[rid], self.length[rid] = req, n
        self.receiving[rid] = (req, host_indices.clone())
        return rid

    def transfer(self, rid):
        """The prefill side sends whole pages of every layer: its pages hold the prompt, and past its end
        whatever the prefill pool had there (random here: ESS must never read it)."""
        req, host = self.receiving.pop(rid)
        n, page = self.length[rid], self.page
        dst_pages = (host[::page] // page).numpy()                      # kv_to_page_indices
        prefill_pages = np.arange(len(dst_pages)) + 3                   # the prefill pool's own pages
        for layer in range(LAYERS):
            src = self.rng.integers(0, 256, ((prefill_pages[-1] + 1) * page, ENTRY), dtype=np.uint8)
            src[3 * page:3 * page + n] = self.full[rid][layer, :n]
            item = self.item_lens[layer]
            for s, d, count in group_concurrent_contiguous(prefill_pages, dst_pages):
                ctypes.memmove(self.dst_ptrs[layer] + d * item, src.ctypes.data + s * item, count * item)
        return req

    def admit_transferred(self, rid):
        """pop_transferred -> admit_request_direct; the request then decodes from the waiting queue."""
        req = self.transfer(rid)
        self.coord.admit_request_direct(req)
        assert not req.hisparse_staging
        self.model.admit(req.kv.req_pool_idx)
        n = self.length[rid]
        keep = min(n, self.SLOTS)
        flat = [-1] * ((-keep) % K) + list(range(n - keep, n))
        self.model.warmup(req.kv.req_pool_idx, [[flat[i:i + K] for i in range(0, len(flat), K)]] * LAYERS)
        self.running.append(rid)

    def fail_transfer(self, rid):
        """_release_request after a failed transfer: request_finished, then release_kv_cache."""
        req, _ = self.receiving.pop(rid)
        self.finish(rid)
        assert req.kv.req_pool_idx not in self.coord._direct
        with pytest.raises(ess.InvalidArgument, match="not admitted|unknown request"):
            self.coord.engine.request(req.kv.req_pool_idx)


def replay_pd(cls=adapter.HiSparseCoordinator, seed=0, steps=10, page=8):
    w = PdWorld(seed, cls, page=page)
    for n in (40, 90):
        w.admit_transferred(w.pre_alloc(n))
    late = w.pre_alloc(57)           # receiving while the others decode
    failed = w.pre_alloc(33)
    for step in range(steps):
        if step == 2:
            w.admit_transferred(late)
        if step == 3:
            w.fail_transfer(failed)
        if step == 5:
            w.finish(w.running[0])
            w.admit_transferred(w.pre_alloc(120))   # its request slot and host pages come back
        w.step()
    w.check_host()
    for rid in list(w.reqs):
        w.finish(rid)
    assert w.coord.engine.stats().requests == 0 and not w.coord._length and not w.coord._direct
    assert int(w.coord.req_to_host_pool_allocated_len.sum()) == 0 and bool((w.coord.req_to_host_pool == -1).all())
    assert w.rows_checked > 60
    w.coord.destroy()


@pytest.mark.parametrize("seed,page", [(0, 8), (1, 8), (2, 1), (3, 64)])
def test_pd_decode_receives_into_ess_host_pool(pd_decode, seed, page):
    replay_pd(seed=seed, page=page)


class PageMajorHostPool(adapter.HostPool):
    """Describes ESS's pool as if a request's layers lay side by side (one stride for every layer)."""

    def get_contiguous_buf_infos(self):
        ptrs, lens, items = super().get_contiguous_buf_infos()
        return [ptrs[0] + layer * items[0] for layer in range(len(ptrs))], lens, [i * len(ptrs) for i in items]


class WrongLayout(adapter.HiSparseCoordinator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mem_pool_host = PageMajorHostPool(self)


def test_the_pd_replay_catches_a_wrong_layout(pd_decode):
    with pytest.raises(AssertionError):
        replay_pd(WrongLayout, seed=0)


def test_pd_decode_refusals(pd_decode):
    from test_sglang_replay import build
    coord, _ = build()
    with pytest.raises(ess.InvalidArgument, match="was not received through mem_pool_host.alloc_paged_token_slots"):
        coord.admit_request_direct(Req(0, 2, 10))
    with pytest.raises(ess.InvalidArgument, match="pass the coordinator's own req_to_host_pool"):
        coord.mem_pool_host.alloc_paged_token_slots(torch.zeros((7, 600), dtype=torch.int64),
                                                    coord.req_to_host_pool_allocated_len, 2, 0, 10)
    args = (coord.req_to_host_pool, coord.req_to_host_pool_allocated_len)
    with pytest.raises(ess.InvalidArgument, match="start_pos 5"):
        coord.mem_pool_host.alloc_paged_token_slots(*args, 2, 5, 10)
    with pytest.raises(ess.InvalidArgument, match="num_tokens = 0"):
        coord.mem_pool_host.alloc_paged_token_slots(*args, 2, 0, 0)
    for idx in (-1, 7, 2**40):   # a named refusal, not torch's IndexError
        with pytest.raises(ess.InvalidArgument, match=f"req_pool_idx = {idx} outside the request slots"):
            coord.mem_pool_host.alloc_paged_token_slots(*args, idx, 0, 10)
    slots = coord.mem_pool_host.alloc_paged_token_slots(*args, 2, 0, 10)
    assert slots.shape == (10,) and int(coord.req_to_host_pool_allocated_len[2]) == 16
    before = coord.engine.stats()
    # Slots already allocated are returned again, as upstream's alloc_paged_token_slots returns them; growing past
    # them is ESS's own (its pages follow the request's length), refused here by name.
    assert torch.equal(coord.mem_pool_host.alloc_paged_token_slots(*args, 2, 0, 10), slots)
    assert torch.equal(coord.mem_pool_host.alloc_paged_token_slots(*args, 2, 10, 6), coord.req_to_host_pool[2, 10:16])
    with pytest.raises(ess.InvalidArgument, match=r"request slot 2, tokens \[10, 17\): ESS holds its host slots up to 16"):
        coord.mem_pool_host.alloc_paged_token_slots(*args, 2, 10, 7)
    assert int(coord.req_to_host_pool_allocated_len[2]) == 16
    with pytest.raises(ess.InvalidArgument, match="it received 10"):
        coord.admit_request_direct(Req(0, 2, 11))
    assert coord.engine.stats() == before
    # No prefill runs on a decode side: ESS leaves SGLang one slot per request (its transfer budget), not a context.
    from sglang_pools import HiSparseAllocator, HiSparseDevicePool, ReqToTokenPool
    tight = HiSparseDevicePool(176 + 8, 8, LAYERS)
    coord_pd = adapter.HiSparseCoordinator(ReqToTokenPool(6, CTX), HiSparseAllocator(184, 8, tight, 4), K, 24, "cpu",
                                           None)
    coord_pd.destroy()
    with pytest.raises(ess.InvalidArgument, match=r"SGLang needs 7 \(one slot per request: SGLang's PD transfer"):
        adapter.HiSparseCoordinator(ReqToTokenPool(6, CTX), HiSparseAllocator(176, 8, tight, 4), K, 24, "cpu", None)
    # A page size that does not divide ESS's 64-token host pages cannot be addressed by the transfer.
    with pytest.raises(ess.InvalidArgument, match="page size 48: .* must divide 64"):
        pool = HiSparseDevicePool(4800, 48, LAYERS)
        adapter.HiSparseCoordinator(ReqToTokenPool(6, CTX), HiSparseAllocator(4800, 48, pool, 4), K, 24, "cpu", None)
