"""An ESS runtime shaped like vLLM's HiSparse runtime (vllm/v1/hisparse/runtime.py): its sparse MLA
backend's index group calls swap_in(...) with the decode tokens' logical top-k and gets the
physical rows of the attention cache back.

    runtime.begin_forward(request_rows, seq_lens)            # once per step, before the forward
    slots = runtime.slot_mapping()                           # where this step's new KV is written
    physical = runtime.swap_in(req_id_per_token=..., logical_topk_indices=topk)   # per layer

ESS owns the host copy (its Total Memory Pool), so vLLM's source-side arguments (block_table,
block_size, resident) describe nothing ESS reads: they are accepted for call compatibility and must
be consistent with nothing. Decode tokens come request by request, T per request (MTP), in batch
order: req_id_per_token = [0]*T + [1]*T + ..."""
from __future__ import annotations

import numpy as np

from .._errors import InvalidArgument
from ..engine import Engine
from . import _arrays
from ._session import DecodeSession


class HiSparseRuntime:
    def __init__(self, engine: Engine, max_num_reqs: int, like=None):
        self.session = DecodeSession(engine, max_num_reqs, like)
        self.engine = engine
        self._layer_calls = 0

    # ---- requests (the worker's view of the scheduler's admissions) ----
    def add_request(self, row: int, prompt_length: int, entries=None, warmup_topk=None):
        """A request whose prefill finished, at ESS pool row `row` (vLLM's persistent batch slot or any free one)."""
        self.session.admit(int(row), int(prompt_length), entries, warmup_topk)

    def free(self, row: int):
        self.session.finish(int(row))

    # ---- steps ----
    def begin_forward(self, request_rows, seq_lens, num_valid_reqs=None):
        """request_rows [B]: each batch request's pool row (-1 = padded); seq_lens [B]: its tokens after this
        step's T new ones. Writes the previous step's new entries back to the host pool and extends each request."""
        self.session.begin_step(request_rows, seq_lens, num_real=num_valid_reqs)
        self._layer_calls = 0

    def slot_mapping(self):
        """[B x T]: the attention cache rows where this step's new KV entries go (-1 for padded requests)."""
        return self.session.reserved_rows().reshape(-1)

    def swap_in(self, *, req_id_per_token, logical_topk_indices=None, topk_indices=None, resident=None,
                block_table=None, block_size=None, return_valid_counts=False, attention_indices_out=None,
                valid_counts_out=None, stream=None, layer=None):
        """logical_topk_indices (or topk_indices) [num_tokens, K], -1 = padding -> physical [num_tokens, K] int32,
        rows of the attention cache; with return_valid_counts also [num_tokens] counts of ids >= 0. `layer`: the
        attention layer (None: the next one of this forward, counting calls since begin_forward, as vLLM's
        per-forward counter does)."""
        del resident, block_table, block_size  # vLLM's host-side source layout: ESS's host pool replaces it
        if (logical_topk_indices is None) == (topk_indices is None):
            raise InvalidArgument("swap_in: pass one of logical_topk_indices and topk_indices")
        topk = logical_topk_indices if logical_topk_indices is not None else topk_indices
        T = self.engine.info.query_tokens
        B = self.session.batch
        ids = _arrays.host_ints(req_id_per_token) if not _arrays.is_torch(req_id_per_token) or \
            req_id_per_token.device.type == "cpu" else None
        if ids is not None:
            expected = np.repeat(np.arange(B, dtype=np.int64), T)
            if ids.shape != expected.shape or not np.array_equal(ids.astype(np.int64), expected):
                raise InvalidArgument(f"swap_in: req_id_per_token must list the {B} batch requests in order, T = {T} "
                                      f"tokens each; got {ids.tolist()[:16]}")
        if layer is None:
            layer = self._layer_calls
            if layer >= self.engine.info.layers:
                raise InvalidArgument(f"swap_in: call {layer + 1} of this forward, but the engine has "
                                      f"{self.engine.info.layers} layers (begin_forward starts a step)")
        self._layer_calls += 1
        physical = self.session.step(layer, topk, stream)
        if attention_indices_out is not None:
            _arrays.copy_into(attention_indices_out, physical)
            physical = attention_indices_out
        if not return_valid_counts:
            return physical
        counts = (physical >= 0).sum(axis=-1) if not _arrays.is_torch(physical) else (physical >= 0).sum(dim=-1)
        if valid_counts_out is not None:
            _arrays.copy_into(valid_counts_out, counts)
            counts = valid_counts_out
        return physical, counts
