"""ESS's HiSparseCoordinator over SGLang 0.5.23's own DeepSeek-V4 pools, imported from the pinned release and built
through their own constructors on CPU tensors, with SGLang's settings published for a DeepSeek-V4 config.json (the
pools read them): DeepSeekV4TokenToKVPool(enable_hisparse=True), whose C4 pool is HiSparseC4DevicePool,
SWATokenToKVPoolAllocator over it and DeepSeekV4HiSparseTokenToKVPoolAllocator around that
(mem_cache/kv_cache_configurator.py), driven in SGLang's call order:

  prefill      DeepSeekV4HiSparseTokenToKVPoolAllocator.alloc_extend (logical pages, C4 device pages for
               seq_len // 4 entries, the compressed-slot mapping); the prefill's compressor stores each entry at
               its compressed slot's device slot (compressor_v2.py: _translate_loc_to_hisparse_device), here with
               SGLang's own torch store of the V4 page layout (test/kernels/deepseek_v4/k_cache_reference.py
               set_k_and_s_torch)
  staging      admit_request_into_staging, collect_ready_reqs
  decode prep  alloc_decode (logical only), seq_lens += 1, map_last_loc_to_buffer
  forward      per C4 layer: the compressor's store when seq_len % 4 == 0 (metadata_kernel.py: c4_out_loc =
               out_cache_loc // 4), then the indexer's swap_in_selected_pages(req_pool_indices=,
               compressed_seq_lens = seq_len // 4, top_k_result = request-local compressed positions, -1 padded,
               layer_id = the C4 layer's compress_layer_id) (dsv4/indexer.py); FlashMLA then reads the returned
               slots of the C4 pool (deepseek_v4_backend.py: extra_indices_in_kvcache)
  finish       request_finished, then allocator.free(req_to_token[idx, :kv_allocated_len])

The oracle is each request's full compressed cache: every byte FlashMLA reads at the returned slots (by upstream's
own addressing, KVLayout.V4.row_addressing) is the entry's, and SGLang's own dequantizing reader
(dequantize_k_cache_paged_ref) gives the same values from them. Upstream's coordinator is not run beside ESS's here
(as it is for the DSA pool): its DeepSeek-V4 swap and staging copy are CUDA kernels only
(load_cache_to_device_buffer_dsv4_mla, transfer_cache_dsv4_mla) and its torch path (naive_load_topk) refuses
DeepSeek-V4."""
import contextlib
import json
import random

import numpy as np
import pytest
import torch

from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
from sglang.srt.mem_cache.allocator.hisparse import DeepSeekV4HiSparseTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool, HiSparseC4DevicePool
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs
from sglang.test.kernels.deepseek_v4.k_cache_reference import (NopeFp8RopeBf16Pack, dequantize_k_cache_paged_ref,
                                                               set_k_and_s_torch)

import ess
from ess.integrations import sglang as adapter
from test_sglang_objects import (host_memory_unregistered, make_req, prepare_decode_step,  # noqa: F401
                                 process_group, release)

# Seven layers as DeepSeek-V4-Flash begins: two sliding-window-only layers, then C4 and C128 alternating.
RATIOS = [0, 0, 4, 128, 4, 128, 4]
C4_LAYERS = RATIOS.count(4)
REQS, CTX, FULL, RATIO, PAGE = 4, 4096, 16384, 2, 256
K, SLOTS = 16, 64
ENTRY = 584                   # KVLayout.V4's bytes per token: 576 of values, 7 scales and a pad byte
NOPE, ROPE, SCALES = 448, 64, 7


