"""ESS_OVERLAP=dba's indexer split (vllm_indexer_split.py) over vLLM 0.33.0's own sparse_attn_indexer
(model_executor/layers/sparse_attn_indexer.py), called as vLLM's CUDA DSA attention calls it
(models/deepseek_v32/attention.py DeepseekV32Attention._sparse_indexer_and_attn: by that module's name, which ESS
wraps), with vLLM's own indexer metadata classes (v1/attention/backends/mla/indexer.py) and its forward context, in
vLLM's venv.

DeepGEMM's paged MQA logits and their schedule, vLLM's top-k kernels, the index-key insert and Triton's pack and
unpack of padded rows cannot run on a CPU:
torch stand-ins compute what they are documented to (the logits of row (b, t): the sum over heads of relu(q . k) x
the head's weight, over the row's context through its block table, -inf past it; each row's top-k of its first
seq_len logits; the schedule a function of the lengths it was computed for, which the logits stand-in checks
against the lengths and cache block it is called with; the insert writes each token's key at its slot; pack and
unpack move each request's rows into and out of a row of the longest one's length). Everything else in the call
is vLLM's code. ESS's swap is recorded (its own tests: test_vllm_replay.py's DBA replay).

Checked: the split writes the top-k buffer and the index cache byte for byte as one call does; the first half's
swap runs between the two halves' logits, with the first half's top-k; each half's logits read that half's lengths,
block table and schedule; calls the split does not serve pass through as one call."""
import types

import pytest
import torch

ind = pytest.importorskip("vllm.model_executor.layers.sparse_attn_indexer")
dsa = pytest.importorskip("vllm.models.deepseek_v32.attention")
from vllm.forward_context import ForwardContext, override_forward_context  # noqa: E402
from vllm.v1.attention.backends.mla.indexer import (DeepseekV32IndexerMetadata,  # noqa: E402
                                                    DeepSeekV32IndexerDecodeMetadata)

from ess.integrations import _device, vllm_indexer_split, vllm_overlap  # noqa: E402

H, D, BLOCK, K, MAX_LEN, BLOCKS = 4, 16, 64, 8, 448, 64
PREFIX, ATTENTION = "model.layers.3.self_attn.indexer.k_cache", "model.layers.3.self_attn.attn"


