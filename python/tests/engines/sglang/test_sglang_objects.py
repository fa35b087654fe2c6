"""ESS's HiSparseCoordinator among SGLang 0.5.23's own objects, imported from the pinned release (a venv from
scripts/engines.sh; a missing import fails, never skips): SGLang's ReqToTokenPool, HiSparseDSATokenToKVPool and
HiSparseTokenToKVPoolAllocator, built through their own constructors on CPU tensors, and upstream's own
HiSparseCoordinator beside ESS's, over the same scenario, in SGLang's call order:

  prefill      mem_cache/allocation.py alloc_for_extend: ReqToTokenPool.alloc, then
               HiSparseTokenToKVPoolAllocator.alloc_extend; the prefill forward writes the prompt's KV
               at the device slots its logical slots map to (what set_mla_kv_buffer does)
  staging      batch_result_processor.process_batch_result_prefill -> admit_request_into_staging
  ready        scheduler.get_next_batch_to_run -> collect_ready_reqs
  decode prep  ScheduleBatch.prepare_for_decode: alloc_decode, seq_lens += 1, map_last_loc_to_buffer
  forward      the layer's KV write at out_cache_loc, then swap_in_selected_pages -> FlashMLA reads
               kv_buffer[layer][page_table_1] (upstream on CPU: naive_load_topk, its own torch path;
               its swap kernel is CUDA's)
  finish       request_finished, then release_kv_cache -> allocator.free(req_to_token[idx, :allocated])

The oracle is upstream itself: what SGLang observes of each coordinator (the bytes at the locations the swap
returns, the allocator's free sizes, req_to_host_pool and its allocated length) is compared, and every byte
FlashMLA would read is checked against the request's full cache."""
import random
import types
from array import array

import numpy as np
import pytest
import torch

import sglang
from sglang.srt.managers import hisparse_coordinator as upstream
from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

import ess
from ess.integrations import sglang as adapter

ENTRY = 656
LAYERS, K, SLOTS, PAGE, REQS, CTX = 2, 16, 64, 64, 4, 1024
SIZE, RATIO = 4096, 2


def test_the_pinned_release_is_imported():
    assert sglang.__version__ == adapter.SGLANG_VERSION
    assert upstream.__file__.endswith("sglang/srt/managers/hisparse_coordinator.py")


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    """Upstream's constructor asks torch.distributed for the TP group's size (one rank here). Rendezvous through a
    file of this run's own, not a TCP port: two runs on one machine (CI beside a developer's) do not collide."""
    if not torch.distributed.is_initialized():
        store = tmp_path_factory.mktemp("process_group") / "store"
        torch.distributed.init_process_group(backend="gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield


class Stack:
    """SGLang's pools, built as model_runner builds them for a DSA model with --enable-hisparse
    (model_runner_kv_cache_mixin / pool_configurator: HiSparseDSATokenToKVPool, then the allocator over it,
    then maybe_init_hisparse_coordinator), around one coordinator class."""

    def __init__(self, cls, layers=LAYERS, latent="fp8", **overrides):
        """latent: "fp8" (--kv-cache-dtype fp8_e4m3: 656-byte entries, kv_cache_dim 656 of uint8) or "bf16"
        (bfloat16, SGLang's DSA default on Hopper: kv_cache_dim = kv_lora_rank + qk_rope_head_dim = 576 bf16
        values, 1,152 bytes; kv_cache_configurator.py passes calculate_mla_kv_cache_dim's 576 then)."""
        self.layers = layers
        dtype, dim = (torch.float8_e4m3fn, ENTRY) if latent == "fp8" else (torch.bfloat16, 576)
        self.entry = dim * (1 if latent == "fp8" else 2)
        self.device_pool = HiSparseDSATokenToKVPool(
            size=SIZE, page_size=PAGE, kv_lora_rank=512, dtype=dtype, qk_rope_head_dim=64,
            layer_num=layers, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=dim,
            host_to_device_ratio=RATIO)
        self.allocator = HiSparseTokenToKVPoolAllocator(
            size=SIZE, page_size=PAGE, dtype=dtype, device="cpu", kvcache=self.device_pool,
            need_sort=False, host_to_device_ratio=RATIO)
        self.req_to_token_pool = ReqToTokenPool(size=REQS, max_context_len=CTX, device="cpu",
                                                enable_memory_saver=False)
        kwargs = dict(req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
                      top_k=K, device_buffer_size=SLOTS, device="cpu", tp_group=None,
                      host_to_device_ratio=RATIO)
        kwargs.update(overrides)
        self.coord = cls(**kwargs)

    def rows(self, layer):
        return self.device_pool.kv_buffer[layer].view(torch.uint8).view(-1, self.entry)


@pytest.fixture(autouse=True)
def host_memory_unregistered(monkeypatch):
    """Upstream's host pool page-locks its buffer with cudaHostRegister (pool_host/common.py
    alloc_with_host_register), which needs a GPU: here the same allocation, not page-locked."""
    from sglang.srt.mem_cache.pool_host import common

    register = common.ALLOC_MEMORY_FUNCS["cpu"]

    def unregistered(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return register(dims, dtype, device, False, allocator, registration_granularity_bytes)
    monkeypatch.setitem(common.ALLOC_MEMORY_FUNCS, "cpu", unregistered)


def _transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers):
    """sgl_kernel's transfer_kv_all_layer_mla, which SGLang builds for CUDA only: for every layer, item_size bytes
    from src_layers[l] + src_indices[i] x item_size to dst_layers[l] + dst_indices[i] x item_size (here the
    layers' addresses are CPU memory, so ctypes.memmove does what the kernel's loads and stores do)."""
    import ctypes
    src_ptrs, dst_ptrs = src_layers.tolist(), dst_layers.tolist()
    for layer in range(num_layers):
        for s, d in zip(src_indices.tolist(), dst_indices.tolist()):
            ctypes.memmove(dst_ptrs[layer] + d * item_size, src_ptrs[layer] + s * item_size, item_size)


def _transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size):
    """sgl_kernel's transfer_kv_per_layer_mla (CUDA only): rows src[src_indices[i]] to dst[dst_indices[i]]."""
    s, d = src.view(torch.uint8).view(-1, item_size), dst.view(torch.uint8).view(-1, item_size)
    d[dst_indices.to(torch.int64)] = s[src_indices.to(torch.int64)]


