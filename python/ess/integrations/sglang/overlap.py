"""The DA overlap in SGLang 0.5.23's DSA decode: attention over a layer's resident rows runs while its misses are
copied, then over the fetched rows, the two partial states merged by their log-sum-exp.

What runs, per layer whose schedule is DA, in DeepseekSparseAttnBackend.forward_decode (layers/attention/
dsa_backend.py; and in forward_extend for the verify forward of speculative decoding, which swaps [bs, T, K] and
runs the same FlashMLA call over bs x T query rows), all of it SGLang's own code but for the marked steps:

  forward_decode         the wrapper (patch_backend) arms the coordinator for this layer [ESS], then SGLang's own
                         forward_decode runs: the KV write, q, _pad_topk_indices, then
  swap_in_selected_pages the swap decision on the current stream, the misses copied by FlashTrans on the
                         coordinator's copy stream after it, its event recorded when the copy ends [ESS]; returns
                         the resident table (each query row's rows that were in place before the step, -1 after)
  _forward_flashmla_kv   SGLang's own preparation (q heads padded, the cache viewed as pages, FlashMLA's metadata),
                         then flash_mla_interface.flash_mla_with_kvcache, which ESS wraps (patch_flashmla): for the
                         armed resident table it runs SGLang's FlashMLA call twice, Attn0 over the resident rows
                         (beside the copy), the current stream's wait for the copy's event, Attn1 over the fetched
                         rows, and merges the two (out, lse) [ESS]; SGLang then trims the padded heads as always.

FlashMLA's sparse decode returns the natural-log LSE [b, h_q, s_q] and, for a query row whose indices are all -1,
an output of 0 and an LSE of +inf (FlashMLA tests/ref.py, ref_sparse_attn_decode); SGLang's merge_state
(layers/attention/merge_state.py: +inf taken as -inf) merges on CUDA, ESS's merge_states below on the host and
for rows where both parts are empty (CUDA graph padding), which stay FlashMLA's empty row.

Only the FlashMLA FP8 decode (dsa decode backend flashmla_kv, HiSparse's default for the FP8 cache ESS serves)
returns the LSE a merge needs; a DA schedule under another decode backend is refused by name. The paper's PreAttn
deferral (q_b_proj, the absorb bmm and RoPE moved into the copy window) is not done: in 0.5.23 q is computed by
the model's forward_prepare before the indexer runs, and the swap happens inside forward_decode, after both."""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from ..._errors import InvalidArgument
from .._overlap import (LAYER_CODES, MODES, CopySplit, layers_from_environment, merge_states,  # noqa: F401
                        schedule_from_environment)
from ._common import _pool_slots

DA_DECODE_BACKENDS = ("flashmla_kv",)
FLASH_MLA_INTERFACE = "sglang.kernels.ops.attention.flash_mla_interface"


def check_decode_backend(impl: Optional[str], where: str, schedule: str = "da") -> None:
    if impl is not None and impl not in DA_DECODE_BACKENDS:
        raise InvalidArgument(
            f"{where}: ESS_OVERLAP = {schedule} needs the dsa decode backend {' or '.join(DA_DECODE_BACKENDS)} "
            f"(FlashMLA's FP8 sparse decode, which returns the log-sum-exp the two parts are merged by); this server "
            f"runs {impl!r}: pass --dsa-decode-backend flashmla_kv, or ESS_OVERLAP = none")


def _merge_on_device(o0, lse0, o1, lse1):
    """SGLang's merge_state on CUDA (one fused kernel), ESS's merge_states elsewhere; rows empty in both parts
    (CUDA graph padding) are FlashMLA's empty row either way."""
    if not o0.is_cuda:
        return merge_states(o0, lse0, o1, lse1)
    from sglang.srt.layers.attention.merge_state import merge_state
    o, lse = merge_state(o0, lse0, o1, lse1)
    inf = float("inf")
    both = (lse0 == inf) & (lse1 == inf)
    o.masked_fill_(both.unsqueeze(-1), 0.0)
    lse.masked_fill_(both, inf)
    return o, lse


