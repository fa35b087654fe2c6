#!/usr/bin/env python3
"""Writes the structural cases of the trace format into a folder: small traces whose container
or metadata is wrong in one way each (bytes after the last tensor, a hole, overlapping and
aliased tensors, a tensor named twice, a context larger than the first length, a length past the
model's maximum, ...), and the valid trace they are made from (`structure-valid`). Kept in
tests/trace/fuzz/corpus/ as seeds of the fuzzer and read by safetensors_crosscheck.py.

    make_structure_cases.py tests/trace/fuzz/corpus
"""
import json
import struct
import sys
from pathlib import Path


def metadata(model="seed", context=11):
    return {"ess.format": "ess-topk-trace", "ess.version": "1", "ess.requests": "1", "ess.layers": "1",
            "ess.mtp": "1", "ess.topk": "2", "ess.model": model, "ess.provenance": "structure case",
            "ess.synthetic": "true", "requests.0.context": str(context)}


def image(header, data, text=None):
    text = (json.dumps(header) if text is None else text).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def valid(lengths=(11, 12), md=None):
    ids = struct.pack("<4i", 1, 3, 2, 5)
    lens = struct.pack(f"<{len(lengths)}q", *lengths)
    header = {"__metadata__": md or metadata(),
              "requests.0.topk": {"dtype": "I32", "shape": [2, 1, 1, 2], "data_offsets": [0, 16]},
              "requests.0.lengths": {"dtype": "I64", "shape": [2], "data_offsets": [16, 32]}}
    return header, ids + lens


def cases():
    h, d = valid()
    yield "structure-valid", image(h, d)
    yield "structure-trailing-bytes", image(h, d + b"\0" * 8)
    h, d = valid()
    h["requests.0.lengths"]["data_offsets"] = [24, 40]
    yield "structure-hole", image(h, d[:16] + b"\0" * 8 + d[16:])
    h, d = valid()
    h["requests.0.topk"]["data_offsets"] = [8, 24]
    h["requests.0.lengths"]["data_offsets"] = [24, 40]
    yield "structure-hole-at-start", image(h, b"\0" * 8 + d)
    h, d = valid()
    h["alias"] = {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}
    yield "structure-alias", image(h, d)
    h, d = valid()
    h["overlap"] = {"dtype": "I64", "shape": [2], "data_offsets": [8, 24]}
    yield "structure-overlap", image(h, d)
    h, d = valid()
    text = json.dumps(h)
    twice = '"requests.0.topk": {"dtype": "I32", "shape": [2, 1, 1, 2], "data_offsets": [0, 16]}, '
    yield "structure-tensor-named-twice", image(None, d + b"\0" * 16, text.replace('"requests.0.topk"', twice + '"requests.0.topk"', 1).replace("[0, 16]}, \"requests.0.topk\"", "[32, 48]}, \"requests.0.topk\"", 1))
    h, d = valid()
    h["requests.0.topk"]["data_offsets"] = [16, 0]
    yield "structure-reversed-offsets", image(h, d)
    h, d = valid()
    h["requests.0.topk"]["shape"] = [2, 1, 1, 3]
    yield "structure-shape-vs-bytes", image(h, d)
    h, d = valid()
    h["requests.0.topk"]["dtype"] = "I16"
    yield "structure-dtype-vs-bytes", image(h, d)
    h, d = valid()
    yield "structure-header-past-end", struct.pack("<Q", 10**6) + image(h, d)[8:]
    h, d = valid(md=metadata(context=12))
    yield "structure-context-over-length", image(h, d)
    h, d = valid(lengths=(163840, 163841), md=metadata(model="deepseek-v3.2-exp", context=163840))
    yield "structure-length-over-model", image(h, d)


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, data in cases():
        (out / name).write_bytes(data)


if __name__ == "__main__":
    main()
