"""Write and read ESS top-k traces (docs/trace-format.md) with numpy alone.

The format is safetensors: an 8-byte little-endian header length, a JSON header, raw
little-endian tensors. Files written here can also be read with the `safetensors` package
(`safetensors.numpy.load_file`), and files written with `safetensors.numpy.save_file` are valid
traces when they carry the tensors and metadata below.

Recording from a deployment (see docs/trace-format.md for where the indexer's top-k is):

    w = TraceWriter(model="deepseek-v3.2-exp", layers=61, mtp=2, topk=2048,
                    provenance="sglang 0.5.x, LongBench v2, H200 decode node", synthetic=False)
    w.add_request(topk=ids,          # int32 [steps, layers, mtp, topk], -1 = padding
                  lengths=lengths,   # int64 [steps]: tokens visible to the step's last query token
                  prefill_topk=pf,   # optional int32 [layers, windows, topk]: last prefill positions
                  context=prompt_len, id="req-17")
    w.write("trace.safetensors")
"""
from __future__ import annotations

import json
import struct

import numpy as np

FORMAT = "ess-topk-trace"
VERSION = 1


class TraceWriter:
    def __init__(self, *, model: str, layers: int, mtp: int, topk: int, provenance: str, synthetic: bool,
                 note: str = "", extra: dict | None = None):
        if layers < 1 or mtp < 1 or topk < 1:
            raise ValueError(f"layers {layers}, mtp {mtp}, topk {topk} must be positive")
        self.model, self.layers, self.mtp, self.topk = model, layers, mtp, topk
        self.provenance, self.synthetic, self.note = provenance, synthetic, note
        self.extra = dict(extra or {})
        self.requests = []

    def add_request(self, *, topk, lengths, prefill_topk=None, context: int | None = None, id: str | None = None):
        ids = np.ascontiguousarray(topk, dtype="<i4")
        lengths = np.ascontiguousarray(lengths, dtype="<i8")
        i = len(self.requests)
        if ids.ndim != 4 or ids.shape[1:] != (self.layers, self.mtp, self.topk):
            raise ValueError(f"request {i}: topk shape {ids.shape} is not [steps, {self.layers}, {self.mtp}, {self.topk}]")
        if lengths.shape != (ids.shape[0],):
            raise ValueError(f"request {i}: lengths shape {lengths.shape} is not [{ids.shape[0]}]")
        pf = None
        if prefill_topk is not None:
            pf = np.ascontiguousarray(prefill_topk, dtype="<i4")
            if pf.ndim != 3 or pf.shape[0] != self.layers or pf.shape[2] != self.topk:
                raise ValueError(f"request {i}: prefill_topk shape {pf.shape} is not [{self.layers}, windows, {self.topk}]")
        self.requests.append((ids, lengths, pf, context, id))

    def write(self, path: str):
        md = {k: str(v) for k, v in self.extra.items()}
        md.update({
            "ess.format": FORMAT, "ess.version": str(VERSION), "ess.requests": str(len(self.requests)),
            "ess.layers": str(self.layers), "ess.mtp": str(self.mtp), "ess.topk": str(self.topk),
            "ess.model": self.model, "ess.provenance": self.provenance,
            "ess.synthetic": "true" if self.synthetic else "false",
        })
        if self.note:
            md["ess.note"] = self.note
        header, blobs, off = {}, [], 0

        def add(name, arr, dtype):
            nonlocal off
            b = arr.tobytes()
            header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
            blobs.append(b)
            off += len(b)

        for i, (ids, lengths, pf, context, rid) in enumerate(self.requests):
            p = f"requests.{i}."
            md[p + "id"] = str(i if rid is None else rid)
            if context is not None:
                md[p + "context"] = str(int(context))
            add(p + "topk", ids, "I32")
            add(p + "lengths", lengths, "I64")
            if pf is not None:
                add(p + "prefill_topk", pf, "I32")
        header["__metadata__"] = md
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * ((8 - (8 + len(text)) % 8) % 8)  # 8-aligned data section
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for b in blobs:
                f.write(b)


def read_trace(path: str):
    """Returns (metadata dict, list of per-request dicts of numpy arrays), memory-mapped."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    md = header.pop("__metadata__", {})
    if md.get("ess.format") != FORMAT:
        raise ValueError(f"{path}: not an ESS top-k trace (ess.format = {md.get('ess.format')!r})")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    dtypes = {"I32": "<i4", "I64": "<i8"}
    out = []
    for i in range(int(md["ess.requests"])):
        req = {"id": md.get(f"requests.{i}.id", str(i))}
        for t in ("topk", "lengths", "prefill_topk"):
            e = header.get(f"requests.{i}.{t}")
            if e is None:
                continue
            b, end = e["data_offsets"]
            req[t] = data[b:end].view(dtypes[e["dtype"]]).reshape(e["shape"])
        out.append(req)
    return md, out
