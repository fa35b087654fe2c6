"""Every use SGLang makes of its HiSparse coordinator, found by reading the release's source with `ast`
(not from a list written here): the constructor call, each attribute read or method call on the
coordinator object, with its positional and keyword arguments, and the attributes read on what a call
returned.

The coordinator object is any expression `<x>.hisparse_coordinator`, a parameter named
`hisparse_coordinator`, or a local name assigned from one of those in the same function."""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from typing import List, Optional

from callsite_ast import call_shape

ATTRIBUTE = "hisparse_coordinator"
OWN_MODULE = os.path.join("srt", "managers", "hisparse_coordinator.py")


@dataclass
class Use:
    path: str                 # relative to the sglang package
    line: int
    function: str             # enclosing def
    name: str                 # attribute or method on the coordinator
    call: bool = False
    positional: int = 0
    keywords: List[str] = field(default_factory=list)
    starred: bool = False     # *args / **kwargs: the binding cannot be checked from the source
    result_attributes: List[str] = field(default_factory=list)  # read on the call's result
    # Members used on an attribute (coordinator.mem_pool_host.alloc_paged_token_slots(...)): Uses whose name is
    # the member.
    members: List["Use"] = field(default_factory=list)

    def where(self) -> str:
        return f"{self.path}:{self.line} ({self.function})"


@dataclass
class Construction:
    path: str
    line: int
    function: str
    positional: int
    keywords: List[str]


def _is_coordinator(node: ast.AST, aliases: set) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == ATTRIBUTE and isinstance(node.ctx, ast.Load):
        return True
    return isinstance(node, ast.Name) and node.id in aliases and isinstance(node.ctx, ast.Load)


class _FunctionScan(ast.NodeVisitor):
    def __init__(self, path: str, function: ast.AST, uses: List[Use], constructions: List[Construction]):
        self.path, self.uses, self.constructions = path, uses, constructions
        self.function = getattr(function, "name", "<module>")
        self.aliases = set()
        self.parents = {}
        args = getattr(function, "args", None)
        if args is not None:
            for a in args.args + args.kwonlyargs + args.posonlyargs:
                if a.arg == ATTRIBUTE:
                    self.aliases.add(a.arg)
        body = function.body if hasattr(function, "body") else []
        # Aliases first (a name assigned from the coordinator anywhere in this function).
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                value = node.value
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if value is not None and isinstance(value, ast.Attribute) and value.attr == ATTRIBUTE:
                    for t in targets:
                        if isinstance(t, ast.Name):
                            self.aliases.add(t.id)
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.results = {}  # local name -> Use whose call result it holds
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            self._visit(node)
        self._result_attributes(body)

    def _visit(self, node):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "HiSparseCoordinator") or \
                    (isinstance(f, ast.Attribute) and f.attr == "HiSparseCoordinator"):
                self.constructions.append(Construction(
                    self.path, node.lineno, self.function, len(node.args),
                    [k.arg for k in node.keywords if k.arg is not None]))
        if isinstance(node, ast.Attribute) and _is_coordinator(node.value, self.aliases):
            use = Use(self.path, node.lineno, self.function, node.attr)
            parent = call_shape(self.parents, node, use)
            if isinstance(parent, ast.Attribute) and parent.value is node and isinstance(parent.ctx, ast.Load):
                member = Use(self.path, parent.lineno, self.function, parent.attr)
                call_shape(self.parents, parent, member)
                use.members.append(member)
            if use.call:
                assign = self.parents.get(parent)
                if isinstance(assign, ast.Assign) and len(assign.targets) == 1 and \
                        isinstance(assign.targets[0], ast.Name):
                    self.results[assign.targets[0].id] = use
                elif isinstance(assign, ast.Attribute) and assign.value is parent:
                    use.result_attributes.append(assign.attr)
            self.uses.append(use)

    def _result_attributes(self, body):
        stores = {}
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                stores[node.id] = stores.get(node.id, 0) + 1
        # A name assigned more than once may hold something else where it is read.
        self.results = {n: u for n, u in self.results.items() if stores.get(n) == 1}
        if not self.results:
            return
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in self.results and isinstance(node.ctx, ast.Load):
                self.results[node.value.id].result_attributes.append(node.attr)


def _functions(tree: ast.AST):
    """The module body, then every def, outer before inner (each scanned on its own: aliases are per
    function; a later, inner scan's record of a use replaces an outer one's)."""
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def scan(package_dir: str, skip_tests: bool = True):
    """(uses, constructions) over every .py file under `package_dir` (the `sglang` package folder)."""
    uses: List[Use] = []
    constructions: List[Construction] = []
    for root, dirs, files in os.walk(package_dir):
        dirs.sort()
        rel_root = os.path.relpath(root, package_dir)
        if skip_tests and (rel_root == "test" or rel_root.startswith("test" + os.sep)):
            continue
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.normpath(os.path.join(rel_root, name))
            if rel == OWN_MODULE:
                continue
            with open(os.path.join(root, name), encoding="utf-8") as f:
                source = f.read()
            if ATTRIBUTE not in source and "HiSparseCoordinator(" not in source:
                continue
            tree = ast.parse(source, filename=rel)
            for fn in _functions(tree):
                scanner = _FunctionScan(rel, fn, [], [])
                uses.extend(scanner.uses)
                constructions.extend(scanner.constructions)
    # The module walk and an enclosing def see a use again: keep the innermost def's (it knows its aliases).
    unique, built = {}, {}
    for u in uses:
        key = (u.path, u.line, u.name, u.call)
        unique[key] = u
    for c in constructions:
        built[(c.path, c.line)] = c
    constructions = sorted(built.values(), key=lambda c: (c.path, c.line))
    return sorted(unique.values(), key=lambda u: (u.path, u.line)), constructions


def default_source() -> Optional[str]:
    """The pinned release's sources (scripts/upstream.sh), or ESS_SGLANG_SOURCE."""
    env = os.environ.get("ESS_SGLANG_SOURCE")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", "build", "upstream", "sglang-0.5.23", "sglang")
