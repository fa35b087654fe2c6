"""ESS's DA overlap inside SGLang 0.5.23's own DSA decode: DeepseekSparseAttnBackend.forward_decode and
_forward_flashmla_kv (layers/attention/dsa_backend.py) and SGLang's FlashMLA interface
(kernels/ops/attention/flash_mla_interface.py) run unchanged over SGLang's own pools with ESS's coordinator
(ESS_OVERLAP = da); only FlashMLA's CUDA kernel is a stand-in (flashmla_standin.py, its documented interface).

Per decode step, in SGLang's order (test_sglang_objects.World.prepare_decode: alloc_decode, map_last_loc_to_buffer,
wait_for_pending_backup), then per layer the KV write of the new token at its device slot (set_mla_kv_buffer's
effect) and forward_decode, which swaps (the decision, the copy with its event), runs FlashMLA over the resident
rows, waits for the copy's event, runs it over the fetched rows and merges. Checks:

- lossless: the rows the two FlashMLA calls read, together, are exactly the selected tokens' entries of the full
  cache; Attn0 reads no row the step copies. The copy is delayed as far as stream order allows: its rows hold
  poison (FP8 NaN) until the current stream waits for the copy's event, so attention that reads them earlier fails;
- the merged output against single-pass FlashMLA over the full cache: bit-equal where one part is empty; else
  within 3 u max|V| (+ 1e-5 max|V| for float32 sums), u = 2^-8 the bf16 rounding: the two partial outputs are each
  rounded to bf16 (u |o_i| <= u max|V| each, and the merge is a convex combination of them), the merged output is
  rounded once more and the single pass once (u max|V| each);
- ESS_OVERLAP = none: one FlashMLA call per layer, bit-equal to the single pass;
- mutations: no wait for the copy's event; the merge taking the natural-log LSE as base 2 — each fails.

Stand-ins, each because the real object cannot be built on a CPU: FlashMLA's kernel (CUDA only); the backend is
made without its __init__ (which needs a ModelRunner) with the attributes forward_decode and _forward_flashmla_kv
read, as __init__ sets them for a DSA model with --enable-hisparse and the FP8 cache; ForwardBatch and the DSA
metadata as namespaces of the fields those two functions read."""
import math
import random
import sys
import types

import numpy as np
import pytest
import torch

from sglang.srt.layers.attention import dsa_backend
from sglang.srt.layers.radix_attention import RadixAttention

import ess
import flashmla_standin
from ess.integrations import sglang as adapter
from ess.integrations.sglang import overlap
from test_sglang_objects import CTX, ENTRY, K, LAYERS, World, cpu_kernels, host_memory_unregistered  # noqa: F401

HEADS, PADDED_HEADS = 8, 16   # the layer's q heads, and FlashMLA's head count they are padded to
INTERFACE = "sglang.kernels.ops.attention.flash_mla_interface"


@pytest.fixture
def flashmla(monkeypatch):
    """SGLang's FlashMLA interface module imported over the stand-in kernel, fresh for each test (ESS wraps its
    flash_mla_with_kvcache at the first DA layer); the DSA backend's forward_decode wrapped as install() does."""
    log = []
    standin = flashmla_standin.module(log)
    monkeypatch.setitem(sys.modules, "flash_mla", standin)
    monkeypatch.setitem(sys.modules, "flash_mla.flash_mla_interface", standin.flash_mla_interface)
    sys.modules.pop(INTERFACE, None)
    overlap.patch_backend(dsa_backend.DeepseekSparseAttnBackend)
    yield log
    overlap.unpatch_backend(dsa_backend.DeepseekSparseAttnBackend)
    sys.modules.pop(INTERFACE, None)


