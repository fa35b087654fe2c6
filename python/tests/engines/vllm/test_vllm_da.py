"""ESS_OVERLAP=da inside vLLM 0.33.0's own FlashMLA sparse FP8 decode (v1/attention/backends/mla/flashmla_sparse.py
FlashMLASparseImpl._host_backed_fp8_decode and _fp8_flash_mla_kernel, vLLM's code, wrapped by vllm_overlap.py), in
vLLM's venv, over the vLLM replay (test_vllm_replay.py: upstream's own cache handles and index group, ESS's rows in
hot regions, requests read in place, every row against the LRU model).

Each DA layer's decode runs vLLM's method: its convert_logical_to_physical_topk reaches ESS's swap, which returns the
resident rows and leaves the fetched ones; vLLM's _fp8_flash_mla_kernel (heads padded as vLLM pads them) then runs
twice, FlashMLA's FP8 sparse decode standing in (flashmla_standin.py: FlashMLA's documented reference, which cannot
run without its CUDA kernels), and the two parts are merged. The copy is delayed as far as stream order allows (the
fetched rows hold FP8 NaN until a stream waits for the copy's event), so a kernel call before the wait reads poison.
Checked: FlashMLA's two calls read the resident and the fetched rows (the replay's checks against the model), and the
merged output against one FlashMLA pass over the full cache's entries of the same ids."""
import types

import pytest
import torch

from ess.integrations import vllm_overlap
import flashmla_standin
from test_vllm_replay import BLOCK, CTX, LAYERS, Replay, decode_steps, shuffled_decode_step, three_requests

flashmla_sparse = pytest.importorskip("vllm.v1.attention.backends.mla.flashmla_sparse")
HEADS, PADDED_HEADS = 16, 64   # vLLM pads the FP8 decode's heads to 64 (FlashMLASparseImpl.fp8_decode_padded_heads)


def fp8_entries(world, seed):
    """Every request's full cache made of valid V32 FP8 entries (FlashMLA's quantization), drafts redrawn alike."""
    gen = torch.Generator().manual_seed(seed)

    def entries(n):
        return flashmla_standin.quantize(torch.randn(n, 512, generator=gen), torch.randn(n, 64, generator=gen)).numpy()

    new = world.new_request

    def new_request(rid, prompt, prefix_of=None, prefix=0):
        new(rid, prompt, prefix_of, prefix)
        fresh = entries(LAYERS * CTX).reshape(LAYERS, CTX, -1)
        fresh[:, :prefix] = world.full[rid][:, :prefix]
        world.full[rid] = fresh

    def redraw_after(rid, position):
        world.full[rid][:, position:] = entries(LAYERS * (CTX - position)).reshape(LAYERS, CTX - position, -1)

    world.new_request, world.redraw_after = new_request, redraw_after


class DelayedCopy(flashmla_standin.DelayedCopy):
    """The decode overlap's copy event, the copy delayed: after each swap its fetched rows (rows of the layer's
    attention view) hold poison until a stream waits for the event."""

    def __init__(self, overlap, attention):
        super().__init__()
        leave = overlap.leave

        def leaving(resident, fetched):
            self.poison(attention[overlap.armed].view(-1, flashmla_standin.ENTRY),
                        fetched[fetched >= 0].unique().to(torch.int64))
            return leave(resident, fetched)
        overlap.leave = leaving
        overlap.copy_done = self


