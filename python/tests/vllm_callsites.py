"""Every use vLLM makes of a HiSparse cache handle's runtime, found by reading the release's source with `ast`
(not from a list written here): each attribute read or method call on `<handle>.runtime` (a handle being any
expression: `self` in HiSparseCacheHandle, `cache`, `leader`, `self.cache_handles[i]`, ...), with its positional
and keyword arguments and the members read on the attribute (runtime.hot.attention_cache), in every file that
names HiSparse. A runtime passed on whole (release_pinned_state([cache.runtime ...])) is a use named "<passed>".

Upstream's own runtime module (the HiSparseRuntime and HiSparseIndexGroup classes ESS replaces) is scanned only
outside those classes."""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from typing import List, Optional

from callsite_ast import call_shape

ATTRIBUTE = "runtime"
OWN_CLASSES = {os.path.join("v1", "hisparse", "runtime.py"): {"HiSparseRuntime", "HiSparseIndexGroup"}}
MODULES = {"triton", "cute", "cutlass", "helion", "torch", "knobs"}   # X.runtime where X is a module


@dataclass
class Use:
    path: str          # relative to the vllm package
    line: int
    function: str      # enclosing def
    cls: str           # enclosing class ("" at module level)
    name: str          # member of the runtime, or "<passed>"
    call: bool = False
    positional: int = 0
    keywords: List[str] = field(default_factory=list)
    starred: bool = False
    store: bool = False  # runtime.X = ... (an assignment to the member)
    members: List[str] = field(default_factory=list)   # read on the member (hot.attention_cache)

    def where(self) -> str:
        return f"{self.path}:{self.line} ({self.cls + '.' if self.cls else ''}{self.function})"


def _is_runtime(node) -> bool:
    if not (isinstance(node, ast.Attribute) and node.attr == ATTRIBUTE and isinstance(node.ctx, ast.Load)):
        return False
    base = node.value
    while isinstance(base, ast.Attribute):
        base = base.value
    return not (isinstance(base, ast.Name) and base.id in MODULES)


class _Scan:
    def __init__(self, path, tree, skip_classes):
        self.path, self.uses = path, []
        self.parents = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                cls = self._class_of(node)
                if cls in skip_classes or self._inner(node):
                    continue
                self._function(node, cls)

    def _class_of(self, node):
        p = self.parents.get(node)
        while p is not None and not isinstance(p, ast.ClassDef):
            p = self.parents.get(p)
        return p.name if p is not None else ""

    def _inner(self, node):
        p = self.parents.get(node)
        while p is not None:
            if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return True
            p = self.parents.get(p)
        return False

    def _function(self, fn, cls):
        aliases = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _is_runtime(node.value):
                aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(fn):
            runtime = _is_runtime(node) or (isinstance(node, ast.Name) and node.id in aliases and
                                            isinstance(node.ctx, ast.Load))
            if not runtime:
                continue
            parent = self.parents.get(node)
            if isinstance(parent, ast.Assign) and parent.value is node:
                continue   # an alias: its uses are scanned
            if isinstance(parent, ast.Attribute) and parent.value is node:
                use = Use(self.path, parent.lineno, fn.name, cls, parent.attr, store=isinstance(parent.ctx, ast.Store))
                call_shape(self.parents, parent, use)
                above = self.parents.get(parent)
                if isinstance(above, ast.Attribute) and above.value is parent:
                    use.members.append(above.attr)
            elif isinstance(parent, ast.Compare) or (isinstance(parent, ast.Call) and parent.func is node):
                continue
            else:
                use = Use(self.path, node.lineno, fn.name, cls, "<passed>")
            self.uses.append(use)


def scan(package_dir: str):
    """Every use under `package_dir` (the `vllm` package folder), sorted by place."""
    uses: List[Use] = []
    for root, dirs, files in os.walk(package_dir):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.normpath(os.path.relpath(os.path.join(root, name), package_dir))
            with open(os.path.join(root, name), encoding="utf-8") as f:
                source = f.read()
            if "hisparse" not in source.lower() or "." + ATTRIBUTE not in source:
                continue
            tree = ast.parse(source, filename=rel)
            uses.extend(_Scan(rel, tree, OWN_CLASSES.get(rel, set())).uses)
    unique = {(u.path, u.line, u.name, u.call): u for u in uses}
    return sorted(unique.values(), key=lambda u: (u.path, u.line))


def default_source() -> Optional[str]:
    """The pinned release's sources (scripts/upstream.sh), or ESS_VLLM_SOURCE."""
    env = os.environ.get("ESS_VLLM_SOURCE")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", "build", "upstream", "vllm-0.33.0", "vllm")