class AttnWorld(World):
    """World with entries FlashMLA can read (valid V32 FP8 entries) and SGLang's DSA backend over its pools."""

    def __init__(self, seed=0, **overrides):
        super().__init__(adapter.HiSparseCoordinator, seed=seed, **overrides)
        self.torch_rng = torch.Generator().manual_seed(seed)
        b = dsa_backend.DeepseekSparseAttnBackend.__new__(dsa_backend.DeepseekSparseAttnBackend)
        b.hisparse_coordinator = self.s.coord
        b.token_to_kv_pool = self.s.device_pool
        b.dsa_decode_impl = "flashmla_kv"
        b.dsa_index_kpool = 1
        b.dsa_index_topk = K
        b.dsa_kv_cache_store_fp8 = True
        b.physical_page_size = 64
        b.kv_cache_dim = ENTRY
        b.flashmla_kv_format = "V32"
        b.flashmla_kv_num_q_heads = PADDED_HEADS
        # forward_extend's verify path: no MHA, the unfused PAGED top-k transform, T draft tokens.
        b.use_mha = False
        b.use_fused_topk = False
        b.dsa_prefill_impl = "flashmla_kv"
        b.speculative_num_draft_tokens = overrides.get("num_draft_tokens", 0)
        self.backend = b
        self.layers = [RadixAttention(num_heads=HEADS, head_dim=576, scaling=576 ** -0.5, num_kv_heads=1,
                                      layer_id=layer, v_head_dim=512) for layer in range(LAYERS)]

    def entries(self):
        n = LAYERS * CTX
        latent = torch.randn((n, 512), generator=self.torch_rng) * 2
        rope = torch.randn((n, 64), generator=self.torch_rng)
        return flashmla_standin.quantize(latent, rope).view(LAYERS, CTX, ENTRY).numpy()

    def forward_decode(self, layer, idx, lens, topk, **batch_fields):
        """dsa_backend.forward_decode of one layer (the KV write done by the caller), as the model's attention calls
        it with a concatenated q; returns (output [bs, heads x 512], q). batch_fields: more of the ForwardBatch."""
        bs = idx.shape[0]
        q = torch.randn((bs, HEADS * 576), generator=self.torch_rng).to(torch.bfloat16) * 4
        self.backend.forward_metadata = types.SimpleNamespace(
            dsa_cache_seqlens_int32=lens.to(torch.int32).clamp_max(K),
            flashmla_metadata=types.SimpleNamespace(flashmla_metadata=torch.zeros(1, dtype=torch.int32),
                                                    num_splits=torch.zeros(bs + 1, dtype=torch.int32)))
        batch = types.SimpleNamespace(req_pool_indices=idx, seq_lens=lens, **batch_fields)
        out = self.backend.forward_decode(q, None, None, self.layers[layer], batch, topk_indices=topk)
        return out, q


def single_pass(w, q, rid, layer, picks):
    """FlashMLA (the stand-in) over the request's full cache, the picks in order, heads padded as SGLang pads
    them: [heads, 512] bf16."""
    rows = torch.from_numpy(w.full[rid][layer, picks]).view(1, 1, len(picks), ENTRY)
    qp = torch.zeros((1, 1, PADDED_HEADS, 576), dtype=torch.bfloat16)
    qp[0, 0, :HEADS] = q.view(HEADS, 576)
    out, _ = flashmla_standin.sparse_decode(qp, rows, torch.ones((1, 1, len(picks)), dtype=torch.bool),
                                            576 ** -0.5, 512)
    return out[0, 0, :HEADS]


