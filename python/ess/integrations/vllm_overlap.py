"""The DA and DBA overlaps in vLLM 0.33.0's FlashMLA sparse FP8 decode (the HiSparse path): attention over a layer's
resident rows runs while its misses are copied, then over the fetched rows, the two partial states merged by their
log-sum-exp; under DBA the layer's indexer also runs per half of the batch, the first half's misses copied while the
second half's indexer runs (vllm_indexer_split.py).

What runs, per layer whose schedule is DA or DBA, in FlashMLASparseImpl (v1/attention/backends/mla/flashmla_sparse.py),
all of it vLLM's own code but for the marked steps:

  _host_backed_fp8_decode   the wrapper arms ESS's runtime of the layer [ESS], then vLLM's own method runs:
  convert_logical_to_physical_topk -> HiSparseCacheHandle.swap_in -> ESS's HiSparseRuntime.swap_in: the swap
                            decision on the current stream, the misses copied on the copy stream after it, its event
                            recorded when the copy ends [ESS] (DBA: the batch's second half only, the indexer having
                            swapped the first); returns each token's resident rows (in place before the step, -1
                            after them) and leaves the fetched ones
  _fp8_flash_mla_kernel     which ESS wraps: for the resident table the swap returned it runs vLLM's own kernel call
                            twice, Attn0 over the resident rows (beside the copy), the current stream's wait for the
                            copy's event, Attn1 over the fetched rows, and merges the two (out, lse) [ESS]: on CUDA
                            with vLLM's merge_attn_states (FlashMLA's +inf LSE of an empty row taken as -inf), on the
                            host with ESS's merge_states. The copies run in order on one stream: the second half's
                            event covers the first's.

FlashMLA's sparse decode returns the natural-log LSE [b, h_q, s_q] and, for a query row whose indices are all -1, an
output of 0 and an LSE of +inf. With HiSparse, vLLM's FP8 sparse MLA decode always takes this path (the mixed-batch
path is off under HiSparse); a DA or DBA layer on another backend or cache is refused by name when the connector
registers (vllm_connector.py check_da_backend), and a split swap from another path at that swap. The schedule is
ESS_OVERLAP (none | da | dba | layerwise with ESS_OVERLAP_LAYERS, the codes a, b and -)."""
from __future__ import annotations

import importlib
from typing import Sequence

import torch

from .._errors import InvalidArgument
from ._overlap import CopySplit, merge_states

FLASHMLA_SPARSE = "vllm.v1.attention.backends.mla.flashmla_sparse"
SCHEDULES = ("none", "da", "dba")


class DecodeOverlap(CopySplit):
    """One EssDecode's DA / DBA state: each ESS layer's schedule, the resident and fetched tables its steps fill (bound
    outputs, [B, T, K] buffer rows), the copy stream and its events, the layer vLLM's decode armed and the split its
    swap left for the kernel call; under DBA the indexer of each DBA layer (by the model's layer index, as the
    indexer op's layer name gives it) and the first half its split swapped."""

    def __init__(self, dev, schedules: Sequence[str], max_reqs: int, T: int, K: int, device):
        bad = [(l, s) for l, s in enumerate(schedules) if s not in SCHEDULES]
        if bad:
            raise InvalidArgument(f"DecodeOverlap: layer {bad[0][0]}'s schedule {bad[0][1]!r}; one of "
                                  f"{', '.join(SCHEDULES)}")
        super().__init__(dev, max_reqs, T, K, device)
        self.schedules = list(schedules)
        # armed: an ESS layer; first_half: (ESS layer, batch rows, tokens, EssDecode.steps_started).
        self.indexers = {}       # DBA: the model's layer index -> (the layer's HiSparseRuntime, its attention's name)
        self._offset_steps = {}  # first batch row -> the step bound to rows [first, max_reqs)

    def runs_da(self, layer: int) -> bool:
        """Whether the layer's decode reads its swap in two parts (DA, and DBA's attention)."""
        return self.schedules[layer] in ("da", "dba")

    def runs_dba(self, layer: int) -> bool:
        return self.schedules[layer] == "dba"

    def serve_indexer(self, model_layer: int, runtime, attention_name: str) -> None:
        """A DBA layer's indexer (vllm_indexer_split.py finds it by the model's layer index of the indexer op's
        layer name): its ESS runtime and the name of its attention layer (the forward's metadata of that name gives
        the swap's req_id_per_token, block size and valid rows)."""
        if not self.runs_dba(runtime.layer):
            raise InvalidArgument(f"serve_indexer: ESS layer {runtime.layer} runs {self.schedules[runtime.layer]!r}, "
                                  "not dba")
        if model_layer in self.indexers:
            raise InvalidArgument(f"serve_indexer: model layer {model_layer}'s indexer is served already (by ESS "
                                  f"layer {self.indexers[model_layer][0].layer})")
        self.indexers[model_layer] = (runtime, attention_name)

    def offset_step(self, decode, first: int):
        """A step bound to batch rows [first, max_reqs) of the decode's staged tensors (a DBA layer's second half:
        the engine's step takes a binding's first positions); bound once per first row."""
        step = self._offset_steps.get(first)
        if step is None:
            step = decode.engine.bind_step(decode.rows[first:], decode.topk[first:], decode.lengths[first:],
                                           decode.physical[first:], counts=decode.counts[first:],
                                           **{name: t[first:] for name, t in self.outputs().items()})
            self._offset_steps[first] = step
        return step

    def take_first_half(self, layer: int, step: int):
        """(batch rows, tokens) the indexer swapped already for this layer in this step (EssDecode.steps_started;
        None: none); consumed. A first half of another layer or step is one a failed forward left (the indexer's
        swap ran, the layer's decode never came): dropped, its swap having left the engine consistent."""
        half = self.first_half
        if half is None:
            return None
        if half[0] != layer or half[3] != step:
            self.drop_first_half()
            return None
        self.first_half = None
        return half[1:3]

    def leave(self, resident: torch.Tensor, fetched: torch.Tensor) -> torch.Tensor:
        self.pending = (resident, fetched)
        return resident