class VllmDecodeReplay(Replay):
    """The replay whose DA layers decode through vLLM's own FlashMLASparseImpl methods (wrapped by ESS)."""

    def __init__(self, *args, overlap="da", **kwargs):
        super().__init__(*args, overlap=overlap, **kwargs)
        fp8_entries(self.world, 5)
        self.delayed = DelayedCopy(self.decode.overlap, self.attention)
        self.calls, self.kinds, self.rng = [], set(), torch.Generator().manual_seed(6)
        self.count_waits = True

    def swap_da(self, layer, topk, attn, request_of_token):
        n, cls = topk.shape[0], flashmla_sparse.FlashMLASparseImpl
        impl = types.SimpleNamespace(index_group=self.group, index_group_index=layer, softmax_scale=576 ** -0.5,
                                     fp8_decode_padded_heads=PADDED_HEADS)
        impl._fp8_flash_mla_kernel = types.MethodType(cls._fp8_flash_mla_kernel, impl)
        q = torch.randn((n, HEADS, 576), generator=self.rng).to(torch.bfloat16)
        kernel_metadata = types.SimpleNamespace(dummy_block_table=None, cache_lens=None, scheduler_metadata=None)
        log = []
        self.calls.append(log)
        waits = self.delayed.waits
        out = cls._host_backed_fp8_decode(impl, q, topk, attn, kernel_metadata, attn.num_decodes)
        assert len(log) == 2, "Attn0 and Attn1"
        assert self.delayed.waits == waits + 1 or not self.count_waits, "one wait for the copy, before Attn1"
        resident, fetched = (indices.reshape(n, -1) for indices, _ in log)
        for i in range(n):   # against one pass over the full cache's entries of the token's ids
            rid = request_of_token[i]
            ids = topk[i][topk[i] >= 0].tolist()
            if rid is None or not ids:
                continue
            full = torch.from_numpy(self.world.full[rid][layer, ids]).view(1, 1, len(ids), -1)
            qp = torch.zeros((1, 1, PADDED_HEADS, 576), dtype=torch.bfloat16)
            qp[0, 0, :HEADS] = q[i]
            ref, _ = flashmla_standin.sparse_decode(qp, full, torch.ones((1, 1, len(ids)), dtype=torch.bool),
                                                    576 ** -0.5, 512)
            ref, got = ref[0, 0, :HEADS], out[i]
            n0, n1 = int((resident[i] >= 0).sum()), int((fetched[i] >= 0).sum())
            assert n0 + n1 == len(ids), (layer, i, n0, n1, len(ids))
            self.kinds.add("mixed" if n0 and n1 else "all resident" if n0 else "all fetched")
            # bf16 outputs (two merged, or one over the rows in another order than the ids'): within their
            # rounding of the largest value
            vmax = float(flashmla_standin.dequantize(full.view(len(ids), -1))[:, :512].abs().max())
            err = float((got.float() - ref.float()).abs().max())
            assert err <= (3 * 2 ** -8 + 1e-5) * vmax, ("output", layer, i, n0, n1, err)
        return resident, fetched


def flashmla(monkeypatch):
    """FlashMLA's FP8 sparse decode as flashmla_sparse.py calls it (its module's flash_mla_with_kvcache), each call
    logged with the indices it read; vLLM's FlashMLASparseImpl wrapped by ESS for the test."""
    def flash_mla_with_kvcache(q, k_cache, block_table, head_dim_v, cache_seqlens, tile_scheduler_metadata,
                               is_fp8_kvcache=False, indices=None, softmax_scale=None):
        assert is_fp8_kvcache and indices is not None and indices.dtype == torch.int32
        b, s_q, h, d = q.shape
        table = k_cache.reshape(-1, flashmla_standin.ENTRY)
        rows = table[indices.clamp_min(0).to(torch.int64)]
        replay_log().append((indices.clone(), rows.clone()))
        return flashmla_standin.sparse_decode(q, rows, indices >= 0, softmax_scale, head_dim_v)

    current = {}

    def replay_log():
        return current["replay"].calls[-1]

    monkeypatch.setattr(flashmla_sparse, "flash_mla_with_kvcache", flash_mla_with_kvcache)
    vllm_overlap.patch(flashmla_sparse)
    return current


@pytest.fixture
def wrapped(monkeypatch):
    current = flashmla(monkeypatch)
    yield current
    vllm_overlap.unpatch(flashmla_sparse)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("overlap", ["da", "dba"])
def test_da_inside_vllms_flashmla_decode_is_lossless_and_merges_to_the_single_pass(wrapped, T, overlap):
    """DBA: the replay's indexer swaps each split batch's first half first (test_vllm_replay.py Replay.first_half);
    the swap then returns both halves' resident rows and leaves both halves' fetched ones, the copy's event after
    the second half's copy."""
    r = VllmDecodeReplay(T, BLOCK - T, seed=81 + T, hot_regions=1, overlap=overlap)
    wrapped["replay"] = r
    decode_steps(r, 8, {2: "a", 5: "c"})
    # (A token whose every id is fetched is rare: each step's newest ids are read in place on vLLM's tail pages. Its
    # empty resident part is the merge test's case below.)
    assert {"mixed", "all resident"} <= r.kinds and r.fetched_checked > 50, (r.kinds, r.fetched_checked)
    assert min(r.rows_checked.values()) > 5, r.rows_checked
    assert overlap == "da" or r.dba_splits > 0


def test_attention_before_the_copys_event_fails(wrapped, monkeypatch):
    """Mutation: the wait for the copy's event dropped: Attn1 reads the fetched rows before the copy lands."""
    monkeypatch.setattr(vllm_overlap.DecodeOverlap, "wait_for_copy", lambda self: None)
    r = VllmDecodeReplay(1, BLOCK - 1, seed=91, hot_regions=1)
    r.count_waits = False   # the poison the copy leaves until its event is waited for is what fails
    wrapped["replay"] = r
    with pytest.raises(AssertionError, match="output"):
        batch, states = three_requests(r)
        r.world.go_hot("a")
        for step in range(3):
            batch, states, _ = shuffled_decode_step(r, batch, states, step)