class Kernels:
    """The stand-ins, each call logged in order."""

    def __init__(self):
        self.log = []

    @staticmethod
    def schedule(seq_lens, block_size, num_sms, indices=None):
        assert indices is None
        return torch.cat([seq_lens.flatten(), torch.tensor([block_size, num_sms], dtype=seq_lens.dtype)])

    def logits(self, q, kv_cache, weights, seq_lens, block_table, schedule_metadata, max_model_len, indices=None):
        q, q_scale = q
        assert q_scale is None and indices is None
        B, next_n = q.shape[:2]
        assert tuple(seq_lens.shape) == (B, next_n) and weights.shape[0] == B * next_n
        assert torch.equal(schedule_metadata, self.schedule(seq_lens, BLOCK, 132)), "a stale paged-MQA schedule"
        self.log.append(("logits", seq_lens.clone(), block_table.clone()))
        out = torch.full((B * next_n, max_model_len), float("-inf"))
        for b in range(B):
            for t in range(next_n):
                n = int(seq_lens[b, t])
                pos = torch.arange(n)
                keys = kv_cache[block_table[b, pos // BLOCK].long(), pos % BLOCK, 0]   # [n, D]
                score = torch.relu(keys @ q[b, t].T)                                      # [n, H]
                out[b * next_n + t, :n] = score @ weights[b * next_n + t]
        return out

    def topk(self, logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len):
        lens = seq_lens.reshape(-1)
        for r in range(logits.shape[0]):
            n = min(int(lens[r]), topk_tokens)
            order = torch.sort(logits[r, :int(lens[r])], descending=True, stable=True).indices[:n]
            topk_indices[r] = -1
            topk_indices[r, :n] = order.to(topk_indices.dtype)

    @staticmethod
    def pack(x, lengths, pad_value=float("-inf")):
        """vLLM's pack_seq_triton (v1/attention/ops/common.py): [N, ...] rows of B sequences -> [B, Lmax, ...]."""
        lengths = lengths.tolist()
        out = torch.full((len(lengths), max(lengths)) + tuple(x.shape[1:]), pad_value, dtype=x.dtype)
        start = 0
        for b, n in enumerate(lengths):
            out[b, :n] = x[start:start + n]
            start += n
        return out

    @staticmethod
    def unpack(packed, lengths):
        """vLLM's unpack_seq_triton: [B, Lmax, ...] -> [sum(lengths), ...]."""
        return torch.cat([packed[b, :n] for b, n in enumerate(lengths.tolist())])

    def insert(self, k, kv_cache, slot_mapping, quant_block_size, scale_fmt):
        self.log.append(("insert", slot_mapping.clone()))
        for i, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:
                kv_cache[slot // BLOCK, slot % BLOCK] = k[i]


@pytest.fixture
def kernels(monkeypatch):
    import vllm.utils.deep_gemm as deep_gemm
    import vllm.utils.platform_utils as platform_utils
    from vllm.platforms import current_platform
    k = Kernels()
    monkeypatch.setattr(ind, "fp8_fp4_paged_mqa_logits", k.logits)
    monkeypatch.setattr(ind, "get_indexer_topk", lambda backend: k.topk)
    monkeypatch.setattr(ind, "ops", types.SimpleNamespace(indexer_k_quant_and_cache=k.insert))
    monkeypatch.setattr(ind, "pack_seq_triton", Kernels.pack)
    monkeypatch.setattr(ind, "unpack_seq_triton", Kernels.unpack)
    # The halves' schedule is computed where vLLM's builder computes the whole's: CUDA with DeepGEMM.
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(deep_gemm, "has_deep_gemm", lambda: True)
    monkeypatch.setattr(deep_gemm, "get_paged_mqa_logits_metadata", Kernels.schedule)
    monkeypatch.setattr(platform_utils, "num_compute_units", lambda device=0: 132)
    vllm_indexer_split._SM_COUNT.clear()
    vllm_indexer_split.patch(dsa)
    yield k
    vllm_indexer_split.unpatch(dsa)
    vllm_indexer_split._SM_COUNT.clear()


class Batch:
    """A pure decode batch of R requests of n tokens each, as vLLM's indexer metadata builder gives it: native (one
    indexer row per request, seq_lens [R, n]: L - n + j + 1) or flattened (one row per token, seq_lens [R x n, 1]);
    every request's context keys in the index cache, its new tokens' keys to insert. pad: a FULL CUDA graph's padded
    requests after them, of no tokens (the forward's token count padded too): native, vLLM's padded path
    (requires_padding, not uniform); flattened, their tokens' rows of length 0."""

    def __init__(self, R, n, seed, flattened=False, uniform=True, pad=0):
        g = torch.Generator().manual_seed(seed)
        self.R, self.n, self.pad = R, n, pad
        total = R + pad
        self.tokens = total * n
        lens = torch.randint(n + K // 2, MAX_LEN, (R,), generator=g)
        blocks = torch.randperm(BLOCKS, generator=g)[:R * (MAX_LEN // BLOCK)].view(R, -1).to(torch.int32)
        self.kv = torch.randn((BLOCKS, BLOCK, D), generator=g)
        self.q = torch.randn((self.tokens, H, D), generator=g)
        self.k = torch.randn((self.tokens, D), generator=g)
        self.weights = torch.rand((self.tokens, H), generator=g)
        per_token = lens.repeat_interleave(n) - n + torch.arange(n).repeat(R) + 1
        slots = torch.stack([blocks[b, (p - 1) // BLOCK] * BLOCK + (p - 1) % BLOCK
                             for b, p in zip(torch.arange(R).repeat_interleave(n), per_token)]).to(torch.int64)
        slots = torch.cat([slots, torch.full((pad * n,), -1, dtype=torch.int64)])
        table = torch.cat([blocks, torch.zeros((pad, blocks.shape[1]), dtype=torch.int32)])
        if flattened:
            seq_lens = torch.cat([per_token, torch.zeros(pad * n, dtype=per_token.dtype)]).view(-1, 1)
            table, decode_lens = table.repeat_interleave(n, 0), torch.ones(self.tokens)
        else:
            seq_lens = torch.cat([per_token.view(R, n), torch.zeros((pad, n), dtype=per_token.dtype)])
            decode_lens = torch.tensor([n] * R + [0] * pad)
        uniform = uniform and pad == 0
        decode = DeepSeekV32IndexerDecodeMetadata(
            block_table=table, seq_lens=seq_lens.to(torch.int32), decode_lens=decode_lens.to(torch.int32),
            requires_padding=pad > 0 and not flattened, schedule_metadata=Kernels.schedule(seq_lens.to(torch.int32), BLOCK, 132),
            per_req_decode_lens=decode_lens.to(torch.int32)[:total] if not flattened else
            torch.tensor([n] * R + [0] * pad, dtype=torch.int32), decode_is_uniform=uniform, write_max_decode_len=n)
        self.metadata = DeepseekV32IndexerMetadata(
            seq_lens=torch.cat([lens, torch.zeros(pad, dtype=lens.dtype)]).to(torch.int32), max_seq_len=int(lens.max()),
            slot_mapping=slots, num_decodes=total, num_decode_tokens=self.tokens, num_prefills=0,
            num_prefill_tokens=0, decode=decode)
        # The layer's attention metadata, the three fields the swap reads (index_group.py
        # convert_logical_to_physical_topk): FlashMLASparseMetadata's (a padded request's queries empty).
        self.attention = types.SimpleNamespace(
            req_id_per_token=torch.arange(R, dtype=torch.int32).repeat_interleave(n), block_size=BLOCK,
            query_start_loc=torch.tensor([min(b, R) * n for b in range(total + 1)], dtype=torch.int32))

    def call(self, skip_insert, skip_clear, original=False):
        """The DSA attention's call (its arguments as _sparse_indexer_and_attn passes them); returns the top-k
        buffer, the index cache after it."""
        kv = self.kv.clone()
        buffer = torch.full((self.tokens + 3, K), 7, dtype=torch.int32)   # rows past the tokens: untouched
        if skip_clear:   # the fused norm-rope kernel cleared the step's rows
            buffer[:self.tokens] = -1
        context = ForwardContext(no_compile_layers={},
                                 attn_metadata={PREFIX: self.metadata, ATTENTION: self.attention}, slot_mapping={})
        fn = dsa.sparse_attn_indexer.ess_original if original else dsa.sparse_attn_indexer
        with override_forward_context(context):
            out = fn(torch.zeros((self.tokens, 8)), PREFIX, kv, self.q.clone(), None, self.k.clone(),
                     self.weights.clone(), 128, "ue8m0", K, D, MAX_LEN, MAX_LEN * self.R, buffer,
                     skip_k_cache_insert=skip_insert, use_pcp=False, pcp_shard_decode_requests=False,
                     dense_mha_metadata_layer_name="", dcp_rank=0, dcp_world_size=1, cp_kv_cache_interleave_size=1,
                     skip_topk_buffer_clear=skip_clear, topk_backend="auto")
        assert out is buffer and context.attn_metadata[PREFIX] is self.metadata
        return buffer, kv


class Swaps:
    """ESS's side: a DecodeOverlap whose layer 0 runs DBA and serves model layer 3's indexer, its runtime's
    swap_first_half recorded (in the kernels' log, for the order); served: the decode rows ESS serves this step
    (EssDecode.batch), adaptive: EssDecode.adaptive."""

    def __init__(self, kernels, max_reqs=8, T=4, served=4, adaptive=False):
        self.kernels, self.calls = kernels, []
        self.overlap = vllm_overlap.DecodeOverlap(_device.for_device("cpu"), ["dba"], max_reqs, T, K, "cpu")
        self.runtime = types.SimpleNamespace(layer=0, handle=object(), swap_first_half=self.swap_first_half,
                                             decode=types.SimpleNamespace(batch=served, adaptive=adaptive))
        self.overlap.serve_indexer(3, self.runtime, ATTENTION)

    def swap_first_half(self, **kwargs):
        self.kernels.log.append(("swap", kwargs["requests"], kwargs["logical_topk_indices"].clone()))
        self.calls.append(kwargs)

    def __enter__(self):
        vllm_indexer_split.serve(self.overlap)
        return self

    def __exit__(self, *exc):
        vllm_indexer_split.unserve(self.overlap)


@pytest.mark.parametrize("R,n,flattened", [(2, 1, False), (5, 1, False), (4, 2, False), (3, 2, True)])
@pytest.mark.parametrize("skip", [True, False])
def test_the_split_is_one_indexer_call_with_the_first_halfs_swap_between(kernels, R, n, flattened, skip):
    """skip: the DSA attention's call (the index keys inserted and the top-k rows cleared before it); else the
    generic call, which inserts and clears."""
    batch = Batch(R, n, seed=R * 10 + n, flattened=flattened)
    whole_buffer, whole_kv = batch.call(skip, skip, original=True)
    kernels.log.clear()
    with Swaps(kernels) as swaps:
        buffer, kv = batch.call(skip, skip)
    assert torch.equal(buffer, whole_buffer), "the split's top-k differ from one call's"
    assert torch.equal(kv, whole_kv), "the split's index cache differs from one call's"
    r0 = (R + 1) // 2
    kinds = [e[0] for e in kernels.log]
    assert kinds == ([] if skip else ["insert"]) + ["logits", "swap", "logits"], kinds
    if not skip:   # every token's key, once, in the first call
        assert torch.equal(kernels.log[0][1], batch.metadata.slot_mapping)
    first, (_, requests, topk), second = [e for e in kernels.log if e[0] != "insert"]
    rows = r0 * (n if flattened else 1)
    assert torch.equal(first[1], batch.metadata.decode.seq_lens[:rows])
    assert torch.equal(first[2], batch.metadata.decode.block_table[:rows])
    assert torch.equal(second[1], batch.metadata.decode.seq_lens[rows:])
    assert torch.equal(second[2], batch.metadata.decode.block_table[rows:])
    assert requests == r0 and torch.equal(topk, whole_buffer[:r0 * n])
    (call,) = swaps.calls
    assert call["resident"] is swaps.runtime.handle and call["block_size"] == BLOCK
    assert call["req_id_per_token"] is batch.attention.req_id_per_token
    assert torch.equal(call["num_valid_rows"], torch.tensor([R * n], dtype=torch.int32))


@pytest.mark.parametrize("case", ["one request", "rows of different lengths", "padded", "a prefill beside",
                                  "another layer", "not served", "no ESS row", "adaptive verification"])
def test_calls_the_split_does_not_serve_pass_through(kernels, case):
    """Padded: a batch padded past its requests (vLLM's padded path; eager or piecewise steps never pad requests, a
    FULL graph's replay runs its capture's split)."""
    batch = Batch(1 if case == "one request" else 3, 2, seed=3, uniform=case != "rows of different lengths",
                  pad=2 if case == "padded" else 0)
    if case == "a prefill beside":
        # vLLM's own call of it needs prefill metadata: the split declines it by the metadata alone.
        batch.metadata.num_prefills = 1
        assert vllm_indexer_split.Halves.of(batch.metadata) is None
        batch.metadata.num_prefills = 0
        assert vllm_indexer_split.Halves.of(batch.metadata) is not None
        return
    whole_buffer, _ = batch.call(True, True, original=True)
    kernels.log.clear()
    swaps = Swaps(kernels, served=0 if case == "no ESS row" else 4, adaptive=case == "adaptive verification")
    if case == "another layer":
        swaps.overlap.indexers = {4: swaps.overlap.indexers[3]}
    if case == "not served":
        buffer, _ = batch.call(True, True)
    else:
        with swaps:
            buffer, _ = batch.call(True, True)
    assert torch.equal(buffer, whole_buffer)
    assert [e[0] for e in kernels.log] == ["logits"] and not swaps.calls


def test_a_full_graphs_capture_splits_before_any_staged_step(kernels, monkeypatch):
    """A FULL decode graph is captured before ESS stages any step (the connector stages none for a capture's dummy
    batch): the capture splits all the same, and its replays read the rows each step stages."""
    batch = Batch(4, 1, seed=17)
    whole_buffer, _ = batch.call(True, True, original=True)
    monkeypatch.setattr(vllm_indexer_split, "_capturing", lambda: True)
    with Swaps(kernels, served=0) as swaps:
        buffer, _ = batch.call(True, True)
    assert torch.equal(buffer, whole_buffer) and len(swaps.calls) == 1


def test_a_second_half_over_the_whole_block_table_fails(kernels, monkeypatch):
    """Mutation: the second half's metadata keeps the whole batch's block table (a half's rows read the other's
    pages): its top-k differ from one call's."""
    narrow = vllm_indexer_split.half_metadata

    def stale(metadata, halves, second, schedule=None):
        half = narrow(metadata, halves, second, schedule)
        if second:
            half.decode.block_table = metadata.decode.block_table
        return half
    monkeypatch.setattr(vllm_indexer_split, "half_metadata", stale)
    batch = Batch(4, 1, seed=11)
    whole_buffer, _ = batch.call(True, True, original=True)
    with Swaps(kernels):
        buffer, _ = batch.call(True, True)
    assert not torch.equal(buffer, whole_buffer)


def test_a_half_with_the_whole_batchs_schedule_fails(kernels, monkeypatch):
    """Mutation: the halves given the whole batch's paged-MQA schedule (DeepGEMM would split the whole's work over
    its SMs for half the rows): the logits stand-in, which checks a schedule against the lengths it runs over,
    refuses."""
    monkeypatch.setattr(vllm_indexer_split, "_half_schedule", lambda kv_cache, seq_lens: None)
    batch = Batch(4, 1, seed=13)
    with Swaps(kernels), pytest.raises(AssertionError, match="stale paged-MQA schedule"):
        batch.call(True, True)


def test_a_dba_layers_indexer_is_served_once():
    overlap = vllm_overlap.DecodeOverlap(_device.for_device("cpu"), ["dba", "da"], 4, 1, K, "cpu")
    runtime = types.SimpleNamespace(layer=0)
    overlap.serve_indexer(7, runtime, ATTENTION)
    with pytest.raises(Exception, match="served already"):
        overlap.serve_indexer(7, runtime, ATTENTION)
    with pytest.raises(Exception, match="not dba"):
        overlap.serve_indexer(8, types.SimpleNamespace(layer=1), ATTENTION)