@pytest.fixture(autouse=True)
def cpu_kernels(monkeypatch):
    """The kernels upstream's staging and its own torch swap (naive_load_topk) reach, in their place (the module
    imports them from sgl_kernel only when CUDA is there)."""
    from sglang.srt.mem_cache.pool_host import mla
    monkeypatch.setattr(mla, "transfer_kv_all_layer_mla", _transfer_kv_all_layer_mla, raising=False)
    monkeypatch.setattr(mla, "transfer_kv_per_layer_mla", _transfer_kv_per_layer_mla, raising=False)
    # torch.cpu.Stream (what SGLang's device module is on a CPU) has no synchronize; CPU work is done when issued.
    monkeypatch.setattr(torch.cpu.Stream, "synchronize", lambda self: None, raising=False)


def make_req(rid, idx, n):
    """The fields of schedule_batch.Req the coordinators read."""
    return types.SimpleNamespace(rid=rid, kv=types.SimpleNamespace(req_pool_idx=idx, kv_allocated_len=n),
                                 extend_end=n, hisparse_staging=False, seqlen=n,
                                 full_untruncated_fill_ids=array("q", range(n)))


def prepare_decode_step(req_to_token_pool, allocator, coordinator, reqs, length):
    """ScheduleBatch.prepare_for_decode for every running request (`reqs`: rid -> Req; `length`: rid -> tokens, both
    advanced): alloc_decode (SGLang's allocator, its real last_loc rule), seq_lens += 1, map_last_loc_to_buffer; then
    the forward's wait_for_pending_backup and num_real_reqs. Returns (rids, req_pool_indices, seq_lens, the new tokens'
    logical slots)."""
    rids = list(reqs)
    idx = torch.tensor([reqs[r].kv.req_pool_idx for r in rids])
    lens = torch.tensor([length[r] for r in rids])
    last = torch.stack([req_to_token_pool.req_to_token[int(i), int(n) - 1].to(torch.int64) for i, n in zip(idx, lens)])
    out_cache_loc = allocator.alloc_decode(lens + 1, lens + 1, last)
    for r, i, loc in zip(rids, idx.tolist(), out_cache_loc.tolist()):
        req_to_token_pool.req_to_token[i, length[r]] = loc
        length[r] += 1
        reqs[r].kv.kv_allocated_len = length[r]
    lens = lens + 1
    coordinator.map_last_loc_to_buffer(lens, out_cache_loc, idx, lens.clone(), idx.clone())
    coordinator.wait_for_pending_backup()
    coordinator.num_real_reqs.fill_(len(rids))
    return rids, idx, lens, out_cache_loc.to(torch.int64)


