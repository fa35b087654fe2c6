"""What the SGLang adapter's modules share: the release it is checked against, upstream's small types, the checks of
what SGLang hands in, its runtime settings, and the rows ESS takes from the HiSparse device pool."""
from __future__ import annotations

import os
from typing import List, NamedTuple

import torch

from ... import _args
from ..._errors import InvalidArgument, InvalidType

SGLANG_VERSION = "0.5.23"   # the release whose call sites the coordinator is checked against
ENTRY_BYTES = 656           # DeepSeek-V3.2's FP8 latent entry (FlashMLA's layout)


class HiSparseAct(NamedTuple):
    """A request whose prefill KV is being staged to the host (upstream's HiSparseAct, plus the copy)."""
    start_event: object
    finish_event: object
    req: object


class HiSparseTokenStats(NamedTuple):
    device_tokens: int
    device_token_usage: float
    host_tokens: int
    host_token_usage: float


class SpecScratch(NamedTuple):
    """What SGLang reads of upstream's HiSparseSpecSwapManager: the speculative scratch slots a request takes from the
    device allocator (ESS's verify rows are among the rows claimed at construction: none)."""
    scratch_capacity: int


def _token_stats_type():
    """SGLang's own HiSparseTokenStats where SGLang imports, else ours (the same fields)."""
    try:
        from sglang.srt.managers.hisparse_coordinator import HiSparseTokenStats as upstream
        return upstream
    except Exception:  # SGLang absent or not importable here: the same NamedTuple
        return HiSparseTokenStats


def _int(name: str, value) -> int:
    """An integer SGLang hands in (an int, a numpy integer, or a one-element integer tensor): never a float (a
    request slot 1.5 is not slot 1), a bool or a string."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise InvalidType(f"{name}: a {value.dtype} tensor of shape {list(value.shape)} is not an integer")
        value = value.item()
    return _args.integer(name, value, -2**63, 2**63 - 1)


def _int_tensor(name: str, t):
    if not isinstance(t, torch.Tensor):
        raise InvalidType(f"{name}: a torch tensor is expected, not {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidType(f"{name}: {t.dtype} where integers are meant (values would be truncated)")


def _ints(name: str, t) -> List[int]:
    """A host tensor's (or list's) integers, each checked as _int does."""
    if isinstance(t, torch.Tensor):
        _int_tensor(name, t)
        t = t.tolist()
    return [_int(f"{name}[{i}]", v) for i, v in enumerate(t)]


def _cuda_index(device) -> int:
    """SGLang passes "cuda" and sets each rank's current device."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


RESIDENCIES = ("sparse", "whole", "adaptive")


def residency_from_environment() -> str:
    """ESS_RESIDENCY (sparse | whole | adaptive; default sparse): where ESS keeps each request's entries among its
    rows of the HiSparse device pool (ess.Engine's residency: whole requests read every entry in place, no swap)."""
    value = os.environ.get("ESS_RESIDENCY", "sparse").strip().lower()
    if value not in RESIDENCIES:
        raise InvalidArgument(f"ESS_RESIDENCY = {value!r}: one of {', '.join(RESIDENCIES)}")
    return value


def _pool_slots(rows, row_base: int, out, padding) -> None:
    """ESS buffer rows (int32, -1 = padding) as slots of SGLang's device pool: `out` = rows + row_base, -1 kept
    (`padding`: a bool scratch of rows' shape). Device work only, into fixed tensors (CUDA-graph capturable)."""
    torch.add(rows, row_base, out=out)
    torch.lt(rows, 0, out=padding)
    out.masked_fill_(padding, -1)


def _keep(tensor, stream):
    """The caching allocator must not hand `tensor`'s memory out again before `stream`'s work on it ends."""
    if tensor.is_cuda:
        tensor.record_stream(stream)


def _sglang_setting(bag: str, path: str):
    """A setting of the running SGLang: sglang.srt.runtime_context's `bag`() and the dotted `path` in it (0.5.23
    nests its namespaces: get_disagg().disaggregation_mode), or None outside SGLang or before its server has
    published the namespace. A published namespace without the path is refused by name (a setting read as None
    would silently allow what it guards)."""
    try:
        from sglang.srt import runtime_context
    except ImportError:  # not inside SGLang (tests, other engines)
        return None
    try:
        value = getattr(runtime_context, bag)()
    except ValueError as e:
        # SGLang publishes its settings when a server starts; its pools and coordinator are also built without
        # one (its own unit tests, tools), as upstream's constructor allows: nothing to read then.
        if "not published" in str(e):
            return None
        raise
    for name in path.split("."):
        try:
            value = getattr(value, name)
        except AttributeError:
            raise InvalidArgument(f"SGLang's runtime context has no {bag}().{path} (at {name!r}): this adapter "
                                  f"reads SGLang {SGLANG_VERSION}'s settings") from None
    return value


def _claim_top_rows(allocator, rows: int, keep_min: int, why: str) -> int:
    """Takes the top `rows` slots (whole pages) of the HiSparse device allocator for ESS and returns the
    first one. Only a fresh allocator (nothing allocated) can give them up; its size shrinks so that
    clear() keeps them out too. What stays SGLang's must hold `keep_min` slots (`why`: a context-length
    prefill, which lives in the device pool until staged; on a PD decode side, where no prefill runs,
    one slot per request for the transfer budget SGLang computes from it)."""
    inner = allocator.hisparse_attn_allocator
    page = inner.page_size
    pages = -(-rows // page)
    if getattr(inner, "ess_rows", None) is not None:
        raise InvalidArgument(f"this HiSparse device allocator already gave ESS its top {inner.ess_rows} slots "
                              "(one coordinator per pool)")
    if inner.available_size() != inner.size:
        raise InvalidArgument(
            f"ESS takes its rows from the HiSparse device pool at construction, before any allocation; "
            f"{inner.size - inner.available_size()} of its {inner.size} slots are in use")
    keep = inner.num_pages - pages
    if keep * page < keep_min:
        raise InvalidArgument(
            f"the HiSparse device pool holds {inner.size} slots; ESS needs {pages * page} of them for its rows "
            f"(req_to_token pool slots x (device_buffer_size + T), whole pages of {page}) and SGLang needs "
            f"{keep_min} ({why}) left: lower --max-running-requests or the hisparse device_buffer_size, or give "
            "the pool more memory")
    inner.ess_claim = (inner.num_pages, inner.size, inner.free_pages, getattr(allocator, "_size_hisparse", None))
    inner.num_pages = keep
    inner.size = keep * page
    inner.free_pages = inner.free_pages[inner.free_pages <= keep]
    inner.ess_rows = pages * page
    if hasattr(allocator, "_size_hisparse"):
        allocator._size_hisparse = inner.size
    return (keep + 1) * page  # page 0 is the padding sink; the allocator's pages are 1..num_pages


def _return_top_rows(allocator) -> None:
    """Gives the slots _claim_top_rows took back to the allocator, as it was before (a refused or destroyed
    coordinator leaves SGLang's pool whole: a new coordinator can take them again)."""
    inner = allocator.hisparse_attn_allocator
    claim = getattr(inner, "ess_claim", None)
    if claim is None:
        return
    inner.num_pages, inner.size, inner.free_pages, size_hisparse = claim
    if size_hisparse is not None:
        allocator._size_hisparse = size_hisparse
    inner.ess_rows = None
    inner.ess_claim = None
