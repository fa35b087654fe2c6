"""ESS: DeepSeek-V3.2-style sparse attention with the latent cache offloaded to pinned host memory.

The per-layer step of a serving engine (`Engine`, `StepBinding`), the capacity planner
(`plan`), and adapters for SGLang's and vLLM's HiSparse (`ess.integrations`), on the
C ABI of libess (include/ess/ess_c.h). Tensors are anything with __dlpack__ (numpy, torch,
CuPy); they are checked once when bound."""
from __future__ import annotations

import ctypes
import json
from typing import Iterable, Optional

from . import _args
from ._errors import DeviceError, EssError, InternalError, InvalidArgument, InvalidType, OutOfMemory, Unavailable, check
from ._lib import ABI_VERSION, lib, path as library_path
from .engine import Engine, ForeignPages, HostLayout, Info, Stats, StepBinding, WriteBackBinding, stream_handle

# project(ess VERSION) of CMakeLists.txt, as libess was built with it (the wheel's version comes from the
# same line), with a local label saying whether that libess carries the CUDA backend: "0.1.0+cuda" or
# "0.1.0+cpu" (`ess --version` says "CUDA target: built" or "not built").
__version__ = f"{lib.ess_version().decode()}+{'cuda' if lib.ess_cuda_built() else 'cpu'}"

__all__ = [
    "ABI_VERSION", "DeviceError", "Engine", "EssError", "ForeignPages", "HostLayout", "Info", "InternalError", "InvalidArgument", "InvalidType",
    "OutOfMemory",
    "Stats", "StepBinding", "Unavailable", "WriteBackBinding", "cuda_built", "cuda_device_count", "library_path",
    "plan", "stream_handle",
]


def cuda_built() -> bool:
    """Whether libess carries the CUDA backend."""
    return bool(lib.ess_cuda_built())


def cuda_device_count() -> int:
    return int(lib.ess_cuda_device_count())


_PLAN_INTEGERS = ("batch_step", "mtp", "nodes", "gpus_per_node", "ep")
_PLAN_NUMBERS = ("accept", "mem_fraction", "misses", "miss_exponent", "pool_floor_margin", "prefix_share",
                 "host_reserve")
_PLAN_TEXTS = ("model", "deployment", "miss_profile", "op_table", "pool_floor", "engine")


def plan(*, contexts: Iterable[int] = (32768,), min_otps: float = 0.0, hardware: Optional[str] = None,
         **options) -> dict:
    """`ess plan --format json` as a call: per context, the batch, Sparse Memory Ratio and overlap mode with the
    highest throughput that meets `min_otps`. Other options as `ess plan`'s flags with underscores (model,
    deployment, modes, batch_step, mtp, accept, nodes, gpus_per_node, ep, mem_fraction, no_tbo, no_prefetch, misses,
    miss_exponent, miss_profile, pool_floor, pool_floor_margin, prefix_share, host_reserve, op_table, engine: "sglang"
    or "vllm" for the search limited to what ESS serves inside that engine and each context's "launch" line); unknown
    ones are refused
    by the library. Integers must be ints (a context of 32768.5 is refused, not planned), numbers finite, no_tbo
    and no_prefetch bools; a refusal is InvalidType or InvalidArgument naming the option."""
    if isinstance(contexts, (str, bytes)) or not isinstance(contexts, Iterable):
        raise InvalidType(f"contexts = {contexts!r}: a list of integers is expected")
    request = dict(options)
    request["contexts"] = [_args.integer(f"contexts[{i}]", c, 1, 2**63 - 1) for i, c in enumerate(contexts)]
    request["min_otps"] = _args.real("min_otps", min_otps)
    if hardware is not None:
        request["hardware"] = _args.text("hardware", hardware, path=True)
    for name, value in options.items():
        if name in _PLAN_INTEGERS:
            request[name] = _args.integer(name, value, -2**63, 2**63 - 1)
        elif name in _PLAN_NUMBERS:
            request[name] = _args.real(name, value)
        elif name in _PLAN_TEXTS:
            request[name] = _args.text(name, value, path=True)
        elif name in ("no_tbo", "no_prefetch"):
            request[name] = _args.flag(name, value)
        elif name == "modes":
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise InvalidType(f"modes = {value!r}: a list of mode names is expected")
            request[name] = [_args.text(f"modes[{i}]", m) for i, m in enumerate(value)]
    try:
        text = json.dumps(request, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidType(f"plan: an option is not JSON: {e}") from None
    out = ctypes.c_void_p()
    check(lib.ess_plan(text.encode(), ctypes.byref(out)))
    try:
        return json.loads(ctypes.string_at(out.value).decode())
    finally:
        lib.ess_string_free(out)