def release(req_to_token_pool, allocator, coordinator_call, req):
    """The coordinator's call (request_finished, retract_req), then release_kv_cache ->
    allocator.free(req_to_token[idx, :kv_allocated_len]) and ReqToTokenPool.free(req)."""
    coordinator_call(req)
    assert not req.hisparse_staging
    idx = req.kv.req_pool_idx
    allocator.free(req_to_token_pool.req_to_token[idx, :req.kv.kv_allocated_len].to(torch.int64))
    req_to_token_pool.free_rows([idx])


class World:
    """One Stack and the requests' full caches: SGLang's calls in its order, and what SGLang observes."""

    def __init__(self, cls, seed=0, layers=LAYERS, **overrides):
        self.s = Stack(cls, layers, **overrides)
        self.rng = np.random.default_rng(seed)
        self.full, self.reqs, self.length = {}, {}, {}
        self.free_at_start = self.free_sizes()

    def prefill(self, rid, n):
        s = self.s
        idx = s.req_to_token_pool.alloc_rows(1)[0]
        self.full[rid] = self.entries()
        zero, length = torch.tensor([0]), torch.tensor([n])
        locs = s.allocator.alloc_extend(prefix_lens=zero, prefix_lens_cpu=zero, seq_lens=length,
                                        seq_lens_cpu=length, last_loc=torch.tensor([-1]), extend_num_tokens=n)
        assert locs is not None
        s.req_to_token_pool.write((idx, slice(0, n)), locs.to(torch.int32))
        device = s.device_pool.translate_loc_from_full_to_hisparse_device(locs.to(torch.int64))
        for layer in range(s.layers):   # the prefill forward's set_mla_kv_buffer
            s.rows(layer)[device] = torch.from_numpy(self.full[rid][layer, :n])
        req = make_req(rid, idx, n)
        self.reqs[rid], self.length[rid] = req, n
        s.coord.admit_request_into_staging(req)
        return req

    def entries(self):
        """A request's full cache, [layers][context][entry] bytes (any bytes: the swap moves them unread)."""
        return self.rng.integers(0, 256, (self.s.layers, CTX, self.s.entry), dtype=np.uint8)

    def collect(self):
        return [r.rid for r in self.s.coord.collect_ready_reqs()]

    def prepare_decode(self):
        """ScheduleBatch.prepare_for_decode for every running request: alloc_decode (SGLang's paged allocator, its
        real last_loc rule), seq_lens += 1, map_last_loc_to_buffer; then the forward's wait_for_pending_backup and
        num_real_reqs. Returns (rids, req_pool_indices, seq_lens, the new tokens' device slots)."""
        s = self.s
        rids, idx, lens, out_cache_loc = prepare_decode_step(s.req_to_token_pool, s.allocator, s.coord, self.reqs,
                                                             self.length)
        return rids, idx, lens, s.device_pool.translate_loc_from_full_to_hisparse_device(out_cache_loc)

    def host_table(self, rid):
        """req_to_host_pool's row as SGLang reads it: how many slots, distinct, and the allocated length."""
        c, idx = self.s.coord, self.reqs[rid].kv.req_pool_idx
        row = c.req_to_host_pool[idx]
        used = row[row >= 0]
        return int(used.numel()), len(set(used.tolist())), int(c.req_to_host_pool_allocated_len[idx])

    def finish(self, rid):
        """request_finished, then release_kv_cache -> allocator.free(req_to_token[idx, :kv_allocated_len])."""
        self._end(rid, self.s.coord.request_finished)

    def retract(self, rid):
        """schedule_batch.release_req -> retract_req (staging or running), then release_kv_cache."""
        self._end(rid, self.s.coord.retract_req)

    def _end(self, rid, coordinator_call):
        release(self.s.req_to_token_pool, self.s.allocator, coordinator_call, self.reqs.pop(rid))

    def prepare_verify(self, T, forward_mode):
        """eagle_prepare_for_verify's part before the verify forward: the T verify tokens' logical slots from
        SGLang's allocator (alloc_logical_only past what each request holds, as alloc_for_spec_decode reserves them),
        then prepare_spec_verify. Returns (rids, req_pool_indices, seq_lens, the batch)."""
        s = self.s
        rids, locs = list(self.reqs), []
        for rid in rids:
            req, L = self.reqs[rid], self.length[rid]
            idx, have = req.kv.req_pool_idx, req.kv.kv_allocated_len
            if have < L + 2 * T:
                new = s.allocator.alloc_logical_only(
                    prefix_lens=torch.tensor([have]), prefix_lens_cpu=torch.tensor([have]),
                    seq_lens=torch.tensor([L + 2 * T]), seq_lens_cpu=torch.tensor([L + 2 * T]),
                    last_loc=s.req_to_token_pool.req_to_token[idx, have - 1].view(1).to(torch.int64),
                    extend_num_tokens=L + 2 * T - have)
                s.req_to_token_pool.req_to_token[idx, have:L + 2 * T] = new.to(torch.int32)
                req.kv.kv_allocated_len = L + 2 * T
            locs.append(s.req_to_token_pool.req_to_token[idx, L:L + T].to(torch.int64))
        idx = torch.tensor([self.reqs[r].kv.req_pool_idx for r in rids])
        lens = torch.tensor([self.length[r] for r in rids])
        batch = types.SimpleNamespace(reqs=[self.reqs[r] for r in rids], req_pool_indices=idx,
                                      out_cache_loc=torch.cat(locs), seq_lens=lens, seq_lens_cpu=lens.clone(),
                                      forward_mode=forward_mode)
        s.coord.prepare_spec_verify(batch)
        return rids, idx, lens, batch

    def free_sizes(self):
        """The allocator's logical and device free sizes and the host pool's (SGLang's load reports read them)."""
        inner = self.s.allocator.hisparse_attn_allocator
        return (self.s.allocator.logical_attn_allocator.available_size(), inner.available_size(),
                self.s.coord.mem_pool_host.available_size())


