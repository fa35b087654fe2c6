#!/usr/bin/env python3
"""The layering rule of docs/architecture.md, checked on every quoted #include of the C++ tree.

Layers, lowest first; a file may include its own layer and those its layer lists:

    runtime   the runtime only (its test-side files: also testing)
    analysis  runtime
    testing   runtime
    capi      runtime, analysis
    harness   runtime, analysis, testing
    tools     runtime, analysis, testing, harness
    bench     runtime, analysis, testing
    tests     everything but bench

Inside the runtime the parts are ordered too: core < model < backend < cache < ops (cuda
beside them) < offload; a part includes only its own and lower ones. The test side of the
runtime (files named *_test.*, *_cases.h, *_bench.*, *_problem.h: tests, their cases and
problems, and the ops' benchmarks) may include any runtime part and the test support.

    scripts/check_layers.py [ROOT]      exit 0 when the tree keeps the rule, 1 with one line per
                                        include that breaks it (file:line: what includes what)
"""
import argparse
import re
import sys
from pathlib import Path

SOURCES = (".h", ".hpp", ".cc", ".cpp", ".c", ".cu", ".cuh", ".in")
FOLDERS = ("include", "src", "tools", "tests", "bench")

ALLOWED = {
    "runtime": {"runtime"},
    "analysis": {"runtime", "analysis"},
    "testing": {"runtime", "testing"},
    "capi": {"runtime", "analysis", "capi"},
    "harness": {"runtime", "analysis", "testing", "harness"},
    "tools": {"runtime", "analysis", "testing", "harness", "tools"},
    "bench": {"runtime", "analysis", "testing", "bench"},
    "tests": {"runtime", "analysis", "testing", "harness", "capi", "tools", "tests"},
}
# The runtime's parts, lowest first (cuda: the CUDA backend's helpers and registration, beside the ops).
RUNTIME_PARTS = {"core": 0, "model": 1, "backend": 2, "cache": 3, "ops": 4, "cuda": 4, "offload": 5}
# Public headers (include/ess/<folder>/...) by the layer and runtime part they belong to.
PUBLIC = {
    "core": ("runtime", "core"), "model": ("runtime", "model"), "cache": ("runtime", "cache"),
    "ops": ("runtime", "ops"), "runtime": ("runtime", "offload"), "trace": ("analysis", None),
    "sim": ("analysis", None), "io": ("analysis", None),
}
PUBLIC_FILES = {
    "ess/runtime/backend.h": ("runtime", "backend"), "ess/runtime/offload.h": ("runtime", "offload"),
    "ess/version.h": ("runtime", "core"), "ess/ess_c.h": ("capi", None),
}
SRC_LAYERS = {"runtime": "runtime", "analysis": "analysis", "testing": "testing", "harness": "harness",
              "capi": "capi"}
TEST_SIDE = re.compile(r"(_test\.[a-z]+|_cases\.h|_bench\.(h|cc)|_problem\.h)$")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def test_side(path: Path) -> bool:
    return bool(TEST_SIDE.search(path.name))


def layer_of_file(root: Path, path: Path):
    """(layer, runtime part or None) of a file of the tree, or None when the rule does not cover it."""
    rel = path.relative_to(root).parts
    top = rel[0]
    if top == "include":
        name = "/".join(rel[1:])
        if name in PUBLIC_FILES:
            return PUBLIC_FILES[name]
        return PUBLIC.get(rel[2]) if len(rel) > 3 else None
    if top == "src":
        layer = SRC_LAYERS.get(rel[1])
        if layer is None:
            return None
        part = rel[2] if layer == "runtime" and len(rel) > 3 else None
        return layer, part
    return {"tools": ("tools", None), "tests": ("tests", None), "bench": ("bench", None)}.get(top)


def layer_of_include(root: Path, including: Path, name: str):
    """(layer, runtime part) of what `#include "name"` in `including` reaches, or None (a system or
    generated header outside the rule)."""
    parts = name.split("/")
    if name in PUBLIC_FILES:
        return PUBLIC_FILES[name]
    if parts[0] == "ess" and len(parts) > 2:
        return PUBLIC.get(parts[1])
    if parts[0] in SRC_LAYERS and len(parts) > 1:
        layer = SRC_LAYERS[parts[0]]
        return layer, (parts[1] if layer == "runtime" and len(parts) > 2 else None)
    # Beside the including file, or under tests/ (the tests' include directory).
    for base in (including.parent, root / "tests"):
        candidate = base / name
        if candidate.is_file():
            return layer_of_file(root, candidate.resolve())
    return None


def check(root: Path):
    problems = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SOURCES or not path.is_file():
                continue
            own = layer_of_file(root, path)
            if own is None:
                continue
            layer, part = own
            side = layer == "runtime" and test_side(path)
            allowed = ALLOWED[layer] | ({"testing"} if side else set())
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                target = layer_of_include(root, path, m.group(1))
                if target is None:
                    continue
                t_layer, t_part = target
                where = f"{path.relative_to(root)}:{number}"
                if t_layer not in allowed:
                    what = f"the runtime's test side ({layer} + testing)" if side else f"layer {layer}"
                    problems.append(f"{where}: {what} includes \"{m.group(1)}\" of layer {t_layer}; "
                                    f"{layer} may include {', '.join(sorted(allowed))}")
                elif (layer == "runtime" and t_layer == "runtime" and not side and part in RUNTIME_PARTS
                      and t_part in RUNTIME_PARTS and RUNTIME_PARTS[t_part] > RUNTIME_PARTS[part]):
                    problems.append(f"{where}: runtime part {part} includes \"{m.group(1)}\" of the higher part "
                                    f"{t_part} (core < model < backend < cache < ops, cuda < offload)")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent))
    root = Path(ap.parse_args().root).resolve()
    if not (root / "src" / "runtime").is_dir():
        print(f"check_layers: {root} holds no src/runtime: not an ESS checkout", file=sys.stderr)
        return 2
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} include(s) break the layering (docs/architecture.md, Layers)",
              file=sys.stderr)
        return 1
    print("check_layers: every include keeps the layering")
    return 0


if __name__ == "__main__":
    sys.exit(main())