def merge(o0, lse0, o1, lse1, with_vllm=None):
    """FlashMLA's two partial results, out [b, s_q, h, dv] and lse [b, h, s_q], merged per (query row, head):
    with_vllm (default: on CUDA) by vLLM's merge_attn_states, else by ESS's merge_states."""
    b, s_q, h, d = o0.shape
    p_out, s_out = o0.reshape(b * s_q, h, d), o1.reshape(b * s_q, h, d)
    p_lse = lse0.permute(1, 0, 2).reshape(h, b * s_q).contiguous()
    s_lse = lse1.permute(1, 0, 2).reshape(h, b * s_q).contiguous()
    if o0.is_cuda if with_vllm is None else with_vllm:
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states
        inf = float("inf")
        # FlashMLA's empty part (lse +inf) given as an empty part (-inf), whatever merge kernel vLLM picks.
        p_empty, s_empty = p_lse == inf, s_lse == inf
        p_lse, s_lse = p_lse.masked_fill(p_empty, -inf), s_lse.masked_fill(s_empty, -inf)
        out, lse = torch.empty_like(p_out), torch.empty_like(p_lse)
        merge_attn_states(out, p_out.contiguous(), p_lse, s_out.contiguous(), s_lse, output_lse=lse)
        empty = p_empty & s_empty   # FlashMLA's empty row stays one (out 0, lse +inf)
        lse.masked_fill_(empty, inf)
        out.masked_fill_(empty.t().unsqueeze(-1), 0.0)
    else:
        out, lse = merge_states(p_out, p_lse.t(), s_out, s_lse.t())
        lse = lse.t()
    return out.view(b, s_q, h, d), lse.reshape(h, b, s_q).permute(1, 0, 2)


def _overlap_of(impl):
    """The DecodeOverlap of ESS's runtime on this FlashMLA sparse layer's cache handle, or None."""
    group = getattr(impl, "index_group", None)
    if group is None or not hasattr(group, "cache"):
        return None, None
    runtime = group.cache(impl.index_group_index).runtime
    return runtime, getattr(getattr(runtime, "decode", None), "overlap", None)


def _wrap_host_backed_decode(original):
    def _host_backed_fp8_decode(self, q, topk_indices, attn_metadata, kernel_metadata, num_decodes):
        runtime, overlap = _overlap_of(self)
        if overlap is None or not overlap.runs_da(runtime.layer):
            return original(self, q, topk_indices, attn_metadata, kernel_metadata, num_decodes)
        overlap.armed, overlap.pending = runtime.layer, None
        try:
            out = original(self, q, topk_indices, attn_metadata, kernel_metadata, num_decodes)
        finally:
            overlap.armed = None
        if overlap.pending is not None:
            overlap.pending = None
            raise RuntimeError(f"ESS layer {runtime.layer}: the DA swap returned the resident rows only, and vLLM's "
                               "decode did not read them through FlashMLASparseImpl._fp8_flash_mla_kernel")
        return out
    return _host_backed_fp8_decode


def _wrap_kernel(original):
    def _fp8_flash_mla_kernel(self, q, kv_c_and_k_pe_cache, topk_indices, kernel_metadata):
        _, overlap = _overlap_of(self)
        fetched = overlap.take(topk_indices) if overlap is not None else None
        if fetched is None:
            return original(self, q, kv_c_and_k_pe_cache, topk_indices, kernel_metadata)
        o0, lse0 = original(self, q, kv_c_and_k_pe_cache, topk_indices, kernel_metadata)   # Attn0, beside the copy
        overlap.wait_for_copy()                                                           # the fetched rows land
        o1, lse1 = original(self, q, kv_c_and_k_pe_cache, fetched, kernel_metadata)      # Attn1
        return merge(o0, lse0, o1, lse1)
    return _fp8_flash_mla_kernel


_WRAPS = {"_host_backed_fp8_decode": _wrap_host_backed_decode, "_fp8_flash_mla_kernel": _wrap_kernel}


def flashmla_sparse_impl(module=None):
    """vLLM's FlashMLASparseImpl (the class the DA wraps)."""
    return (module or importlib.import_module(FLASHMLA_SPARSE)).FlashMLASparseImpl


def patch(module=None) -> None:
    """FlashMLASparseImpl's two methods wrapped, once (each wrapper carries its original as ess_original); a layer
    without ESS's DA passes through unchanged."""
    cls = (module or importlib.import_module(FLASHMLA_SPARSE)).FlashMLASparseImpl
    for name, wrap in _WRAPS.items():
        current = getattr(cls, name)
        if getattr(current, "ess_original", None) is None:
            wrapped = wrap(current)
            wrapped.ess_original = current
            setattr(cls, name, wrapped)


def unpatch(module=None) -> None:
    cls = (module or importlib.import_module(FLASHMLA_SPARSE)).FlashMLASparseImpl
    for name in _WRAPS:
        original = getattr(getattr(cls, name), "ess_original", None)
        if original is not None:
            setattr(cls, name, original)
