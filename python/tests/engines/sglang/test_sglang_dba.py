"""ESS's DBA overlap inside SGLang 0.5.23's own DSA decode: the indexer's Indexer._get_topk_paged
(layers/attention/dsa/dsa_indexer.py), as ESS wraps it, runs SGLang's own method per half of the batch, the first
half swapped between the two; then DeepseekSparseAttnBackend.forward_decode swaps the second half and runs FlashMLA
over the resident rows, waits for the copy's event, over the fetched rows, and merges (as DA: test_sglang_da.py).

What runs is SGLang's: _get_topk_paged with its own metadata class (DSAIndexerMetadata) and top-k backend
(DSATopKBackend.TORCH, --dsa-topk-backend torch), the paged MQA logits on its own torch path
(SGLANG_FP8_PAGED_MQA_LOGITS_TORCH: dsv4/indexer.fp8_paged_mqa_logits_torch through deepgemm_paged_mqa_logits_split),
the index keys read from the HiSparse pool's own index-K buffer (written in the per-page layout IndexKeyCache.move
documents: a page's 64 keys of 128 FP8 bytes, then their 64 float32 scales), the forward context SGLang's
(forward_context.forward_context with the DSA backend), the decode as in test_sglang_da.

Per decode step and layer, in SGLang's order (prepare_decode, the new token's KV and index key written, the
indexer, forward_decode). Checks:

- the indexer's top-k under DBA equals SGLang's own _get_topk_paged over the whole batch, bit for bit (the halves
  compute the same rows);
- order: the first half's logits, its swap, then the second half's logits, for every layer of a batch of two or
  more (one batch of one: no split);
- lossless and the merge within test_sglang_da's bound, with the copy delayed as far as stream order allows;
- with two-batch overlap's micro-batches, each split in halves; in the verify forward of speculative decoding
  (T = 2: bs x T query rows, per-token lengths, the page table expanded per token);
- layer-wise: each layer and micro-batch as ESS_OVERLAP_LAYERS says; its settings checked before anything is taken;
- mutations: the second half's step bound at the batch's first position; the second half's indexer reading the
  first half's page table — each fails.

Stand-ins, each because the real object cannot be built on a CPU: FlashMLA's kernel (flashmla_standin.py); the
Indexer and the DSA backend made without their __init__ (which need a ModelRunner and the model's weights) with the
attributes _get_topk_paged and forward_decode read; the DSA attention metadata as a namespace of the fields the
indexer metadata's getters read."""
import random
import types

import pytest
import torch

from sglang.srt.layers.attention.dsa import dsa_indexer
from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod
from sglang.srt.layers.attention.dsa.paged_mqa_logits_backend import DSAPagedMQALogitsBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

from ess.integrations.sglang import forward_batches, indexer_split
from test_sglang_da import (HEADS, AttnWorld, DelayedCopy, check, flashmla,  # noqa: F401
                            forward_batches_of, refused_before_anything_is_taken, step_batches,
                            write_step_kv)
from test_sglang_objects import CTX, K, LAYERS, PAGE, cpu_kernels, host_memory_unregistered  # noqa: F401

INDEX_HEADS, INDEX_DIM = 4, 128


@pytest.fixture
def indexer(flashmla, monkeypatch):
    """(SGLang's Indexer with ESS's wrapper (as install() puts it), the log of its logits calls and first-half swaps,
    the flashmla fixture's log of FlashMLA calls); the paged MQA logits on SGLang's torch path."""
    from sglang.srt.layers.attention.dsa import utils
    monkeypatch.setenv("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH", "1")
    log = []
    real = utils.resolve_fp8_paged_mqa_logits_fn

    def logged():
        fn = real()

        def logits(q, *args, **kwargs):
            log.append(("logits", int(q.shape[0])))
            return fn(q, *args, **kwargs)
        return logits
    monkeypatch.setattr(dsa_indexer, "resolve_fp8_paged_mqa_logits_fn", logged)
    indexer_split.patch_indexer(dsa_indexer.Indexer)
    ix = dsa_indexer.Indexer.__new__(dsa_indexer.Indexer)
    torch.nn.Module.__init__(ix)
    ix.paged_mqa_logits_backend = DSAPagedMQALogitsBackend.DEEPGEMM
    ix.sm_count, ix.n_heads, ix.index_topk = 132, INDEX_HEADS, K
    ix.num_init_tokens = ix.num_local_tokens = 0
    yield ix, log, flashmla
    indexer_split.unpatch_indexer(dsa_indexer.Indexer)


