"""install() and the launcher put ESS's coordinator where SGLang's ModelRunner imports HiSparse's from,
in the launching process and in the processes SGLang spawns (multiprocessing 'spawn', as SGLang starts
its schedulers). SGLang itself does not import here, so a stand-in package with the same module path
(sglang.srt.managers.hisparse_coordinator) and a launch_server that spawns a child play its part."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ess

PYTHON_DIR = Path(ess.__file__).resolve().parent.parent  # where `ess` is imported from: the checkout's python/ or site-packages

LAUNCH_SERVER = textwrap.dedent('''
    import multiprocessing as mp
    import sys

    def which():
        # ModelRunner.maybe_init_hisparse_coordinator imports the class at the call
        from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator
        # the attention backends' registry imports the DSA backend
        from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
        wrapped = getattr(DeepseekSparseAttnBackend.forward_decode, "ess_original", None) is not None
        return HiSparseCoordinator.__module__ + ("+da" if wrapped else "")

    def child(q):
        q.put(which())

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        print("parent", which(), "child", q.get(timeout=60), "args", " ".join(sys.argv[1:]))
        p.join()
''')


def fake_sglang(root: Path, version: str):
    pkg = root / "sglang"
    (pkg / "srt" / "managers").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "srt" / "managers" / "__init__.py").write_text("")
    (pkg / "srt" / "managers" / "hisparse_coordinator.py").write_text("class HiSparseCoordinator:\n    pass\n")
    (pkg / "srt" / "layers" / "attention").mkdir(parents=True)
    (pkg / "srt" / "layers" / "__init__.py").write_text("")
    (pkg / "srt" / "layers" / "attention" / "__init__.py").write_text("")
    (pkg / "srt" / "layers" / "attention" / "dsa_backend.py").write_text(
        "class DeepseekSparseAttnBackend:\n    def forward_decode(self, q, k, v, layer, forward_batch):\n"
        "        pass\n    def forward_extend(self, q, k, v, layer, forward_batch):\n        pass\n")
    (pkg / "launch_server.py").write_text(LAUNCH_SERVER)


def launch(tmp_path, version):
    fake_sglang(tmp_path, version)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR), str(tmp_path)])
    env.pop("ESS_SGLANG", None)
    return subprocess.run([sys.executable, "-m", "ess.integrations.sglang_launch", "--enable-hisparse", "--tp", "1"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_the_launcher_installs_in_every_process(tmp_path):
    r = launch(tmp_path, "0.5.23")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["parent", "ess.integrations.sglang+da", "child", "ess.integrations.sglang+da",
                                "args", "--enable-hisparse", "--tp", "1"], r.stdout


def test_another_sglang_release_is_refused(tmp_path):
    r = launch(tmp_path, "0.5.22")
    assert r.returncode != 0
    assert "sglang 0.5.22: this adapter is checked against sglang 0.5.23" in r.stderr


def test_install_replaces_an_imported_module(tmp_path, monkeypatch):
    fake_sglang(tmp_path, "0.5.23")
    code = ("import sglang.srt.managers.hisparse_coordinator as m\n"
            "from ess.integrations import sglang as a\n"
            "old = m.HiSparseCoordinator\n"
            "import sglang.srt.layers.attention.dsa_backend as d\n"
            "decode = d.DeepseekSparseAttnBackend.forward_decode\n"
            "a.install(); a.install()\n"
            "assert m.HiSparseCoordinator is a.HiSparseCoordinator and m.ESS_REPLACED is old\n"
            "assert d.DeepseekSparseAttnBackend.forward_decode.ess_original is decode\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PYTHON_DIR), str(tmp_path)]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
