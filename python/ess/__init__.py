"""ESS: DeepSeek-V3.2-style sparse attention with the latent cache offloaded to pinned host memory.

The per-layer step of a serving engine (`Engine`, `StepBinding`), the capacity planner
(`plan`), and adapters shaped like SGLang's and vLLM's HiSparse (`ess.integrations`), on the
C ABI of libess (include/ess/ess_c.h). Tensors are anything with __dlpack__ (numpy, torch,
CuPy); they are checked once when bound."""
from __future__ import annotations

import ctypes
import json
from typing import Iterable, Optional

from ._errors import DeviceError, EssError, InternalError, InvalidArgument, OutOfMemory, Unavailable, check
from ._lib import ABI_VERSION, lib, path as library_path
from .engine import Engine, HostLayout, Info, Stats, StepBinding, WriteBackBinding, stream_handle

# project(ess VERSION) of CMakeLists.txt, as libess was built with it (the wheel's version comes from the
# same line), with a local label saying whether that libess carries the CUDA backend: "0.1.0+cuda" or
# "0.1.0+cpu" (`ess --version` says "CUDA target: built" or "not built").
__version__ = f"{lib.ess_version().decode()}+{'cuda' if lib.ess_cuda_built() else 'cpu'}"

__all__ = [
    "ABI_VERSION", "DeviceError", "Engine", "EssError", "HostLayout", "Info", "InternalError", "InvalidArgument", "OutOfMemory",
    "Stats", "StepBinding", "Unavailable", "WriteBackBinding", "cuda_built", "cuda_device_count", "library_path",
    "plan", "stream_handle",
]


def cuda_built() -> bool:
    """Whether libess carries the CUDA backend."""
    return bool(lib.ess_cuda_built())


def cuda_device_count() -> int:
    return int(lib.ess_cuda_device_count())


def plan(*, contexts: Iterable[int] = (32768,), min_otps: float = 0.0, hardware: Optional[str] = None,
         **options) -> dict:
    """`ess plan --format json` as a call: per context, the batch, Sparse Memory Ratio and overlap mode with the
    highest throughput that meets `min_otps`. Other options as `ess plan`'s flags with underscores (model,
    deployment, modes, batch_step, mtp, accept, nodes, gpus_per_node, ep, mem_fraction, no_tbo, misses,
    miss_exponent, miss_profile, op_table); unknown ones are refused by the library."""
    request = dict(options, contexts=list(contexts), min_otps=min_otps)
    if hardware is not None:
        request["hardware"] = hardware
    out = ctypes.c_void_p()
    check(lib.ess_plan(json.dumps(request).encode(), ctypes.byref(out)))
    try:
        return json.loads(ctypes.string_at(out.value).decode())
    finally:
        lib.ess_string_free(out)
