"""ess.integrations.vllm_connector's own code on CPU, its vLLM bases stood in for by the little of them it uses
(test_vllm_conformance.py holds what it reads to the pinned release's source): what register_kv_caches builds
from upstream's handles and runtimes, start_load_kv's reading of the scheduler output and of vLLM's host pool
through the source block table, the refusals, the shared pool per node and the order of shutdown. The handles
are upstream's own class (vllm_upstream.py)."""
import os
import sys
import types

import numpy as np
import pytest
import torch

import ess
from ess.integrations import vllm as adapter
import vllm_upstream

UP = vllm_upstream.load()
K, T, SLOTS, STATES, BLOCK, BLOCKS, CTX = 16, 1, 24, 4, 64, 6, 320


class UpstreamWorker:
    """worker.py HiSparseConnectorWorker as far as EssConnectorWorker uses it."""

    def __init__(self, vllm_config, kv_cache_config):
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config

    def register_kv_caches(self, kv_caches):
        world = self.kv_cache_config   # the test's world, where upstream reads its KV cache config
        self.cache_handles = world.handles
        self.host_caches = tuple(world.host)
        self.kernel_block_size = BLOCK
        self._group_leaders = (("layers.0", world.handles[0]),)

    def shutdown(self):
        self.runtimes_at_shutdown = [h.runtime for h in self.cache_handles]


class UpstreamConnector:
    """connector.py HiSparseConnector as far as ours uses it."""

    def __init__(self, vllm_config, role, kv_cache_config):
        self.connector_worker = UpstreamWorker(vllm_config, kv_cache_config) if role == "worker" else None
        self.metadata = types.SimpleNamespace(all_context_pages_resident=False)
        self.loads = []

    def register_kv_caches(self, kv_caches):   # upstream's: its worker's
        self.connector_worker.register_kv_caches(kv_caches)

    def shutdown(self):
        self.connector_worker.shutdown()

    def start_load_kv(self, forward_context, **kwargs):
        self.loads.append(kwargs)

    def _get_connector_metadata(self):
        return self.metadata


@pytest.fixture
def connector_module(monkeypatch):
    """Stand-ins for the vLLM modules vllm_connector imports; `shared` switches the pool per node on."""
    state = types.SimpleNamespace(shared=False, rank=0, barriers=0)
    modules = {
        "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector": dict(HiSparseConnector=UpstreamConnector),
        "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.worker": dict(HiSparseConnectorWorker=UpstreamWorker),
        "vllm.distributed.parallel_state": dict(
            get_tensor_model_parallel_rank=lambda: state.rank,
            get_tp_group=lambda: types.SimpleNamespace(barrier=lambda: setattr(state, "barriers", state.barriers + 1))),
        "vllm.v1.attention.backend": dict(max_decode_query_len=lambda config: T),
        "vllm.v1.hisparse.runtime": dict(use_shared_hisparse_host_pool=lambda config: state.shared),
    }
    for name, members in modules.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in sys.modules or not getattr(sys.modules[sub], "_ess_stand_in", False):
                module = types.ModuleType(sub)
                module._ess_stand_in = True
                monkeypatch.setitem(sys.modules, sub, module)
                if i > 1:
                    setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], module)
        for key, value in members.items():
            setattr(sys.modules[name], key, value)
    monkeypatch.delitem(sys.modules, "ess.integrations.vllm_connector", raising=False)
    import ess.integrations.vllm_connector as module
    yield module, state
    sys.modules.pop("ess.integrations.vllm_connector", None)


class World:
    """vLLM's side: three target layers and a speculator layer, their handles with upstream's runtimes, vLLM's host
    pool (per layer) and the host block table of each request state (blocks in no particular order)."""

    def __init__(self, seed=4):
        rng = np.random.default_rng(seed)
        self.host = [torch.from_numpy(rng.integers(0, 256, (STATES * BLOCKS * BLOCK, 656), dtype=np.uint8))
                     for _ in range(4)]
        self.source = torch.from_numpy(rng.permutation(STATES * BLOCKS).reshape(STATES, BLOCKS).astype(np.int32))
        self.handles = []
        for layer in range(4):
            handle = UP["HiSparseCacheHandle"](types.SimpleNamespace(
                region_stride=SLOTS, device=torch.device("cpu"), is_group_leader=True, eager_host_mirror=True,
                request_state_indices=torch.full((STATES,), -1, dtype=torch.int32), resident_source_index=0,
                index_group=types.SimpleNamespace(shared_topk=types.SimpleNamespace(
                    device_topk_rows=torch.empty((STATES * T, K), dtype=torch.int32)))))
            handle.source_block_table = self.source
            handle.draft_layer = layer == 3
            self.handles.append(handle)

    def host_rows(self, layer, state, first, count):
        tokens = np.arange(first, first + count)
        rows = self.source[state].numpy().astype(np.int64)[tokens // BLOCK] * BLOCK + tokens % BLOCK
        return self.host[layer][torch.from_numpy(rows)].numpy()


def config(eager=True, instance="t"):
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={"ess_host_gib": 0.01}),
        attention_config=types.SimpleNamespace(hisparse_config=types.SimpleNamespace(eager_host_mirror=eager)),
        scheduler_config=types.SimpleNamespace(max_num_seqs=STATES),
        model_config=types.SimpleNamespace(max_model_len=CTX), instance_id=f"{instance}-{os.getpid()}",
        parallel_config=types.SimpleNamespace(data_parallel_index=0))


