"""What the upstream call-site scanners (sglang_callsites.py, vllm_callsites.py) and their conformance
tests share: the shape of a call found in upstream's source, and whether our function binds it."""
from __future__ import annotations

import ast
import inspect


def call_shape(parents: dict, node: ast.AST, use) -> ast.AST:
    """If `node` is called (it is the func of its parent ast.Call), records on `use` the call's positional
    count, keyword names and whether it unpacks *args / **kwargs. Returns the parent."""
    parent = parents.get(node)
    if isinstance(parent, ast.Call) and parent.func is node:
        use.call = True
        use.positional = sum(1 for a in parent.args if not isinstance(a, ast.Starred))
        use.keywords = [k.arg for k in parent.keywords if k.arg is not None]
        use.starred = any(isinstance(a, ast.Starred) for a in parent.args) or \
            any(k.arg is None for k in parent.keywords)
    return parent


def binds(fn, positional, keywords) -> bool:
    """Whether a method `fn` accepts self plus `positional` arguments and these keywords."""
    try:
        inspect.signature(fn).bind(object(), *([None] * positional), **{k: None for k in keywords})
        return True
    except TypeError:
        return False