UPSTREAM, ESS = upstream.HiSparseCoordinator, adapter.HiSparseCoordinator


@pytest.mark.parametrize("n", [1, 63, 64, 65, 300])
def test_staging_leaves_sglang_what_upstream_leaves(n):
    """After admit_request_into_staging and collect_ready_reqs, SGLang's tables (req_to_host_pool: page-rounded,
    distinct slots; the allocated length) read the same under both coordinators; after request_finished and
    release_kv_cache every pool is back to its size at the start."""
    worlds = {cls: World(cls) for cls in (UPSTREAM, ESS)}
    seen = {}
    for cls, w in worlds.items():
        w.prefill("a", n)
        assert w.collect() == ["a"]
        seen[cls] = w.host_table("a")
        w.finish("a")
        assert w.free_sizes() == w.free_at_start, cls
        assert int((w.s.coord.req_to_host_pool >= 0).sum()) == 0
    assert seen[ESS] == seen[UPSTREAM]


@pytest.mark.parametrize("micro_batches,residency,latent", [
    (False, "sparse", "fp8"), (True, "sparse", "fp8"), (False, "adaptive", "fp8"), (True, "adaptive", "fp8"),
    (False, "sparse", "bf16"), (True, "adaptive", "bf16")])
def test_decode_serves_the_full_caches_bytes_among_sglangs_pools(micro_batches, residency, latent, monkeypatch):
    """ESS's decode among SGLang's own pools and allocator: prepare_for_decode's alloc_decode (SGLang's paged
    allocator, its real last_loc rule), map_last_loc_to_buffer, the layer's KV write at out_cache_loc through
    the real full-to-device mapping, then swap_in_selected_pages: every byte at the returned locations is the
    full cache's, step after step, and the pools are whole again after finish. micro_batches: two-batch overlap
    (batch_overlap/two_batch_overlap.py), the first layer on the whole batch (a dense layer), the others once per
    half of the requests, A then B, each half's req_pool_indices and seq_lens its own, padded with row 0 to one
    length (TboForwardBatchPreparer.filter_batch, ForwardBatch._pad_tbo_child_inputs). residency: ESS_RESIDENCY,
    adaptive keeping requests whole among ESS's rows while they are free. latent: the pool's FP8 entries, or its bf16
    latent (1,152 bytes: SGLang's DSA default on Hopper)."""
    monkeypatch.setenv("ESS_RESIDENCY", residency)
    w, rng = World(ESS, seed=3, latent=latent), random.Random(5)
    s, c = w.s, w.s.coord
    # Adaptive: prompts that fit ESS's rows whole (one row of SLOTS tokens each, then c on two), a's growth past
    # its row borrowing a free one; a, b and c sparse at once otherwise.
    prompts = (("a", 60), ("b", 40), ("c", 100)) if residency == "adaptive" else (("a", 300), ("b", 70), ("c", 150))
    for rid, n in prompts:
        w.prefill(rid, n)
    assert sorted(w.collect()) == ["a", "b", "c"]
    for step in range(6):
        rids, idx, lens, device = w.prepare_decode()
        half, width = len(rids) // 2, len(rids) - len(rids) // 2
        parts = [(0, len(rids))] if not micro_batches else [(0, half), (half, len(rids))]
        for layer in range(LAYERS):
            for lo, hi in (parts if layer > 0 else [(0, len(rids))]):
                n = hi - lo
                pad = width - n if (lo, hi) != (0, len(rids)) else 0
                part_idx = torch.cat([idx[lo:hi], torch.zeros(pad, dtype=idx.dtype)])
                part_lens = torch.cat([lens[lo:hi], torch.ones(pad, dtype=lens.dtype)])
                for r, d in zip(rids[lo:hi], device[lo:hi].tolist()):   # set_mla_kv_buffer of the step's token
                    s.rows(layer)[d] = torch.from_numpy(w.full[r][layer, w.length[r] - 1])
                picks = [sorted(rng.sample(range(w.length[r]), min(K, w.length[r]))) for r in rids[lo:hi]]
                topk = torch.tensor([p + [-1] * (K - len(p)) for p in picks] + [[0] + [-1] * (K - 1)] * pad,
                                    dtype=torch.int32)
                table = c.swap_in_selected_pages(part_idx, part_lens, topk, layer)
                for b, r in enumerate(rids[lo:hi]):
                    got = s.rows(layer)[table[b, :len(picks[b])].to(torch.int64)].numpy()
                    assert np.array_equal(got, w.full[r][layer, picks[b]]), (step, layer, r)
                assert (table[n:] == -1).all()
    # What SGLang reads of the host pool: req_to_host_pool names, for every token ESS has written back (all but
    # the newest, in its reserved row), the host slot that holds the token's bytes.
    c.wait_for_pending_backup()
    for rid in w.reqs:
        idx, n = w.reqs[rid].kv.req_pool_idx, w.length[rid]
        assert w.host_table(rid)[0] == -(-n // PAGE) * PAGE
        slots = c.req_to_host_pool[idx, :n - 1]
        for layer in range(LAYERS):
            host = c.mem_pool_host.layer_view(layer)[slots].numpy()
            assert np.array_equal(host, w.full[rid][layer, :n - 1]), (rid, layer)
    st = c.engine.stats()
    if residency == "adaptive":  # some steps read whole requests in place, a's row count grew
        assert st.whole_steps > 0 and len(c.engine.residency(w.reqs["a"].kv.req_pool_idx)[1]) == 2, st
    for rid in list(w.reqs):
        w.finish(rid)
    assert w.free_sizes() == w.free_at_start


def served(w, rid, layer, picks):
    """The bytes FlashMLA reads for `picks` of request `rid` at its current length, through each coordinator's
    swap: ESS's swap_in_selected_pages, upstream's naive_load_topk (its torch path; its kernel is CUDA's)."""
    c, idx = w.s.coord, w.reqs[rid].kv.req_pool_idx
    topk = torch.tensor([picks + [-1] * (K - len(picks))], dtype=torch.int32)
    args = (torch.tensor([idx]), torch.tensor([w.length[rid]]), topk, layer)
    c.num_real_reqs.fill_(1)
    table = c.naive_load_topk(*args) if isinstance(c, UPSTREAM) else c.swap_in_selected_pages(*args)
    return w.s.rows(layer)[table[0, :len(picks)].to(torch.int64)].numpy()


@pytest.mark.parametrize("n", [40, 64, 65, 300])
def test_right_after_admission_the_prompt_is_served(n):
    """A swap at the prompt's own length, before SGLang extends the request (SGLang's own unit test does this).
    ESS serves every selected token with the prompt's bytes, the newest included. Upstream's torch path does
    too while the prompt fits the device buffer (and one token past it); beyond, the newest token is read from
    the reserved slot, which then holds another prompt token's bytes (its slots are the prefill's own, reused
    in order): recorded here as a difference of this release, so that a release that changes it shows."""
    rng = random.Random(n)
    picks = sorted({n - 1, 0} | set(rng.sample(range(1, n - 1), K - 2)))   # K distinct: upstream reads exactly K
    for cls in (ESS, UPSTREAM):
        w = World(cls, seed=n)
        w.prefill("a", n)
        w.collect()
        for layer in range(LAYERS):
            got, want = served(w, "a", layer, picks), w.full["a"][layer, picks]
            if cls is ESS:
                assert np.array_equal(got, want), (layer, n)
            else:
                assert np.array_equal(got[:-1], want[:-1])
                assert np.array_equal(got[-1], want[-1]) == (n <= SLOTS + 1), (layer, n)


@pytest.mark.parametrize("n", [64, 300])
@pytest.mark.parametrize("end", ["finish", "retract while staging", "retract after admission"])
def test_every_pool_is_whole_again_as_upstreams_is(end, n):
    """A request's end in each of SGLang's ways, with a second request still running: under both coordinators
    the allocator's logical and device free sizes and the host pool's free size return to what they were before
    the request came, and its req_to_host_pool row is cleared."""
    for cls in (UPSTREAM, ESS):
        w = World(cls, seed=n)
        w.prefill("other", 100)
        w.collect()
        before = w.free_sizes()
        w.prefill("a", n)
        if end != "retract while staging":
            assert w.collect() == ["a"]
        idx = w.reqs["a"].kv.req_pool_idx
        (w.finish if end == "finish" else w.retract)("a")
        assert w.free_sizes() == before, (cls, end)
        assert int((w.s.coord.req_to_host_pool[idx] >= 0).sum()) == 0
        assert int(w.s.coord.req_to_host_pool_allocated_len[idx]) == 0


def transfer(w, rid, host_slots):
    """The transfer engine's writes on a PD decode side (mooncake's _send_kvcache_generic): token slot s of layer
    l at data_ptrs[l] + s x token bytes, the regions get_contiguous_buf_infos registers. (The prefill side and its
    transfer engine stand in: neither runs without a network of GPUs.)"""
    import ctypes
    c = w.s.coord
    ptrs, lens, items = c.mem_pool_host.get_contiguous_buf_infos()
    stride = items[0] // c.page_size
    for layer in range(LAYERS):
        for t, slot in enumerate(host_slots.tolist()):
            assert (slot + 1) * stride <= lens[layer]
            entry = np.ascontiguousarray(w.full[rid][layer, t])
            ctypes.memmove(ptrs[layer] + slot * stride, entry.ctypes.data, ENTRY)


def pd_worlds(n):
    """Each coordinator's world for a PD prompt of n tokens, with the tokens a swap then selects (K distinct, the
    first and the newest among them)."""
    rng = random.Random(n)
    picks = sorted({n - 1, 0} | set(rng.sample(range(1, n - 1), K - 2)))
    for cls in (ESS, UPSTREAM):
        yield cls, World(cls, seed=n), picks


@pytest.mark.parametrize("n", [40, 300])
def test_pd_direct_admission_under_both(n):
    """The PD decode side in SGLang's order, each step its own code where it runs: DecodePreallocQueue._pre_alloc's
    alloc_for_decode_prealloc_hisparse (decode.py, called as it is) and req_to_token_pool.write, then
    coordinator.mem_pool_host.alloc_paged_token_slots(req_to_host_pool, allocated_len, idx, 0, host_token_len(n)),
    the transfer into those slots, admit_request_direct. Both coordinators hand out distinct, page-rounded host
    slots inside the regions they register; each then serves the prompt's bytes; both give every pool back."""
    from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc_hisparse
    tables = {}
    for cls, w, picks in pd_worlds(n):
        s, c = w.s, w.s.coord
        before = w.free_sizes()
        idx = s.req_to_token_pool.alloc_rows(1)[0]
        req = make_req("a", idx, 0)
        w.full["a"] = w.rng.integers(0, 256, (LAYERS, CTX, ENTRY), dtype=np.uint8)
        kv_loc = alloc_for_decode_prealloc_hisparse(s.allocator, req=req, fill_len=n, uses_swa_tail=False,
                                                    swa_tail_len=0)
        s.req_to_token_pool.write((idx, slice(0, len(kv_loc))), kv_loc)
        slots = c.mem_pool_host.alloc_paged_token_slots(c.req_to_host_pool, c.req_to_host_pool_allocated_len, idx,
                                                        0, c.host_token_len(n))
        tables[cls] = admit_transferred(w, cls, req, slots, picks, before)
    assert tables[ESS] == tables[UPSTREAM]


def admit_transferred(w, cls, req, slots, picks, before):
    """The transfer into the host slots the prealloc handed out, admit_request_direct, the prompt's bytes served at
    `picks`, then finish: the pools whole again. Returns the request's host table as SGLang reads it."""
    n, c = len(slots), w.s.coord
    assert len(set(slots.tolist())) == n
    transfer(w, "a", slots)
    w.reqs["a"], w.length["a"] = req, n
    c.admit_request_direct(req)
    table = w.host_table("a")
    for layer in range(LAYERS):
        got, want = served(w, "a", layer, picks), w.full["a"][layer, picks]
        assert np.array_equal(got[:-1], want[:-1]), (cls, layer)
        # The newest token: upstream's torch path past the buffer reads its reserved slot (the difference
        # test_right_after_admission_the_prompt_is_served records).
        assert np.array_equal(got[-1], want[-1]) == (cls is ESS or n <= SLOTS + 1), (cls, layer)
    w.finish("a")
    assert w.free_sizes() == before, cls
    return table


@pytest.fixture
def published_settings(tmp_path):
    """SGLang's runtime settings as its launcher publishes them (runtime_context.py set_server_args from the
    ServerArgs of `--enable-hisparse --disaggregation-mode decode`), over a local two-layer DSA model's
    config.json (ServerArgs reads the model's config, never its weights)."""
    import json
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "num_hidden_layers": LAYERS,
        "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 512, "q_lora_rank": 128, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "index_topk": K, "index_n_heads": 4, "index_head_dim": 128, "vocab_size": 1000,
        "max_position_embeddings": CTX, "torch_dtype": "bfloat16"}))
    context = get_context()
    saved = (context._server_args, context._config_bags, context.parallel._config,
             context.flags.capture.enable_torch_compile)
    context.set_server_args(ServerArgs(model_path=str(tmp_path), device="cpu", skip_tokenizer_init=True,
                                       disaggregation_mode="decode"))
    yield
    # The other tests run where nothing is published (as a coordinator built before the launcher publishes).
    (context._server_args, context._config_bags, context.parallel._config,
     context.flags.capture.enable_torch_compile) = saved


