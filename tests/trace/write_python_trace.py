#!/usr/bin/python3
"""Writes a small trace with python/ess_trace.py plus a raw sidecar of the same values, for the
Python-writes / C++-reads round-trip test. usage: write_python_trace.py REPO_ROOT OUT_TRACE OUT_RAW"""
import sys

sys.path.insert(0, sys.argv[1] + "/python")
import numpy as np  # noqa: E402

import ess_trace  # noqa: E402

rng = np.random.default_rng(1234)
layers, mtp, topk = 3, 2, 16
w = ess_trace.TraceWriter(model="test-model", layers=layers, mtp=mtp, topk=topk,
                          provenance="tests/trace/write_python_trace.py", synthetic=True, note="round trip")
raw = []
for i, (steps, length, windows) in enumerate([(5, 100, 4), (3, 40, 0), (7, 1000, 2)]):
    ids = np.full((steps, layers, mtp, topk), -1, dtype=np.int32)
    for s in range(steps):
        for l in range(layers):
            for t in range(mtp):
                n = topk - (s + l + t) % 3  # some padding
                ids[s, l, t, :n] = rng.choice(length + s, size=n, replace=False)
    lengths = np.arange(steps, dtype=np.int64) + length
    pf = None
    if windows:
        pf = np.stack([np.stack([rng.choice(length, size=topk, replace=False) for _ in range(windows)])
                       for _ in range(layers)]).astype(np.int32)
    w.add_request(topk=ids, lengths=lengths, prefill_topk=pf, context=length - 2, id=f"py-{i}")
    raw += [ids.ravel().astype("<i8"), lengths.astype("<i8")]
    if pf is not None:
        raw.append(pf.ravel().astype("<i8"))
w.write(sys.argv[2])
np.concatenate(raw).astype("<i8").tofile(sys.argv[3])
md, reqs = ess_trace.read_trace(sys.argv[2])  # the Python reader agrees with itself
assert md["ess.synthetic"] == "true" and len(reqs) == 3 and reqs[2]["topk"].shape == (7, layers, mtp, topk)