class DecodeSplit(CopySplit):
    """A coordinator's DA / DBA state: the resident and fetched tables of the layer swapped last (bound outputs of
    its steps, SGLang device-pool slots after the swap), the copy stream and its events, which layer forward_decode
    armed, and under DBA the first half the indexer swapped. The split a swap leaves is consumed by the FlashMLA
    call that reads its resident table."""

    def __init__(self, dev, max_reqs: int, T: int, K: int, device, padding, schedule: str = "da", layers=None):
        """padding: the coordinator's bool scratch of [max_reqs, T, K] (the swaps run one after another on a
        stream). schedule: da or dba, every layer's; or layerwise, `layers` (layers_from_environment) then giving
        each layer's per micro-batch."""
        super().__init__(dev, max_reqs, T, K, device)
        i32 = dict(dtype=torch.int32, device=device)
        self._schedule = schedule
        self._layers = layers
        self._calls = {}         # layer id -> its decode forwards so far in this forward (the micro-batch's index)
        self._last_layer = None
        self.resident_locs = torch.full((max_reqs, T, K), -1, **i32)
        self.fetched_locs = torch.full((max_reqs, T, K), -1, **i32)
        self._padding = padding
        # armed: the layer id forward_decode armed; first_half: (layer id, batch key, positions).

    def new_forward(self) -> None:
        """A step's preparation begins the next forward: the micro-batch counts restart, and a DBA first half a
        failed forward left behind is dropped."""
        self._calls.clear()
        self._last_layer = None
        self.first_half = None

    def _observe(self, layer_id) -> None:
        # A forward visits layers in order (two-batch overlap: A(l), B(l), A(l + 1), ...): a lower layer id begins
        # the next forward.
        if self._last_layer is not None and layer_id < self._last_layer:
            self._calls.clear()
        self._last_layer = layer_id

    def schedule(self, layer_id) -> str:
        """The schedule of the layer's next decode forward (none, da or dba): layer-wise, its micro-batch's."""
        if self._layers is None:
            return self._schedule
        self._observe(layer_id)
        group = self._layers[layer_id]
        return group[min(self._calls.get(layer_id, 0), len(group) - 1)]

    def forward_done(self, layer_id) -> None:
        """A decode forward of the layer ran (layer-wise: the next one is the next micro-batch's)."""
        if self._layers is not None:
            self._observe(layer_id)
            self._calls[layer_id] = self._calls.get(layer_id, 0) + 1

    def finish(self, B: int, row_base: int) -> None:
        """Both tables of positions [0, B) as device-pool slots (-1 kept)."""
        _pool_slots(self.resident[:B], row_base, self.resident_locs[:B], self._padding[:B])
        _pool_slots(self.fetched[:B], row_base, self.fetched_locs[:B], self._padding[:B])

    def take_first_half(self, layer_id, key, B: int) -> int:
        """The positions the indexer swapped already for this layer and batch (0: none); consumed."""
        half, self.first_half = self.first_half, None
        if half is None:
            return 0
        if half[0] != layer_id or half[1] != key or not 0 < half[2] < B:
            raise RuntimeError(f"layer {layer_id}: ESS's DBA swapped the first half of another batch or layer "
                               f"({half}) before this forward_decode")
        return half[2]

    def leave(self, B: int, shape):
        self.pending = (self.resident_locs[:B].view(shape), self.fetched_locs[:B].view(shape))
        return self.pending[0]



_SPLITS = []   # the DecodeSplit of every live coordinator that serves DA (a process usually has one)


def register(split: DecodeSplit) -> None:
    _SPLITS.append(split)


def unregister(split: DecodeSplit) -> None:
    if split in _SPLITS:
        _SPLITS.remove(split)


def _wrap_flash_mla(original):
    def flash_mla_with_kvcache(*args, **kwargs):
        indices = kwargs.get("indices")
        for split in _SPLITS:
            fetched = split.take(indices)
            if fetched is not None:
                break
        else:
            return original(*args, **kwargs)
        o0, lse0 = original(*args, **kwargs)                # Attn0: the resident rows, beside the copy
        split.wait_for_copy()                               # the fetched rows are in place after this
        kwargs["indices"] = fetched
        o1, lse1 = original(*args, **kwargs)                # Attn1: the fetched rows
        b, s_q, h, d = o0.shape
        # FlashMLA: out [b, s_q, h_q, dv], lse [b, h_q, s_q]; merged per (query row, head).
        o, lse = _merge_on_device(o0.reshape(b * s_q, h, d), lse0.transpose(1, 2).reshape(b * s_q, h),
                                  o1.reshape(b * s_q, h, d), lse1.transpose(1, 2).reshape(b * s_q, h))
        return o.view(b, s_q, h, d), lse.view(b, s_q, h).transpose(1, 2)
    return flash_mla_with_kvcache


