#!/usr/bin/env python3
"""An engine-like decode loop through ESS's Python API, on a synthetic top-k trace (CPU or CUDA backend).

Each step every request grows by T tokens (MTP); the model writes their latent entries into
ESS's reserved rows; per layer the "indexer" picks K ids per query token (mostly last step's,
some new, often the newest: temporal locality as in the ESS paper), ESS's step turns them into
rows of the layer buffer (fetching the misses from the Total Memory Pool), and sparse MLA-style
attention runs over those rows. The same attention over the full cache (every entry, addressed
by logical id) must give the same bits. Prints hits and misses per layer.

    /usr/bin/python3 examples/engine_loop.py                    # a table
    /usr/bin/python3 examples/engine_loop.py --format json      # {"bitwise_equal": ..., "hits": ..., ...}
    python3 examples/engine_loop.py --backend cuda               # ESS's CUDA backend, torch CUDA tensors

With --backend cuda the step's tensors are torch CUDA tensors, the layer buffers ESS's device
memory (seen by torch through __cuda_array_interface__), the step and the write-back run on
torch's current stream, and attention reads the rows the step named back to the host.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import ess  # noqa: E402

ENTRY, NOPE, SCALES, ROPE = 656, 512, 4, 64  # DeepSeek-V3.2's FP8 latent entry: 512 e4m3, 4 fp32 scales, 64 bf16


def e4m3_table() -> np.ndarray:
    """float32 value of every FP8 e4m3fn byte."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, mant = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, mant / 8.0 * 2.0 ** -6, (1 + mant / 8.0) * 2.0 ** (exp - 7.0))
    value[(b & 0x7F) == 0x7F] = np.nan
    return (sign * value).astype(np.float32)


E4M3 = e4m3_table()