def scheduler_output(new=(), cached=(), finished=()):
    """SchedulerOutput's fields the connector reads: new and cached requests as (id, computed, scheduled)."""
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                                    num_computed_tokens=[c for _, c, _ in cached]),
        num_scheduled_tokens={r: n for r, _, n in list(new) + list(cached)}, finished_req_ids=set(finished),
        preempted_req_ids=None)


def attn(decodes):
    return {"layers.0": types.SimpleNamespace(num_decodes=decodes, num_decode_tokens=decodes * T)}


def test_register_start_load_and_shutdown(connector_module):
    module, _ = connector_module
    world = World()
    upstream = [h.runtime for h in world.handles]
    c = module.HiSparseConnector(config(), "worker", world)
    c.register_kv_caches({})
    worker = c.connector_worker
    info = worker.ess_engine.info
    assert (info.layers, info.slots, info.query_tokens, info.topk, info.backend) == (3, SLOTS, T, K, "cpu")
    assert all(isinstance(h.runtime, adapter.HiSparseRuntime) and h.runtime.upstream is u
               for h, u in zip(world.handles[:3], upstream))
    assert world.handles[3].runtime is upstream[3], "the speculator's layer keeps vLLM's runtime"
    # Two requests decode at states 2 and 0 after their prefill: ESS takes their context from vLLM's host pool.
    out = scheduler_output(cached=[("a", 150, T), ("b", 70, T)])
    c.start_load_kv(None, scheduler_output=out, request_ids=["a", "b"],
                    request_state_indices=torch.tensor([2, 0], dtype=torch.int32), attn_metadata=attn(2))
    assert c.loads and worker.ess.state_of == {"a": 2, "b": 0}
    for layer in range(3):
        got = worker.ess_engine.read_entries(2, layer, 0, np.empty((150, 656), np.uint8))
        np.testing.assert_array_equal(got, world.host_rows(layer, 2, 0, 150))
    # The batch condensed: "b" finished, "a" at batch row 0. A forward with other decode rows is refused before
    # anything changes; then the step runs.
    out = scheduler_output(cached=[("a", 151, T)], finished=["b"])
    with pytest.raises(ess.InvalidArgument, match="decode rows"):
        c.start_load_kv(None, scheduler_output=out, request_ids=["a"],
                        request_state_indices=torch.tensor([2], dtype=torch.int32), attn_metadata=attn(2))
    assert worker.ess.state_of == {"a": 2, "b": 0}
    c.start_load_kv(None, scheduler_output=out, request_ids=["a"],
                    request_state_indices=torch.tensor([2], dtype=torch.int32), attn_metadata=attn(1))
    assert worker.ess.state_of == {"a": 2} and worker.ess_engine.request(2) == (2, 152)
    c.start_load_kv(None)   # no forward this step: nothing staged
    c.connector_worker.shutdown()
    assert worker.runtimes_at_shutdown == upstream, "upstream's teardown must see its own runtimes"
    assert worker.ess_engine is None


def test_a_lazy_host_mirror_is_refused(connector_module):
    module, _ = connector_module
    with pytest.raises(ValueError, match="eager_host_mirror"):
        module.HiSparseConnector(config(eager=False), "worker", World())
    assert module.HiSparseConnector(config(eager=False), "scheduler", World()).connector_worker is None


def test_one_pool_per_node_under_attention_tp(connector_module):
    module, state = connector_module
    state.shared = True
    world = World()
    cfg = config(instance="shared")
    c = module.HiSparseConnector(cfg, "worker", world)
    c.register_kv_caches({})
    worker = c.connector_worker
    path = os.path.join("/dev/shm", f"ess_{cfg.instance_id}_dp0")
    assert os.path.exists(path) and state.barriers == 1 and worker.ess.writer
    import ctypes
    base = ctypes.addressof(ctypes.c_char.from_buffer(worker.ess_shared_pool.buffer))
    assert base <= worker.ess_engine.host_layer(2) < base + len(worker.ess_shared_pool.buffer)
    worker.shutdown()
    assert not os.path.exists(path)
