#!/usr/bin/env python3
"""Which order LRU gives the entries one step touched, measured on a top-k trace: when a later step evicts some of
them, ESS's order (ascending slot: the CPU policy, the GPU swap kernel and the tests' model agree on it) takes
them by slot, SGLang's HiSparse kernel takes the step's misses first, and the third order its hits first. Strict
LRU holds under all three; only the misses differ. Prints each order's misses per request-layer-step at each pool
size (the Sparse Memory Ratio of the context), the newest T tokens in reserved rows as ESS and HiSparse keep them.

    ess trace gen -o t.safetensors --context 32768 --requests 4 --steps 256 --layers 8
    scripts/lru_tie_rule.py t.safetensors --ratio 0.1 0.2 0.3

A synthetic trace (ess trace gen) is a locality model, not a model's selections: its result says how much the
order can matter, not which order a real model prefers."""
from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import ess_trace  # noqa: E402

ORDERS = ("slot", "misses-first", "hits-first")


class Lru:
    """One request-layer's pool under one tie order: an OrderedDict from token to slot, oldest first."""

    def __init__(self, slots: int, order: str):
        self.order = order
        self.free = list(range(slots - 1, -1, -1))
        self.lru = OrderedDict()   # token -> slot

    def step(self, working):
        """working: the step's distinct ids, in first-seen order. Returns its misses."""
        hits = [t for t in working if t in self.lru]
        misses = [t for t in working if t not in self.lru]
        slot_of = {t: self.lru.pop(t) for t in hits}   # a step's own hits are never its victims
        for t in misses:
            if self.free:
                slot_of[t] = self.free.pop()
            else:
                _, slot_of[t] = self.lru.popitem(last=False)
        if self.order == "slot":
            ranked = sorted(working, key=slot_of.__getitem__)
        elif self.order == "misses-first":
            ranked = misses + hits
        else:
            ranked = hits + misses
        for t in ranked:
            self.lru[t] = slot_of[t]
        return len(misses)


def measure(path, ratios, layers_limit):
    meta, requests = ess_trace.read_trace(path)
    T = int(meta["ess.mtp"])
    totals = {(r, o): 0 for r in ratios for o in ORDERS}
    steps = 0
    for req in requests:
        topk, lengths = req["topk"], req["lengths"]
        context = int(lengths[0]) - 1
        layers = min(topk.shape[1], layers_limit)
        for ratio in ratios:
            slots = max(int(ratio * context), T * topk.shape[3])
            for layer in range(layers):
                pools = {o: Lru(slots, o) for o in ORDERS}
                for s in range(topk.shape[0]):
                    newest = int(lengths[s]) - T
                    seen, working = set(), []
                    for q in range(T):
                        for t in topk[s, layer, q].tolist():
                            if 0 <= t < newest and t not in seen:
                                seen.add(t)
                                working.append(t)
                    for o in ORDERS:
                        totals[(ratio, o)] += pools[o].step(working)
        steps += topk.shape[0] * min(topk.shape[1], layers_limit)
    return totals, steps


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--ratio", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    p.add_argument("--layers", type=int, default=8, help="the first N layers of each request (default 8)")
    a = p.parse_args()
    for r in a.ratio:
        if not 0 < r <= 1:
            p.error(f"--ratio {r}: a fraction of the context in (0, 1] is expected")
    totals, steps = measure(a.trace, a.ratio, a.layers)
    print(f"{'ratio':>6}  " + "  ".join(f"{o:>14}" for o in ORDERS) + "   misses per request-layer-step; vs slot")
    for r in a.ratio:
        base = totals[(r, "slot")]
        cells = "  ".join(f"{totals[(r, o)] / steps:14.2f}" for o in ORDERS)
        rel = "  ".join(f"{o} {100 * (totals[(r, o)] - base) / base:+.2f} %" for o in ORDERS[1:]) if base else ""
        print(f"{r:6.2f}  {cells}   {rel}")


if __name__ == "__main__":
    main()
