"""Finds and loads libess (the C ABI of include/ess/ess_c.h) and declares its functions."""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from pathlib import Path
from typing import Optional

ABI_VERSION = 1  # ESS_ABI_VERSION this package speaks


class Config(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("model_path", ctypes.c_char_p),
        ("model_json", ctypes.c_char_p),
        ("layers", ctypes.c_int32),
        ("max_requests", ctypes.c_int32),
        ("max_context", ctypes.c_int64),
        ("query_tokens", ctypes.c_int32),
        ("topk", ctypes.c_int32),
        ("slots", ctypes.c_int32),
        ("ratio", ctypes.c_double),
        ("reserve_newest", ctypes.c_int32),
        ("warmup_windows", ctypes.c_int32),
        ("policy", ctypes.c_int32),
        ("backend", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("copy_blocks", ctypes.c_int32),
        ("host_bytes", ctypes.c_uint64),
        ("latent", ctypes.POINTER(ctypes.c_void_p)),
        ("latent_count", ctypes.c_int32),
        ("host_memory", ctypes.c_void_p),
        ("host_memory_bytes", ctypes.c_uint64),
        ("host_memory_pinned", ctypes.c_int32),
        ("host_pages_per_layer", ctypes.c_int64),
        ("host_page_stride", ctypes.c_uint64),
        ("host_layer_first_page", ctypes.POINTER(ctypes.c_int64)),
        ("residency", ctypes.c_int32),
        ("whole_headroom", ctypes.c_int32),
        ("latent_tail", ctypes.POINTER(ctypes.c_void_p)),
        ("latent_tail_count", ctypes.c_int32),
        ("split_bytes", ctypes.c_int32),
        ("tail_bytes", ctypes.c_int32),
        ("region_blocks", ctypes.c_int32),
        ("region_group", ctypes.POINTER(ctypes.c_int32)),
    ]


class EngineInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("layers", ctypes.c_int32),
        ("max_requests", ctypes.c_int32),
        ("max_context", ctypes.c_int64),
        ("query_tokens", ctypes.c_int32),
        ("topk", ctypes.c_int32),
        ("slots", ctypes.c_int32),
        ("rows_per_request", ctypes.c_int32),
        ("reserve_newest", ctypes.c_int32),
        ("backend", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("entry_bytes", ctypes.c_int32),
        ("row_stride", ctypes.c_uint64),
        ("block_rows", ctypes.c_int64),
        ("block_stride", ctypes.c_uint64),
        ("host_bytes_capacity", ctypes.c_uint64),
        ("split_bytes", ctypes.c_int32),
        ("tail_bytes", ctypes.c_int32),
        ("tail_row_stride", ctypes.c_uint64),
        ("tail_block_rows", ctypes.c_int64),
        ("tail_block_stride", ctypes.c_uint64),
    ]


class Stats(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("steps", ctypes.c_int64),
        ("warmup_fills", ctypes.c_int64),
        ("hits", ctypes.c_int64),
        ("misses", ctypes.c_int64),
        ("reserved_hits", ctypes.c_int64),
        ("host_bytes_used", ctypes.c_uint64),
        ("host_bytes_capacity", ctypes.c_uint64),
        ("requests", ctypes.c_int32),
        ("host_bytes_shared", ctypes.c_uint64),
        ("host_bytes_retained", ctypes.c_uint64),
        ("host_bytes_unshared", ctypes.c_uint64),
        ("whole_requests", ctypes.c_int32),
        ("whole_steps", ctypes.c_int64),
        ("sparse_steps", ctypes.c_int64),
        ("swap_launches", ctypes.c_int64),
        ("demotions", ctypes.c_int64),
        ("promotions", ctypes.c_int64),
    ]


class HostLayout(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("layers", ctypes.c_int32),
        ("page_tokens", ctypes.c_int32),
        ("pinned", ctypes.c_int32),
        ("entry_bytes", ctypes.c_uint64),
        ("page_bytes", ctypes.c_uint64),
        ("pages_per_layer", ctypes.c_int64),
        ("layer_bytes", ctypes.c_uint64),
    ]


class StepTensors(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32)] + [
        (name, ctypes.c_void_p)
        for name in ("rows", "topk", "lengths", "physical", "counts", "resident", "fetched", "resident_count",
                     "fetched_count")
    ]


