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
import os
import struct
import tempfile

import numpy as np

FORMAT = "ess-topk-trace"
VERSION = 1          # a trace of tokens; one of units (unit_tokens > 1) is version 2


INT32_MAX = 2**31 - 1


def _int_array(values, what: str, dtype: str, lo: int, hi: int):
    """values as a contiguous array of `dtype`: integers only (a float, NaN or bool is refused, not
    truncated), each in [lo, hi] (refused, never wrapped)."""
    try:
        a = np.asarray(values)
    except ValueError:   # nested lists of different lengths: numpy names no value
        raise ValueError(f"{what}: a ragged nested sequence (rows of different lengths); a rectangular array "
                         "is expected") from None
    if a.dtype.kind not in "iu":
        raise ValueError(f"{what}: dtype {a.dtype} is not an integer type (ids and lengths are integers)")
    if a.size:
        mn, mx = int(a.min()), int(a.max())
        if mn < lo or mx > hi:
            bad = mn if mn < lo else mx
            where = np.argwhere(a == bad)[0].tolist()
            raise ValueError(f"{what}: value {bad} at {where} is outside [{lo}, {hi}]")
    return np.ascontiguousarray(a, dtype=dtype)


def _check_rows(rows, lengths, what: str, unit: str, unit_tokens: int = 1):
    """rows [n, queries, K]: each id in [0, ceil(lengths[n] / unit_tokens)) or -1 (padding), none twice in a
    query."""
    for n in range(rows.shape[0]):
        r = rows[n]
        length = -(-int(lengths[n]) // unit_tokens)
        if (r >= length).any():
            q, k = np.argwhere(r >= length)[0].tolist()
            of = f" (ids of {unit_tokens} tokens over a length of {int(lengths[n])})" if unit_tokens > 1 else ""
            raise ValueError(f"{what}: {unit} {n}, query {q}, position {k}: id {int(r[q, k])} is outside "
                             f"[0, {length}){of}")
        s = np.sort(r, axis=1)
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        if dup.any():
            q, k = np.argwhere(dup)[0].tolist()
            raise ValueError(f"{what}: {unit} {n}, query {q}: id {int(s[q, k])} is selected twice")


# The longest context of the models ESS ships, by the names a trace gives in ess.model (as the
# C++ reader's model_max_length): a longer request of such a model is refused.
_MODEL_MAX_LENGTH = {"deepseek-v3.2-exp": 163840, "deepseek-ai/deepseek-v3.2-exp": 163840, "deepseek_v32": 163840}


class TraceWriter:
    def __init__(self, *, model: str, layers: int, mtp: int, topk: int, provenance: str, synthetic: bool,
                 note: str = "", extra: dict | None = None, unit_tokens: int = 1):
        """unit_tokens: the tokens an id names (1: a token; 4: DeepSeek-V4's C4 entries); lengths and contexts
        stay tokens, a step of length L selecting among ceil(L / unit_tokens) ids."""
        for name, v in (("layers", layers), ("mtp", mtp), ("topk", topk), ("unit_tokens", unit_tokens)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= 1 << 16:
                raise ValueError(f"{name} {v!r} must be an integer in [1, 65536]")
        self.model, self.layers, self.mtp, self.topk = model, layers, mtp, topk
        self.unit_tokens = int(unit_tokens)
        self.provenance, self.synthetic, self.note = provenance, synthetic, note
        self.extra = dict(extra or {})
        self.requests = []

    def add_request(self, *, topk, lengths, prefill_topk=None, context: int | None = None, id: str | None = None,
                    prefix_group: str | None = None, prefix_tokens: int = 0):
        """Checks the request as the C++ reader will (ValueError naming the request, the tensor and
        the value) and keeps it; a refused request leaves the writer as it was."""
        i = len(self.requests)
        ids = _int_array(topk, f"request {i}: topk", "<i4", -1, INT32_MAX)
        lengths = _int_array(lengths, f"request {i}: lengths", "<i8", 1, INT32_MAX)
        if ids.ndim != 4 or ids.shape[1:] != (self.layers, self.mtp, self.topk):
            raise ValueError(f"request {i}: topk shape {ids.shape} is not [steps, {self.layers}, {self.mtp}, {self.topk}]")
        if ids.shape[0] < 1:
            raise ValueError(f"request {i}: topk has no step; a request needs at least one")
        if lengths.shape != (ids.shape[0],):
            raise ValueError(f"request {i}: lengths shape {lengths.shape} is not [{ids.shape[0]}]")
        _check_rows(ids.reshape(ids.shape[0], -1, self.topk), lengths, f"request {i}: topk", "step", self.unit_tokens)
        pf = None
        if prefill_topk is not None:
            pf = _int_array(prefill_topk, f"request {i}: prefill_topk", "<i4", -1, INT32_MAX)
            if pf.ndim != 3 or pf.shape[0] != self.layers or pf.shape[2] != self.topk or not 1 <= pf.shape[1] <= 1 << 16:
                raise ValueError(f"request {i}: prefill_topk shape {pf.shape} is not [{self.layers}, windows in "
                                 f"[1, 65536], {self.topk}]")
            rows = pf.reshape(1, -1, self.topk)
            _check_rows(rows, lengths[:1], f"request {i}: prefill_topk", "prompt", self.unit_tokens)
        if context is not None:
            if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or not 1 <= context <= INT32_MAX:
                raise ValueError(f"request {i}: context {context!r} must be an integer in [1, 2^31-1]")
            context = int(context)
            if context > int(lengths[0]):
                raise ValueError(f"request {i}: context {context} exceeds the length {int(lengths[0])} of its first "
                                 "step (the prompt is part of every step's context)")
        most = _MODEL_MAX_LENGTH.get(str(self.model).lower())
        if most is not None and int(lengths.max()) > most:
            s = int(np.argmax(lengths))
            raise ValueError(f"request {i}: lengths, step {s}: length {int(lengths[s])} exceeds the "
                             f"max_position_embeddings ({most}) of the model '{self.model}'")
        # Requests of one prefix group share their first prefix_tokens prompt tokens.
        base = context if context is not None else int(lengths[0])
        if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, (int, np.integer)) or not 0 <= prefix_tokens <= base:
            raise ValueError(f"request {i}: prefix_tokens {prefix_tokens!r} must be an integer in [0, its context {base}]")
        if prefix_group is None and prefix_tokens:
            raise ValueError(f"request {i}: prefix_tokens {prefix_tokens} without a prefix_group")
        if prefix_group is not None and (not isinstance(prefix_group, str) or not prefix_group):
            raise ValueError(f"request {i}: prefix_group {prefix_group!r} must be a non-empty string")
        self.requests.append((ids, lengths, pf, context, id, prefix_group, int(prefix_tokens)))

    def write(self, path: str):
        md = {k: str(v) for k, v in self.extra.items()}
        md.update({
            "ess.format": FORMAT, "ess.version": str(VERSION if self.unit_tokens == 1 else 2),
            "ess.requests": str(len(self.requests)),
            "ess.layers": str(self.layers), "ess.mtp": str(self.mtp), "ess.topk": str(self.topk),
            "ess.model": self.model, "ess.provenance": self.provenance,
            "ess.synthetic": "true" if self.synthetic else "false",
        })
        if self.note:
            md["ess.note"] = self.note
        if self.unit_tokens != 1:
            md["ess.unit_tokens"] = str(self.unit_tokens)
        header, blobs, off = {}, [], 0

        def add(name, arr, dtype):
            nonlocal off
            b = arr.tobytes()
            header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
            blobs.append(b)
            off += len(b)

        for i, (ids, lengths, pf, context, rid, group, shared) in enumerate(self.requests):
            p = f"requests.{i}."
            md[p + "id"] = str(i if rid is None else rid)
            if context is not None:
                md[p + "context"] = str(int(context))
            if group is not None:
                md[p + "prefix_group"] = group
                md[p + "prefix_tokens"] = str(shared)
            add(p + "topk", ids, "I32")
            add(p + "lengths", lengths, "I64")
            if pf is not None:
                add(p + "prefill_topk", pf, "I32")
        header["__metadata__"] = md
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * ((8 - (8 + len(text)) % 8) % 8)  # 8-aligned data section
        if not self.requests:
            raise ValueError(f"{path}: a trace needs at least one request")
        # Beside the target, renamed into place when complete: a failed write leaves it as it was.
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".tmp.", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(struct.pack("<Q", len(text)))
                f.write(text)
                for b in blobs:
                    f.write(b)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