class IndexWorld(AttnWorld):
    """AttnWorld with each request's index keys, written where SGLang's indexer reads them."""

    def __init__(self, seed=0, **overrides):
        super().__init__(seed=seed, **overrides)
        self.keys = {}

    def prefill(self, rid, n):
        req = super().prefill(rid, n)
        g = self.torch_rng
        self.keys[rid] = ((torch.randn((LAYERS, CTX, INDEX_DIM), generator=g) * 2).to(torch.float8_e4m3fn),
                          torch.rand((LAYERS, CTX), generator=g) + 0.5)
        self.write_keys(rid, 0, n)
        return req

    def write_keys(self, rid, begin, end):
        """The index keys of tokens [begin, end) at their logical slots (the pool's per-page layout)."""
        pool, idx = self.s.device_pool, self.reqs[rid].kv.req_pool_idx
        locs = self.s.req_to_token_pool.req_to_token[idx, begin:end].to(torch.int64)
        page, off = locs // PAGE, locs % PAGE
        for layer in range(LAYERS):
            buf = pool.get_index_k_with_scale_buffer(layer)
            keys = buf[:, :PAGE * INDEX_DIM].view(buf.shape[0], PAGE, INDEX_DIM)
            scales = buf[:, PAGE * INDEX_DIM:].view(buf.shape[0], PAGE, 4)
            keys[page, off] = self.keys[rid][0][layer, begin:end].view(torch.uint8)
            scales[page, off] = self.keys[rid][1][layer, begin:end].contiguous().view(torch.uint8).view(-1, 4)


def indexer_metadata(w, idx, lens):
    """SGLang's DSAIndexerMetadata of a decode batch (HiSparse forces the unfused top-k on decode)."""
    table = w.s.req_to_token_pool.req_to_token[idx].to(torch.int32)
    lens32 = lens.to(torch.int32)
    attn = types.SimpleNamespace(cache_seqlens_int32=lens32, real_page_table=table[:, ::PAGE] // PAGE,
                                 page_table_1=table, dsa_seqlens_expanded=lens32,
                                 dsa_extend_seq_lens_list=[1] * int(idx.shape[0]), cu_seqlens_q=None,
                                 topk_indices_offset=None, indexer_logical_page_table=None)
    return DSAIndexerMetadata(attn_metadata=attn, topk_transform_method=TopkTransformMethod.PAGED,
                              topk_backend=DSATopKBackend.TORCH, force_unfused_topk=True)


def run(w, ix, log, steps, micro_batches=False, delayed=None):
    """Decode steps, the top-k from SGLang's indexer; returns test_sglang_da.run's entries and the per-call
    order of logits calls and first-half swaps."""
    if delayed is not None:
        delayed.install()
    coord = w.s.coord
    swap_first = coord.swap_first_half

    def logged_swap(req_pool_indices, seq_lens, top_k_half, layer_id):
        log.append(("first", int(top_k_half.shape[0])))
        return swap_first(req_pool_indices, seq_lens, top_k_half, layer_id)
    coord.swap_first_half = logged_swap
    calls, orders = [], []
    original = dsa_indexer.Indexer._get_topk_paged.ess_original
    for step in range(steps):
        rids, idx, lens, device = w.prepare_decode()
        batches = step_batches(rids, idx, lens, micro_batches)
        for r in rids:
            w.write_keys(r, w.length[r] - 1, w.length[r])
        for layer in range(LAYERS):
            write_step_kv(w, rids, device, layer)
            for lo, hi, part_idx, part_lens in forward_batches_of(batches, layer):
                batch = types.SimpleNamespace(req_pool_indices=part_idx, seq_lens=part_lens,
                                              forward_mode=ForwardMode.DECODE)
                metadata = indexer_metadata(w, part_idx, part_lens)
                q_fp8 = torch.randn((part_idx.shape[0], INDEX_HEADS, INDEX_DIM),
                                    generator=w.torch_rng).to(torch.float8_e4m3fn)
                weights = torch.randn((part_idx.shape[0], INDEX_HEADS, 1), generator=w.torch_rng)
                with forward_context(ForwardContext(attn_backend=w.backend)):
                    whole = original(ix, batch, layer, q_fp8, weights, metadata)   # SGLang's own, unsplit
                    del log[:]
                    topk = ix._get_topk_paged(batch, layer, q_fp8, weights, metadata)
                    assert torch.equal(topk, whole), ("top-k", step, layer)
                    orders.append(list(log))
                    out, q = w.forward_decode(layer, part_idx, part_lens, topk, forward_mode=ForwardMode.DECODE)
                del log[:]
                n = hi - lo
                picks = [[p for p in topk[b].tolist() if p >= 0] for b in range(n)]
                calls.append((step, layer, [(r, picks[b], out[b].view(HEADS, 512), q[b])
                                            for b, r in enumerate(rids[lo:hi])], out[n:]))
    return calls, orders