def test_without_the_kernel_wrapper_the_split_is_refused(wrapped, monkeypatch):
    """vLLM's decode reading the swap's rows through another call than _fp8_flash_mla_kernel is refused by name
    (the fetched rows would go unread)."""
    monkeypatch.setattr(flashmla_sparse.FlashMLASparseImpl, "_fp8_flash_mla_kernel",
                        flashmla_sparse.FlashMLASparseImpl._fp8_flash_mla_kernel.ess_original)
    r = VllmDecodeReplay(1, BLOCK - 1, seed=93, hot_regions=1)
    wrapped["replay"] = r
    with pytest.raises(RuntimeError, match="did not read them through FlashMLASparseImpl._fp8_flash_mla_kernel"):
        three_requests(r)   # "a" decodes beside the prefill of "b"


def test_vllms_merge_and_esss_agree_on_flashmlas_partial_states(monkeypatch):
    """The merge the DA runs on CUDA (vLLM's merge_attn_states, here its host path) against ESS's merge_states, over
    FlashMLA's partial states with empty parts (lse +inf, out 0) on either side and on both. vLLM's kernels differ in
    what they make of +inf (its host path and Triton take it as empty): ESS hands them -inf."""
    import vllm.v1.attention.ops.merge_attn_states as merging
    original = merging.merge_attn_states

    def no_positive_infinity(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None, **kw):
        assert not torch.isposinf(prefix_lse).any() and not torch.isposinf(suffix_lse).any(), "+inf LSE handed on"
        return original(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, **kw)

    monkeypatch.setattr(merging, "merge_attn_states", no_positive_infinity)
    gen = torch.Generator().manual_seed(3)
    b, s_q, h, d = 5, 2, 4, 512
    o0, o1 = (torch.randn((b, s_q, h, d), generator=gen).to(torch.bfloat16) for _ in range(2))
    lse0, lse1 = (torch.randn((b, h, s_q), generator=gen) * 4 for _ in range(2))
    inf = float("inf")
    lse0[0], o0[0] = inf, 0.0            # query row 0: the resident part empty
    lse1[1], o1[1] = inf, 0.0            # row 1: the fetched part empty
    lse0[2], lse1[2], o0[2], o1[2] = inf, inf, 0.0, 0.0   # row 2: both (CUDA-graph padding)
    got, got_lse = vllm_overlap.merge(o0, lse0, o1, lse1, with_vllm=True)
    want, want_lse = vllm_overlap.merge(o0, lse0, o1, lse1, with_vllm=False)
    assert got.shape == (b, s_q, h, d) and got_lse.shape == (b, h, s_q)
    assert torch.equal(got[:3], want[:3]) and torch.equal(got[1], o0[1]) and torch.equal(got[2], torch.zeros_like(got[2]))
    assert (got_lse[2] == inf).all() and torch.equal(got_lse[:2], want_lse[:2])
    assert float((got[3:].float() - want[3:].float()).abs().max()) <= 2 ** -7 * float(o0.abs().max())
    assert torch.allclose(got_lse, want_lse, rtol=1e-5, atol=1e-5)


def test_da_is_refused_at_registration_on_vllms_other_sparse_backend():
    """check_da_backend (vllm_connector.py) against vLLM's own impl classes: a layer attending with
    FlashMLASparseImpl over fp8_ds_mla passes; FlashInfer's SM120 sparse impl (which also reads fp8_ds_mla, and is
    not a FlashMLASparseImpl) and a FlashMLA layer over another cache are refused by name. The impls are made without
    their constructors (they need a GPU model's configuration), their kv_cache_dtype set as MLACommonBaseImpl's
    constructor sets it; the attention layers holding them, whose constructor needs the model too, are namespaces
    with the one attribute upstream's worker and ESS read (`impl`, mla_attention.py MLAAttention)."""
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120 import FlashInferMLASparseSM120Impl
    from vllm.v1.hisparse.layout import HISPARSE_HOT_SUFFIX
    from ess import InvalidArgument
    from ess.integrations.vllm_connector import check_da_backend

    def impl(cls, dtype="fp8_ds_mla"):
        made = object.__new__(cls)
        made.kv_cache_dtype = dtype
        return made

    def config(**impls):
        return types.SimpleNamespace(compilation_config=types.SimpleNamespace(static_forward_context={
            f"model.layers.{i}.self_attn.attn": types.SimpleNamespace(impl=made) for i, made in impls.items()}))

    names = [f"model.layers.{i}.self_attn.attn{HISPARSE_HOT_SUFFIX}" for i in range(2)]
    flashmla = flashmla_sparse.FlashMLASparseImpl
    check_da_backend(config(**{"0": impl(flashmla), "1": impl(flashmla)}), names)
    with pytest.raises(InvalidArgument, match="attends with FlashInferMLASparseSM120Impl"):
        check_da_backend(config(**{"0": impl(flashmla), "1": impl(FlashInferMLASparseSM120Impl)}), names)
    with pytest.raises(InvalidArgument, match="cache is auto"):
        check_da_backend(config(**{"0": impl(flashmla, "auto"), "1": impl(flashmla)}), names)
