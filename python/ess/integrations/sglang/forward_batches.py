"""The batches one forward swaps for: the whole batch, and with two-batch overlap its two micro-batches, each with
its own staged rows and lengths and its own bound step."""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..._errors import InvalidArgument


class ForwardBatches:
    """Without two-batch overlap a forward calls swap_in_selected_pages with the whole batch at every layer. With
    it (SGLang's batch_overlap/two_batch_overlap.py), a DSA model's dense layers still get the whole batch, and
    every other layer is called once per micro-batch (TboForwardBatchPreparer.filter_batch: the first and second
    halves of the requests, their own req_pool_indices and seq_lens padded with row 0), A(l), B(l), A(l + 1), ...
    on one stream; under a CUDA graph the micro-batches are views of the graph's static buffers.

    Each distinct batch of a forward gets its own rows and lengths, staged at its first swap of the forward, and a
    step bound to them, so that every swap reads its own requests. The top-k and physical tensors are shared: the
    swaps run on one stream, each one's output read by its attention before the next swap writes them.

    A batch is known by its req_pool_indices tensor (address and size): the whole batch and its micro-batches are
    alive together during a forward, so theirs are distinct. A forward begins at the step's preparation
    (new_forward) and at the first layer after any other (a CUDA graph's capture runs forwards without one)."""

    LIMIT = 3   # the whole batch and two micro-batches

    def __init__(self, engine, max_reqs: int, topk: torch.Tensor, physical: torch.Tensor, device, outputs=None):
        self._engine, self._max_reqs, self._device = engine, max_reqs, device
        self._topk, self._physical = topk, physical
        self._outputs = outputs or {}   # the DA split's resident / fetched outputs, shared as the physical rows
        self._slots: List[Tuple[torch.Tensor, torch.Tensor, object]] = []
        self._seen = {}   # (address, size) -> slot, this forward
        self._last_layer = None
        self._offset_steps = {}   # (slot, first position) -> step bound to the slot's positions from there on

    @staticmethod
    def key(req_pool_indices: torch.Tensor):
        return (req_pool_indices.data_ptr(), int(req_pool_indices.shape[0]))

    def new_forward(self) -> None:
        self._seen.clear()
        self._last_layer = None

    def slot(self, layer: int, req_pool_indices: torch.Tensor):
        """(rows, lengths, step, first): the slot of this batch; first: its first swap of the forward (stage it)."""
        if layer == 0 and self._last_layer not in (None, 0):
            self.new_forward()
        self._last_layer = layer
        key = self.key(req_pool_indices)
        index = self._seen.get(key)
        if index is not None:
            return self._slots[index] + (False,)
        index = len(self._seen)
        if index == self.LIMIT:
            raise InvalidArgument(
                f"a swap at layer {layer} brings a fourth batch to one forward (its req_pool_indices are neither "
                "the whole batch's nor one of its two micro-batches')")
        if index == len(self._slots):
            i32 = dict(dtype=torch.int32, device=self._device)
            rows = torch.full((self._max_reqs,), -1, **i32)
            lengths = torch.zeros((self._max_reqs,), **i32)
            self._slots.append((rows, lengths, self._engine.bind_step(rows, self._topk, lengths, self._physical,
                                                                    **self._outputs)))
        self._seen[key] = index
        return self._slots[index] + (True,)

    def index(self, key) -> int:
        """The slot of a batch this forward has swapped for (known by its key)."""
        return self._seen[key]

    def offset_step(self, req_pool_indices: torch.Tensor, first: int):
        """A step bound to positions [first, ...) of this forward's batch (staged already): a DBA layer's second half
        (the engine's step takes a batch's first positions). Bound once per slot and first position."""
        index = self._seen[self.key(req_pool_indices)]
        step = self._offset_steps.get((index, first))
        if step is None:
            rows, lengths, _ = self._slots[index]
            step = self._engine.bind_step(rows[first:], self._topk[first:], lengths[first:], self._physical[first:],
                                          **{name: t[first:] for name, t in self._outputs.items()})
            self._offset_steps[(index, first)] = step
        return step