def four_requests(seed=1):
    w = IndexWorld(seed=seed)
    for rid, n in (("a", 300), ("b", 70), ("c", 260), ("d", 40)):
        w.prefill(rid, n)
    assert sorted(w.collect()) == ["a", "b", "c", "d"]
    return w


@pytest.mark.parametrize("micro_batches", [False, True])
def test_dba_inside_sglangs_indexer_and_decode_is_lossless(indexer, monkeypatch, micro_batches):
    ix, log, flash = indexer
    monkeypatch.setenv("ESS_OVERLAP", "dba")
    w = four_requests()
    delayed = DelayedCopy(w)
    calls, orders = run(w, ix, log, 6, micro_batches, delayed)
    assert delayed.waits == len(calls)
    # Every call splits: four requests (halves of 2 + 2), or a micro-batch of two (1 + 1).
    for order, (step, layer, positions, padded) in zip(orders, calls):
        B = len(positions) + padded.shape[0]
        b0 = (B + 1) // 2
        assert order == [("logits", b0), ("first", b0), ("logits", B - b0)], (step, layer, order)
    kinds = check(w, calls, flash)
    assert "mixed" in kinds or "all fetched" in kinds, kinds
    for rid in list(w.reqs):
        w.finish(rid)
    assert w.free_sizes() == w.free_at_start


def test_a_batch_of_one_runs_as_da(indexer, monkeypatch):
    ix, log, flash = indexer
    monkeypatch.setenv("ESS_OVERLAP", "dba")
    w = IndexWorld(seed=3)
    w.prefill("a", 200)
    w.collect()
    calls, orders = run(w, ix, log, 3)
    assert all(order == [("logits", 1)] for order in orders), orders
    check(w, calls, flash)


def test_the_second_half_bound_at_the_first_position_fails(indexer, monkeypatch):
    """Mutation: the second half's step reads the batch from its first position (the halves' rows mixed up)."""
    ix, log, flash = indexer
    monkeypatch.setenv("ESS_OVERLAP", "dba")
    monkeypatch.setattr(forward_batches.ForwardBatches, "offset_step",
                        lambda self, req_pool_indices, first: self._slots[self._seen[self.key(req_pool_indices)]][2])
    w = four_requests()
    calls, _ = run(w, ix, log, 3, delayed=DelayedCopy(w))
    with pytest.raises(AssertionError, match="bytes|split"):
        check(w, calls, flash)


def test_a_half_reading_the_other_halfs_page_table_fails(indexer, monkeypatch):
    """Mutation: each half's metadata gives the page table of the batch's first requests (rows mixed up)."""
    ix, log, flash = indexer
    monkeypatch.setenv("ESS_OVERLAP", "dba")
    monkeypatch.setattr(indexer_split.HalfIndexerMetadata, "get_page_table_64",
                        lambda self: self._whole.get_page_table_64()[:self._b1 - self._b0])
    w = four_requests()
    with pytest.raises(AssertionError, match="top-k"):
        run(w, ix, log, 2)


def test_dba_with_sglangs_topk_broadcast_is_refused_before_anything_is_taken(flashmla, monkeypatch):
    refused_before_anything_is_taken(monkeypatch, {"ESS_OVERLAP": "dba", "SGLANG_DSA_TOPK_BROADCAST": "1"},
                                     "ESS_OVERLAP = dba: SGLANG_DSA_TOPK_BROADCAST")


