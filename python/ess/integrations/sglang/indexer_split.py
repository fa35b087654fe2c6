"""The DBA overlap in SGLang 0.5.23's DSA decode: the indexer of a layer runs per half of the batch, and the first
half's misses are copied while the second half's indexer runs; attention then runs as under DA (overlap.py).

What runs, per layer whose schedule is DBA, all of it SGLang's own code but for the marked steps:

  Indexer.forward_cuda   (layers/attention/dsa/dsa_indexer.py) q, weights and the index keys as always, then
  _get_topk_paged        wrapped [ESS] (decode and the verify forward of speculative decoding): SGLang's own
                         _get_topk_paged runs twice, over the first ceil(B / 2) requests' query rows and over the
                         rest, each with the indexer metadata narrowed to its requests (HalfIndexerMetadata); between
                         the two, the coordinator swaps the first half (decision on the current stream, copy on the
                         copy stream), so that copy runs beside the second half's paged MQA logits and top-k. The
                         halves' top-k, concatenated, are what one call returns (row for row the same computation).
  forward_decode         armed for DA as in overlap.py; swap_in_selected_pages swaps the second half only and returns
                         both halves' resident rows; FlashMLA runs over them beside the copies, waits for the copy's
                         event (the copies run in order on one stream: the second's end covers both), runs over the
                         fetched rows and merges.

The halves are the rig's (harness/rig/executor.cc, indexer_half): positions [0, ceil(B / 2)) and [ceil(B / 2), B) of
the batch the indexer sees (a two-batch-overlap micro-batch is split the same way). Where the split does not apply
the layer runs as DA: a batch of one, an indexer path that does not reach _get_topk_paged (all sequences within
top-k, SGLang's skip), a query layout that is not T rows per request, the top-k not forced unfused (HiSparse's decode
forces it: the indexer then returns logical positions, the swap's input)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..._errors import InvalidArgument

INDEXER_MODULE = "sglang.srt.layers.attention.dsa.dsa_indexer"


def topk_broadcast_refusal() -> Optional[str]:
    """Why DBA cannot run in this server, or None. With SGLANG_DSA_TOPK_BROADCAST, SGLang replaces each rank's top-k
    by rank 0's after _get_topk_paged returns (dsa_indexer._broadcast_indexer_topk_from_rank0), after ESS swapped
    the first half for this rank's own: the swap and attention would read different selections."""
    try:
        from sglang.srt.environ import envs
        on = bool(envs.SGLANG_DSA_TOPK_BROADCAST.get())
    except (ImportError, AttributeError):
        on = os.environ.get("SGLANG_DSA_TOPK_BROADCAST", "").strip().lower() in ("1", "true", "yes", "on")
    if on:
        return ("SGLANG_DSA_TOPK_BROADCAST replaces each rank's top-k by rank 0's after the indexer returns, after "
                "ESS has swapped the first half of the batch for this rank's own")
    return None


class HalfIndexerMetadata:
    """The indexer metadata of requests [b0, b1) of a batch of B requests with n query rows each, for SGLang's
    _get_topk_paged: every per-request or per-row getter it reads narrowed to the half, the paged MQA schedule left
    to be computed for the half (_get_topk_paged computes it when absent, as it does for any metadata without one),
    and the top-k transform the whole's, over the half's lengths (the unfused top-k reads only the logits and
    them)."""

    def __init__(self, whole, B: int, n: int, b0: int, b1: int):
        self._whole, self._B, self._n, self._b0, self._b1 = whole, B, n, b0, b1
        self.force_unfused_topk = True
        self.paged_mqa_schedule_metadata = None
        ctx = getattr(whole, "paged_mqa_ctx_lens_2d", None)
        self.paged_mqa_ctx_lens_2d = None if ctx is None else self._rows(ctx, "paged_mqa_ctx_lens_2d")

    def _rows(self, t, what):
        """t's rows of the half: per request (B rows) or per query row (B x n rows, or B rows of n columns)."""
        B, n, b0, b1 = self._B, self._n, self._b0, self._b1
        if t.shape[0] == B:
            return t[b0:b1]
        if t.shape[0] == B * n:
            return t[b0 * n:b1 * n]
        raise InvalidArgument(f"DBA: the indexer metadata's {what} has {t.shape[0]} rows for {B} requests x {n} "
                              "query rows")

    def get_seqlens_int32(self):
        return self._rows(self._whole.get_seqlens_int32(), "seqlens_int32")

    def get_page_table_64(self):
        return self._rows(self._whole.get_page_table_64(), "page_table_64")

    def get_page_table_1(self):
        return self._rows(self._whole.get_page_table_1(), "page_table_1")

    def get_seqlens_expanded(self):
        return self._rows(self._whole.get_seqlens_expanded(), "seqlens_expanded")

    def get_dsa_extend_len_cpu(self):
        """Per request ([n] x B: an eager verify or decode) or per query row ([1] x B x n: SGLang's captured
        verify graph, dsa_backend's init_forward_metadata_capture_cuda_graph), the half's."""
        extend = list(self._whole.get_dsa_extend_len_cpu())
        if len(extend) == self._B:
            return extend[self._b0:self._b1]
        return extend[self._b0 * self._n:self._b1 * self._n]

    def topk_transform(self, logits, topk: int, **kwargs):
        if kwargs:
            raise InvalidArgument(f"DBA: _get_topk_paged's top-k transform took {sorted(kwargs)}, which the split "
                                  "does not narrow")
        return self._whole.topk_transform(logits, topk, ke_offset=self.get_seqlens_expanded())


