"""vLLM 0.33.0 itself, imported from the pinned release (a venv from scripts/engines.sh; a missing import fails,
never skips): the modules ESS's connector binds to load on this CPU with their own dependencies, so the replays
can move onto vLLM's own classes (python/tests/test_vllm_replay.py still compiles their source into a namespace
of stand-ins: docs/integration.md lists which)."""
import importlib

import pytest

from ess.integrations import vllm as adapter

MODULES = [
    "vllm.v1.hisparse.runtime",                                      # PagedCacheView, HiSparseCacheHandle
    "vllm.v1.hisparse.coordinator",                                  # HiSparseCoordinator (scheduler side)
    "vllm.v1.attention.backends.mla.index_group",                    # HiSparseMLAIndexGroup (idx_mapping)
    "vllm.v1.attention.backends.utils",                              # split_decodes_and_prefills
    "vllm.v1.core.sched.output",                                     # SchedulerOutput, CachedRequestData
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.worker",
]


def test_the_pinned_release_is_imported():
    import vllm
    assert vllm.__version__ == adapter.VLLM_VERSION


@pytest.mark.parametrize("name", MODULES)
def test_the_modules_the_connector_binds_to_import(name):
    importlib.import_module(name)


def test_the_replays_stand_ins_name_what_the_release_defines():
    """Every class the replay compiles from source is the release's own, by name, in the imported modules."""
    from vllm.v1.attention.backends import utils
    from vllm.v1.attention.backends.mla import index_group
    from vllm.v1.hisparse import runtime
    for module, names in ((runtime, ["is_hisparse_decode_batch", "PagedCacheView", "HiSparseCacheHandle"]),
                          (index_group, ["SparseMLAIndexGroup", "HiSparseMLAIndexGroup"]),
                          (utils, ["split_decodes_and_prefills"])):
        for name in names:
            assert hasattr(module, name), (module.__name__, name)
