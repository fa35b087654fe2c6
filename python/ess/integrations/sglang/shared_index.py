"""Shared-index layers (GLM-5.2's index sharing; SGLang 0.5.23 models/deepseek_v2.py `skip_topk`): a layer that runs no
indexer of its own reuses the top-k of the last layer before it that did (forward_mla.py: `should_run_indexer`,
the carried `prev_topk_indices`). Its selection is therefore known once its leader's indexer has run, and its
misses can be copied during the layers in between: the one place where fetching before a layer's own indexer is
exact.

SGLang's own coordinator does this as plan-then-IO (hisparse_coordinator.py `_init_shared_index_prefetch`,
`swap_in_selected_pages`): the leader ("anchor") swaps and records its miss plan, its followers' copies replay that
plan on a prefetch stream, and a follower's swap only waits for its copy and returns the leader's slots (its
buffers kept in lockstep with the leader's). ESS keeps every layer's LRU of its own, so here a follower's whole
step (its decision over its own pool and its copy) is issued at the leader's swap, on the prefetch stream: one
decision per follower layer pool, one copy per distinct miss of each. The follower's swap call then waits for its
event and returns the rows that step chose. Nothing else changes: the bytes a follower's attention reads are those
its own swap would have made resident (the same ids, the same LRU state), and the host pool it copies from already
holds every entry the step may miss (the previous step's newest entries are backed up before the forward, the
step's own newest stay in the reserved rows, which no step copies into).

Order on a CUDA device: the prefetch stream waits for the current stream after the leader's swap is enqueued (the
staged rows, lengths and the top-k are in place); each follower's step records its own event; the follower's
swap makes the current stream wait for it. Every follower of a group waits for its event before the group's next
leader runs, so a group's prefetch is complete before the next group's starts in the current stream's order. The
prefetch's steps use the engine's scratch set 1, as a DBA layer's second half does, both ways ordered: a DBA
leader's followers wait for its second half's copy (on the DA copy stream, reading set 1 until copy_done), and a DBA
second half waits for the prefetch stream (with two-batch overlap the other micro-batch's prefetch may still be
copying). A follower called for a batch its leader did not swap (a dense leader's whole batch, then two-batch
overlap's micro-batches: a pairing SGLang refuses with index sharing) swaps itself after the prefetch stream."""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..._errors import InvalidArgument
from ._common import _keep, _pool_slots

logger = logging.getLogger("ess.integrations.sglang")

PREFETCH_PART = 1   # the engine's scratch set the followers' steps use


def prefetch_groups(pattern: Sequence[bool]) -> Tuple[Dict[int, List[int]], List[int]]:
    """(groups, position): each leader layer -> its followers in order (the shared layers after it, up to the next
    layer with an indexer), and each follower's position in its group. `pattern[l]`: layer l reuses its leader's
    top-k (SGLang's `resolve_shared_index_layers`, indexed by the pool's layers)."""
    groups: Dict[int, List[int]] = {}
    position = [0] * len(pattern)
    leader = None
    for layer, shared in enumerate(pattern):
        if not shared:
            leader = layer
            continue
        if leader is None:
            raise InvalidArgument(f"shared_index_layers: layer {layer} reuses a top-k, but no layer before it runs an "
                                  "indexer (the pattern must start with a layer that computes its own)")
        group = groups.setdefault(leader, [])
        position[layer] = len(group)
        group.append(layer)
    return groups, position


def check_pattern(shared_index_layers, layer_num: int) -> Optional[List[bool]]:
    """The pattern SGLang passes, as the coordinator uses it: None when there is nothing to prefetch; a pattern whose
    length is not the pool's layer count is not used, as upstream's coordinator does not use it (a model whose
    attention layers differ from num_hidden_layers), with the same warning. Checked before anything is taken."""
    if shared_index_layers is None:
        return None
    pattern = [bool(x) for x in shared_index_layers]
    if not any(pattern):
        return None
    if len(pattern) != layer_num:
        logger.warning("ESS: shared-index prefetch disabled: pattern length %d != KV pool layer_num %d; the shared "
                       "layers swap their own rows", len(pattern), layer_num)
        return None
    prefetch_groups(pattern)   # refuses a pattern whose first layer is shared
    return pattern


