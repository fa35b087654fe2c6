"""vLLM 0.33.0's own code for the replays, without importing vLLM (its package needs CUDA builds, pydantic and a
newer torch): the classes the attention layers call through (vllm/v1/hisparse/runtime.py PagedCacheView,
is_hisparse_decode_batch, HiSparseCacheHandle; vllm/v1/attention/backends/mla/index_group.py
SparseMLAIndexGroup, HiSparseMLAIndexGroup), the worker's residency table update (runtime.py
update_hisparse_residency) and the decode split the sparse MLA metadata builders make
(vllm/v1/attention/backends/utils.py split_decodes_and_prefills) are read from the pinned release's source
(scripts/upstream.sh), each definition's text compiled as it is, in a namespace holding only what those classes name: torch, and for the
CUDA-only helpers they reference (streams, events, the Triton conversion of the all-resident path) stand-ins
that refuse to run, so a replay that reaches one fails."""
from __future__ import annotations

import __future__
import ast
import dataclasses
import os
import sys
import types
import typing

import numpy as np
import torch

RUNTIME = os.path.join("v1", "hisparse", "runtime.py")
INDEX_GROUP = os.path.join("v1", "attention", "backends", "mla", "index_group.py")
BACKEND_UTILS = os.path.join("v1", "attention", "backends", "utils.py")
ADAPTIVE = os.path.join("v1", "worker", "gpu", "spec_decode", "adaptive_verification.py")


def default_source() -> str:
    """The pinned release's sources (scripts/upstream.sh), or ESS_VLLM_SOURCE."""
    env = os.environ.get("ESS_VLLM_SOURCE")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", "build", "upstream", "vllm-0.33.0", "vllm")


def _refuse(name):
    def refused(*args, **kwargs):
        raise AssertionError(f"the replay reached vLLM's {name}, which needs CUDA")
    return refused


def _definitions(path, names):
    """The text of each top-level definition in `names`; "Class.method" is a method's, as a function of its own."""
    source = open(path, encoding="utf-8").read()
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found = {}

    def add(node, name, indent=""):
        first = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
        # Blank lines before it, so that tracebacks name the release's own line numbers.
        text = "".join(line[len(indent):] if line.startswith(indent) else line
                       for line in lines[first - 1:node.end_lineno])
        found[name] = "\n" * (first - 1) + text

    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names:
            add(node, node.name)
        if isinstance(node, ast.ClassDef):
            for inner in node.body:
                name = f"{node.name}.{getattr(inner, 'name', '')}"
                if isinstance(inner, ast.FunctionDef) and name in names:
                    add(inner, name, " " * inner.col_offset)
    missing = [n for n in names if n not in found]
    assert not missing, f"{path} no longer defines {missing}: the release's layout changed"
    return [found[n] for n in names]


NAMES = {RUNTIME: ["is_hisparse_decode_batch", "PagedCacheView", "HiSparseCacheHandle", "update_hisparse_residency"],
         INDEX_GROUP: ["SparseMLAIndexGroup", "HiSparseMLAIndexGroup"],
         BACKEND_UTILS: ["split_decodes_and_prefills"],
         # adaptive verification (v1/worker/gpu/model_runner.py prepare_inputs): which drafts the model runner keeps
         # on the device, and the host's token counts then
         ADAPTIVE: ["_assign_draft_token_budget", "AdaptiveVerificationManager.compact_batch"]}


def function(rel, name, source_dir: str = None):
    """One self-contained function of the pinned source (`rel` under vllm/), compiled as it is."""
    path = os.path.join(source_dir or default_source(), *rel.split("/"))
    ns = {}
    (text,) = _definitions(path, [name])
    exec(compile(text, path, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    return ns[name]


def imported():
    """The same names from vLLM itself, imported (in its own venv: scripts/engines.sh), its module functions
    included: what the compiled namespace stands in for is then the release's own code, and a replay that
    reaches a CUDA-only one fails there."""
    import importlib
    torch_utils = importlib.import_module("vllm.utils.torch_utils")
    if not torch.cuda.is_available():   # PyPI's CUDA torch without a device: no pinned staging for async_tensor_h2d
        torch_utils.PIN_MEMORY = False
    out = {}
    for rel, names in NAMES.items():
        module = importlib.import_module("vllm." + rel[:-len(".py")].replace(os.sep, "."))
        for name in names:
            owner, _, attr = name.rpartition(".")
            out[name] = getattr(getattr(module, owner) if owner else module, attr)
    return out


def load(source_dir: str = None):
    """A namespace with upstream's classes and functions: vLLM's own where it imports (ESS_ENGINE=vllm, its venv),
    else compiled from the pinned source."""
    if source_dir is None and os.environ.get("ESS_ENGINE") == "vllm":
        return imported()
    source_dir = source_dir or default_source()
    if not os.path.isdir(source_dir):
        raise AssertionError(f"the pinned vLLM sources are not at {source_dir}: run scripts/upstream.sh")
    module = types.ModuleType("vllm_upstream_replay")   # dataclasses look their module up in sys.modules
    sys.modules[module.__name__] = module
    ns = module.__dict__
    ns.update({
        "torch": torch, "Any": typing.Any, "Callable": typing.Callable,
        "dataclass": dataclasses.dataclass, "field": dataclasses.field, "TypeAlias": typing.TypeAlias,
        "HiSparseTopKResult": typing.Any, "VllmConfig": typing.Any,
        # CUDA-only helpers the loaded classes name: reaching one fails the replay.
        "current_stream": _refuse("current_stream"), "in_piecewise_cudagraph": lambda: False,
        "get_forward_context": _refuse("get_forward_context"), "CUDAGraphMode": None,
        "triton_convert_req_index_to_global_index": _refuse("triton_convert_req_index_to_global_index"),
        "create_hisparse_cache_handle": _refuse("create_hisparse_cache_handle"),
        "_create_side_stream": _refuse("_create_side_stream"), "_create_event": _refuse("_create_event"),
        "ops": None, "FP8_DS_MLA_ROW_BYTES": 656, "HiSparsePrefillStagingPlan": typing.Any,
        "np": np, "Mapping": typing.Mapping, "Sequence": typing.Sequence, "SparseKVResidencyUpdate": typing.Any,
        # vllm/utils/torch_utils.py async_tensor_h2d: a host array to the device (here the CPU): a copy (int32 as
        # int64 under torch 1.x, which indexes with long tensors only; the values are the same).
        "async_tensor_h2d": lambda data, device=None, dtype=None: torch.as_tensor(
            np.asarray(data), device=device,
            dtype=torch.int64 if dtype == torch.int32 and torch.__version__ < "2" else dtype),
    })
    flags = __future__.annotations.compiler_flag
    for rel, names in NAMES.items():
        path = os.path.join(source_dir, rel)
        for name, text in zip(names, _definitions(path, names)):
            owner, _, attr = name.rpartition(".")
            exec(compile(text, path, "exec", flags=flags, dont_inherit=True), ns)
            if owner:   # a method, compiled as a function of its own: named as the class names it
                ns[name] = ns.pop(attr)
    return ns