@pytest.mark.parametrize("layers,micro_batches,expected", [
    ("b a", False, [["split"], ["whole"]]),
    ("a ab", True, [["whole"], ["whole", "split"]]),
])
def test_layerwise_runs_each_layer_and_micro_batch_as_its_schedule_says(indexer, monkeypatch, layers,
                                                                        micro_batches, expected):
    """ESS_OVERLAP = layerwise with the plan's per-layer codes: a DBA layer (b) splits the indexer, a DA layer (a)
    does not; with two-batch overlap a layer's two codes are its micro-batches' (A, then B). Lossless throughout."""
    ix, log, flash = indexer
    monkeypatch.setenv("ESS_OVERLAP", "layerwise")
    monkeypatch.setenv("ESS_OVERLAP_LAYERS", layers)
    w = four_requests()
    calls, orders = run(w, ix, log, 4, micro_batches, DelayedCopy(w))
    kinds = [kind for layer in expected for kind in layer]   # one step's forward_decode calls, in order
    for i, order in enumerate(orders):
        assert (len(order) == 3) == (kinds[i % len(kinds)] == "split"), (i, order)
    check(w, calls, flash)
    for rid in list(w.reqs):
        w.finish(rid)
    assert w.free_sizes() == w.free_at_start


def test_a_layer_without_misses_runs_sglangs_own_decode(indexer, monkeypatch):
    """Code '-' (no misses in the plan): the layer's forward_decode is not armed, one FlashMLA call; the next layer's
    DBA still splits."""
    ix, log, flash = indexer
    monkeypatch.setenv("ESS_OVERLAP", "layerwise")
    monkeypatch.setenv("ESS_OVERLAP_LAYERS", "- b b")   # a group past the pool's layers (the MTP layer): not read
    w = four_requests()
    calls, orders = run(w, ix, log, 2)
    assert [len(o) for o in orders] == [1, 3] * 2
    assert len(flash) == 2 * (1 + 2)


@pytest.mark.parametrize("layers,message", [
    (None, "needs ESS_OVERLAP_LAYERS"),
    ("b", "has 1 layers; this pool serves layers \\[0, 2\\)"),
    ("a c", "layer 1's schedule 'c'"),
    ("a aab", "layer 1's schedule 'aab'"),
])
def test_layerwise_settings_are_checked_before_anything_is_taken(flashmla, monkeypatch, layers, message):
    refused_before_anything_is_taken(monkeypatch, {"ESS_OVERLAP": "layerwise", "ESS_OVERLAP_LAYERS": layers}, message)