def random_entries(rng, n) -> np.ndarray:
    """n valid entries (no NaN codes): the bytes a model would write."""
    out = np.empty((n, ENTRY), np.uint8)
    nope = rng.integers(0, 0x7F, (n, NOPE), dtype=np.uint8) | (rng.integers(0, 2, (n, NOPE), dtype=np.uint8) << 7)
    out[:, :NOPE] = nope
    out[:, NOPE:NOPE + 4 * SCALES] = rng.uniform(0.01, 1.0, (n, SCALES)).astype(np.float32).view(np.uint8)
    rope = (rng.standard_normal((n, ROPE)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    out[:, NOPE + 4 * SCALES:] = rope.view(np.uint8)
    return out


def dequantize(entries: np.ndarray) -> np.ndarray:
    """[n, 656] bytes -> [n, 576] float32 (512 scaled e4m3, then 64 bf16)."""
    n = entries.shape[0]
    nope = E4M3[entries[:, :NOPE]].reshape(n, SCALES, NOPE // SCALES)
    scales = entries[:, NOPE:NOPE + 4 * SCALES].copy().view(np.float32).reshape(n, SCALES, 1)
    rope = (entries[:, NOPE + 4 * SCALES:].copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.concatenate([(nope * scales).reshape(n, NOPE), rope], axis=1)


def attention(q: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """Sparse MLA-style decode of one query token: q [H, 576] over the selected entries -> [H, 512]."""
    kv = dequantize(entries)
    s = (q @ kv.T) * np.float32(576 ** -0.5)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return p @ kv[:, :NOPE]


class _DeviceBytes:
    """A device buffer ESS allocated, for torch.as_tensor (zero-copy)."""

    def __init__(self, pointer: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (pointer, False), "version": 3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--mtp", type=int, default=2, help="T: query tokens per request per step")
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--ratio", type=float, default=0.2, help="Sparse Memory Ratio of the longest context")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=["table", "json"], default="table")
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    a = ap.parse_args()
    for name in ("requests", "layers", "context", "steps", "mtp", "topk", "heads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} = {getattr(a, name)} must be >= 1")
    if a.seed < 0:
        ap.error(f"--seed = {a.seed} must be >= 0")

    t0 = time.perf_counter()
    rng = np.random.default_rng(a.seed)
    B, L, T, K = a.requests, a.layers, a.mtp, a.topk
    max_context = a.context + a.steps * T
    cuda = a.backend == "cuda"
    if cuda:
        import torch  # the CUDA backend's tensors
        if not torch.cuda.is_available():
            print("engine_loop: --backend cuda needs a CUDA device that torch sees", file=sys.stderr)
            return 2
    engine = ess.Engine(layers=L, max_requests=B, max_context=max_context, query_tokens=T, topk=K,
                        ratio=a.ratio, reserve_newest=True, backend=a.backend)
    info = engine.info
    # The full cache: what attention reads with everything on the GPU.
    full = [[random_entries(rng, max_context) for _ in range(L)] for _ in range(B)]
    layer_buffers = []
    for layer in range(L):  # ESS's layer buffers, as the engine hands them to attention
        base = engine.layer_data(layer)
        size = B * info.rows_per_request * info.row_stride
        if cuda:
            layer_buffers.append(torch.as_tensor(_DeviceBytes(base, size), device="cuda")
                                 .view(-1, info.row_stride)[:, :ENTRY])
        else:
            layer_buffers.append(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * size).from_address(base))
                                 .reshape(-1, info.row_stride)[:, :ENTRY])
    rows = np.empty(B, np.int32)
    lengths = np.empty(B, np.int32)
    for r in range(B):
        rows[r] = engine.admit(r, a.context)
        lengths[r] = a.context
        for layer in range(L):
            engine.write_entries(r, layer, 0, full[r][layer][: a.context])
    # LRU-Warmup from the prefill's last query positions: their top-k is the first decode selection's seed.
    selection = {(r, layer): rng.choice(a.context, K, replace=False) for r in range(B) for layer in range(L)}
    for r in range(B):
        windows = np.stack([np.stack([selection[(r, layer)]] * 4) for layer in range(L)]).astype(np.int32)
        engine.warmup(r, windows)
    topk = np.empty((B, T, K), np.int32)
    physical = np.empty((B, T, K), np.int32)
    counts = np.empty((B, 2), np.int32)
    if cuda:  # the step's tensors on the device; the loop fills the host arrays and copies them over
        d = {name: torch.from_numpy(v).cuda() for name, v in
             (("rows", rows), ("lengths", lengths), ("topk", topk), ("physical", physical), ("counts", counts))}
        stream = torch.cuda.current_stream()
        step = engine.bind_step(d["rows"], d["topk"], d["lengths"], d["physical"], counts=d["counts"])
        write_back = engine.bind_write_back(d["rows"], d["lengths"])
    else:
        stream = None
        step = engine.bind_step(rows, topk, lengths, physical, counts=counts)
        write_back = engine.bind_write_back(rows, lengths)
    hits, misses = np.zeros(L, np.int64), np.zeros(L, np.int64)
    equal = True
    compared = 0
    for s in range(a.steps):
        if s > 0:
            for layer in range(L):
                write_back.write_back(layer, stream=stream)  # last step's new entries to the host pool
            if cuda:
                stream.synchronize()  # the host lengths change next
        for r in range(B):
            engine.extend(r, T)
            lengths[r] += T
        if cuda:
            d["lengths"].copy_(torch.from_numpy(lengths))
        for r in range(B):
            n = int(lengths[r])
            for layer in range(L):
                for t in range(T):  # the model writes the step's new entries into the reserved rows
                    entry = full[r][layer][n - T + t]
                    layer_buffers[layer][info.reserved_row(int(rows[r]), t)] = torch.from_numpy(entry).cuda() if cuda \
                        else entry
        for layer in range(L):
            for r in range(B):
                n = int(lengths[r])
                prev = selection[(r, layer)]
                for t in range(T):
                    keep = prev[rng.random(K) < 0.85]
                    fresh = rng.choice(n, K, replace=False)
                    newest = np.arange(n - T, n)
                    candidates = np.concatenate([newest, rng.permutation(keep), fresh])
                    _, first = np.unique(candidates, return_index=True)
                    topk[r, t] = rng.permutation(candidates[np.sort(first)][:K])
                selection[(r, layer)] = topk[r, 0].copy()
            if cuda:
                d["topk"].copy_(torch.from_numpy(topk))
                step.step(layer, stream=stream)
                physical[...] = d["physical"].cpu().numpy()
                counts[...] = d["counts"].cpu().numpy()
                rows_read = layer_buffers[layer].cpu().numpy()  # attention's view of the layer's rows
            else:
                step.step(layer)
                rows_read = layer_buffers[layer]
            hits[layer] += counts[:, 0].sum()
            misses[layer] += counts[:, 1].sum()
            for r in range(B):
                for t in range(T):
                    q = rng.standard_normal((a.heads, 576)).astype(np.float32)
                    offloaded = attention(q, rows_read[physical[r, t]])
                    resident = attention(q, full[r][layer][topk[r, t]])
                    equal = equal and np.array_equal(offloaded.view(np.uint32), resident.view(np.uint32))
                    compared += 1
    stats = engine.stats()
    wall = time.perf_counter() - t0
    result = {
        "bitwise_equal": bool(equal), "attention_calls_compared": compared,
        "hits": int(hits.sum()), "misses": int(misses.sum()),
        "per_layer": [{"layer": l, "hits": int(hits[l]), "misses": int(misses[l])} for l in range(L)],
        "requests": B, "layers": L, "context": a.context, "steps": a.steps, "mtp": T, "topk": K,
        "slots": info.slots, "ratio": a.ratio, "host_bytes_used": stats.host_bytes_used,
        "backend": info.backend, "library": ess.library_path, "wall_s": round(wall, 3),
    }
    if a.format == "json":
        print(json.dumps(result, indent=2))
    else:
        print(f"ESS {ess.__version__} ({info.backend} backend): {B} requests x {L} layers, context {a.context}, "
              f"{a.steps} steps, T {T}, top-{K}, {info.slots} slots (ratio {a.ratio})")
        print(f"{'layer':>5} {'hits':>8} {'misses':>8} {'miss %':>7}")
        for l in range(L):
            total = hits[l] + misses[l]
            print(f"{l:>5} {hits[l]:>8} {misses[l]:>8} {100 * misses[l] / max(1, total):>6.1f}%")
        print(f"attention over ESS's rows vs over the full cache: {compared} calls, "
              f"{'bit-identical' if equal else 'DIFFERENT'}; wall {wall:.2f} s")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