def _layout(forward_batch, metadata, q_fp8):
    """(B, n): B requests of n query rows each, the rows _get_topk_paged computes, or None where the split does not
    apply."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not (mode.is_decode() or mode.is_target_verify()):
        return None
    if not getattr(metadata, "force_unfused_topk", False):
        return None
    B = int(metadata.get_seqlens_int32().shape[0])
    extend = list(metadata.get_dsa_extend_len_cpu())
    if B < 2 or not extend:
        return None
    if len(extend) == B:   # n query rows per request
        n = extend[0]
        if any(e != n for e in extend):
            return None
    elif len(extend) % B == 0 and all(e == 1 for e in extend):   # a captured verify graph: one per query row
        n = len(extend) // B
    else:
        return None
    if n < 1 or B * n > q_fp8.shape[0]:
        return None
    return B, n


def _coordinator_split(layer_id):
    """The DecodeSplit of the forward's DSA backend when its coordinator runs DBA on `layer_id`, else None."""
    from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context
    if not has_forward_context():
        return None
    coord = getattr(get_attn_backend(), "hisparse_coordinator", None)
    split = getattr(coord, "decode_split", None)
    if split is None or split.schedule(layer_id) != "dba":
        return None
    return coord, split


def _wrap_get_topk_paged(original):
    def _get_topk_paged(self, forward_batch, layer_id, q_fp8, weights, metadata):
        found = _coordinator_split(layer_id)
        layout = None if found is None else _layout(forward_batch, metadata, q_fp8)
        if layout is None:
            return original(self, forward_batch, layer_id, q_fp8, weights, metadata)
        coord, split = found
        B, n = layout
        b0 = (B + 1) // 2
        first = original(self, forward_batch, layer_id, q_fp8[:b0 * n], weights[:b0 * n],
                         HalfIndexerMetadata(metadata, B, n, 0, b0))
        # The verify forward swaps with per-token seq_lens (forward_extend passes dsa_seqlens_expanded), decode
        # with the batch's.
        seq_lens = (metadata.get_seqlens_expanded() if forward_batch.forward_mode.is_target_verify()
                    else forward_batch.seq_lens)
        coord.swap_first_half(forward_batch.req_pool_indices, seq_lens,
                              first.view(b0, n, -1) if coord.T > 1 else first, layer_id)
        second = original(self, forward_batch, layer_id, q_fp8[b0 * n:B * n], weights[b0 * n:B * n],
                          HalfIndexerMetadata(metadata, B, n, b0, B))
        parts = [first, second]
        if q_fp8.shape[0] > B * n:   # _get_topk_paged's own padding of rows past the real query rows
            parts.append(torch.full((q_fp8.shape[0] - B * n, first.shape[1]), -1, dtype=first.dtype,
                                    device=first.device))
        return torch.cat(parts, dim=0)
    return _get_topk_paged


def patch_indexer(cls) -> None:
    """Indexer._get_topk_paged wrapped: split per half of the batch for layers whose schedule is DBA, SGLang's own
    method unchanged for every other call."""
    from .overlap import _wrap_attribute
    _wrap_attribute(cls, "_get_topk_paged", _wrap_get_topk_paged)


def unpatch_indexer(cls) -> None:
    from .overlap import _unwrap_attribute
    _unwrap_attribute(cls, "_get_topk_paged")