class DelayedCopy(flashmla_standin.DelayedCopy):
    """The coordinator's copy event, the copy delayed: after each swap the rows it fetched (its pending split's
    device-pool slots) hold poison until a stream waits for the event."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def after_swap(self, layer):
        fetched = self.w.s.coord.decode_split.pending[1]
        self.poison(self.w.s.rows(layer), torch.unique(fetched[fetched >= 0]).to(torch.int64))

    def install(self):
        """Stands in for the coordinator's copy event; each swap's fetched rows poisoned until it is waited for."""
        c = self.w.s.coord
        c.decode_split.copy_done = self
        swap = c.swap_in_selected_pages

        def swapping(*args):
            table = swap(*args)
            self.after_swap(args[3])
            return table
        c.swap_in_selected_pages = swapping
        return self


def write_step_kv(w, rids, device, layer):
    """set_mla_kv_buffer of the step's token: each request's newest entry at its device slot."""
    for r, d in zip(rids, device.tolist()):
        w.s.rows(layer)[d] = torch.from_numpy(w.full[r][layer, w.length[r] - 1])


def step_batches(rids, idx, lens, micro_batches):
    """The batches of one step's forward, (whole, halves), each (lo, hi, req_pool_indices, seq_lens), one tensor each
    for the whole forward as SGLang's: the whole batch, and with two-batch overlap each half of the requests padded
    with row 0 (seq_len 1) to one length (TboForwardBatchPreparer.filter_batch, ForwardBatch._pad_tbo_child_inputs);
    without it the halves are the whole batch."""
    n = len(rids)
    whole = (0, n, idx, lens)
    if not micro_batches:
        return whole, [whole]
    width = n - n // 2
    halves = []
    for lo, hi in ((0, n // 2), (n // 2, n)):
        pad = width - (hi - lo)
        halves.append((lo, hi, torch.cat([idx[lo:hi], torch.zeros(pad, dtype=idx.dtype)]),
                       torch.cat([lens[lo:hi], torch.ones(pad, dtype=lens.dtype)])))
    return whole, halves


def forward_batches_of(batches, layer):
    """The batches a layer's forward runs (step_batches): the whole batch at the first layer (a dense one), else the
    halves."""
    whole, halves = batches
    return [whole] if layer == 0 else halves


def run(w, steps, rng, delayed=None, micro_batches=False):
    """Decode steps over every running request; returns one entry per forward_decode call: (step, layer, [(rid,
    picks, output, q) per position], padded positions' outputs). micro_batches: two-batch overlap, every layer but
    the first once per half of the requests, each half padded with row 0 to one length
    (TboForwardBatchPreparer.filter_batch, ForwardBatch._pad_tbo_child_inputs)."""
    if delayed is not None:
        delayed.install()
    seen, calls = {}, []
    for step in range(steps):
        rids, idx, lens, device = w.prepare_decode()
        batches = step_batches(rids, idx, lens, micro_batches)
        for layer in range(LAYERS):
            write_step_kv(w, rids, device, layer)
            for lo, hi, part_idx, part_lens in forward_batches_of(batches, layer):
                pad = part_idx.shape[0] - (hi - lo)
                picks = []
                for r in rids[lo:hi]:
                    n, kind = w.length[r], rng.choice(["repeat", "old", "random"])
                    before = seen.get((r, layer))
                    if kind == "repeat" and before is not None and max(before) < n:
                        p = before                                     # the last step's picks: all resident
                    elif kind == "old" and n > 200:
                        p = sorted(rng.sample(range(0, n - 150), K))   # far from the newest: mostly fetched
                    else:
                        p = sorted(rng.sample(range(n), min(K, n)))
                    seen[(r, layer)] = p
                    picks.append(p)
                topk = torch.tensor([p + [-1] * (K - len(p)) for p in picks] + [[0] + [-1] * (K - 1)] * pad,
                                    dtype=torch.int32)
                out, q = w.forward_decode(layer, part_idx, part_lens, topk)
                n = hi - lo
                calls.append((step, layer, [(r, picks[b], out[b].view(HEADS, 512), q[b])
                                            for b, r in enumerate(rids[lo:hi])], out[n:]))
    return calls


def check(w, calls, log, da=True):
    """Lossless bytes and the merged output against the single pass; returns the split kinds seen."""
    kinds = set()
    flash = iter(log)
    for step, layer, positions, padded in calls:
        first = next(flash)
        second = next(flash) if da else None
        # A padded position (row 0, or past num_real_reqs) selects nothing: FlashMLA's empty row, 0.
        assert torch.equal(padded, torch.zeros_like(padded)), ("padding", step, layer)
        for b, (r, picks, out, q) in enumerate(positions):
            full = w.full[r][layer, picks]
            ref = single_pass(w, q, r, layer, picks)
            if not da:
                got = first[1][b, 0, :len(picks)].numpy()
                assert np.array_equal(got, full), ("bytes", step, layer, r)
                assert torch.equal(out, ref), ("output", step, layer, r)
                continue
            n0, n1 = int((first[0][b] >= 0).sum()), int((second[0][b] >= 0).sum())
            read = np.concatenate([first[1][b, 0, :n0].numpy(), second[1][b, 0, :n1].numpy()])
            assert n0 + n1 == len(picks), ("split", step, layer, r, n0, n1)
            assert sorted(map(bytes, read)) == sorted(map(bytes, full)), ("bytes", step, layer, r)
            if n1 == 0 or n0 == 0:
                kinds.add("all resident" if n1 == 0 else "all fetched")
                assert torch.equal(out, ref), ("output", step, layer, r, n0, n1)
            else:
                kinds.add("mixed")
                vmax = float(flashmla_standin.dequantize(torch.from_numpy(full))[:, :512].abs().max())
                err = float((out.float() - ref.float()).abs().max())
                assert err <= (3 * 2 ** -8 + 1e-5) * vmax, ("output", step, layer, r, err, vmax)
    assert next(flash, None) is None
    return kinds


@pytest.mark.parametrize("micro_batches", [False, True])
def test_da_inside_sglangs_decode_is_lossless_and_merges_to_the_single_pass(flashmla, monkeypatch, micro_batches):
    monkeypatch.setenv("ESS_OVERLAP", "da")
    w = three_requests()
    delayed = DelayedCopy(w)
    results = run(w, 8, random.Random(2), delayed, micro_batches)
    assert delayed.waits == len(results)   # one wait for the copy per forward_decode, before Attn1
    assert check(w, results, flashmla) == {"all resident", "all fetched", "mixed"}
    for rid in list(w.reqs):
        w.finish(rid)
    assert w.free_sizes() == w.free_at_start


def test_da_with_adaptive_residency_reads_whole_requests_in_place(flashmla, monkeypatch):
    """ESS_OVERLAP=da with ESS_RESIDENCY=adaptive (the planner's launch line): requests that fit ESS's rows whole
    read every pick in place (Attn1 over nothing), the sparse one splits as before; lossless either way."""
    monkeypatch.setenv("ESS_OVERLAP", "da")
    monkeypatch.setenv("ESS_RESIDENCY", "adaptive")
    w = AttnWorld(seed=1)
    for rid, n in (("a", 60), ("b", 40), ("c", 300)):   # a and b fit a row whole; c is sparse beside them
        w.prefill(rid, n)
    assert sorted(w.collect()) == ["a", "b", "c"]
    results = run(w, 6, random.Random(2), DelayedCopy(w))
    kinds = check(w, results, flashmla)
    assert "all resident" in kinds and kinds & {"all fetched", "mixed"}, kinds
    st = w.s.coord.engine.stats()
    assert st.whole_steps > 0 and st.sparse_steps > 0, st
    for rid in list(w.reqs):
        w.finish(rid)
    assert w.free_sizes() == w.free_at_start


def test_without_da_one_flashmla_call_per_layer_reads_the_full_caches_bytes(flashmla, monkeypatch):
    monkeypatch.setenv("ESS_OVERLAP", "none")
    w, rng = AttnWorld(seed=4), random.Random(5)
    for rid, n in (("a", 300), ("b", 70)):
        w.prefill(rid, n)
    w.collect()
    check(w, run(w, 4, rng), flashmla, da=False)
    assert w.s.coord.decode_split is None


def three_requests(seed=1):
    """An AttnWorld with three running requests (300, 70 and 260 tokens)."""
    w = AttnWorld(seed=seed)
    for rid, n in (("a", 300), ("b", 70), ("c", 260)):
        w.prefill(rid, n)
    assert sorted(w.collect()) == ["a", "b", "c"]
    return w


def test_attention_before_the_copys_event_fails(flashmla, monkeypatch):
    """Mutation: the wait for the copy's event dropped; Attn1 reads the fetched rows before the copy lands."""
    monkeypatch.setenv("ESS_OVERLAP", "da")
    monkeypatch.setattr(overlap.DecodeSplit, "wait_for_copy", lambda self: None)
    w = three_requests()
    results = run(w, 3, random.Random(2), DelayedCopy(w))
    with pytest.raises(AssertionError, match="bytes"):
        check(w, results, flashmla)


def test_a_merge_taking_the_lse_as_base_two_fails(flashmla, monkeypatch):
    """Mutation: the partial states merged as if FlashMLA's natural-log LSE were base 2."""
    monkeypatch.setenv("ESS_OVERLAP", "da")
    merge = overlap.merge_states
    monkeypatch.setattr(overlap, "merge_states",
                        lambda o0, l0, o1, l1: merge(o0, l0 * math.log(2), o1, l1 * math.log(2)))
    w = three_requests()
    results = run(w, 4, random.Random(2), DelayedCopy(w))
    with pytest.raises(AssertionError, match="output"):
        check(w, results, flashmla)


def test_da_in_the_verify_forward_of_speculative_decoding(flashmla, monkeypatch):
    """The verify forward (forward_mode TARGET_VERIFY): forward_extend's HiSparse branch swaps [bs, T, K] with
    per-token seq_lens and FlashMLA reads bs x T query rows; armed as decode is (prepare_spec_verify before, the
    T tokens' KV at their reserved rows, commit_spec_accept_tokens after, every draft accepted). The same checks
    per query row. SGLang's Triton page-table transform, whose result the HiSparse branch replaces, runs as its
    own torch reference (sglang.test.kernels.dsa_transform_index)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kernels.dsa_transform_index import transform_index_page_table_prefill_ref
    monkeypatch.setattr(dsa_backend, "transform_index_page_table_prefill",
                        lambda *a, cu_seqlens_q=None, **k: transform_index_page_table_prefill_ref(*a, **k))
    monkeypatch.setenv("ESS_OVERLAP", "da")
    T = 2
    w, rng = AttnWorld(seed=5, num_draft_tokens=T), random.Random(6)
    s, c = w.s, w.s.coord
    for rid, n in (("a", 300), ("b", 90), ("c", 250)):
        w.prefill(rid, n)
    assert sorted(w.collect()) == ["a", "b", "c"]
    delayed = DelayedCopy(w).install()
    calls, seen = [], {}
    for step in range(5):
        rids, idx, lens, batch = w.prepare_verify(T, ForwardMode.TARGET_VERIFY)
        c.wait_for_pending_backup()
        c.num_real_reqs.fill_(len(rids))
        device = s.device_pool.translate_loc_from_full_to_hisparse_device(batch.out_cache_loc)
        expanded = (lens.view(-1, 1) + torch.arange(1, T + 1)).view(-1).to(torch.int32)
        B = len(rids)
        for layer in range(LAYERS):
            for b, r in enumerate(rids):   # the verify forward's set_mla_kv_buffer of the T tokens
                for t in range(T):
                    s.rows(layer)[int(device[b * T + t])] = torch.from_numpy(w.full[r][layer, w.length[r] + t])
            picks = []
            for r in rids:
                for t in range(T):
                    n, kind = w.length[r] + t + 1, rng.choice(["repeat", "old", "random"])
                    before = seen.get((r, layer, t))
                    if kind == "repeat" and before is not None:
                        p = before
                    elif kind == "old" and n > 200:
                        p = sorted(rng.sample(range(0, n - 150), K))
                    else:
                        p = sorted(rng.sample(range(n), min(K, n)))
                    seen[(r, layer, t)] = p
                    picks.append(p)
            topk = torch.tensor([p + [-1] * (K - len(p)) for p in picks], dtype=torch.int32)
            q = torch.randn((B * T, HEADS * 576), generator=w.torch_rng).to(torch.bfloat16) * 4
            w.backend.forward_metadata = types.SimpleNamespace(
                dsa_cache_seqlens_int32=expanded.clamp_max(K), dsa_seqlens_expanded=expanded,
                page_table_1=s.req_to_token_pool.req_to_token[idx].repeat_interleave(T, dim=0),  # expanded per token
                dsa_extend_seq_lens_list=[T] * B,
                cu_seqlens_q=torch.arange(0, B * T + 1, T, dtype=torch.int32),
                flashmla_metadata=types.SimpleNamespace(flashmla_metadata=torch.zeros(1, dtype=torch.int32),
                                                        num_splits=torch.zeros(B * T + 1, dtype=torch.int32)))
            fb = types.SimpleNamespace(req_pool_indices=idx, seq_lens=lens + T, forward_mode=ForwardMode.TARGET_VERIFY)
            out = w.backend.forward_extend(q, None, None, w.layers[layer], fb, topk_indices=topk)
            # Query row b x T + t reads request b's cache as it is at that token: picks within its first L + t + 1.
            positions = [(rids[i // T], picks[i], out[i].view(HEADS, 512), q[i]) for i in range(B * T)]
            calls.append((step, layer, positions, out[B * T:]))
        c.commit_spec_accept_tokens(batch, torch.arange(B * T, dtype=torch.int32).view(B, T))
        for r in rids:
            w.length[r] += T
    assert delayed.waits == len(calls)
    assert check(w, calls, flashmla) == {"all resident", "all fetched", "mixed"}
    for rid in list(w.reqs):
        w.finish(rid)
    assert w.free_sizes() == w.free_at_start


def refused_before_anything_is_taken(monkeypatch, settings, message):
    """A coordinator built under `settings` (environment: value, None to unset) over SGLang's pools is refused
    with `message`, and the HiSparse device allocator keeps every row it had."""
    monkeypatch.setenv("ESS_OVERLAP", "none")
    w = AttnWorld()
    w.s.coord.destroy()
    adapter._common._return_top_rows(w.s.allocator)
    free = w.s.allocator.hisparse_attn_allocator.available_size()
    for name, value in settings.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(ess.InvalidArgument, match=message):
        adapter.HiSparseCoordinator(req_to_token_pool=w.s.req_to_token_pool,
                                    token_to_kv_pool_allocator=w.s.allocator, top_k=K, device_buffer_size=64,
                                    device="cpu", tp_group=None, host_to_device_ratio=2)
    assert w.s.allocator.hisparse_attn_allocator.available_size() == free


@pytest.mark.parametrize("value", ["fast", "da-dba"])
def test_schedules_not_served_are_refused_before_anything_is_taken(flashmla, monkeypatch, value):
    refused_before_anything_is_taken(monkeypatch, {"ESS_OVERLAP": value}, f"ESS_OVERLAP = '?{value}")


def test_da_under_a_decode_kernel_without_an_lse_is_refused_by_name(flashmla, monkeypatch):
    monkeypatch.setenv("ESS_OVERLAP", "da")
    w = AttnWorld()
    w.prefill("a", 100)
    w.collect()
    w.backend.dsa_decode_impl = "flashinfer_sparse_mla"
    rids, idx, lens, device = w.prepare_decode()
    topk = torch.tensor([list(range(K))], dtype=torch.int32)
    with pytest.raises(Exception, match="flashinfer_sparse_mla.*--dsa-decode-backend flashmla_kv"):
        w.forward_decode(0, idx, lens, topk)
