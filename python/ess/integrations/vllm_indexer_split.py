"""The DBA overlap's indexer split in vLLM 0.33.0: the indexer of a DBA layer runs per half of the decode batch, and
the first half's misses are copied while the second half's indexer runs; attention then runs as under DA
(vllm_overlap.py), the layer's swap taking only the second half.

The indexer is vLLM's sparse_attn_indexer (model_executor/layers/sparse_attn_indexer.py), which the DSA attention of
vLLM's CUDA model for DeepSeek-V3.2 and GLM-5 (vllm/models/deepseek_v32/attention.py, DeepseekV32Attention
._sparse_indexer_and_attn) calls by its module's name for it, before the layer's attention. ESS wraps that name
(patch); the wrapper passes every call that is not a split through to vLLM's own function unchanged. It runs where
the call runs: at every eager or piecewise step, and at the capture of a FULL CUDA graph (vLLM's decode graphs under
HiSparse, FULL_AND_PIECEWISE), whose replays then run the split as captured: the halves of the captured batch size.
A split, per DBA layer (its model layer index, vLLM's extract_layer_index of the call's k-cache layer name, served by
a DecodeOverlap), all of it vLLM's own code but for the marked steps:

  sparse_attn_indexer      vLLM's own, over the whole batch's tensors with the indexer metadata narrowed to the
                           first ceil(R / 2) decode requests (half_metadata): the index keys of every token inserted
                           and the top-k buffer cleared as the call asks (the fused path did both already), then the
                           first half's paged MQA logits and top-k
  swap_first_half          [ESS] the first half's swap (HiSparseRuntime.swap_first_half, with the forward's
                           attention metadata of the layer): decision on the current stream, copy on the copy stream
  sparse_attn_indexer      vLLM's own again, over the second half's rows (q, weights, the top-k buffer from the
                           first half's last token on) and metadata, the key insert and the buffer clear skipped
                           (skip_k_cache_insert, skip_topk_buffer_clear: the first call did both)

Row for row, the top-k buffer holds what one call writes (each row's logits and top-k read only its own request's
keys and lengths). The split applies to a pure decode batch of at least two requests with the same token count each
(the indexer metadata's decode_is_uniform, no padded path: a FULL graph's capture batch is one), of which ESS serves
rows this step (or a FULL graph's capture); not with decode context parallelism, varlen indices (SM100),
DeepSeek-V4.1's candidate blocks or adaptive verification. Any other call runs the layer as DA. The halves' paged-MQA
schedule is computed per half, as vLLM's metadata builder computes the whole's
(vllm.utils.deep_gemm.get_paged_mqa_logits_metadata over the half's lengths and the cache's kernel block, where
DeepGEMM runs; inside a FULL graph, captured with the rest)."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import threading
from typing import List, Optional

import torch

DSA_ATTENTION = "vllm.models.deepseek_v32.attention"

_SERVED: List = []         # the DecodeOverlaps with DBA layers (a vLLM worker process has one)
_LOCK = threading.Lock()
_SM_COUNT = {}             # device index -> its SMs (vLLM's num_compute_units), once per device
_LAYER_OF = {}             # the k-cache layer name -> the model's layer index (-1: none), once per name


def serve(overlap) -> None:
    """A DecodeOverlap whose DBA layers' indexers (DecodeOverlap.serve_indexer) the split serves."""
    with _LOCK:
        if overlap not in _SERVED:
            _SERVED.append(overlap)


def unserve(overlap) -> None:
    with _LOCK:
        if overlap in _SERVED:
            _SERVED.remove(overlap)


def _target(model_layer: int):
    for overlap in _SERVED:
        found = overlap.indexers.get(model_layer)
        if found is not None:
            return (overlap,) + found
    return None


