"""ESS's HiSparseCoordinator over SGLang 0.5.23's own MiniMax-M3 pools, imported from the pinned release and built
through their own constructors on CPU tensors (as kv_cache_configurator.py _build_minimax_sparse_kv_pool builds them
with --enable-hisparse): MiniMaxSparseKVPool, whose main pool (HiSparseMHAMainPool) holds the sparse layers' K and V
in two tensors each, and HiSparseTokenToKVPoolAllocator over it, driven in SGLang's call order:

  prefill      HiSparseTokenToKVPoolAllocator.alloc_extend; the prefill forward's K / V store at the tokens'
               logical slots, through the pool's own set_kv_buffer (HiSparseMHAMainPool: the mapping's device slot)
  staging      admit_request_into_staging, collect_ready_reqs
  decode prep  alloc_decode (logical only), seq_lens += 1, map_last_loc_to_buffer
  forward      per sparse layer: the step's K / V store (set_kv_buffer at out_cache_loc), then
               swap_in_selected_blocks(req_pool_indices=, seq_lens= (tokens), top_k_blocks= int32 [bs, n] block ids,
               -1 padded, layer_id= the model layer, sparse_block_size=) (minimax_sparse_backend.py
               _hisparse_swap_in_blocks); the decode kernel then reads K and V at the returned slots, entry
               j x block + t for token top_k_blocks[j] x block + t (topk_sparse.py)
  finish       request_finished, then allocator.free(req_to_token[idx, :kv_allocated_len])

The oracle is each request's full K / V: every slot the swap returns holds the selected token's key and value (bf16,
compared bit for bit), a padded block or a token past the length gives -1. Upstream's coordinator is not run beside
ESS's: its block swap (load_blocks_to_device_buffer_mha) is a CUDA kernel only."""
import random
import types

import numpy as np
import pytest
import torch

from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseMHAMainPool
from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool, ReqToTokenPool

import ess
from ess.integrations import sglang as adapter
from test_sglang_objects import (host_memory_unregistered, make_req, prepare_decode_step,  # noqa: F401
                                 process_group, release)

DENSE, SPARSE = [0, 1, 2], [3, 4, 5]
REQS, CTX, SIZE, RATIO, PAGE = 4, 2048, 4096, 2, 64
HEAD_DIM, BLOCK, BLOCKS, SLOTS = 128, 16, 4, 128


class Pools:
    def __init__(self):
        self.req_to_token_pool = ReqToTokenPool(size=REQS, max_context_len=CTX, device="cpu",
                                                enable_memory_saver=False)
        self.kv_pool = MiniMaxSparseKVPool(
            size=SIZE, page_size=PAGE, dtype=torch.bfloat16, index_dtype=torch.bfloat16, head_num=1,
            head_dim=HEAD_DIM, idx_head_dim=128, dense_layer_ids=DENSE, sparse_layer_ids=SPARSE,
            disable_value_sparse_layer_ids=SPARSE, device="cpu", start_layer=0, end_layer=len(DENSE + SPARSE),
            enable_hisparse=True, host_to_device_ratio=RATIO)
        self.allocator = HiSparseTokenToKVPoolAllocator(
            size=SIZE, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=self.kv_pool, need_sort=False,
            host_to_device_ratio=RATIO)
        self.main = self.kv_pool.main_pool
        assert isinstance(self.main, HiSparseMHAMainPool)

    def coordinator(self, **overrides):
        kwargs = dict(req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
                      top_k=BLOCKS * BLOCK, device_buffer_size=SLOTS, device="cpu", tp_group=None,
                      host_to_device_ratio=RATIO)
        kwargs.update(overrides)
        return adapter.HiSparseCoordinator(**kwargs)

    def free_sizes(self, c):
        return (self.allocator.logical_attn_allocator.available_size()
                if hasattr(self.allocator, "logical_attn_allocator") else self.allocator.available_size(),
                self.allocator.hisparse_attn_allocator.available_size(), c.mem_pool_host.available_size())


