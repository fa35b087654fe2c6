"""ess/_lib.py's ctypes declarations against include/ess/ess_c.h, parsed (pycparser), not copied: every
function the header declares has a signature in _lib with the same return and parameter types, every
struct _lib mirrors has the header's fields in the header's order with the same types, and nothing in
_lib names what the header does not declare."""
import ctypes
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

pycparser = pytest.importorskip("pycparser", reason="pycparser (Debian python3-pycparser) parses ess_c.h")
from pycparser import c_ast  # noqa: E402

from ess import _lib  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "include" / "ess" / "ess_c.h"

# The C types of the header and the ctypes type _lib must use for them.
SCALARS = {
    "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t, "double": ctypes.c_double,
    "ess_status": ctypes.c_int, "ess_backend": ctypes.c_int, "ess_policy": ctypes.c_int,
}
# Stand-ins for the system and DLPack headers: only the names ess_c.h uses, so the parse needs no
# compiler extensions.
STUBS = {
    "stddef.h": "typedef unsigned long size_t;\n",
    "stdint.h": "typedef int int32_t; typedef long long int64_t; typedef unsigned int uint32_t;\n"
                "typedef unsigned long long uint64_t;\n",
    "dlpack/dlpack.h": "typedef struct DLTensor DLTensor;\n",
}


def parse_header():
    """The header preprocessed against the stand-ins, as a pycparser AST."""
    with tempfile.TemporaryDirectory() as d:
        for name, text in STUBS.items():
            p = Path(d) / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        cpp = os.environ.get("CPP", "cpp")
        text = subprocess.run([cpp, "-P", "-nostdinc", "-I", d, "-D__attribute__(x)=", str(HEADER)],
                              check=True, capture_output=True, text=True).stdout
    return pycparser.c_parser.CParser().parse(text, str(HEADER))


def type_name(node):
    """A declaration's type as (base name, pointer depth, whether the pointee is const)."""
    depth = 0
    while isinstance(node, (c_ast.PtrDecl, c_ast.ArrayDecl)):
        depth += 1
        node = node.type
    base = node.type
    if isinstance(base, c_ast.IdentifierType):
        name = " ".join(base.names)
    elif isinstance(base, (c_ast.Struct, c_ast.Enum)):
        name = base.name
    else:
        raise AssertionError(f"unexpected type node {base}")
    return name, depth, "const" in node.quals


def expected_ctype(c_type, structs):
    """The ctypes type _lib must declare for a C type."""
    name, depth, const = c_type
    if depth == 0:
        return None if name == "void" else SCALARS[name]
    if depth == 1:
        if name == "char":
            # A string in (const char*); a string the library gave out, passed back to be freed, stays a pointer.
            return ctypes.c_char_p if const else ctypes.c_void_p
        if name in SCALARS:
            return ctypes.POINTER(SCALARS[name])
        if name in structs:  # a struct _lib mirrors
            return ctypes.POINTER(structs[name])
        return ctypes.c_void_p  # void*, opaque handles (ess_engine*), DLTensor*
    if depth == 2 and name not in SCALARS:
        return ctypes.POINTER(ctypes.c_void_p)  # a handle or pointer out: ess_engine**, void**, char**
    raise AssertionError(f"no ctypes rule for {c_type}")


def same(a, b):
    if a is None or b is None:
        return a is b
    return a == b or (hasattr(a, "_type_") and hasattr(b, "_type_") and a.__name__ == b.__name__
                      and same(a._type_, b._type_))


class Declarations(c_ast.NodeVisitor):
    def __init__(self):
        self.functions, self.structs = {}, {}

    def visit_Decl(self, node):
        if isinstance(node.type, c_ast.FuncDecl):
            fd = node.type
            params = []
            for p in (fd.args.params if fd.args else []):
                if isinstance(p, c_ast.Typename) and type_name(p.type)[:2] == ("void", 0):
                    continue  # f(void)
                params.append(type_name(p.type))
            self.functions[node.name] = (type_name(fd.type), params)
        self.generic_visit(node)

    def visit_Struct(self, node):
        if node.decls is not None:
            self.structs[node.name] = [(d.name, type_name(d.type)) for d in node.decls]