@contextlib.contextmanager
def published(tmp_path, **server_args):
    """SGLang's settings published for a seven-layer DeepSeek-V4 config.json (ServerArgs, as its launcher does; the
    pools read them), taken back after."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_hidden_layers": len(RATIOS),
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": ROPE, "q_lora_rank": 128, "o_lora_rank": 128, "o_groups": 2, "index_topk": 512,
        "index_head_dim": 128, "index_n_heads": 4, "sliding_window": 128, "compress_ratios": RATIOS + [0],
        "vocab_size": 1000, "max_position_embeddings": CTX, "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16", "intermediate_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 8}))
    context = get_context()
    saved = (context._server_args, context._config_bags, context.parallel._config,
             context.flags.capture.enable_torch_compile)
    try:
        context.set_server_args(ServerArgs(model_path=str(tmp_path), device="cpu", skip_tokenizer_init=True,
                                           **server_args))
        yield
    finally:
        (context._server_args, context._config_bags, context.parallel._config,
         context.flags.capture.enable_torch_compile) = saved


class Pools:
    """SGLang's DeepSeek-V4 pools with --enable-hisparse (kv_cache_configurator.py _build_dsv4_kv_pool and the
    allocator after it): the C4 device pool holds FULL // (4 x RATIO) entries, the logical space FULL tokens."""

    def __init__(self):
        self.req_to_token_pool = ReqToTokenPool(size=REQS, max_context_len=CTX, device="cpu",
                                                enable_memory_saver=False)
        self.kv_pool = DeepSeekV4TokenToKVPool(
            max_num_reqs=REQS, swa_size=FULL, c4_size=FULL // (4 * RATIO), c128_size=FULL // 128,
            c4_state_pool_size=FULL, c128_state_pool_size=256, page_size=PAGE, swa_page_size=PAGE,
            dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
            qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, indexer_head_dim=128, layer_num=len(RATIOS), device="cpu",
            enable_memory_saver=False, compression_ratios=RATIOS, sliding_window=128, enable_hisparse=True,
            num_req_slots=REQS + 1, full_size=FULL)
        swa = SWATokenToKVPoolAllocator(FULL, FULL, page_size=PAGE, dtype=torch.float8_e4m3fn, device="cpu",
                                        kvcache=self.kv_pool, need_sort=False,
                                        req_to_token_pool=self.req_to_token_pool)
        self.allocator = DeepSeekV4HiSparseTokenToKVPoolAllocator(swa)
        self.c4 = self.allocator.hisparse_kvcache
        assert isinstance(self.c4, HiSparseC4DevicePool)
        # The swap's layer_id: the C4 layer's compress_layer_id, as the indexer reads it.
        self.c4_layer_ids = [self.kv_pool.layer_mapping[l].compress_layer_id
                             for l, r in enumerate(RATIOS) if r == 4]
        assert self.c4_layer_ids == list(range(C4_LAYERS))

    def coordinator(self, **overrides):
        kwargs = dict(req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
                      top_k=K, device_buffer_size=SLOTS, device="cpu", tp_group=None, host_to_device_ratio=RATIO)
        kwargs.update(overrides)
        return adapter.HiSparseCoordinator(**kwargs)

    def free_sizes(self, coordinator):
        return (self.allocator.logical_attn_allocator.available_size(),
                self.allocator.hisparse_attn_allocator.available_size(), coordinator.mem_pool_host.available_size())


def entries(rng, n):
    """n C4 entries as the compressor packs them: FP8 NoPE values, BF16 RoPE values, UE8M0 scales (finite values,
    so SGLang's dequantizing reader can be compared too)."""
    nope = torch.from_numpy(rng.normal(0, 40, (n, NOPE)).astype(np.float32)).to(torch.float8_e4m3fn)
    rope = torch.from_numpy(rng.normal(0, 1, (n, ROPE)).astype(np.float32)).to(torch.bfloat16)
    scales = torch.from_numpy(rng.integers(117, 137, (n, SCALES), dtype=np.uint8))
    return NopeFp8RopeBf16Pack(k_nope_fp8=nope.contiguous(), k_rope_bf16=rope.contiguous(),
                               scale_k_nope_ue8m0=scales.contiguous())