class World:
    def __init__(self, seed=0, **overrides):
        self.p = Pools()
        self.c = self.p.coordinator(**overrides)
        self.rng = np.random.default_rng(seed)
        self.k, self.v, self.reqs, self.length = {}, {}, {}, {}
        self.free_at_start = self.p.free_sizes(self.c)

    def store(self, layer, locs, rid, positions):
        """The model's K / V store at logical slots `locs` (HiSparseMHAMainPool.set_kv_buffer: the mapping's slot)."""
        self.p.main.set_kv_buffer(types.SimpleNamespace(layer_id=layer), locs,
                                  self.k[rid][layer][positions].view(-1, 1, HEAD_DIM),
                                  self.v[rid][layer][positions].view(-1, 1, HEAD_DIM))

    def prefill(self, rid, n):
        p = self.p
        idx = p.req_to_token_pool.alloc_rows(1)[0]
        self.k[rid] = {l: torch.from_numpy(self.rng.normal(0, 1, (CTX, HEAD_DIM)).astype(np.float32)).to(torch.bfloat16)
                       for l in SPARSE}
        self.v[rid] = {l: torch.from_numpy(self.rng.normal(0, 1, (CTX, HEAD_DIM)).astype(np.float32)).to(torch.bfloat16)
                       for l in SPARSE}
        zero, length = torch.tensor([0]), torch.tensor([n])
        locs = p.allocator.alloc_extend(prefix_lens=zero, prefix_lens_cpu=zero, seq_lens=length,
                                        seq_lens_cpu=length, last_loc=torch.tensor([-1]), extend_num_tokens=n)
        assert locs is not None
        p.req_to_token_pool.write((idx, slice(0, n)), locs.to(torch.int32))
        for layer in SPARSE:
            self.store(layer, locs.to(torch.int64), rid, torch.arange(n))
        req = make_req(rid, idx, n)
        self.reqs[rid], self.length[rid] = req, n
        self.c.admit_request_into_staging(req)

    def prepare_decode(self):
        """ScheduleBatch.prepare_for_decode (test_sglang_objects.prepare_decode_step): returns (rids,
        req_pool_indices, seq_lens, out_cache_loc)."""
        return prepare_decode_step(self.p.req_to_token_pool, self.p.allocator, self.c, self.reqs, self.length)

    def finish(self, rid):
        """request_finished, then release_kv_cache -> allocator.free(req_to_token[idx, :kv_allocated_len])."""
        release(self.p.req_to_token_pool, self.p.allocator, self.c.request_finished, self.reqs.pop(rid))


def kv_at(pool, layer, slots):
    """What the decode kernel reads at main-pool slots: K and V rows (topk_sparse.py: kv_pool.get_kv_buffer)."""
    k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
    return k[slots].view(-1, HEAD_DIM), v[slots].view(-1, HEAD_DIM)