def _wrap_attribute(owner, name: str, wrap) -> None:
    """owner.name replaced by wrap(owner.name), once (the wrapper carries its original as ess_original)."""
    current = getattr(owner, name)
    if getattr(current, "ess_original", None) is None:
        wrapped = wrap(current)
        wrapped.ess_original = current
        setattr(owner, name, wrapped)


def _unwrap_attribute(owner, name: str) -> None:
    original = getattr(getattr(owner, name), "ess_original", None)
    if original is not None:
        setattr(owner, name, original)


def patch_flashmla(module) -> None:
    """sglang.kernels.ops.attention.flash_mla_interface.flash_mla_with_kvcache wrapped (the DSA backend imports it
    from the module at each call); calls that do not read an armed resident table pass through unchanged."""
    _wrap_attribute(module, "flash_mla_with_kvcache", _wrap_flash_mla)


def unpatch_flashmla(module) -> None:
    _unwrap_attribute(module, "flash_mla_with_kvcache")


def _decode_split(backend):
    """The coordinator's DecodeSplit (ESS's coordinator with ESS_OVERLAP = da, dba or layerwise), else None."""
    return getattr(getattr(backend, "hisparse_coordinator", None), "decode_split", None)


def _da_layer(backend, layer, split):
    """`split` when it runs DA or DBA on this forward of the layer (the decode backend checked), else None."""
    schedule = split.schedule(layer.layer_id)
    if schedule == "none":
        return None
    check_decode_backend(backend.dsa_decode_impl, f"layer {layer.layer_id}", schedule)
    # The module as _forward_flashmla_kv's own import resolves it (sys.modules, by its full name).
    patch_flashmla(importlib.import_module(FLASH_MLA_INTERFACE))
    return split


def _armed(backend, layer, split, run):
    """`run` (SGLang's own forward) with the layer armed: its swap leaves the split, which its FlashMLA call takes."""
    split.armed, split.pending = layer.layer_id, None
    try:
        out = run()
    finally:
        split.armed = None
        split.first_half = None
    if split.pending is not None:
        split.pending = None
        raise RuntimeError(f"layer {layer.layer_id}: ESS's DA swap returned the resident rows only, and the "
                           f"decode kernel did not read them through FlashMLA's flash_mla_with_kvcache "
                           f"(dsa decode backend {backend.dsa_decode_impl!r})")
    return out


def _armed_when(applies):
    """A wrapper of a DSA backend forward (self, q, k, v, layer, forward_batch, ...) that arms ESS's DA for the
    layer when `applies(forward_batch)` and the coordinator runs DA, else calls SGLang's own forward unchanged."""
    def wrap(original):
        def forward(self, q, k, v, layer, forward_batch, *args, **kwargs):
            split = _decode_split(self) if applies(forward_batch) else None
            if split is None:
                return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
            armed = _da_layer(self, layer, split)
            if armed is None:
                out = original(self, q, k, v, layer, forward_batch, *args, **kwargs)
            else:
                out = _armed(self, layer, split, lambda: original(self, q, k, v, layer, forward_batch, *args,
                                                                  **kwargs))
            split.forward_done(layer.layer_id)
            return out
        return forward
    return wrap


def _target_verify(forward_batch) -> bool:
    mode = getattr(forward_batch, "forward_mode", None)
    return mode is not None and mode.is_target_verify()


# forward_decode always; forward_extend for the verify forward of speculative decoding (target verify: it swaps
# [bs, T, K] and FlashMLA's decode kernel reads bs x T query rows), not for prefill or draft extends.
_WRAPPERS = {"forward_decode": _armed_when(lambda forward_batch: True),
             "forward_extend": _armed_when(_target_verify)}


def patch_backend(cls) -> None:
    """DeepseekSparseAttnBackend.forward_decode and forward_extend wrapped: ESS's DA armed for the layers whose
    schedule is DA (decode, and the verify forward of speculative decoding), else SGLang's own methods unchanged."""
    for name, wrap in _WRAPPERS.items():
        _wrap_attribute(cls, name, wrap)


def unpatch_backend(cls) -> None:
    for name in _WRAPPERS:
        _unwrap_attribute(cls, name)
