"""The per-layer step and its request lifecycle (ess_c.h's engine) for Python engines."""
from __future__ import annotations

import ctypes
import functools
import json
import threading
import weakref
from dataclasses import dataclass
from os import PathLike
from typing import Mapping, NamedTuple, Optional, Sequence, Union

from . import _args, _dlpack
from ._args import i32 as _i32, i64 as _i64
from ._errors import InvalidArgument, InvalidType, check
from ._lib import Config, EngineInfo, HostLayout as _HostLayout, StepTensors, Stats as _Stats, lib, unchecked

_BACKENDS = {"cpu": 0, "cuda": 1}
_POLICIES = {"lru": 0}
_RESIDENCIES = {"sparse": 0, "whole": 1, "adaptive": 2}


def stream_handle(stream) -> Optional[int]:
    """A cudaStream_t as an integer: an int, a torch.cuda.Stream (.cuda_stream), a CuPy stream (.ptr) or None."""
    return _args.handle("stream", stream)


def _locked(method):
    """Runs the method under the engine's lock: calls from several threads run one at a time, each whole."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return call


class ForeignPages(NamedTuple):
    """Another engine's host block pool as ESS's host pool (Engine's foreign_pages): page g (64 entries) of layer
    l at host_memory + (layer_first_page[l] + g) x page_stride bytes."""
    pages_per_layer: int
    page_stride: int
    layer_first_page: Sequence[int]


def _integers(name: str, values, bounds) -> list:
    """A sequence of integers (a list, tuple, or an integer array or tensor with tolist()) as Python ints, each
    checked against the C type's range."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidType(f"{name}: a sequence of integers is expected, not {type(values).__name__}")
    return [_args.integer(f"{name}[{i}]", v, *bounds) for i, v in enumerate(values)]


@dataclass(frozen=True)
class Info:
    layers: int
    max_requests: int
    max_context: int
    query_tokens: int
    topk: int
    slots: int
    rows_per_request: int
    reserve_newest: bool
    backend: str
    device: int
    entry_bytes: int
    row_stride: int
    block_rows: int
    block_stride: int
    host_bytes_capacity: int
    split_bytes: int = 0       # a buffer in two parts (latent_tail): a row's head bytes, its tail bytes,
    tail_bytes: int = 0        # and where row p's tail lives from its layer's tail tensor
    tail_row_stride: int = 0
    tail_block_rows: int = 0
    tail_block_stride: int = 0
    region_blocks: int = 0     # regions: a request's rows in this many blocks of `latent` (Engine.place)

    def reserved_row(self, row: int, t: int = 0) -> int:
        """The physical row holding the t-th of a step's T newest tokens of pool row `row` (reserve_newest). With
        regions a row's rows are where Engine.place put them: Engine.buffer_row(row, slots + t)."""
        if self.region_blocks:
            raise InvalidArgument("reserved_row: the engine has regions; its rows are Engine.buffer_row(row, slots + t)")
        return row * self.rows_per_request + self.slots + t


@dataclass(frozen=True)
class HostLayout:
    """The host pool as a transfer backend addresses it (ess_c.h, ess_host_layout): one region per layer,
    page g of layer l at host_layer(l) + g x page_bytes; a request's page i is the same g in every layer."""
    layers: int
    page_tokens: int
    pinned: bool
    entry_bytes: int
    page_bytes: int
    pages_per_layer: int
    layer_bytes: int


@dataclass(frozen=True)
class Stats:
    steps: int
    warmup_fills: int
    hits: int
    misses: int
    reserved_hits: int
    host_bytes_used: int
    host_bytes_capacity: int
    requests: int
    host_bytes_shared: int
    host_bytes_retained: int
    host_bytes_unshared: int
    whole_requests: int
    whole_steps: int
    sparse_steps: int
    swap_launches: int
    demotions: int
    promotions: int


def _layer_tensors(name, tensors):
    """One DLPack export per layer's tensor and the C array of their DLTensor pointers, or None."""
    if tensors is None:
        return None
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        raise InvalidType(f"{name}: a sequence of tensors (one per layer) is expected, not {type(tensors).__name__}")
    exported = [_dlpack.export(t, f"{name}[{i}]") for i, t in enumerate(tensors)]
    return exported, (ctypes.c_void_p * max(1, len(exported)))(*[e.pointer for e in exported])


class Engine:
    """ESS's offloaded latent cache behind one object: the C ABI's ess_engine.

    model: None (the shipped DeepSeek-V3.2-Exp), a config.json path, or its fields as a dict.
    slots or ratio: the LRU slots per request-layer (ratio x max_context, rounded up).
    latent: the engine's own layer buffers (one tensor per layer, [rows, E] or [blocks,
    block_rows, E]); None: ESS allocates them. latent_tail (with latent, split_bytes and tail_bytes): a buffer
    that keeps each entry in two parts, such as DeepSeek-V4's C4 pages (values, then scales, per page): row
    p's first split_bytes in latent[l] (last dimension split_bytes), its next tail_bytes in latent_tail[l]
    (last dimension tail_bytes), each at row p's place (ess_c.h's ess_config.latent_tail). host_memory: the host pool's memory, a writable
    buffer of the caller's (an mmap of a shared-memory region several processes' engines map:
    ess_c.h's ess_config.host_memory says how they share it), kept alive with the engine;
    host_memory_pinned: the caller registered it as pinned, mapped memory. foreign_pages (with host_memory:
    another engine's host block pool, such as vLLM's HiSparse host pool): ForeignPages(pages_per_layer,
    page_stride, layer_first_page), that engine's layout; requests then come by adopt and repage, on the
    pages that engine hands out (ess_c.h's ess_config.host_pages_per_layer). residency: "sparse" (a Sparse
    Memory Pool each), "whole" (every entry in rows of its own, read in place, no swap) or "adaptive" (whole while
    pool rows are free, demoted under pressure, promoted back with whole_headroom rows left; whole and adaptive
    need reserve_newest; Engine.residency(id) says where a request is). region_blocks > 0: `latent` is another
    engine's paged cache ([blocks, block_rows, E] tensors, e.g. vLLM's hot slab) and each request's rows lie in
    region_blocks of its blocks, named by place(); region_group: each layer's region group (a request has a region
    in each: vLLM keeps groups of layers in blocks of their own; None: one group); buffer_row(row, slot, layer) says
    where. Every value is checked;
    a refused one raises InvalidArgument naming it (InvalidType, also a TypeError, for a wrong
    type: a float, bool or string where an integer is meant, anything but a bool for
    reserve_newest), and nothing is created. A refused call on an engine changes nothing.

    Threads: an engine and its bindings may be called from several threads. Each call holds
    the engine's lock (one threading.RLock, shared with its bindings), so calls run one at a
    time, each whole; the order among threads is the caller's to choose. close() waits for a
    call in flight; calls after it raise InvalidArgument."""

    def __init__(self, *, max_requests: int, max_context: int, slots: int = 0, ratio: float = 0.0,
                 model: Union[None, str, PathLike, Mapping] = None, layers: int = 0, query_tokens: int = 1,
                 topk: int = 0, reserve_newest: bool = False, warmup_windows: int = 32, policy: str = "lru",
                 backend: str = "cpu", device: int = 0, copy_blocks: int = 0, host_bytes: int = 0,
                 latent: Optional[Sequence] = None, host_memory=None, host_memory_pinned: bool = False,
                 foreign_pages: Optional["ForeignPages"] = None, residency: str = "sparse", whole_headroom: int = 1,
                 latent_tail: Optional[Sequence] = None, split_bytes: int = 0, tail_bytes: int = 0,
                 region_blocks: int = 0, region_group: Optional[Sequence[int]] = None):
        self._handle = None
        self._lock = threading.RLock()
        _args.choice("backend", backend, _BACKENDS)
        _args.choice("policy", policy, _POLICIES)
        _args.choice("residency", residency, _RESIDENCIES)
        c = Config()
        lib.ess_config_init(ctypes.byref(c))
        if model is None:
            pass
        elif isinstance(model, Mapping):
            try:
                c.model_json = json.dumps(dict(model), allow_nan=False).encode()
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"model: its fields are not JSON: {e}") from None
        else:
            c.model_path = _args.text("model", model, path=True).encode()
        for name, value in (("layers", layers), ("max_requests", max_requests), ("max_context", max_context),
                            ("query_tokens", query_tokens), ("topk", topk), ("slots", slots),
                            ("warmup_windows", warmup_windows), ("device", device), ("copy_blocks", copy_blocks),
                            ("host_bytes", host_bytes), ("whole_headroom", whole_headroom),
                            ("split_bytes", split_bytes), ("tail_bytes", tail_bytes), ("region_blocks", region_blocks)):
            field = dict(Config._fields_)[name]
            bounds = _args.I32 if field is ctypes.c_int32 else _args.I64 if field is ctypes.c_int64 else _args.U64
            setattr(c, name, _args.integer(name, value, *bounds))
        c.ratio = _args.real("ratio", ratio)
        c.reserve_newest = 1 if _args.flag("reserve_newest", reserve_newest) else 0
        c.policy = _POLICIES[policy]
        c.residency = _RESIDENCIES[residency]
        c.backend = _BACKENDS[backend]
        self._latent = _layer_tensors("latent", latent)  # kept alive with the engine
        self._latent_tail = _layer_tensors("latent_tail", latent_tail)
        for name, held in (("latent", self._latent), ("latent_tail", self._latent_tail)):
            if held is not None:
                setattr(c, name, ctypes.cast(held[1], ctypes.POINTER(ctypes.c_void_p)))
                setattr(c, f"{name}_count", len(held[0]))
        self._host_memory = None
        pinned = _args.flag("host_memory_pinned", host_memory_pinned)
        if host_memory is not None:
            try:
                view = memoryview(host_memory).cast("B")
            except TypeError:
                raise InvalidType(f"host_memory: {type(host_memory).__name__} is not a buffer (an mmap or "
                                  "bytearray is expected)") from None
            if view.readonly:
                raise InvalidArgument("host_memory: a read-only buffer (the pool is written)")
            c.host_memory = ctypes.addressof(ctypes.c_char.from_buffer(view))
            c.host_memory_bytes = view.nbytes
            c.host_memory_pinned = 1 if pinned else 0
            self._host_memory = view
        self._region_group = None
        if region_group is not None:
            groups = _integers("region_group", region_group, _args.I32)
            if len(groups) != c.layers:   # the C ABI reads `layers` values
                raise InvalidArgument(f"region_group: {len(groups)} values for layers = {c.layers} (give layers)")
            self._region_group = (ctypes.c_int32 * max(1, len(groups)))(*groups)
            c.region_group = ctypes.cast(self._region_group, ctypes.POINTER(ctypes.c_int32))
        self._first_pages = None
        if foreign_pages is not None:
            if not isinstance(foreign_pages, ForeignPages):
                raise InvalidType(f"foreign_pages: an ess.ForeignPages is expected, not {type(foreign_pages).__name__}")
            c.host_pages_per_layer = _args.integer("foreign_pages.pages_per_layer", foreign_pages.pages_per_layer,
                                                   *_args.I64)
            c.host_page_stride = _args.integer("foreign_pages.page_stride", foreign_pages.page_stride, *_args.U64)
            firsts = _integers("foreign_pages.layer_first_page", foreign_pages.layer_first_page, _args.I64)
            self._first_pages = (ctypes.c_int64 * max(1, len(firsts)))(*firsts)
            c.host_layer_first_page = ctypes.cast(self._first_pages, ctypes.POINTER(ctypes.c_int64))
            layers = c.layers if c.layers > 0 else None
            if layers is not None and len(firsts) != layers:
                raise InvalidArgument(f"foreign_pages.layer_first_page: {len(firsts)} values for {layers} layers")
        handle = ctypes.c_void_p()
        check(lib.ess_engine_create(ctypes.byref(c), ctypes.byref(handle)))
        self._handle = handle.value
        self._bindings = weakref.WeakSet()  # closed with the engine; each freed when it goes
        raw = EngineInfo()
        lib.ess_engine_info_init(ctypes.byref(raw))
        check(lib.ess_engine_get_info(self._handle, ctypes.byref(raw)))
        values = {name: getattr(raw, name) for name, _ in EngineInfo._fields_ if name != "struct_size"}
        values["reserve_newest"] = bool(values["reserve_newest"])
        values["backend"] = "cuda" if values["backend"] == 1 else "cpu"
        self.info = Info(**values, region_blocks=c.region_blocks)

    # ---- lifetime ----
    @_locked
    def close(self):
        """Frees the engine and its bindings (they refuse calls afterwards)."""
        if self._handle is not None:
            for b in list(self._bindings):
                b._handle = None
            handle, self._handle = self._handle, None
            try:
                check(lib.ess_engine_destroy(handle))
            finally:
                self._host_memory = None  # the engine that used it is gone

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _h(self):
        if self._handle is None:
            raise InvalidArgument("the engine is closed")
        return self._handle

    # ---- requests ----
    @_locked
    def admit(self, request_id: int, prompt_length: int, row: int = -1) -> int:
        """Admits a request of `prompt_length` tokens (entries zeroed) into pool row `row` (-1: any free); returns the row."""
        _i64(request_id=request_id, prompt_length=prompt_length)
        _i32(row=row)
        out = ctypes.c_int32()
        check(lib.ess_request_admit(self._h(), request_id, prompt_length, row, ctypes.byref(out)))
        return out.value

    @_locked
    def admit_shared(self, request_id: int, prompt_length: int, source: int, prefix: int, row: int = -1) -> int:
        """Admits a request whose first `prefix` tokens are request `source`'s: their host pages are shared
        (read-only), not copied. Write its entries from `prefix` on. Returns the row."""
        _i64(request_id=request_id, prompt_length=prompt_length, source=source, prefix=prefix)
        _i32(row=row)
        out = ctypes.c_int32()
        check(lib.ess_request_admit_shared(self._h(), request_id, prompt_length, source, prefix, row, ctypes.byref(out)))
        return out.value

    @_locked
    def admit_cached(self, request_id: int, prompt_tokens, row: int = -1):
        """Admits a request on the host prefix cache: (row, tokens reused); write its entries from there on."""
        _i64(request_id=request_id)
        _i32(row=row)
        t = _dlpack.export(prompt_tokens, "prompt_tokens")
        out, reused = ctypes.c_int32(), ctypes.c_int64()
        check(lib.ess_request_admit_cached(self._h(), request_id, t.pointer, row, ctypes.byref(out), ctypes.byref(reused)))
        return out.value, reused.value

    @_locked
    def publish(self, request_id: int, prompt_tokens) -> int:
        """Registers the request's written prompt in the host prefix cache; returns the pages per layer added."""
        _i64(request_id=request_id)
        t = _dlpack.export(prompt_tokens, "prompt_tokens")
        pages = ctypes.c_int64()
        check(lib.ess_request_publish(self._h(), request_id, t.pointer, ctypes.byref(pages)))
        return pages.value

    @_locked
    def write_entries(self, request_id: int, layer: int, first_token: int, entries):
        """Copies host entries ([n, E] bytes per entry) into the Total Memory Pool at tokens [first_token, +n)."""
        _i64(request_id=request_id, first_token=first_token)
        _i32(layer=layer)
        e = _dlpack.export(entries, "entries")
        check(lib.ess_request_write_entries(self._h(), request_id, layer, first_token, e.pointer))

    @_locked
    def read_entries(self, request_id: int, layer: int, first_token: int, out):
        """Fills `out` ([n, E] host bytes) from the Total Memory Pool; returns it."""
        _i64(request_id=request_id, first_token=first_token)
        _i32(layer=layer)
        e = _dlpack.export(out, "out")
        check(lib.ess_request_read_entries(self._h(), request_id, layer, first_token, e.pointer))
        return out

    @_locked
    def warmup(self, request_id: int, windows):
        """LRU-Warmup of every layer from the prefill's top-k: int32 host [layers, W, K], oldest first."""
        _i64(request_id=request_id)
        e = _dlpack.export(windows, "windows")
        check(lib.ess_request_warmup(self._h(), request_id, e.pointer))

    @_locked
    def extend(self, request_id: int, tokens: int = 1):
        _i64(request_id=request_id, tokens=tokens)
        check(lib.ess_request_extend(self._h(), request_id, tokens))

    @_locked
    def truncate(self, request_id: int, length: int):
        """Takes back draft tokens that were not accepted: the request's length becomes `length` (at least its
        length - T; reserve_newest engines). Write the accepted ones back before the next step reads them."""
        _i64(request_id=request_id, length=length)
        check(lib.ess_request_truncate(self._h(), request_id, length))

    @_locked
    def adopt(self, request_id: int, length: int, pages, row: int = -1) -> int:
        """Foreign pages: admits a request of `length` tokens whose entries the other engine wrote on `pages` (its
        block table: ceil(length / 64) page indices, ints or an integer array); returns the row. Nothing is copied."""
        _i64(request_id=request_id, length=length)
        _i32(row=row)
        values = _integers("pages", pages, _args.I32)
        array = (ctypes.c_int32 * max(1, len(values)))(*values)
        out = ctypes.c_int32()
        check(lib.ess_request_adopt(self._h(), request_id, length, array, len(values), row, ctypes.byref(out)))
        return out.value

    @_locked
    def repage(self, request_id: int, length: int, pages=(), first_page: Optional[int] = None):
        """Foreign pages: the request's length anew and its pages from `first_page` on (None: its page count, so
        `pages` are appended); growth as extend, shrinking by at most T as truncate."""
        _i64(request_id=request_id, length=length)
        values = _integers("pages", pages, _args.I32)
        if first_page is None:
            first_page = -(-self.request(request_id)[1] // 64)   # its pages: one per 64 tokens
        _i64(first_page=first_page)
        array = (ctypes.c_int32 * max(1, len(values)))(*values)
        check(lib.ess_request_repage(self._h(), request_id, length, first_page, array, len(values)))

    @_locked
    def release(self, request_id: int):
        _i64(request_id=request_id)
        check(lib.ess_request_release(self._h(), request_id))

    @_locked
    def set_lifecycle_stream(self, stream):
        """The CUDA stream of the lifecycle calls (admit, warmup, extend, release, reset, adopt, repage): from now on
        their device work is enqueued on it (an int handle, a torch.cuda.Stream, a CuPy stream; 0: the legacy default
        stream) and they return without waiting for the device; steps run on it or after it. None: back to the
        default, each call waiting for the device. The CPU backend ignores it."""
        handle = stream_handle(stream) or 0   # checked even when 0
        ordered = 0 if stream is None else 1
        check(lib.ess_engine_set_lifecycle_stream(self._h(), ctypes.c_void_p(handle) if handle else None, ordered))

    @_locked
    def place(self, request_id: int, blocks):
        """Regions: the request's rows lie from now on in `blocks`: its region of each region group, group after
        group (region_blocks block ids of `latent` each, distinct, none in another request's region); its device
        residency is forgotten and, with reserve_newest, its newest entries loaded into its new reserved rows. Place a
        request before its warmup and first step."""
        _i64(request_id=request_id)
        values = _integers("blocks", blocks, _args.I32)
        array = (ctypes.c_int32 * max(1, len(values)))(*values)
        check(lib.ess_request_place(self._h(), request_id, array, len(values)))

    @_locked
    def buffer_row(self, row: int, slot: int, layer: int = 0) -> int:
        """The physical row of row `slot` (its slots, then its reserved rows) of pool row `row` in `layer`; -1 while
        a row of an engine with regions has none."""
        _i32(row=row, slot=slot, layer=layer)
        out = ctypes.c_int32()
        check(lib.ess_engine_buffer_row(self._h(), layer, row, slot, ctypes.byref(out)))
        return out.value

    @_locked
    def reset(self, request_id: int):
        _i64(request_id=request_id)
        check(lib.ess_request_reset(self._h(), request_id))

    @_locked
    def request(self, request_id: int):
        """(pool row, length) of an admitted request."""
        _i64(request_id=request_id)
        row, length = ctypes.c_int32(), ctypes.c_int64()
        check(lib.ess_request_get(self._h(), request_id, ctypes.byref(row), ctypes.byref(length)))
        return row.value, length.value

    # ---- the per-layer step ----
    @_locked
    def bind_step(self, rows, topk, lengths, physical, *, counts=None, resident=None, fetched=None,
                  resident_count=None, fetched_count=None) -> "StepBinding":
        """Checks the step's tensors once; the returned binding's step(layer) passes only integers."""
        exported = {
            "rows": _dlpack.export(rows, "rows"),
            "topk": _dlpack.export(topk, "topk"),
            "lengths": _dlpack.export(lengths, "lengths"),
            "physical": _dlpack.export(physical, "physical"),
            "counts": _dlpack.maybe(counts, "counts"),
            "resident": _dlpack.maybe(resident, "resident"),
            "fetched": _dlpack.maybe(fetched, "fetched"),
            "resident_count": _dlpack.maybe(resident_count, "resident_count"),
            "fetched_count": _dlpack.maybe(fetched_count, "fetched_count"),
        }
        t = StepTensors()
        lib.ess_step_tensors_init(ctypes.byref(t))
        for name, e in exported.items():
            setattr(t, name, None if e is None else e.pointer)
        handle = ctypes.c_void_p()
        check(lib.ess_step_bind(self._h(), ctypes.byref(t), ctypes.byref(handle)))
        b = StepBinding(self, handle.value, exported)
        self._bindings.add(b)
        return b

    @_locked
    def query_groups(self, rows, topk, lengths) -> list:
        """The query groups of a step from host copies of its rows [B], topk [B, T, K] and lengths [B]:
        boundaries [0, ..., T] of consecutive query-token ranges whose working sets fit the slots
        ([0, T] when the whole step fits). Serve each with StepBinding.step_group, its attention
        before the next group's step."""
        ex = [_dlpack.export(rows, "rows"), _dlpack.export(topk, "topk"), _dlpack.export(lengths, "lengths")]
        bounds = (ctypes.c_int32 * (self.info.query_tokens + 1))()
        count = ctypes.c_int32()
        check(lib.ess_query_groups(self._h(), ex[0].pointer, ex[1].pointer, ex[2].pointer, bounds, ctypes.byref(count)))
        return list(bounds[: count.value + 1])

    @_locked
    def bind_write_back(self, rows, lengths, source_rows=None) -> "WriteBackBinding":
        """The D2H write-back of each step's T newest entries (from the reserved rows, or source_rows [B, T])."""
        exported = {"rows": _dlpack.export(rows, "rows"), "lengths": _dlpack.export(lengths, "lengths"),
                    "source_rows": _dlpack.maybe(source_rows, "source_rows")}
        handle = ctypes.c_void_p()
        src = exported["source_rows"]
        check(lib.ess_write_back_bind(self._h(), exported["rows"].pointer, exported["lengths"].pointer,
                                      None if src is None else src.pointer, ctypes.byref(handle)))
        b = WriteBackBinding(self, handle.value, exported)
        self._bindings.add(b)
        return b

    # ---- what is where ----
    @_locked
    def stats(self) -> Stats:
        raw = _Stats()
        lib.ess_stats_init(ctypes.byref(raw))
        check(lib.ess_engine_get_stats(self._h(), ctypes.byref(raw)))
        return Stats(**{name: getattr(raw, name) for name, _ in _Stats._fields_ if name != "struct_size"})

    @_locked
    def layer_data(self, layer: int) -> int:
        """The address of a layer's buffer (the engine's own, or the one ESS allocated)."""
        _i32(layer=layer)
        out = ctypes.c_void_p()
        check(lib.ess_engine_layer_data(self._h(), layer, ctypes.byref(out)))
        return out.value

    @_locked
    def device_bytes(self) -> int:
        """The device memory the engine allocated at creation and holds until closed, as asked of cudaMalloc (its
        LRU state, step scratch, page tables and, when ESS allocated them, the layer buffers); 0 on the CPU
        backend."""
        out = ctypes.c_uint64()
        check(lib.ess_engine_device_bytes(self._h(), ctypes.byref(out)))
        return out.value

    @_locked
    def host_layout(self) -> HostLayout:
        raw = _HostLayout()
        lib.ess_host_layout_init(ctypes.byref(raw))
        check(lib.ess_engine_host_layout(self._h(), ctypes.byref(raw)))
        values = {name: getattr(raw, name) for name, _ in _HostLayout._fields_ if name != "struct_size"}
        values["pinned"] = bool(values["pinned"])
        return HostLayout(**values)

    @_locked
    def host_layer(self, layer: int) -> int:
        """The address of a layer's region of the host pool."""
        _i32(layer=layer)
        out = ctypes.c_void_p()
        check(lib.ess_engine_host_layer(self._h(), layer, ctypes.byref(out)))
        return out.value

    @_locked
    def host_pages(self, request_id: int) -> list:
        """The request's page indices (one per page_tokens tokens): page i of every layer's region."""
        _i64(request_id=request_id)
        count = ctypes.c_int64()
        status = lib.ess_request_host_pages(self._h(), request_id, None, 0, ctypes.byref(count))
        if count.value == 0 or status == 0:
            check(status)
            return []
        out = (ctypes.c_int32 * count.value)()
        check(lib.ess_request_host_pages(self._h(), request_id, out, count.value, ctypes.byref(count)))
        return list(out)

    @_locked
    def residency(self, request_id: int) -> tuple:
        """(whole, rows): whether the request is whole (every entry in rows of its own, no swap), and the pool rows
        it takes, its own first (one when sparse; for a whole request each holds `slots` of its tokens in order)."""
        _i64(request_id=request_id)
        whole = ctypes.c_int32()
        count = ctypes.c_int32()
        rows = (ctypes.c_int32 * 1)()
        status = lib.ess_request_residency(self._h(), request_id, ctypes.byref(whole), rows, 1, ctypes.byref(count))
        if status != 0 and count.value > 1:
            rows = (ctypes.c_int32 * count.value)()
            status = lib.ess_request_residency(self._h(), request_id, ctypes.byref(whole), rows, count.value,
                                               ctypes.byref(count))
        check(status)
        return bool(whole.value), list(rows)[:count.value]

    @_locked
    def read_row(self, layer: int, row: int) -> bytes:
        """A copy of physical row `row` of a layer's buffer."""
        _i32(layer=layer, row=row)
        buf = ctypes.create_string_buffer(self.info.entry_bytes)
        check(lib.ess_engine_read_row(self._h(), layer, row, buf, self.info.entry_bytes))
        return buf.raw


class _Binding:
    """A binding shares its engine's lock: its calls and the engine's run one at a time. The per-layer calls
    (step, step_group, write_back) take no Python lock: the library holds the engine's lock for each call and
    refuses a handle destroyed meanwhile, so a close on another thread cannot reach a call in flight."""
    _destroy = None

    def __init__(self, engine: Engine, handle: int, exported):
        self._engine = engine
        self._lock = engine._lock
        self._handle = handle
        self._c_handle = ctypes.c_void_p(handle)  # what the unchecked per-layer calls take
        self._exported = exported  # keeps every bound tensor alive while the C side points at it

    def close(self):
        with self._lock:
            if self._handle is not None:
                handle, self._handle = self._handle, None
                self._c_handle = None
                check(type(self)._destroy(handle))

    def __del__(self):
        try:
            if self._engine._handle is not None:
                self.close()
        except Exception:
            pass

    def _h(self):
        if self._handle is None:
            raise InvalidArgument("the binding is closed (or its engine is)")
        return self._handle

    def _failed(self, code):
        self._h()  # a closed binding says so rather than the library's "step binding is NULL"
        check(code)


_I32_MIN, _I32_MAX = -2**31, 2**31 - 1


def _c_stream(stream):
    """A stream for an unchecked call: None, or its address as a c_void_p (checked by stream_handle)."""
    if stream is None:
        return None
    return ctypes.c_void_p(stream if type(stream) is int and 0 < stream < 2**64 else stream_handle(stream))


class StepBinding(_Binding):
    """A bound step: step(layer) runs one layer over the bound tensors."""

    _destroy = lib.ess_step_binding_destroy

    def step(self, layer: int, batch: int = -1, stream=None):
        """The step of `layer` over the first `batch` positions (-1: all), enqueued on `stream` (CUDA backend)."""
        # The tensors were checked when bound; what can change between calls is checked here: plain ints within
        # int32 go straight to the library, anything else through the full check, which names the argument.
        if not (type(layer) is int and type(batch) is int and _I32_MIN <= layer <= _I32_MAX
                and _I32_MIN <= batch <= _I32_MAX):
            _i32(layer=layer, batch=batch)
        code = _c_ess_step(self._c_handle, layer, batch, None if stream is None else _c_stream(stream))
        if code:
            self._failed(code)

    __call__ = step

    @_locked
    def step_async(self, layer: int, batch: int = -1, part: int = 0, stream=None, copy_stream=None, copy_done=None):
        """The step with its fetch on `copy_stream`, `copy_done` (a cudaEvent_t: an int or a torch.cuda.Event)
        recorded when it ends."""
        _i32(layer=layer, batch=batch, part=part)
        check(lib.ess_step_async(self._h(), layer, batch, part, stream_handle(stream),
                                 _args.handle("copy_stream", copy_stream),
                                 _args.handle("copy_done", copy_done, ("cuda_event", "ptr", "handle"))))

    def step_group(self, layer: int, query_begin: int, query_end: int, batch: int = -1, stream=None):
        """The step of query tokens [query_begin, query_end) only (Engine.query_groups); the others are padding."""
        _i32(layer=layer, query_begin=query_begin, query_end=query_end, batch=batch)
        code = _c_ess_step_group(self._c_handle, layer, batch, query_begin, query_end, _c_stream(stream))
        if code:
            self._failed(code)


class WriteBackBinding(_Binding):
    _destroy = lib.ess_write_back_binding_destroy

    def write_back(self, layer: int, batch: int = -1, stream=None):
        """The write-back of `layer`'s newest entries over the first `batch` positions (-1: all)."""
        if not (type(layer) is int and type(batch) is int and _I32_MIN <= layer <= _I32_MAX
                and _I32_MIN <= batch <= _I32_MAX):
            _i32(layer=layer, batch=batch)
        code = _c_ess_write_back(self._c_handle, layer, batch, None if stream is None else _c_stream(stream))
        if code:
            self._failed(code)

    __call__ = write_back


_c_ess_step, _c_ess_step_group, _c_ess_write_back = unchecked.ess_step, unchecked.ess_step_group, unchecked.ess_write_back
