#!/usr/bin/env python3
"""Python's cost per layer call of the bound step, above the C call (CPU backend).

Timings of the same call, each the median of --repeats runs of --calls calls:
  ctypes:   ess_step as a C loop would see it is not reachable from Python, so the floors are the
            raw ctypes calls: with argtypes declared (ctypes converts every argument), and without
            (the package's per-layer path: it checks the arguments itself and passes the handle as
            a c_void_p);
  wrapper:  StepBinding.step(layer, batch) of the package;
with batch 0 (the library validates and returns: the C work is nearly nil) and with a real step
(B 8, T 2, K 64, all hits). wrapper - unchecked ctypes is the package's own overhead; wrapper at
batch 0 is the whole Python-side cost of one call.

    ESS_LIBRARY=build/release/src/capi/libess.so /usr/bin/python3 bench/python_overhead.py --format json
"""
import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import ess  # noqa: E402
from ess._lib import lib, unchecked  # noqa: E402


def per_call(fn, calls, repeats):
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - t0) / calls / 1000.0)
    return {"median_us": statistics.median(samples), "min_us": min(samples), "max_us": max(samples)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--format", choices=["table", "json"], default="table")
    a = ap.parse_args()
    B, T, K = 8, 2, 64
    e = ess.Engine(layers=1, max_requests=B, max_context=4096, query_tokens=T, topk=K, slots=256)
    rows = np.array([e.admit(i, 4096) for i in range(B)], np.int32)
    lengths = np.full(B, 4096, np.int32)
    topk = np.tile(np.arange(T * K, dtype=np.int32).reshape(1, T, K), (B, 1, 1))
    physical = np.empty_like(topk)
    b = e.bind_step(rows, topk, lengths, physical)
    b.step(0)  # every id resident from here: each later step is all hits
    handle, raw, bare = b._handle, lib.ess_step, unchecked.ess_step
    c_handle = ctypes.c_void_p(handle)
    out = {"device": "host CPU (CPU backend)", "calls": a.calls, "repeats": a.repeats, "shape": [B, T, K]}
    out["ctypes_batch0"] = per_call(lambda: raw(handle, 0, 0, None), a.calls, a.repeats)
    out["ctypes_unchecked_batch0"] = per_call(lambda: bare(c_handle, 0, 0, None), a.calls, a.repeats)
    out["wrapper_batch0"] = per_call(lambda: b.step(0, 0), a.calls, a.repeats)
    steps = max(1, a.calls // 20)
    out["ctypes_step"] = per_call(lambda: raw(handle, 0, -1, None), steps, a.repeats)
    out["wrapper_step"] = per_call(lambda: b.step(0), steps, a.repeats)
    out["wrapper_overhead_us"] = out["wrapper_batch0"]["median_us"] - out["ctypes_unchecked_batch0"]["median_us"]
    if a.format == "json":
        print(json.dumps(out, indent=2))
    else:
        for k in ("ctypes_batch0", "ctypes_unchecked_batch0", "wrapper_batch0", "ctypes_step", "wrapper_step"):
            v = out[k]
            print(f"{k:>23}: {v['median_us']:8.3f} us/call (min {v['min_us']:.3f}, max {v['max_us']:.3f})")
        print(f"package overhead above the unchecked ctypes call: {out['wrapper_overhead_us']:.3f} us")


if __name__ == "__main__":
    main()