def mirrored_structs():
    """The header's structs as _lib mirrors them."""
    return {
        "ess_config": _lib.Config, "ess_engine_info": _lib.EngineInfo, "ess_stats": _lib.Stats,
        "ess_host_layout": _lib.HostLayout, "ess_step_tensors": _lib.StepTensors,
    }


def function_problems(header, signatures, structs):
    problems = []
    for name in sorted(set(header.functions) - set(signatures)):
        problems.append(f"ess_c.h declares {name}, which _lib.py does not")
    for name in sorted(set(signatures) - set(header.functions)):
        problems.append(f"_lib.py declares {name}, which ess_c.h does not")
    for name, (ret, params) in sorted(header.functions.items()):
        if name not in signatures:
            continue
        restype, argtypes = signatures[name]
        if not same(restype, expected_ctype(ret, structs)):
            problems.append(f"{name}: returns {ret}, _lib says {restype}")
        if len(argtypes) != len(params):
            problems.append(f"{name}: {len(params)} parameters, _lib declares {len(argtypes)}")
            continue
        for i, (c_type, py) in enumerate(zip(params, argtypes)):
            if not same(py, expected_ctype(c_type, structs)):
                problems.append(f"{name}: parameter {i} is {c_type}, _lib says {py}")
    return problems


def struct_problems(header, structs):
    problems = []
    for c_name, cls in structs.items():
        if c_name not in header.structs:
            problems.append(f"_lib mirrors {c_name}, which ess_c.h does not define")
            continue
        fields = header.structs[c_name]
        if [f for f, _ in cls._fields_] != [f for f, _ in fields]:
            problems.append(f"{c_name}: fields differ: ess_c.h {[f for f, _ in fields]}, _lib {[f for f, _ in cls._fields_]}")
            continue
        for (f, c_type), (_, py) in zip(fields, cls._fields_):
            if not same(py, expected_ctype(c_type, structs)):
                problems.append(f"{c_name}.{f} is {c_type}, _lib says {py}")
    # Every struct the header gives an ess_*_init (the structs a caller fills) is mirrored.
    inited = {params[0][0] for fn, (_, params) in header.functions.items() if fn.endswith("_init") and params}
    for c_name in sorted(inited - set(structs)):
        problems.append(f"ess_c.h has {c_name} (with an init function), which _lib does not mirror")
    return problems


@pytest.fixture(scope="module")
def header():
    v = Declarations()
    v.visit(parse_header())
    return v


def test_the_parse_sees_the_whole_header(header):
    declared = set(re.findall(r"ESS_API\s+[^;(]*?\b(ess_\w+)\s*\(", HEADER.read_text()))
    assert declared and declared == set(header.functions), "the parse and the header's ESS_API lines disagree"
    assert {"ess_config", "ess_stats", "ess_step_tensors"} <= set(header.structs)


def test_every_function_is_declared_with_the_header_types(header):
    assert function_problems(header, _lib._signatures, mirrored_structs()) == []


def test_every_mirrored_struct_has_the_header_fields_in_order(header):
    assert struct_problems(header, mirrored_structs()) == []


def test_a_changed_declaration_is_caught(header):
    """The check can fail: a parameter's width changed, a function dropped, a field dropped or retyped."""
    structs = mirrored_structs()
    changed = dict(_lib._signatures)
    restype, argtypes = changed["ess_step"]
    changed["ess_step"] = (restype, [argtypes[0], ctypes.c_int64] + list(argtypes[2:]))
    del changed["ess_request_reset"]
    problems = function_problems(header, changed, structs)
    assert any(p.startswith("ess_step: parameter 1") for p in problems), problems
    assert any("ess_request_reset, which _lib.py does not" in p for p in problems), problems

    class Dropped:
        _fields_ = _lib.Stats._fields_[:-1]

    class Retyped:
        _fields_ = [(f, ctypes.c_int32 if f == "max_context" else t) for f, t in _lib.Config._fields_]

    problems = struct_problems(header, dict(structs, ess_stats=Dropped, ess_config=Retyped))
    assert any(p.startswith("ess_stats: fields differ") for p in problems), problems
    assert any(p.startswith("ess_config.max_context") for p in problems), problems
