"""install(): ESS's coordinator where SGLang's ModelRunner imports HiSparse's, the DSA backend's decode wrapped for
ESS's DA overlap (overlap.py) and the DSA indexer's paged top-k for its DBA overlap (indexer_split.py)."""
from __future__ import annotations

import logging

from ..._errors import InvalidArgument
from ._common import SGLANG_VERSION
from .coordinator import HiSparseCoordinator
from .indexer_split import INDEXER_MODULE, patch_indexer
from .overlap import patch_backend

logger = logging.getLogger("ess.integrations.sglang")

UPSTREAM_MODULE = "sglang.srt.managers.hisparse_coordinator"
DSA_BACKEND_MODULE = "sglang.srt.layers.attention.dsa_backend"


def _check_release():
    import sglang
    version = getattr(sglang, "__version__", None)
    if version != SGLANG_VERSION:
        raise InvalidArgument(f"sglang {version}: this adapter is checked against sglang {SGLANG_VERSION} "
                              "(re-run its conformance test against the new release first)")


def _replace(module):
    _check_release()
    if module.HiSparseCoordinator is not HiSparseCoordinator:
        module.ESS_REPLACED = module.HiSparseCoordinator
        module.HiSparseCoordinator = HiSparseCoordinator
        logger.info("ESS: %s.HiSparseCoordinator is ESS's", module.__name__)


def _wrap_decode(module):
    """DeepseekSparseAttnBackend.forward_decode: SGLang's own unless ESS's coordinator runs DA on the layer."""
    _check_release()
    patch_backend(module.DeepseekSparseAttnBackend)


def _wrap_indexer(module):
    """Indexer._get_topk_paged: SGLang's own unless ESS's coordinator runs DBA on the layer."""
    _check_release()
    patch_indexer(module.Indexer)


_PATCHES = {UPSTREAM_MODULE: _replace, DSA_BACKEND_MODULE: _wrap_decode, INDEXER_MODULE: _wrap_indexer}


class _Finder:
    """Patches each module as soon as SGLang imports it (ModelRunner.maybe_init_hisparse_coordinator imports the
    coordinator's module when it builds the coordinator; the attention backends' registry imports dsa_backend)."""

    def find_spec(self, name, path=None, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader

        def exec_module(module, _exec=loader.exec_module):
            _exec(module)
            patch(module)
        spec.loader.exec_module = exec_module
        return spec


def install():
    """Puts ESS's coordinator where SGLang's ModelRunner takes HiSparse's from
    (sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator), wraps the DSA backend's forward_decode for
    ESS_OVERLAP = da / dba and the DSA indexer's _get_topk_paged for dba, in this process: at once for a module
    already imported, else when it is. SGLang builds its model runners in spawned processes, which do not inherit
    this: launch with
    `python -m ess.integrations.sglang_launch ...` (every process of the server then installs it at start-up), or
    call install() at the start of each process. Refuses another sglang release."""
    import sys
    pending = False
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending = True
    if pending and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