@pytest.mark.parametrize("residency", ["sparse", "adaptive"])
def test_block_swap_reads_the_full_k_and_v_among_sglangs_m3_pools(residency, monkeypatch):
    """Prompts of 700, 40 and 300 tokens decode 6 steps; at each sparse layer the swap of a block top-k (the last
    block partly past the length, -1 padding blocks) returns, for every selected token, a slot holding its K and V,
    and -1 where upstream's kernel gives -1; finishing leaves SGLang's pools as they started."""
    monkeypatch.setenv("ESS_RESIDENCY", residency)
    w, pick = World(seed=3), random.Random(5)
    p, c = w.p, w.c
    for rid, n in (("a", 700), ("b", 40), ("c", 300)):
        w.prefill(rid, n)
    assert sorted(r.rid for r in c.collect_ready_reqs()) == ["a", "b", "c"]
    for step in range(6):
        rids, idx, lens, out_cache_loc = w.prepare_decode()
        for layer in SPARSE:
            for b, r in enumerate(rids):   # the step's K / V store
                w.store(layer, out_cache_loc[b:b + 1], r, torch.tensor([w.length[r] - 1]))
            blocks = []
            for n in lens.tolist():
                have = -(-n // BLOCK)
                chosen = sorted(pick.sample(range(have), min(BLOCKS - 1, have)))
                if have - 1 not in chosen:   # the local block (the newest tokens), as the index kernel forces it
                    chosen = sorted(chosen[1:] + [have - 1]) if len(chosen) == BLOCKS - 1 else chosen + [have - 1]
                blocks.append(chosen + [-1] * (BLOCKS - len(chosen)))
            topk = torch.tensor(blocks, dtype=torch.int32)
            table = c.swap_in_selected_blocks(req_pool_indices=idx, seq_lens=lens, top_k_blocks=topk,
                                              layer_id=layer, sparse_block_size=BLOCK)
            assert table.dtype == torch.int32 and tuple(table.shape) == (len(rids), BLOCKS * BLOCK)
            for b, r in enumerate(rids):
                for j, blk in enumerate(blocks[b]):
                    for t in range(BLOCK):
                        slot = int(table[b, j * BLOCK + t])
                        token = blk * BLOCK + t
                        if blk < 0 or token >= int(lens[b]):
                            assert slot == -1, (step, layer, r, j, t)
                            continue
                        k, v = kv_at(p.main, layer, torch.tensor([slot]))
                        assert torch.equal(k[0], w.k[r][layer][token]) and torch.equal(v[0], w.v[r][layer][token]), \
                            (step, layer, r, token)
    stats = c.engine.stats()
    assert stats.whole_steps > 0 if residency == "adaptive" else stats.misses > 0, stats
    for rid in list(w.reqs):
        w.finish(rid)
    assert p.free_sizes(c) == w.free_at_start
    assert int((p.allocator.full_to_hisparse_device_index_mapping[:-1] != 0).sum()) == 0
    c.destroy()


def test_the_host_pool_holds_every_token_but_the_newest():
    w = World(seed=2)
    w.prefill("a", 100)
    w.c.collect_ready_reqs()
    for _ in range(3):
        w.prepare_decode()
        for layer in SPARSE:
            w.store(layer, w.p.req_to_token_pool.req_to_token[w.reqs["a"].kv.req_pool_idx,
                                                              w.length["a"] - 1:w.length["a"]].to(torch.int64),
                    "a", torch.tensor([w.length["a"] - 1]))
    w.prepare_decode()
    w.c.wait_for_pending_backup()
    n = w.length["a"] - 1
    for i, layer in enumerate(SPARSE):
        host = w.c.engine.read_entries(w.reqs["a"].kv.req_pool_idx, i, 0, torch.empty((n, 512), dtype=torch.uint8))
        want = torch.cat([w.k["a"][layer][:n].view(torch.uint8), w.v["a"][layer][:n].view(torch.uint8)], dim=1)
        assert torch.equal(host, want), layer
    w.finish("a")
    w.c.destroy()


def test_a_block_top_k_past_the_device_buffer_and_other_misuse_are_refused():
    w = World()
    w.prefill("a", 100)
    w.c.collect_ready_reqs()
    rids, idx, lens, _ = w.prepare_decode()
    too_many = torch.zeros((1, SLOTS // BLOCK + 1), dtype=torch.int32)
    with pytest.raises(ess.InvalidArgument, match="holds only 128"):
        w.c.swap_in_selected_blocks(idx, lens, too_many, SPARSE[0], BLOCK)
    with pytest.raises(ess.InvalidArgument, match="sparse_block_size = 0"):
        w.c.swap_in_selected_blocks(idx, lens, torch.zeros((1, 2), dtype=torch.int32), SPARSE[0], 0)
    with pytest.raises(ess.InvalidArgument, match="layer_id 1 outside"):   # a dense layer
        w.c.swap_in_selected_blocks(idx, lens, torch.zeros((1, 2), dtype=torch.int32), 1, BLOCK)
    with pytest.raises(ess.InvalidType):
        w.c.swap_in_selected_blocks(idx, lens, torch.zeros((1, 2), dtype=torch.float32), SPARSE[0], BLOCK)
    w.finish("a")
    w.c.destroy()


def test_what_the_m3_pool_cannot_serve_is_refused_by_name(monkeypatch):
    p = Pools()
    inner = p.allocator.hisparse_attn_allocator
    before = (inner.size, inner.available_size())
    with pytest.raises(ess.InvalidArgument, match="speculative decoding with HiSparse serves DSA caches only"):
        p.coordinator(num_draft_tokens=2, device_buffer_size=4096)
    monkeypatch.setenv("ESS_OVERLAP", "da")
    with pytest.raises(ess.InvalidArgument, match="ESS_OVERLAP = da with the MiniMax-M3 K / V pool"):
        p.coordinator()
    monkeypatch.delenv("ESS_OVERLAP")
    assert (inner.size, inner.available_size()) == before
    p.coordinator().destroy()
