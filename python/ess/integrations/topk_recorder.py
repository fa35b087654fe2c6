"""The top-k an engine hands ESS while it serves, recorded as an ESS trace (docs/trace-format.md), so that
`ess trace analyze` and `ess plan --miss-profile` run on the user's own workload.

Opt-in, by environment (read when the adapter is built):

    ESS_RECORD_TRACE=/data/my-workload.safetensors   the trace to write (nothing is recorded without it)
    ESS_RECORD_REQUESTS=8                            requests recorded: the first ones to enter decode
    ESS_RECORD_STEPS=512                             decode steps kept per request (its first ones)
    ESS_RECORD_MODEL=deepseek-v3.2-exp               the trace's model name (optional)

The trace is written when every recorded request has ended, or when the adapter is destroyed. Its size is about
requests x steps x layers x T x top-k x 4 bytes (8 x 512 x 61 x 1 x 2048 x 4 = 2 GiB at the defaults), held in
host memory until then."""
from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional

import numpy as np
import torch

from .._errors import InvalidArgument

logger = logging.getLogger("ess.integrations")


class _Request:
    def __init__(self, rid, context: int, slot: int):
        self.rid, self.context, self.slot = rid, context, slot
        self.ids: List[np.ndarray] = []      # per step [layers, T, K]
        self.lengths: List[int] = []
        self.open_steps = 0                  # steps copied or to be copied, not yet taken
        self.ended = False


