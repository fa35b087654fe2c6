"""install(): ESS's coordinator where SGLang's ModelRunner imports HiSparse's."""
from __future__ import annotations

import logging

from ..._errors import InvalidArgument
from ._common import SGLANG_VERSION
from .coordinator import HiSparseCoordinator

logger = logging.getLogger("ess.integrations.sglang")

UPSTREAM_MODULE = "sglang.srt.managers.hisparse_coordinator"


def _replace(module):
    import sglang
    version = getattr(sglang, "__version__", None)
    if version != SGLANG_VERSION:
        raise InvalidArgument(f"sglang {version}: this adapter is checked against sglang {SGLANG_VERSION} "
                              "(re-run its conformance test against the new release first)")
    if module.HiSparseCoordinator is not HiSparseCoordinator:
        module.ESS_REPLACED = module.HiSparseCoordinator
        module.HiSparseCoordinator = HiSparseCoordinator
        logger.info("ESS: %s.HiSparseCoordinator is ESS's", module.__name__)


class _Finder:
    """Replaces the class as soon as SGLang imports its module (ModelRunner.maybe_init_hisparse_coordinator
    imports it when it builds the coordinator)."""

    def find_spec(self, name, path=None, target=None):
        if name != UPSTREAM_MODULE:
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader

        def exec_module(module, _exec=loader.exec_module):
            _exec(module)
            _replace(module)
        spec.loader.exec_module = exec_module
        return spec


def install():
    """Puts ESS's coordinator where SGLang's ModelRunner takes HiSparse's from
    (sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator), in this process: at once if SGLang's module
    is imported, else when it is. SGLang builds its model runners in spawned processes, which do not inherit
    this: launch with `python -m ess.integrations.sglang_launch ...` (every process of the server then installs
    it at start-up), or call install() at the start of each process. Refuses another sglang release."""
    import sys
    module = sys.modules.get(UPSTREAM_MODULE)
    if module is not None:
        _replace(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