class Halves:
    """The halves of a decode batch the split applies to: its first r0 requests (t0 tokens, the indexer's first k0
    decode rows: one per request, or one per token under vLLM's flattened decode) and the rest, up to the
    metadata's R requests and N tokens."""

    def __init__(self, R: int, N: int, r0: int, t0: int, k0: int):
        self.R, self.N, self.r0, self.t0, self.k0 = R, N, r0, t0, k0

    @staticmethod
    def of(metadata, candidate_blocks=None, dcp_world_size: int = 1, use_pcp: bool = False) -> Optional["Halves"]:
        """The halves of the batch `metadata` (vLLM's DeepseekV32IndexerMetadata) describes, R requests of n tokens
        each, the first ceil(R / 2); None where the split does not apply."""
        decode = getattr(metadata, "decode", None)
        if decode is None or metadata.num_prefills or candidate_blocks is not None or dcp_world_size != 1 or use_pcp:
            return None
        if decode.global_seq_lens is not None or decode.indices is not None:
            return None
        R, N = int(metadata.num_decodes), int(metadata.num_decode_tokens)
        rows = int(decode.decode_lens.shape[0])
        if R < 2 or decode.requires_padding or not decode.decode_is_uniform or N % R or rows % R or N % rows:
            return None
        r0 = (R + 1) // 2
        return Halves(R, N, r0, r0 * (N // R), r0 * (rows // R))


def _rows(t, first, last):
    return None if t is None else t[first:last]


def half_metadata(metadata, halves: Halves, second: bool, schedule=None):
    """vLLM's indexer metadata narrowed to one half of the decode batch (a copy: vLLM's dataclasses, replaced): its
    decode rows' block table, lengths, decode lengths and per-request lengths, the token and request counts, and the
    half's paged-MQA schedule (schedule; None: the whole's, where DeepGEMM does not run). The first half keeps the
    whole's slot mapping (its call inserts every token's index key)."""
    decode = metadata.decode
    rows = slice(halves.k0, None) if second else slice(0, halves.k0)
    requests = (halves.r0, halves.R) if second else (0, halves.r0)
    narrowed = dataclasses.replace(
        decode, block_table=decode.block_table[rows], seq_lens=decode.seq_lens[rows],
        decode_lens=decode.decode_lens[rows], per_req_decode_lens=_rows(decode.per_req_decode_lens, *requests),
        schedule_metadata=decode.schedule_metadata if schedule is None else schedule)
    tokens = halves.N - halves.t0 if second else halves.t0
    slot_mapping = metadata.slot_mapping[halves.t0:] if second else metadata.slot_mapping
    return dataclasses.replace(metadata, num_decodes=requests[1] - requests[0], num_decode_tokens=tokens,
                               slot_mapping=slot_mapping, decode=narrowed)


def _half_schedule(kv_cache: torch.Tensor, seq_lens: torch.Tensor):
    """The half's paged-MQA schedule, as DeepseekV32IndexerMetadataBuilder.build computes the whole's (the indexer
    cache's kernel block: the paged cache's second dimension, DeepGEMM's block_size; the device's SMs), where vLLM
    computes one (CUDA with DeepGEMM); else None."""
    from vllm.platforms import current_platform
    deep_gemm = importlib.import_module("vllm.utils.deep_gemm")
    if not (current_platform.is_cuda() and deep_gemm.has_deep_gemm()):
        return None
    device = seq_lens.device.index or 0
    sms = _SM_COUNT.get(device)
    if sms is None:
        from vllm.utils.platform_utils import num_compute_units
        sms = _SM_COUNT[device] = num_compute_units(device)
    return deep_gemm.get_paged_mqa_logits_metadata(seq_lens, int(kv_cache.shape[1]), sms)


def _wrap(original):
    signature = inspect.signature(original)

    def sparse_attn_indexer(*args, **kwargs):
        # Most calls are not a DBA layer's: those pass straight through, by the layer name alone.
        target = _target_of(args[1] if len(args) > 1 else kwargs.get("k_cache_prefix")) if _SERVED else None
        if target is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        split = _split_of(a, target)
        if split is None:
            return original(*args, **kwargs)
        context, metadata, attention, halves, runtime, prefix = split
        whole = context.attn_metadata
        buffer = a["topk_indices_buffer"]
        t0 = halves.t0
        try:
            # The first half, every token's index key inserted and the whole top-k buffer cleared as one call does.
            whole[prefix] = half_metadata(metadata, halves, False, _half_schedule(
                a["kv_cache"], metadata.decode.seq_lens[:halves.k0]))
            original(**a)
            runtime.swap_first_half(resident=runtime.handle, req_id_per_token=attention.req_id_per_token,
                                    logical_topk_indices=buffer[:t0, :a["topk_tokens"]],
                                    block_size=attention.block_size, num_valid_rows=attention.query_start_loc[-1:],
                                    requests=halves.r0)
            # The second half over its own rows.
            whole[prefix] = half_metadata(metadata, halves, True, _half_schedule(
                a["kv_cache"], metadata.decode.seq_lens[halves.k0:]))
            second = dict(a, hidden_states=a["hidden_states"][t0:], q_quant=a["q_quant"][t0:],
                          q_scale=_rows(a["q_scale"], t0, None), weights=a["weights"][t0:],
                          topk_indices_buffer=buffer[t0:], skip_k_cache_insert=True, skip_topk_buffer_clear=True)
            original(**second)
        finally:
            whole[prefix] = metadata
        return buffer
    sparse_attn_indexer.ess_original = original
    return sparse_attn_indexer


def _target_of(name):
    """(DecodeOverlap, ESS runtime, attention layer name) of the DBA layer whose indexer's k-cache layer is `name`
    (as the call passes it), else None."""
    layer = _LAYER_OF.get(name) if isinstance(name, str) else None
    if layer is None:
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.utils.torch_utils import _resolve_layer_name
        try:
            layer = extract_layer_index(_resolve_layer_name(name))
        except (AssertionError, ValueError):
            layer = -1
        if isinstance(name, str):
            _LAYER_OF[name] = layer
    return _target(layer)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _split_of(a, target):
    """(forward context, the layer's indexer metadata, its attention metadata, Halves, ESS runtime, k-cache layer
    name) of a call the split serves, else None."""
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.utils.torch_utils import _resolve_layer_name
    if not is_forward_context_available():
        return None
    context = get_forward_context()
    whole = context.attn_metadata
    if not isinstance(whole, dict):
        return None
    prefix = _resolve_layer_name(a["k_cache_prefix"])
    _, runtime, attention_name = target
    if runtime.decode.adaptive or (runtime.decode.batch == 0 and not _capturing()):
        # The rows' token counts are decided on the device (adaptive verification), or ESS serves no row this step
        # (vLLM resolves it over resident pages: no swap follows). A FULL graph's capture runs before any step ESS
        # staged (the connector stages none for it): its replays read the rows each step stages.
        return None
    metadata, attention = whole.get(prefix), whole.get(attention_name)
    if metadata is None or attention is None:
        return None
    halves = Halves.of(metadata, a["candidate_blocks"], a["dcp_world_size"], a["use_pcp"])
    if halves is None or halves.t0 > a["q_quant"].shape[0]:
        return None
    return context, metadata, attention, halves, runtime, prefix


def patch(module=None) -> None:
    """The DSA attention module's sparse_attn_indexer wrapped, once (the wrapper carries vLLM's as ess_original)."""
    module = module or importlib.import_module(DSA_ATTENTION)
    if getattr(module.sparse_attn_indexer, "ess_original", None) is None:
        module.sparse_attn_indexer = _wrap(module.sparse_attn_indexer)


def unpatch(module=None) -> None:
    module = module or importlib.import_module(DSA_ATTENTION)
    original = getattr(module.sparse_attn_indexer, "ess_original", None)
    if original is not None:
        module.sparse_attn_indexer = original