def _checkout_root(package: Path):
    """The source checkout this package directory lies in (python/ess of a repository with
    include/ess/ess_c.h), or None for an installed package."""
    repo = package.parent.parent
    if package.parent.name == "python" and (repo / "include" / "ess" / "ess_c.h").is_file():
        return repo
    return None


def _candidates(here: Path, env: Optional[str]):
    """Where the package in directory `here` looks for libess, in order. ESS_LIBRARY (`env`), when set, is
    the only place. An installed package (a wheel) has its own libess.so beside it and uses only that one,
    so it never loads a build tree's library by accident; only a source checkout looks in its build trees."""
    if env:
        yield Path(env)
        return
    bundled = here / "libess.so"
    if bundled.exists():
        yield bundled
        return
    repo = _checkout_root(here)
    if repo is not None:
        for preset in ("release", "cpu", "debug"):
            yield repo / "build" / preset / "src" / "capi" / "libess.so"
        for p in sorted(glob.glob(str(repo / "build" / "*" / "src" / "capi" / "libess.so"))):
            yield Path(p)
    # The system's library path (cmake --install into a prefix the loader searches).
    found = ctypes.util.find_library("ess")
    if found:
        yield Path(found)


def _load():
    tried = []
    for path in _candidates(Path(__file__).resolve().parent, os.environ.get("ESS_LIBRARY")):
        if not path.exists() and path.is_absolute():
            tried.append(f"{path} (missing)")
            continue
        try:
            return ctypes.CDLL(str(path)), str(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
    raise ImportError(
        "ess: libess.so not found. Install the package with its library (pip install . at the repository root), "
        "build it in a checkout (./scripts/test.sh, or cmake --build build/release --target ess_c), "
        "install it (cmake --install), or set ESS_LIBRARY to its path. Tried: " + "; ".join(tried or ["nothing"]))


lib, path = _load()

_c = ctypes
_P = _c.c_void_p
_signatures = {
    "ess_abi_version": (_c.c_int, []),
    "ess_version": (_c.c_char_p, []),
    "ess_status_name": (_c.c_char_p, [_c.c_int]),
    "ess_last_error": (_c.c_char_p, []),
    "ess_cuda_built": (_c.c_int, []),
    "ess_cuda_device_count": (_c.c_int, []),
    "ess_config_init": (None, [_c.POINTER(Config)]),
    "ess_engine_create": (_c.c_int, [_c.POINTER(Config), _c.POINTER(_P)]),
    "ess_engine_destroy": (_c.c_int, [_P]),
    "ess_engine_info_init": (None, [_c.POINTER(EngineInfo)]),
    "ess_engine_get_info": (_c.c_int, [_P, _c.POINTER(EngineInfo)]),
    "ess_engine_layer_data": (_c.c_int, [_P, _c.c_int32, _c.POINTER(_P)]),
    "ess_engine_device_bytes": (_c.c_int, [_P, _c.POINTER(_c.c_uint64)]),
    "ess_engine_read_row": (_c.c_int, [_P, _c.c_int32, _c.c_int32, _P, _c.c_size_t]),
    "ess_host_layout_init": (None, [_c.POINTER(HostLayout)]),
    "ess_engine_host_layout": (_c.c_int, [_P, _c.POINTER(HostLayout)]),
    "ess_engine_host_layer": (_c.c_int, [_P, _c.c_int32, _c.POINTER(_P)]),
    "ess_request_host_pages": (_c.c_int, [_P, _c.c_int64, _c.POINTER(_c.c_int32), _c.c_int64, _c.POINTER(_c.c_int64)]),
    "ess_request_residency": (_c.c_int, [_P, _c.c_int64, _c.POINTER(_c.c_int32), _c.POINTER(_c.c_int32), _c.c_int32,
                                         _c.POINTER(_c.c_int32)]),
    "ess_stats_init": (None, [_c.POINTER(Stats)]),
    "ess_engine_get_stats": (_c.c_int, [_P, _c.POINTER(Stats)]),
    "ess_request_admit": (_c.c_int, [_P, _c.c_int64, _c.c_int64, _c.c_int32, _c.POINTER(_c.c_int32)]),
    "ess_request_admit_shared": (_c.c_int, [_P, _c.c_int64, _c.c_int64, _c.c_int64, _c.c_int64, _c.c_int32,
                                            _c.POINTER(_c.c_int32)]),
    "ess_request_admit_cached": (_c.c_int, [_P, _c.c_int64, _P, _c.c_int32, _c.POINTER(_c.c_int32),
                                            _c.POINTER(_c.c_int64)]),
    "ess_request_publish": (_c.c_int, [_P, _c.c_int64, _P, _c.POINTER(_c.c_int64)]),
    "ess_request_write_entries": (_c.c_int, [_P, _c.c_int64, _c.c_int32, _c.c_int64, _P]),
    "ess_request_read_entries": (_c.c_int, [_P, _c.c_int64, _c.c_int32, _c.c_int64, _P]),
    "ess_request_warmup": (_c.c_int, [_P, _c.c_int64, _P]),
    "ess_request_extend": (_c.c_int, [_P, _c.c_int64, _c.c_int64]),
    "ess_request_truncate": (_c.c_int, [_P, _c.c_int64, _c.c_int64]),
    "ess_request_adopt": (_c.c_int, [_P, _c.c_int64, _c.c_int64, _c.POINTER(_c.c_int32), _c.c_int64, _c.c_int32,
                                     _c.POINTER(_c.c_int32)]),
    "ess_request_repage": (_c.c_int, [_P, _c.c_int64, _c.c_int64, _c.c_int64, _c.POINTER(_c.c_int32), _c.c_int64]),
    "ess_request_release": (_c.c_int, [_P, _c.c_int64]),
    "ess_request_reset": (_c.c_int, [_P, _c.c_int64]),
    "ess_request_place": (_c.c_int, [_P, _c.c_int64, _c.POINTER(_c.c_int32), _c.c_int64]),
    "ess_engine_buffer_row": (_c.c_int, [_P, _c.c_int32, _c.c_int32, _c.c_int32, _c.POINTER(_c.c_int32)]),
    "ess_engine_set_lifecycle_stream": (_c.c_int, [_P, _P, _c.c_int32]),
    "ess_request_get": (_c.c_int, [_P, _c.c_int64, _c.POINTER(_c.c_int32), _c.POINTER(_c.c_int64)]),
    "ess_step_tensors_init": (None, [_c.POINTER(StepTensors)]),
    "ess_step_bind": (_c.c_int, [_P, _c.POINTER(StepTensors), _c.POINTER(_P)]),
    "ess_step_binding_destroy": (_c.c_int, [_P]),
    "ess_step": (_c.c_int, [_P, _c.c_int32, _c.c_int32, _P]),
    "ess_step_async": (_c.c_int, [_P, _c.c_int32, _c.c_int32, _c.c_int32, _P, _P, _P]),
    "ess_step_group": (_c.c_int, [_P, _c.c_int32, _c.c_int32, _c.c_int32, _c.c_int32, _P]),
    "ess_query_groups": (_c.c_int, [_P, _P, _P, _P, _c.POINTER(_c.c_int32), _c.POINTER(_c.c_int32)]),
    "ess_write_back_bind": (_c.c_int, [_P, _P, _P, _P, _c.POINTER(_P)]),
    "ess_write_back_binding_destroy": (_c.c_int, [_P]),
    "ess_write_back": (_c.c_int, [_P, _c.c_int32, _c.c_int32, _P]),
    "ess_plan": (_c.c_int, [_c.c_char_p, _c.POINTER(_c.c_void_p)]),
    "ess_string_free": (None, [_c.c_void_p]),
}
for _name, (_res, _args) in _signatures.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args

# The per-layer calls without ctypes' argument conversion (argtypes costs about a microsecond a call): the
# package checks each argument's type and range before calling them and passes handles and streams as
# c_void_p, so no value is cut to a C type's width. A second CDLL object over the same loaded library
# (dlopen hands it out again), so that `lib`'s declarations stay whole.
unchecked = ctypes.CDLL(path)
for _name in ("ess_step", "ess_step_group", "ess_write_back"):
    getattr(unchecked, _name).restype = ctypes.c_int

if lib.ess_abi_version() != ABI_VERSION:
    raise ImportError(f"ess: {path} speaks ABI {lib.ess_abi_version()}, this package ABI {ABI_VERSION}; "
                      "rebuild the library or reinstall the package from the same source")
