"""What the overlap schedules share across engines (sglang/overlap.py, vllm_overlap.py): the schedule a server asks
for (ESS_OVERLAP, ESS_OVERLAP_LAYERS) and the merge of two partial attention states over disjoint index sets by their
log-sum-exp (the DA overlap's Attn0 over a layer's resident rows and Attn1 over the rows its step copied in)."""
from __future__ import annotations

import logging
import os

import torch

from .._errors import InvalidArgument

logger = logging.getLogger("ess.integrations")

MODES = ("none", "da", "dba", "layerwise")
LAYER_CODES = {"a": "da", "b": "dba", "-": "none"}


def schedule_from_environment() -> str:
    """ESS_OVERLAP (none | da | dba | layerwise; default none): the schedule of every layer's decode (dba:
    the indexer split along the batch too), or layer by layer from ESS_OVERLAP_LAYERS (layers_from_environment)."""
    value = os.environ.get("ESS_OVERLAP", "none").strip().lower()
    if value not in MODES:
        raise InvalidArgument(f"ESS_OVERLAP = {value!r}: one of {', '.join(MODES)}")
    return value


def layers_from_environment(first_layer: int, layers: int):
    """ESS_OVERLAP_LAYERS for ESS_OVERLAP = layerwise: the schedule of every layer of the model, as `ess plan` prints
    it (its launch line's value): one group per layer from layer 0, separated by spaces, each one code per micro-batch
    (a: DA, b: DBA, -: none, the simulator's code for a layer without misses); a group of one serves both of
    two-batch overlap's micro-batches. Groups past the last layer (the MTP draft layer's) are not read. Returns a
    tuple of per-micro-batch schedule tuples, indexed by layer id."""
    text = os.environ.get("ESS_OVERLAP_LAYERS")
    if text is None or not text.strip():
        raise InvalidArgument("ESS_OVERLAP = layerwise needs ESS_OVERLAP_LAYERS: the schedule per layer, as the "
                              "launch line of `ess plan` gives it (e.g. 'a a b b ...')")
    groups = text.split()
    if len(groups) < first_layer + layers:
        raise InvalidArgument(f"ESS_OVERLAP_LAYERS has {len(groups)} layers; this pool serves layers "
                              f"[{first_layer}, {first_layer + layers})")
    out = []
    for layer, group in enumerate(groups[:first_layer + layers]):
        bad = [c for c in group if c not in LAYER_CODES]
        if bad or len(group) > 2:
            raise InvalidArgument(f"ESS_OVERLAP_LAYERS: layer {layer}'s schedule {group!r} is not one or two of "
                                  f"a (DA), b (DBA), - (none)")
        out.append(tuple(LAYER_CODES[c] for c in group))
    return tuple(out)


def merge_states(o0, lse0, o1, lse1):
    """Two partial attention states over disjoint index sets merged: o [N, H, D], lse [N, H] natural-log, +inf for a
    part that selected nothing (FlashMLA's empty row). Returns (o in o0's dtype, lse float32); a row where both parts
    are empty stays FlashMLA's empty row (o 0, lse +inf). Where one part is empty the other is returned bit for bit
    (its weight is exp(0) = 1, the empty one's exp(-inf) = 0)."""
    inf = float("inf")
    a = lse0.float().masked_fill(lse0 == inf, -inf)
    b = lse1.float().masked_fill(lse1 == inf, -inf)
    m = torch.maximum(a, b)
    empty = m == -inf
    m = m.masked_fill(empty, 0.0)
    wa, wb = torch.exp(a - m), torch.exp(b - m)
    total = (wa + wb).masked_fill(empty, 1.0)
    o = o0.float() * (wa / total).unsqueeze(-1) + o1.float() * (wb / total).unsqueeze(-1)
    lse = (m + torch.log(total)).masked_fill(empty, inf)
    return o.to(o0.dtype), lse


class CopySplit:
    """A DA / DBA swap's state, both engines': the resident and fetched tables its steps fill (bound outputs,
    [max_reqs, T, K] rows, each query row's compacted), the copy stream and the copies' events, the layer the decode
    armed, the hand-over to the attention kernel (`pending`: the tables the swap left, the resident one returned to
    the engine's decode) and under DBA the first half the indexer swapped."""

    def __init__(self, dev, max_reqs: int, T: int, K: int, device):
        i32 = dict(dtype=torch.int32, device=device)
        self.dev = dev
        self.resident = torch.full((max_reqs, T, K), -1, **i32)
        self.fetched = torch.full((max_reqs, T, K), -1, **i32)
        self.resident_count = torch.zeros((max_reqs, T), **i32)
        self.fetched_count = torch.zeros((max_reqs, T), **i32)
        self.copy_stream = dev.Stream()
        self.copy_done = self.event()   # after the layer's last copy: what Attn1 waits for
        self.first_copy_done = self.event()   # after a DBA layer's first-half copy (its step records one)
        self.armed = None        # the layer the engine's decode armed for a split swap, or None
        self.pending = None
        self.first_half = None   # DBA: the first half of a batch the indexer swapped (each engine's tuple), for the
                                 # layer's swap

    def drop_first_half(self) -> None:
        """A DBA first half no decode took, dropped with a warning: only a forward that raised between a layer's
        indexer and its decode leaves one; that forward's work is abandoned, and its swap left the engine
        consistent."""
        if self.first_half is not None:
            logger.warning("ESS: layer %s's DBA first half was never taken (its forward failed); dropped",
                           self.first_half[0])
            self.first_half = None

    def event(self):
        """A copy event, recorded once: torch creates a CUDA event at its first record, and until then its handle is
        0, which ESS's step would take for "no event" and the wait for would skip."""
        event = self.dev.Event()
        if self.dev.is_cuda:
            event.record(self.dev.current_stream())
        return event

    def outputs(self) -> dict:
        """The step binding's DA outputs (Engine.bind_step)."""
        return dict(resident=self.resident, fetched=self.fetched, resident_count=self.resident_count,
                    fetched_count=self.fetched_count)

    def step_part(self, step, layer: int, n: int, part: int = 0, done=None) -> None:
        """A step's device work over a bound batch's first n positions: the decision on the current stream, the copy
        on the copy stream, `done` (default: copy_done) recorded when it ends (the host backend copies in the step
        itself). part: the engine's scratch set (0, and 1 for a DBA layer's second half)."""
        dev = self.dev
        if dev.is_cuda:
            step.step_async(layer, n, part, dev.handle(dev.current_stream()), self.copy_stream,
                            self.copy_done if done is None else done)
        else:
            step.step_async(layer, n, part)

    def take(self, indices):
        """The fetched table of the pending split whose resident table `indices` views (FlashMLA's indices: the table,
        reshaped), or None for any other call; consumed."""
        if self.pending is None or indices is None:
            return None
        resident, fetched = self.pending
        if indices.data_ptr() != resident.data_ptr() or indices.numel() != resident.numel():
            return None
        self.pending = None
        return fetched.view(indices.shape)

    def wait_for_copy(self) -> None:
        """The current stream waits for the copy's event (Attn1 reads the fetched rows after it)."""
        self.copy_done.wait(self.dev.current_stream())