class TopkRecorder:
    """The device side, graph-safe and per call: each swap copies its requests' top-k rows into the recorder's
    buffer ([layers, slots + 1, T, K]) at their request's slot, every other position (not recorded, padding) into
    the last, discarded slot; a micro-batch's call records its own rows. The host side, once per step at the
    step's preparation (step()): the buffer as the previous step's forward left it is copied to host memory, after
    that forward and before this step's, with the rows that began or ended since mapped then (never under a
    forward in flight), and taken one step later, when the copy is long done, so that recording never waits for the
    device."""

    def __init__(self, path: str, *, layers: int, T: int, K: int, max_reqs: int, device, dev, requests: int,
                 steps: int, model: str, provenance: str, unit_tokens: int = 1):
        """unit_tokens: the tokens an id names (DeepSeek-V4's C4 entries: 4); begin() and step() take lengths in
        ids, as the engine counts them (the trace's lengths are tokens: unit_tokens x those)."""
        for name, value in (("ESS_RECORD_REQUESTS", requests), ("ESS_RECORD_STEPS", steps)):
            if value < 1:
                raise InvalidArgument(f"{name} = {value}: at least 1")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise InvalidArgument(f"ESS_RECORD_TRACE = {path!r}: the folder {folder!r} does not exist")
        self.path, self.layers, self.T, self.K, self.unit_tokens = path, layers, T, K, unit_tokens
        self.requests, self.steps, self.model, self.provenance = requests, steps, model, provenance
        self.dev = dev
        self._trash = requests
        self._slot_of_row = torch.full((max_reqs,), self._trash, dtype=torch.int64, device=device)
        self._ids = torch.full((layers, requests + 1, T, K), -1, dtype=torch.int32, device=device)
        pinned = getattr(dev, "is_cuda", False)
        self._host = torch.empty((layers, requests, T, K), dtype=torch.int32, pin_memory=pinned)
        self._by_row: Dict[int, _Request] = {}
        self._done: List[_Request] = []
        self._begun = 0
        self._step: List[tuple] = []          # (request, length) of the step being run
        self._remap: Dict[int, int] = {}      # row -> slot (or the discard) from the next step on
        self._pending: Optional[tuple] = None  # (event, [(request, length)]) copied, not taken
        self._written = False

    @classmethod
    def from_environment(cls, **kwargs) -> Optional["TopkRecorder"]:
        path = os.environ.get("ESS_RECORD_TRACE")
        if not path:
            return None

        def count(name, default):
            text = os.environ.get(name, str(default))
            try:
                return int(text)
            except ValueError:
                raise InvalidArgument(f"{name} = {text!r}: an integer expected") from None
        return cls(path, requests=count("ESS_RECORD_REQUESTS", 8), steps=count("ESS_RECORD_STEPS", 512),
                   model=os.environ.get("ESS_RECORD_MODEL", "unknown"), **kwargs)

    # ---- the host side ----
    def begin(self, row: int, rid, context: int) -> None:
        """The request in request slot `row` enters decode with `context` ids (the first `requests` ones are
        recorded, each in a slot of its own: slots are never reused)."""
        if self._begun == self.requests or row in self._by_row:
            return
        request = _Request(rid, context * self.unit_tokens, self._begun)   # slots in order of admission
        self._by_row[row] = request
        self._begun += 1
        self._remap[row] = request.slot

    def end(self, row: int) -> None:
        request = self._by_row.pop(row, None)
        if request is None:
            return
        request.ended = True
        self._remap[row] = self._trash
        self._finish_if_done(request)

    def step(self, rows, lengths, after_the_forward=None) -> None:
        """A step is prepared over `rows` (request slots) whose query tokens see `lengths` ids: the previous
        step's copy is taken, and the buffer as the last forward left it is copied to host memory. The copy runs
        through `after_the_forward(fn)` where the step is prepared on another stream than the forward's (it must
        then run fn after the last forward, and the next forward after fn); else on the current stream."""
        self._take_pending()
        # The buffer as the last forward left it, then the rows that began or ended since (a forward still in
        # flight may record a request that has ended: its row keeps its slot until that forward is done).
        copy, remap = bool(self._step), sorted(self._remap.items())
        self._remap = {}
        if copy or remap:
            done = self.dev.Event() if copy else None

            def record_copy():
                if copy:
                    self._host.copy_(self._ids[:, :self.requests], non_blocking=True)
                    done.record()
                for row, slot in remap:
                    self._slot_of_row[row].fill_(slot)
            (after_the_forward or self.dev.launch)(record_copy)
            if copy:
                self._pending, self._step = (done, self._step), []
        for row, length in zip(rows, lengths):
            request = self._by_row.get(row)
            if request is not None and len(request.lengths) + request.open_steps < self.steps:
                request.open_steps += 1
                self._step.append((request, int(length) * self.unit_tokens))

    def close(self) -> None:
        """Everything recorded so far (the last step's copy waited for) goes to the trace."""
        if self._written:
            return
        self.step([], [])
        self._take_pending()
        for request in list(self._by_row.values()):
            request.ended = True
            self._finish_if_done(request)
        self._by_row.clear()
        self._write()

    def _take_pending(self):
        if self._pending is None:
            return
        done, taken = self._pending
        self._pending = None
        done.synchronize()
        for request, length in taken:
            request.ids.append(self._host[:, request.slot].numpy().copy())
            request.lengths.append(length)
            request.open_steps -= 1
            self._finish_if_done(request)

    def _finish_if_done(self, request: _Request):
        if request.ended and request.open_steps == 0 and request not in self._done:
            self._done.append(request)
            if len(self._done) == self._begun == self.requests:
                self._write()

    def _write(self):
        if self._written:
            return
        self._written = True
        kept = [r for r in self._done if r.lengths]
        if not kept:
            logger.warning("ESS: ESS_RECORD_TRACE=%s: no decode step was recorded, no trace written", self.path)
            return
        import ess_trace
        writer = ess_trace.TraceWriter(model=self.model, layers=self.layers, mtp=self.T, topk=self.K,
                                       provenance=self.provenance, synthetic=False, unit_tokens=self.unit_tokens)
        for r in kept:
            writer.add_request(topk=np.stack(r.ids), lengths=np.array(r.lengths, dtype=np.int64),
                               context=min(r.context, r.lengths[0]), id=str(r.rid))
        writer.write(self.path)
        logger.info("ESS: recorded %d requests (%d steps) to %s", len(kept), sum(len(r.lengths) for r in kept),
                    self.path)

    # ---- the device side ----
    def record(self, layer: int, rows: torch.Tensor, top_k_result: torch.Tensor) -> None:
        """Device work only (captured in a CUDA graph): each position's top-k rows into its request's slot; rows
        are request slots (SGLang's req_pool_indices, vLLM's state indices), -1 for none."""
        B = int(rows.shape[0])
        rows = rows.to(torch.int64)
        slots = self._slot_of_row.index_select(0, rows.clamp(min=0))
        slots = torch.where(rows >= 0, slots, torch.full_like(slots, self._trash))
        self._ids[layer].index_copy_(0, slots, top_k_result.view(B, self.T, self.K))