def take(pack, at):
    return NopeFp8RopeBf16Pack(k_nope_fp8=pack.k_nope_fp8[at].contiguous(),
                               k_rope_bf16=pack.k_rope_bf16[at].contiguous(),
                               scale_k_nope_ue8m0=pack.scale_k_nope_ue8m0[at].contiguous())


def read_bytes(buf, slots):
    """The bytes FlashMLA reads of each C4 slot, by upstream's addressing (KVLayout.V4.row_addressing): its 576
    bytes of values and 8 of scales."""
    stride, scale_base, scale_stride = KVLayout.V4.row_addressing(64)
    flat = buf.view(-1)
    out = []
    for s in slots.tolist():
        page, at = divmod(s, 64)
        base = page * buf.shape[1]
        out.append(bytes(flat[base + at * stride:base + (at + 1) * stride].tolist())
                   + bytes(flat[base + scale_base + at * scale_stride:base + scale_base + (at + 1) * scale_stride]
                           .tolist()))
    return out


class World:
    """The pools, ESS's coordinator and each request's full compressed cache (per C4 layer, as packed entries and
    in a reference page buffer at slot = position, which SGLang's reader dequantizes for comparison)."""

    def __init__(self, tmp_path, seed=0, **overrides):
        self.p = Pools()
        self.c = self.p.coordinator(**overrides)
        self.rng = np.random.default_rng(seed)
        self.full, self.reference, self.reqs, self.length = {}, {}, {}, {}
        self.free_at_start = self.p.free_sizes(self.c)

    def store(self, layer, compressed_locs, rid, positions):
        """The compressor's store of the request's entries `positions` at their compressed slots."""
        device = self.p.c4.translate_loc_to_hisparse_device(compressed_locs)   # compressor_v2.py's translation
        set_k_and_s_torch(self.p.c4.kv_buffer[layer], device, take(self.full[rid][layer], positions), 64)

    def prefill(self, rid, n):
        p = self.p
        idx = p.req_to_token_pool.alloc_rows(1)[0]
        self.full[rid] = [entries(self.rng, CTX // 4) for _ in range(C4_LAYERS)]
        pages = -(-(CTX // 4) // 64)
        self.reference[rid] = [torch.zeros((pages, KVLayout.V4.page_bytes(64)), dtype=torch.uint8)
                               for _ in range(C4_LAYERS)]
        for layer in range(C4_LAYERS):
            set_k_and_s_torch(self.reference[rid][layer], torch.arange(CTX // 4), self.full[rid][layer], 64)
        zero, length = torch.tensor([0]), torch.tensor([n])
        locs = p.allocator.alloc_extend(prefix_lens=zero, prefix_lens_cpu=zero, seq_lens=length,
                                        seq_lens_cpu=length, last_loc=torch.tensor([-1]), extend_num_tokens=n)
        assert locs is not None
        p.req_to_token_pool.write((idx, slice(0, n)), locs.to(torch.int32))
        completing = locs[(locs + 1) % 4 == 0]   # the tokens that complete an entry, in order
        assert completing.numel() == n // 4
        if n >= 4:
            for layer in range(C4_LAYERS):
                self.store(layer, (completing // 4).to(torch.int64), rid, torch.arange(n // 4))
        req = make_req(rid, idx, n)
        self.reqs[rid], self.length[rid] = req, n
        self.c.admit_request_into_staging(req)
        return req

    def prepare_decode(self):
        """ScheduleBatch.prepare_for_decode (test_sglang_objects.prepare_decode_step): returns (rids,
        req_pool_indices, seq_lens, out_cache_loc)."""
        return prepare_decode_step(self.p.req_to_token_pool, self.p.allocator, self.c, self.reqs, self.length)

    def finish(self, rid):
        """request_finished, then release_kv_cache -> allocator.free(req_to_token[idx, :kv_allocated_len])."""
        release(self.p.req_to_token_pool, self.p.allocator, self.c.request_finished, self.reqs.pop(rid))


@pytest.fixture
def v4(tmp_path):
    with published(tmp_path):
        yield tmp_path


# Prompts of 301, 2 (no entry yet: its first comes at its fourth token) and 130 tokens; and of 256 then 255 tokens,
# whose pages follow each other, so that at the first step "a" enters a new page while "b", on the page before it,
# completes that page's last entry: (loc - 3) // 4 of a's token is b's completing slot. "b" decodes first in the batch
# (where two writes of one slot race, the later one stands).
PROMPTS = [(("a", 301), ("b", 2), ("c", 130)), (("a", 256), ("b", 255))]
DECODE_FIRST = {1: "b"}


@pytest.mark.parametrize("residency", ["sparse", "adaptive"])
@pytest.mark.parametrize("prompts", PROMPTS, ids=["301-2-130", "adjacent-pages"])
def test_decode_reads_the_full_compressed_cache_among_sglangs_v4_pools(v4, residency, prompts, monkeypatch):
    """The prompts decode 14 steps; at each C4 layer of each step every slot the swap returns holds the chosen entry's
    bytes (and SGLang's reader gives its values), padding positions -1; the host pool ends up holding every entry but
    the newest; finishing leaves SGLang's pools as they started."""
    monkeypatch.setenv("ESS_RESIDENCY", residency)
    w, pick = World(v4, seed=3), random.Random(5)
    p, c = w.p, w.c
    for rid, n in prompts:
        w.prefill(rid, n)
    first = DECODE_FIRST.get(PROMPTS.index(prompts))
    if first is not None:   # the batch's order (prepare_decode's), the prompts' pages as allocated above
        w.reqs = {first: w.reqs[first], **{r: q for r, q in w.reqs.items() if r != first}}
    assert sorted(r.rid for r in c.collect_ready_reqs()) == sorted(rid for rid, _ in prompts)
    made = 0
    for step in range(14):
        rids, idx, lens, out_cache_loc = w.prepare_decode()
        compressed = lens // 4
        for layer in range(C4_LAYERS):
            for b, r in enumerate(rids):   # the compressor writes the entry this step completes
                if int(lens[b]) % 4 == 0:
                    made += layer == 0
                    w.store(layer, (out_cache_loc[b:b + 1] // 4), r, torch.tensor([int(compressed[b]) - 1]))
            picks = [sorted(pick.sample(range(int(n)), min(K, int(n)))) for n in compressed]
            topk = torch.tensor([q + [-1] * (K - len(q)) for q in picks], dtype=torch.int32)
            table = c.swap_in_selected_pages(req_pool_indices=idx, compressed_seq_lens=compressed.to(torch.int32),
                                             top_k_result=topk, layer_id=p.c4_layer_ids[layer])
            assert table.dtype == torch.int32 and tuple(table.shape) == (len(rids), K)
            buf = p.c4.kv_buffer[layer]
            for b, r in enumerate(rids):
                got = table[b, :len(picks[b])].to(torch.int64)
                assert (table[b, len(picks[b]):] == -1).all(), (step, layer, r)
                want = read_bytes(w.reference[r][layer], torch.tensor(picks[b]))
                assert read_bytes(buf, got) == want, (step, layer, r)
                if picks[b]:
                    assert torch.equal(dequantize_k_cache_paged_ref(buf, got, 64),
                                       dequantize_k_cache_paged_ref(w.reference[r][layer], torch.tensor(picks[b]),
                                                                    64))
    assert made >= 6   # entries were completed during decode
    # Every entry but the newest is in ESS's host pool (the newest is backed up at the next step).
    c.wait_for_pending_backup()
    for rid, req in w.reqs.items():
        n = w.length[rid] // 4
        for layer in range(C4_LAYERS):
            host = c.engine.read_entries(req.kv.req_pool_idx, layer, 0, torch.empty((max(n - 1, 0), 592),
                                                                                   dtype=torch.uint8))
            want = read_bytes(w.reference[rid][layer], torch.arange(max(n - 1, 0)))
            assert [bytes(row[:ENTRY].tolist()) for row in host] == want, (rid, layer)
    stats = c.engine.stats()
    if residency == "adaptive":
        assert stats.whole_steps > 0, stats
    else:
        assert stats.misses > 0, stats
    for rid in list(w.reqs):
        w.finish(rid)
    assert p.free_sizes(c) == w.free_at_start
    assert int((p.allocator.full_to_hisparse_device_index_mapping[:-1] != 0).sum()) == 0
    c.destroy()


def test_a_step_that_completes_no_entry_backs_nothing_up(v4):
    """Between entries (seq_len % 4 != 0) the request's length in ESS stays, the allocator's mapping is left as it is
    (the prompt's compressed slots stay unmapped, as staging left them), and the next step's backup skips the
    request: bytes scribbled over its reserved row after such a step never reach the host pool."""
    w = World(v4, seed=1)
    w.prefill("a", 40)   # 10 entries; decode steps reach 41, 42, 43 (none), 44 (the 11th)
    w.c.collect_ready_reqs()
    idx = w.reqs["a"].kv.req_pool_idx
    mapping = w.p.allocator.full_to_hisparse_device_index_mapping
    prompt = w.p.req_to_token_pool.req_to_token[idx, :40].to(torch.int64)
    compressed = prompt[(prompt + 1) % 4 == 0] // 4
    reserved = w.c.row_base + idx * w.c.info.rows_per_request + w.c.info.slots
    page, at = divmod(reserved, 64)
    w.prepare_decode()   # 41
    assert w.c._length[idx] == 10 and int((mapping[compressed] != 0).sum()) == 0
    w.p.c4.kv_buffer[0][page, at * 576:(at + 1) * 576] = 0xA5   # the reserved row (entry 9's values)
    w.prepare_decode()   # 42: would back up step 41's newest
    w.c.wait_for_pending_backup()
    host = w.c.engine.read_entries(idx, 0, 9, torch.empty((1, 592), dtype=torch.uint8))
    assert bytes(host[0, :ENTRY].tolist()) == read_bytes(w.reference["a"][0], torch.tensor([9]))[0]
    w.prepare_decode()   # 43
    w.prepare_decode()   # 44: the 11th entry, written by the step's forward into the reserved row
    assert w.c._length[idx] == 11
    for layer in range(C4_LAYERS):
        w.store(layer, w.p.req_to_token_pool.req_to_token[idx, 43:44].to(torch.int64) // 4, "a", torch.tensor([10]))
    w.prepare_decode()   # 45: backs up entry 10
    w.c.wait_for_pending_backup()
    for layer in range(C4_LAYERS):
        host = w.c.engine.read_entries(idx, layer, 10, torch.empty((1, 592), dtype=torch.uint8))
        assert bytes(host[0, :ENTRY].tolist()) == read_bytes(w.reference["a"][layer], torch.tensor([10]))[0]
    w.finish("a")
    assert w.p.free_sizes(w.c) == w.free_at_start
    w.c.destroy()


def test_a_decode_step_of_the_wrong_length_is_refused(v4):
    w = World(v4)
    w.prefill("a", 40)
    w.c.collect_ready_reqs()
    idx = torch.tensor([w.reqs["a"].kv.req_pool_idx])
    with pytest.raises(ess.InvalidArgument, match="seq_len 46 does not follow its 10 C4 entries"):
        w.c.map_last_loc_to_buffer(torch.tensor([46]), torch.tensor([300]), idx, torch.tensor([46]), idx.clone())
    assert w.c._length[int(idx)] == 10
    w.finish("a")
    w.c.destroy()


def test_what_the_v4_pool_cannot_serve_is_refused_by_name_and_gives_the_rows_back(v4, monkeypatch):
    """Speculative decoding (upstream's spec swap refuses DeepSeek-V4 too), the DSA backend's overlap schedules and
    index sharing: refused by name at construction, SGLang's C4 allocator whole after each."""
    p = Pools()
    inner = p.allocator.hisparse_attn_allocator
    before = (inner.size, inner.available_size())
    with pytest.raises(ess.InvalidArgument, match="speculative decoding with HiSparse serves DSA caches only"):
        p.coordinator(num_draft_tokens=2)
    with pytest.raises(ess.InvalidArgument, match="index sharing is a DSA model's"):
        p.coordinator(shared_index_layers=[False, True, False])
    monkeypatch.setenv("ESS_OVERLAP", "da")
    with pytest.raises(ess.InvalidArgument, match="ESS_OVERLAP = da with the DeepSeek-V4 C4 pool"):
        p.coordinator()
    monkeypatch.delenv("ESS_OVERLAP")
    assert (inner.size, inner.available_size()) == before
    c = p.coordinator()   # the rows are there to take again
    assert inner.size < before[0]
    c.destroy()


def test_pd_decode_is_refused_with_the_v4_pool(tmp_path):
    """A PD decode side receives C4 pages in the device layout, which ESS's host pool does not keep."""
    with published(tmp_path, disaggregation_mode="decode"):
        p = Pools()
        with pytest.raises(ess.InvalidArgument, match="disaggregation_mode = decode with the DeepSeek-V4 C4 pool"):
            p.coordinator()


def test_the_recorded_trace_counts_c4_entries(v4, monkeypatch):
    """ESS_RECORD_TRACE under the C4 pool: a trace of units (ess.unit_tokens 4, version 2) whose ids are the C4
    entries the indexer handed the swap, and whose lengths are the tokens of the entries each request held (4 x its
    entries), so that every id lies below ceil(length / 4)."""
    path = v4 / "v4.safetensors"
    monkeypatch.setenv("ESS_RECORD_TRACE", str(path))
    w, pick = World(v4, seed=4), random.Random(6)
    p, c = w.p, w.c
    for rid, n in (("a", 133), ("b", 2)):
        w.prefill(rid, n)
    c.collect_ready_reqs()
    handed = {"a": [], "b": []}
    for step in range(5):
        rids, idx, lens, out_cache_loc = w.prepare_decode()
        compressed = lens // 4
        ids = {r: np.full((C4_LAYERS, 1, K), -1, np.int32) for r in rids}
        for layer in range(C4_LAYERS):
            for b, r in enumerate(rids):
                if int(lens[b]) % 4 == 0:
                    w.store(layer, (out_cache_loc[b:b + 1] // 4), r, torch.tensor([int(compressed[b]) - 1]))
            picks = [sorted(pick.sample(range(int(n)), min(K, int(n)))) for n in compressed]
            topk = torch.tensor([q + [-1] * (K - len(q)) for q in picks], dtype=torch.int32)
            c.swap_in_selected_pages(req_pool_indices=idx, compressed_seq_lens=compressed.to(torch.int32),
                                     top_k_result=topk, layer_id=p.c4_layer_ids[layer])
            for b, r in enumerate(rids):
                ids[r][layer, 0] = topk[b].numpy()
        for b, r in enumerate(rids):
            handed[r].append((ids[r], 4 * max(int(compressed[b]), 1)))
    for rid in list(w.reqs):
        w.finish(rid)
    c.destroy()
    import ess_trace
    metadata, recorded = ess_trace.read_trace(str(path))
    assert metadata["ess.unit_tokens"] == "4" and metadata["ess.version"] == "2"
    assert metadata["ess.layers"] == str(C4_LAYERS)
    by_id = {r["id"]: r for r in recorded}
    for rid, steps in handed.items():
        got = by_id[rid]
        np.testing.assert_array_equal(got["topk"][..., :K], np.stack([ids for ids, _ in steps]))
        np.testing.assert_array_equal(got["lengths"], [length for _, length in steps])
        assert (got["topk"] < (got["lengths"][:, None, None, None] + 3) // 4).all()