@pytest.mark.parametrize("n", [40, 300])
def test_pd_prealloc_through_sglangs_own_decode_prealloc_queue(n, published_settings):
    """DecodePreallocQueue._pre_alloc itself (disaggregation/decode.py), with SGLang's own Req: it binds the
    request's pool row, fills req_to_token with the logical slots of alloc_for_decode_prealloc_hisparse and asks
    the coordinator's host pool for the transfer's destination slots; the transfer lands there and
    admit_request_direct serves its bytes. Under both coordinators: the same tables, the pools whole after
    finish. The queue is built without its constructor (which wires the transfer backend and the bootstrap
    queues, neither of which runs without a network of GPUs): _pre_alloc reads its pools and the scheduler's
    HiSparse settings, given as the scheduler has them (enable_hisparse, hisparse_coordinator, no hybrid SWA);
    the decode side's tree cache (the radix cache is off with HiSparse) is handed nothing to keep."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    tables = {}
    for cls, w, picks in pd_worlds(n):
        s, c = w.s, w.s.coord
        before = w.free_sizes()
        queue = object.__new__(DecodePreallocQueue)
        queue.req_to_token_pool, queue.token_to_kv_pool_allocator = s.req_to_token_pool, s.allocator
        queue.token_to_kv_pool = s.device_pool
        queue.scheduler = types.SimpleNamespace(enable_hisparse=True, hisparse_coordinator=c,
                                                tp_worker=types.SimpleNamespace(is_hybrid_swa=False),
                                                sliding_window_size=None)
        queue.tree_cache = types.SimpleNamespace(maybe_hand_to_session=lambda req: None)
        req = Req("a", "", list(range(1, n + 1)), SamplingParams(max_new_tokens=8))
        req.output_ids = [7]   # the prefill's first token: _pre_alloc_fill_len leaves its KV to the decode side
        w.full["a"] = w.rng.integers(0, 256, (LAYERS, CTX, ENTRY), dtype=np.uint8)
        slots = queue._pre_alloc(req)
        idx = req.kv.req_pool_idx
        assert slots.shape == (n,)
        assert req.kv.kv_committed_len == req.kv.kv_allocated_len == n
        logical = s.req_to_token_pool.req_to_token[idx, :n]
        assert len(set(logical.tolist())) == n
        tables[cls] = admit_transferred(w, cls, req, slots, picks, before)
    assert tables[ESS] == tables[UPSTREAM]


def test_speculative_verify_among_sglangs_pools():
    """EAGLE / MTP verify steps (T = 3 draft tokens) among SGLang's own pools: the verify tokens' logical slots from
    SGLang's allocator (alloc_logical_only past what the request holds, as alloc_for_spec_decode reserves them),
    prepare_spec_verify, the forward's KV write of the T tokens at out_cache_loc through the real mapping,
    swap_in_selected_pages over [bs, T, K] with per-token seq_lens, commit_spec_accept_tokens along an accepted
    path that is not slot-for-position. Every byte served is the request's own at that point (rejected drafts get
    other bytes before the next step), every kept token's host slot holds its bytes, and the pools are whole
    again after finish."""
    T = 3
    w = World(ESS, seed=9, num_draft_tokens=T)
    s, c, rng = w.s, w.s.coord, np.random.default_rng(9)
    for rid, n in (("a", 200), ("b", 50)):
        w.prefill(rid, n)
    assert sorted(w.collect()) == ["a", "b"]
    for step in range(5):
        rids, idx, lens, batch = w.prepare_verify(T, types.SimpleNamespace(is_idle=lambda: False))
        c.num_real_reqs.fill_(len(rids))
        device = s.device_pool.translate_loc_from_full_to_hisparse_device(batch.out_cache_loc)
        expanded = (lens.view(-1, 1) + torch.arange(1, T + 1)).view(-1).to(torch.int32)
        for layer in range(LAYERS):
            for b, r in enumerate(rids):   # the verify forward's set_mla_kv_buffer of the T tokens
                for t in range(T):
                    s.rows(layer)[int(device[b * T + t])] = torch.from_numpy(w.full[r][layer, w.length[r] + t])
            picks = [[sorted(rng.choice(w.length[r] + t + 1, K, replace=False).tolist()) for t in range(T)]
                     for r in rids]
            table = c.swap_in_selected_pages(idx, expanded, torch.tensor(picks, dtype=torch.int32), layer)
            for b, r in enumerate(rids):
                for t in range(T):
                    got = s.rows(layer)[table[b, t].to(torch.int64)].numpy()
                    assert np.array_equal(got, w.full[r][layer, picks[b][t]]), (step, layer, r, t)
        accept = torch.full((len(rids), T), -1, dtype=torch.int32)
        for b, rid in enumerate(rids):
            kept = int(rng.integers(1, T + 1))
            path = [0] + sorted(rng.choice(np.arange(1, T), kept - 1, replace=False).tolist())
            accept[b, :kept] = torch.tensor([b * T + j for j in path], dtype=torch.int32)
            L = w.length[rid]
            verified = w.full[rid][:, L:L + T].copy()
            for p, j in enumerate(path):
                w.full[rid][:, L + p] = verified[:, j]
            w.full[rid][:, L + kept:] = rng.integers(0, 256, w.full[rid][:, L + kept:].shape, dtype=np.uint8)
            w.length[rid] = L + kept
        c.commit_spec_accept_tokens(batch, accept)
    c.wait_for_pending_backup()
    for rid in w.reqs:
        n, i = w.length[rid], w.reqs[rid].kv.req_pool_idx
        for layer in range(LAYERS):
            host = c.mem_pool_host.layer_view(layer)[c.req_to_host_pool[i, :n]].numpy()
            assert np.array_equal(host, w.full[rid][layer, :n]), (rid, layer)
    for rid in list(w.reqs):
        w.finish(rid)
    assert w.free_sizes() == w.free_at_start


# ---- mutations: each shows a check above able to fail on SGLang's own objects ----

def test_the_prompts_newest_entries_not_loaded_at_admission_fail(monkeypatch):
    """ESS's reserved rows served before the prompt's bytes are in them (ESS's warm-up, which loads them, skipped)."""
    import ess
    monkeypatch.setattr(ess.Engine, "warmup", lambda self, request_id, windows: None)
    with pytest.raises(AssertionError):
        test_right_after_admission_the_prompt_is_served(300)


def test_req_to_host_pool_left_unfilled_fails(monkeypatch):
    """ESS's host slots never published to SGLang's req_to_host_pool."""
    monkeypatch.setattr(adapter.HiSparseCoordinator, "_publish_host_slots", lambda self, idx, n: None)
    with pytest.raises(AssertionError):
        test_staging_leaves_sglang_what_upstream_leaves(300)


def test_a_pool_not_restored_after_finish_fails(monkeypatch):
    """A finished request's ESS pages never released: the host pool's free size stays short."""
    import ess
    monkeypatch.setattr(ess.Engine, "release", lambda self, request_id: None)
    with pytest.raises(AssertionError):
        test_every_pool_is_whole_again_as_upstreams_is("finish", 300)


def test_micro_batches_reading_the_whole_batchs_rows_fail(monkeypatch):
    """Every swap of a forward reading the rows staged at its first (the adapter before two-batch overlap)."""
    from ess.integrations.sglang.forward_batches import ForwardBatches
    slot, same = ForwardBatches.slot, torch.zeros(1)
    monkeypatch.setattr(ForwardBatches, "slot", lambda self, layer, req_pool_indices: slot(self, layer, same))
    test_decode_serves_the_full_caches_bytes_among_sglangs_pools(False, "sparse", "fp8", monkeypatch)
    with pytest.raises(AssertionError):
        test_decode_serves_the_full_caches_bytes_among_sglangs_pools(True, "sparse", "fp8", monkeypatch)
