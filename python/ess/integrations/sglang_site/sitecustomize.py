"""Run at the start-up of every Python process of an SGLang server launched by
`python -m ess.integrations.sglang_launch` (this folder is on PYTHONPATH, which spawned processes
inherit): installs ESS's coordinator in place of SGLang's HiSparseCoordinator, then runs the
sitecustomize this one shadows, if there is one further down the path."""
import importlib.util
import os
import sys

if os.environ.get("ESS_SGLANG") == "1":
    from ess.integrations.sglang import install

    install()

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _candidate = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.abspath(os.path.dirname(_candidate)) != _here and os.path.isfile(_candidate):
        _spec = importlib.util.spec_from_file_location("_ess_shadowed_sitecustomize", _candidate)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