@pytest.mark.parametrize("captured", [False, True])
def test_dba_in_the_verify_forward_of_speculative_decoding(indexer, monkeypatch, captured):
    """The verify forward (TARGET_VERIFY, T = 2): SGLang's _get_topk_paged over bs x T query rows with the per-token
    lengths and the page table expanded per token (the target-verify metadata), split per half of the requests;
    the first half swapped as forward_extend's HiSparse branch swaps ([b0, T, K], per-token seq_lens), then
    forward_extend swaps the rest. The top-k equals the unsplit call's, the order holds, lossless per query row.
    captured: the extend lengths as SGLang's captured verify graph has them, one per query row ([1] x bs x T,
    dsa_backend.init_forward_metadata_capture_cuda_graph), not [T] x bs."""
    from sglang.srt.layers.attention import dsa_backend
    from sglang.test.kernels.dsa_transform_index import transform_index_page_table_prefill_ref
    monkeypatch.setattr(dsa_backend, "transform_index_page_table_prefill",
                        lambda *a, cu_seqlens_q=None, **k: transform_index_page_table_prefill_ref(*a, **k))
    ix, log, flash = indexer
    monkeypatch.setenv("ESS_OVERLAP", "dba")
    T = 2
    w = IndexWorld(seed=5, num_draft_tokens=T)
    s, c = w.s, w.s.coord
    for rid, n in (("a", 300), ("b", 90), ("c", 250)):
        w.prefill(rid, n)
    assert sorted(w.collect()) == ["a", "b", "c"]
    delayed = DelayedCopy(w).install()
    swap_first = c.swap_first_half
    c.swap_first_half = lambda *a: (log.append(("first", int(a[2].shape[0]))), swap_first(*a))[1]
    original = dsa_indexer.Indexer._get_topk_paged.ess_original
    calls = []
    for step in range(4):
        rids, idx, lens, batch = w.prepare_verify(T, ForwardMode.TARGET_VERIFY)
        c.wait_for_pending_backup()
        c.num_real_reqs.fill_(len(rids))
        device = s.device_pool.translate_loc_from_full_to_hisparse_device(batch.out_cache_loc)
        B = len(rids)
        for r in rids:
            w.write_keys(r, w.length[r], w.length[r] + T)
        expanded = (lens.view(-1, 1) + torch.arange(1, T + 1)).view(-1).to(torch.int32)
        table = s.req_to_token_pool.req_to_token[idx].to(torch.int32)
        attn = types.SimpleNamespace(
            cache_seqlens_int32=(lens + T).to(torch.int32), real_page_table=(table[:, ::PAGE] // PAGE).repeat_interleave(
                T, dim=0), page_table_1=table.repeat_interleave(T, dim=0), dsa_seqlens_expanded=expanded,
            dsa_extend_seq_lens_list=[1] * B * T if captured else [T] * B,
            cu_seqlens_q=torch.arange(0, B * T + 1, T, dtype=torch.int32),
            topk_indices_offset=None, indexer_logical_page_table=None, dsa_cache_seqlens_int32=expanded.clamp_max(K),
            flashmla_metadata=types.SimpleNamespace(flashmla_metadata=torch.zeros(1, dtype=torch.int32),
                                                    num_splits=torch.zeros(B * T + 1, dtype=torch.int32)))
        metadata = DSAIndexerMetadata(attn_metadata=attn, topk_transform_method=TopkTransformMethod.PAGED,
                                      topk_backend=DSATopKBackend.TORCH, force_unfused_topk=True)
        fb = types.SimpleNamespace(req_pool_indices=idx, seq_lens=lens + T, forward_mode=ForwardMode.TARGET_VERIFY)
        for layer in range(LAYERS):
            for b, r in enumerate(rids):   # the verify forward's set_mla_kv_buffer of the T tokens
                for t in range(T):
                    s.rows(layer)[int(device[b * T + t])] = torch.from_numpy(w.full[r][layer, w.length[r] + t])
            q_fp8 = torch.randn((B * T, INDEX_HEADS, INDEX_DIM), generator=w.torch_rng).to(torch.float8_e4m3fn)
            weights = torch.randn((B * T, INDEX_HEADS, 1), generator=w.torch_rng)
            q = torch.randn((B * T, HEADS * 576), generator=w.torch_rng).to(torch.bfloat16) * 4
            with forward_context(ForwardContext(attn_backend=w.backend)):
                whole = original(ix, fb, layer, q_fp8, weights, metadata)
                del log[:]
                topk = ix._get_topk_paged(fb, layer, q_fp8, weights, metadata)
                assert torch.equal(topk, whole), ("top-k", step, layer)
                b0 = (B + 1) // 2
                assert log == [("logits", b0 * T), ("first", b0), ("logits", (B - b0) * T)], log
                w.backend.forward_metadata = attn
                out = w.backend.forward_extend(q, None, None, w.layers[layer], fb, topk_indices=topk)
            del log[:]
            picks = [[p for p in topk[i].tolist() if p >= 0] for i in range(B * T)]
            positions = [(rids[i // T], picks[i], out[i].view(HEADS, 512), q[i]) for i in range(B * T)]
            calls.append((step, layer, positions, out[B * T:]))
        c.commit_spec_accept_tokens(batch, torch.arange(B * T, dtype=torch.int32).view(B, T))
        for r in rids:
            w.length[r] += T
    assert delayed.waits == len(calls)
    check(w, calls, flash)
    for rid in list(w.reqs):
        w.finish(rid)
    assert w.free_sizes() == w.free_at_start


def test_a_step_preparation_forgets_what_a_failed_forward_left(indexer, monkeypatch):
    """A forward that raised after a DBA first half (before its forward_decode) leaves the first half and the
    layer-wise counts behind; the next step's preparation (map_last_loc_to_buffer) drops both, and that step is
    lossless."""
    ix, log, flash = indexer
    monkeypatch.setenv("ESS_OVERLAP", "layerwise")
    monkeypatch.setenv("ESS_OVERLAP_LAYERS", "ab ab")   # micro-batch A: DA, B: DBA; without micro-batches, DA
    w = four_requests()
    split = w.s.coord.decode_split
    split.first_half = (1, (0, 4), 2)   # as a failed forward leaves them
    split._calls[0], split._last_layer = 1, 0
    calls, orders = run(w, ix, log, 2, delayed=DelayedCopy(w))
    assert all(len(order) == 1 for order in orders), orders   # every layer DA again: the counts restarted
    check(w, calls, flash)
