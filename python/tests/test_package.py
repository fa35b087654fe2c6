"""The package's own facts: one version (project(ess VERSION) of CMakeLists.txt) with the CUDA build named,
the order libess is looked for in, and, for an installed wheel (ESS_TEST_INSTALLED=1), its bundled libess.so
and `ess` program."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ess
from ess import _lib

REPO = Path(__file__).resolve().parents[2]
INSTALLED = os.environ.get("ESS_TEST_INSTALLED") == "1"


def project_version():
    m = re.search(r"project\(ess VERSION ([0-9]+\.[0-9]+\.[0-9]+)", (REPO / "CMakeLists.txt").read_text())
    assert m, "CMakeLists.txt has no project(ess VERSION x.y.z)"
    return m.group(1)


def test_version_is_the_projects_and_names_the_cuda_build():
    label = "cuda" if ess.cuda_built() else "cpu"
    assert ess.__version__ == f"{project_version()}+{label}"


def layout(root: Path, files):
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    return root


def test_an_installed_package_uses_its_own_library_only(tmp_path):
    site = layout(tmp_path / "lib" / "python3" / "site-packages", ["ess/__init__.py", "ess/libess.so"])
    # A build tree where a checkout's would be, relative to the package: never looked at.
    layout(tmp_path / "lib", ["build/release/src/capi/libess.so"])
    assert list(_lib._candidates(site / "ess", None)) == [site / "ess" / "libess.so"]


def test_an_installed_package_without_its_library_skips_build_trees(tmp_path):
    site = layout(tmp_path / "python", ["ess/__init__.py"])  # named python/, but no checkout around it
    layout(tmp_path, ["build/release/src/capi/libess.so"])
    assert not [p for p in _lib._candidates(site / "ess", None) if "build" in p.parts]


def test_a_checkout_looks_in_its_build_trees(tmp_path):
    layout(tmp_path, ["include/ess/ess_c.h", "python/ess/__init__.py", "build/mine/src/capi/libess.so"])
    found = list(_lib._candidates(tmp_path / "python" / "ess", None))
    assert found[:3] == [tmp_path / "build" / p / "src" / "capi" / "libess.so" for p in ("release", "cpu", "debug")]
    assert tmp_path / "build" / "mine" / "src" / "capi" / "libess.so" in found


def test_ess_library_comes_first_and_alone(tmp_path):
    site = layout(tmp_path, ["ess/libess.so"])
    assert list(_lib._candidates(site / "ess", "/elsewhere/libess.so")) == [Path("/elsewhere/libess.so")]


@pytest.mark.skipif(not INSTALLED, reason="an installed wheel only (ESS_TEST_INSTALLED=1)")
def test_the_wheel_loads_its_bundled_library():
    assert "ESS_LIBRARY" not in os.environ
    assert Path(ess.library_path) == Path(ess.__file__).resolve().parent / "libess.so"
    from importlib.metadata import version
    assert version("ess") == project_version()


@pytest.mark.skipif(not INSTALLED, reason="an installed wheel only (ESS_TEST_INSTALLED=1)")
def test_the_ess_program_is_on_path_with_the_same_version():
    program = shutil.which("ess", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    assert program, "no ess program beside the interpreter or on PATH"
    out = subprocess.run([program, "--version"], capture_output=True, text=True, check=True).stdout
    built = "built" if ess.cuda_built() else "not built"
    assert out.strip() == f"ess {project_version()} (CUDA target: {built})"