class SharedIndexPrefetch:
    """The followers' steps of a coordinator, started at their leader's swap. Per batch a forward swaps for (the
    whole batch, two-batch overlap's micro-batches: ForwardBatches' slots), a copy of the leader's top-k; per batch
    and follower position, the step's output rows and SGLang slots, a step bound to the batch's staged rows and
    lengths, and an event."""

    def __init__(self, dev, engine, pattern: List[bool], max_reqs: int, T: int, K: int, device, row_base: int):
        self.dev, self._engine, self.pattern = dev, engine, pattern
        self.groups, self.position = prefetch_groups(pattern)
        self._shape = (max_reqs, T, K)
        self._device, self._row_base = device, row_base
        self.stream = dev.Stream()
        self._topk: Dict[int, torch.Tensor] = {}            # batch slot -> the leader's top-k, the followers' input
        self._out: Dict[Tuple[int, int], tuple] = {}        # (batch slot, position) -> (physical, locs, padding, step)
        self._done: Dict[Tuple[int, int], object] = {}      # (batch slot, position) -> its event
        self._issued: Dict[Tuple[int, object], Tuple[int, int]] = {}   # (follower, batch key) -> (batch slot, B)
        self.in_flight = False
        self.prefetched = 0   # follower swaps served by a step their leader started

    def is_follower(self, layer: int) -> bool:
        return self.pattern[layer]

    def new_forward(self) -> None:
        self._issued.clear()

    def _outputs(self, index: int, position: int, rows, lengths):
        key = (index, position)
        out = self._out.get(key)
        if out is None:
            if index not in self._topk:
                self._topk[index] = torch.full(self._shape, -1, dtype=torch.int32, device=self._device)
            i32 = dict(dtype=torch.int32, device=self._device)
            physical = torch.full(self._shape, -1, **i32)
            locs = torch.full(self._shape, -1, **i32)
            padding = torch.zeros(self._shape, dtype=torch.bool, device=self._device)
            step = self._engine.bind_step(rows, self._topk[index], lengths, physical)
            out = self._out[key] = (physical, locs, padding, step)
            self._done[key] = self.dev.Event()
        return out

    def start(self, leader: int, index: int, key, rows, lengths, B: int, top_k_result, after=None) -> None:
        """After the leader's swap was enqueued on the current stream (the batch staged at slot `index`): every
        follower's step on the prefetch stream, its event recorded after it. `after`: an event the steps also wait
        for (a DBA leader's second-half copy, which reads the scratch set they write)."""
        followers = self.groups.get(leader)
        if not followers:
            return
        outs = [self._outputs(index, self.position[f], rows, lengths) for f in followers]
        topk = self._topk[index]
        dev = self.dev
        self.stream.wait_stream(dev.current_stream())
        if after is not None:
            after.wait(self.stream)
        with dev.stream(self.stream):
            def prefetch():
                topk[:B].view(top_k_result.shape).copy_(top_k_result)
                handle = dev.handle(self.stream) if dev.is_cuda else None
                for follower, (physical, locs, padding, step) in zip(followers, outs):
                    if handle is None:
                        step.step_async(follower, B, PREFETCH_PART)
                    else:
                        step.step_async(follower, B, PREFETCH_PART, handle)
                    _pool_slots(physical[:B], self._row_base, locs[:B], padding[:B])
                    self._done[(index, self.position[follower])].record(self.stream)
            dev.launch(prefetch)
        _keep(top_k_result, self.stream)
        for follower in followers:
            self._issued[(follower, key)] = (index, B)
        self.in_flight = True

    def take(self, follower: int, key, B: int, shape):
        """The follower's SGLang slots for this batch once its prefetched step is done (the current stream waits for
        it), or None when its leader started none for this batch in this forward (the follower then swaps itself)."""
        issued = self._issued.pop((follower, key), None)
        if issued is None or issued[1] != B:
            return None
        index = issued[0]
        position = self.position[follower]
        self._done[(index, position)].wait(self.dev.current_stream())
        self.in_flight = bool(self._issued)
        self.prefetched += 1
        return self._out[(index, position)][1][:B].view(shape)

    def order_before(self) -> None:
        """The current stream waits for every prefetch issued so far (before a step on the prefetch's scratch set, or
        on a layer the prefetch may be stepping)."""
        if self.in_flight:
            self.dev.current_stream().wait_stream(self.stream)
            self.in_flight = False
