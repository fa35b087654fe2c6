"""ess.integrations.vllm_connector's own code on CPU, its vLLM bases stood in for by the little of them it uses
(test_vllm_conformance.py holds what it reads to the pinned release's source): what register_kv_caches builds
from upstream's handles and runtimes (ESS's engine on vLLM's host pool, no pool of its own), start_load_kv's
reading of the scheduler output and of the forward's host block table (per batch row), the refusals and the order
of shutdown. The handles are upstream's own class (vllm_upstream.py)."""
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
REGION = 1          # the hot group's blocks_per_request: ESS's slots are its 64 rows less T
SLAB_BLOCKS = 12    # vLLM's GPU blocks of each layer's hot cache


class HiSparseHotSpec:
    """kv_cache_interface.py HiSparseHotSpec as far as the connector reads it."""

    def __init__(self, blocks_per_request):
        self.blocks_per_request = blocks_per_request


class UpstreamWorker:
    """worker.py HiSparseConnectorWorker as far as EssConnectorWorker uses it."""

    def __init__(self, vllm_config, kv_cache_config):
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config

    def register_kv_caches(self, kv_caches):
        world = self.kv_cache_config   # the test's world, where upstream reads its KV cache config
        self.cache_handles = world.handles
        self.host_caches = tuple(world.host)
        self.kernel_block_size = BLOCK
        # The speculator's layer leads its own group (listed first: the connector must pass it over).
        self._group_leaders = (("layers.3", world.handles[3]), ("layers.0", world.handles[0]))

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

    def get_finished(self, finished_req_ids):   # KVConnectorBase_V1's
        return None, None


class FlashMLASparseImpl:
    """The two methods of vLLM's FlashMLA sparse backend vllm_overlap.py wraps (their calls: test_vllm_da.py, in vLLM's
    venv)."""

    kv_cache_dtype = "fp8_ds_mla"

    def _host_backed_fp8_decode(self, q, topk_indices, attn_metadata, kernel_metadata, num_decodes):
        raise AssertionError("not run here")

    def _fp8_flash_mla_kernel(self, q, kv_c_and_k_pe_cache, topk_indices, kernel_metadata):
        raise AssertionError("not run here")


def sparse_attn_indexer(*args, **kwargs):
    """The name vLLM's CUDA DSA attention calls its indexer by, which vllm_indexer_split.py wraps (its calls:
    test_vllm_dba.py, in vLLM's venv)."""
    raise AssertionError("not run here")


@pytest.fixture
def connector_module(monkeypatch):
    """Stand-ins for the vLLM modules vllm_connector imports."""
    state = types.SimpleNamespace()
    modules = {
        "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector": dict(HiSparseConnector=UpstreamConnector),
        "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.worker": dict(HiSparseConnectorWorker=UpstreamWorker),
        "vllm.v1.attention.backend": dict(max_decode_query_len=lambda config: T),
        "vllm.v1.kv_cache_interface": dict(HiSparseHotSpec=HiSparseHotSpec),
        "vllm.v1.hisparse.layout": dict(HISPARSE_HOT_SUFFIX=".hisparse_hot"),
        "vllm.v1.attention.backends.mla.flashmla_sparse": dict(FlashMLASparseImpl=FlashMLASparseImpl),
        "vllm.models.deepseek_v32.attention": dict(sparse_attn_indexer=sparse_attn_indexer),
        # The release's own function, compiled from the pinned source (pure Python).
        "vllm.model_executor.models.utils": dict(extract_layer_index=vllm_upstream.function(
            "model_executor/models/utils.py", "extract_layer_index")),
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
    monkeypatch.setattr(sys.modules["vllm"], "__version__", adapter.VLLM_VERSION, raising=False)
    monkeypatch.delitem(sys.modules, "ess.integrations.vllm_connector", raising=False)
    import ess.integrations.vllm_connector as module
    yield module, state
    sys.modules.pop("ess.integrations.vllm_connector", None)


class World:
    """vLLM's side: three target layers and a speculator layer, their handles with upstream's runtimes, vLLM's host
    pool (one 4 KiB-aligned allocation, a region per layer: HiSparseHostPool's `registered`) and the forward's host
    block table (row b: batch row b's blocks, gathered from its state's)."""

    def __init__(self, seed=4):
        rng = np.random.default_rng(seed)
        rows = STATES * BLOCKS * BLOCK
        size = -(-4 * rows * 656 // 4096) * 4096
        raw = torch.zeros(size + 4096, dtype=torch.uint8)
        start = (-raw.data_ptr()) % 4096
        self.registered = raw[start:start + size]
        self.registered[:4 * rows * 656] = torch.from_numpy(rng.integers(0, 256, 4 * rows * 656, dtype=np.uint8))
        self.host = [self.registered[l * rows * 656:(l + 1) * rows * 656].view(rows, 656) for l in range(4)]
        self.state_blocks = torch.from_numpy(rng.permutation(STATES * BLOCKS).reshape(STATES, BLOCKS).astype(np.int32))
        self.source = torch.zeros((STATES, BLOCKS), dtype=torch.int32)
        # KVCacheConfig's: the host source group, then two hot cache groups (v1/hisparse/layout.py packs layers into
        # groups of one indexer page): layers 0 and 1, layers 2 and 3.
        self.host_group_ids = (0,)
        self.kv_cache_groups = [types.SimpleNamespace(kv_cache_spec=None, layer_names=[])] + [
            types.SimpleNamespace(kv_cache_spec=HiSparseHotSpec(REGION), layer_names=[f"layers.{l}.hisparse_hot" for l in pair])
            for pair in ((0, 1), (2, 3))]
        # vLLM's one hot slab: a block holds the page of each of the 4 layers (kv_cache_planning.py: a block's bytes
        # a multiple of the hot page); a layer's view starts at its page (runtime.py PagedCacheView.bind: the strided
        # cache, and the attention view raw[byte_offset:], a vLLM block every 4 x 64 rows), so later layers' views
        # are shorter.
        page = BLOCK * 656
        self.backing = torch.zeros(SLAB_BLOCKS * 4 * page, dtype=torch.uint8)
        self.attention = [self.backing[j * page:].view(-1, BLOCK, 656) for j in range(4)]
        caches = [torch.as_strided(self.backing, (SLAB_BLOCKS, BLOCK, 656), (4 * page, 656, 1), j * page)
                  for j in range(4)]
        self.handles = []
        for layer in range(4):
            handle = UP["HiSparseCacheHandle"](types.SimpleNamespace(
                region_stride=SLOTS, device=torch.device("cpu"), is_group_leader=True, eager_host_mirror=True,
                hot=UP["PagedCacheView"](caches[layer], self.attention[layer], BLOCK, 4 * BLOCK),
                request_state_indices=torch.full((STATES,), -1, dtype=torch.int32), resident_source_index=0,
                registered_host_pool=self.registered,
                index_group=types.SimpleNamespace(shared_topk=types.SimpleNamespace(
                    device_topk_rows=torch.empty((STATES * T, K), dtype=torch.int32)))))
            handle.source_block_table = self.source
            handle.draft_layer = layer == 3
            self.handles.append(handle)

    def gather(self, states):
        """block_table.py gather_block_tables for a batch of these states."""
        self.source.zero_()
        for b, s in enumerate(states):
            self.source[b] = self.state_blocks[s]

    def host_rows(self, layer, state, first, count):
        tokens = np.arange(first, first + count)
        rows = self.state_blocks[state].numpy().astype(np.int64)[tokens // BLOCK] * BLOCK + tokens % BLOCK
        return self.host[layer][torch.from_numpy(rows)].numpy()


def config(eager=True, instance="t", speculative=False):
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={}),
        attention_config=types.SimpleNamespace(hisparse_config=types.SimpleNamespace(eager_host_mirror=eager)),
        scheduler_config=types.SimpleNamespace(max_num_seqs=STATES, async_scheduling=True),
        model_config=types.SimpleNamespace(max_model_len=CTX), instance_id=f"{instance}-{os.getpid()}",
        parallel_config=types.SimpleNamespace(data_parallel_index=0, use_ubatching=False),
        # Each attention layer (the hot caches' names less ".hisparse_hot") with vLLM's FlashMLA sparse backend.
        compilation_config=types.SimpleNamespace(static_forward_context={
            f"layers.{l}": types.SimpleNamespace(impl=FlashMLASparseImpl()) for l in range(4)}),
        speculative_config=types.SimpleNamespace(enable_adaptive_verification=False) if speculative else None)


def scheduler_output(new=(), cached=(), finished=(), resumed=(), blocks=None, hot=None):
    """SchedulerOutput's fields the connector reads: new and cached requests as (id, computed, scheduled), the
    cached ones marked resumed, the host source group's blocks (group 0 here) of the new and resumed ones
    (blocks: {id: blocks}; a cached request gets none) and the hot groups' (groups 1 and 2; hot: {id: its hot
    regions}, given to a cached request when they are allocated)."""
    blocks, hot = blocks or {}, hot or {}
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r, num_computed_tokens=c,
                                                  block_ids=(blocks[r], *hot.get(r, ([], []))))
                            for r, c, _ in new],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                                    num_computed_tokens=[c for _, c, _ in cached],
                                                    new_block_ids=[(blocks[r] if r in resumed else [],
                                                                    *hot.get(r, ([], [])))
                                                                   if r in resumed or r in hot else None
                                                                   for r, _, _ in cached],
                                                    resumed_req_ids=set(resumed)),
        num_scheduled_tokens={r: n for r, _, n in list(new) + list(cached)}, finished_req_ids=set(finished),
        preempted_req_ids=None)


def owned(world, **states):
    """Each request's host blocks: those of its state in the world."""
    return {r: world.state_blocks[s].tolist() for r, s in states.items()}


def attn(*seq_lens, decodes=None):
    """The forward's attention metadata by layer name, the leader's with the sparse MLA metadata start_step reads:
    the decode rows' seq_lens (after this step's T tokens), num_decodes (default: one per seq_len)."""
    decodes = len(seq_lens) if decodes is None else decodes
    return {"layers.0": types.SimpleNamespace(num_decodes=decodes, num_decode_tokens=decodes * T,
                                              seq_lens=torch.tensor(seq_lens, dtype=torch.int32))}


def eager(*seq_lens):
    """The forward context of an eager or piecewise forward (model_runner.py: pre_forward inside
    set_forward_context(attn_metadata, ...)): start_load_kv gets no attn_metadata keyword."""
    return types.SimpleNamespace(attn_metadata=attn(*seq_lens))


def test_register_start_load_and_shutdown(connector_module):
    module, _ = connector_module
    world = World()
    upstream = [h.runtime for h in world.handles]
    before = world.registered.clone()
    # Async scheduling with speculative decoding: the scheduler's counts run ahead, the forward's seq_lens are read.
    c = module.HiSparseConnector(config(speculative=True), "worker", world)
    c.register_kv_caches({})
    worker = c.connector_worker
    assert worker.ess.counts_run_ahead
    info = worker.ess_engine.info
    assert (info.layers, info.slots, info.query_tokens, info.topk, info.backend) == (3, REGION * BLOCK - T, T, K, "cpu")
    assert info.region_blocks == REGION and worker.ess_hot_groups == [1, 2]
    assert worker.ess.region_group == [0, 0, 1]   # the target layers' hot cache groups, in order
    # ESS's rows are vLLM's hot caches (their attention views, cut to the shortest): no buffer of its own.
    assert [t.data_ptr() for t in worker.ess.latent] == [world.attention[layer].data_ptr() for layer in range(3)]
    assert {t.shape[0] for t in worker.ess.latent} == {SLAB_BLOCKS * 4 - 2}
    assert all(isinstance(h.runtime, adapter.HiSparseRuntime) and h.runtime.upstream is u
               for h, u in zip(world.handles[:3], upstream))
    assert world.handles[3].runtime is upstream[3], "the speculator's layer keeps vLLM's runtime"
    # ESS's host pool is vLLM's: each layer's region is vLLM's host cache of that layer.
    for layer in range(3):
        assert worker.ess_engine.host_layer(layer) == world.host[layer].data_ptr()
    # Two requests decode at states 2 and 0 after their prefill: ESS adopts their blocks, batch row b's from row b
    # of the forward's table.
    world.gather([2, 0])
    out = scheduler_output(new=[("a", 150, T), ("b", 70, T)], blocks=owned(world, a=2, b=0))
    c.start_load_kv(None, scheduler_output=out, request_ids=["a", "b"],
                    request_state_indices=torch.tensor([2, 0], dtype=torch.int32), attn_metadata=attn(151, 71))
    assert c.loads and worker.ess.state_of == {"a": 2, "b": 0}
    for layer in range(3):
        got = worker.ess_engine.read_entries(2, layer, 0, np.empty((150, 656), np.uint8))
        np.testing.assert_array_equal(got, world.host_rows(layer, 2, 0, 150))
    # The batch condensed: "b" finished, "a" at batch row 0; the scheduler still counts a draft the device did not
    # keep: ESS holds the scheduler's count, its step serves the forward's seq_len.
    world.gather([2])
    out = scheduler_output(cached=[("a", 152, T)], finished=["b"])
    c.start_load_kv(None, scheduler_output=out, request_ids=["a"],
                    request_state_indices=torch.tensor([2], dtype=torch.int32), attn_metadata=attn(152))
    assert worker.ess.state_of == {"a": 2} and worker.ess_engine.request(2) == (2, 153)
    assert int(worker.ess.lengths[0]) == 152
    c.start_load_kv(None)   # no forward this step: nothing staged
    assert torch.equal(world.registered, before), "ESS wrote vLLM's host pool"
    c.connector_worker.shutdown()
    assert worker.runtimes_at_shutdown == upstream, "upstream's teardown must see its own runtimes"
    assert worker.ess_engine is None


def test_without_speculative_decoding_a_decode_step_reads_nothing_back(connector_module):
    """Async scheduling without drafts: the scheduler's counts are the device's, so a step whose decode requests ESS
    holds already reads neither state indices nor seq_lens nor block table entries (the blocks come from the
    scheduler's output); the first step of a request reads its state index, once."""
    module, _ = connector_module
    world = World()
    c = module.HiSparseConnector(config(), "worker", world)
    c.register_kv_caches({})
    decode = c.connector_worker.ess
    assert not decode.counts_run_ahead
    world.gather([2, 0])
    c.start_load_kv(eager(151, 71), scheduler_output=scheduler_output(new=[("a", 150, T), ("b", 70, T)],
                                                                      blocks=owned(world, a=2, b=0)),
                    request_ids=["a", "b"], request_state_indices=torch.tensor([2, 0], dtype=torch.int32))
    assert decode.device_reads == 1 and decode.state_of == {"a": 2, "b": 0}
    world.source.fill_(-5)   # the forward's table is not read: entries there would be refused
    for step in range(3):
        out = scheduler_output(cached=[("b", 71 + step, T), ("a", 151 + step, T)])
        c.start_load_kv(eager(72 + step, 152 + step), scheduler_output=out, request_ids=["b", "a"],
                        request_state_indices=torch.tensor([0, 2], dtype=torch.int32))
    assert decode.device_reads == 1
    assert c.connector_worker.ess_engine.request(2) == (2, 154)
    for layer in range(3):
        got = c.connector_worker.ess_engine.read_entries(0, layer, 0, np.empty((74, 656), np.uint8))
        np.testing.assert_array_equal(got, world.host_rows(layer, 0, 0, 74))
    c.connector_worker.shutdown()


def test_a_request_finished_in_a_step_without_a_forward_is_released(connector_module):
    """A step without a forward brings no start_load_kv, only get_finished (ActiveKVConnector.no_forward ->
    post_forward); its finished requests are released at the next forward's start_load_kv."""
    module, _ = connector_module
    world = World()
    c = module.HiSparseConnector(config(), "worker", world)
    c.register_kv_caches({})
    worker = c.connector_worker
    world.gather([2, 0])
    c.start_load_kv(eager(151, 71), scheduler_output=scheduler_output(new=[("a", 150, T), ("b", 70, T)],
                                                                      blocks=owned(world, a=2, b=0)),
                    request_ids=["a", "b"], request_state_indices=torch.tensor([2, 0], dtype=torch.int32))
    assert c.get_finished({"b", "never-seen"}) == (None, None)
    assert worker.ess.state_of == {"a": 2, "b": 0}   # released with the next step's other releases
    world.gather([2])
    c.start_load_kv(eager(152), scheduler_output=scheduler_output(cached=[("a", 151, T)]), request_ids=["a"],
                    request_state_indices=torch.tensor([2], dtype=torch.int32))
    assert worker.ess.state_of == {"a": 2} and worker.ess.finished_since == set()
    with pytest.raises(ess.InvalidArgument):
        worker.ess_engine.request(0)
    c.connector_worker.shutdown()


def test_a_request_preempted_in_a_step_without_a_forward_starts_over_when_it_returns(connector_module):
    """Its preempted_req_ids never reach ESS (no start_load_kv with a batch); when the scheduler sends it again
    as a new request (model runner v2) or a resumed one, over blocks handed out afresh, ESS starts it over."""
    module, _ = connector_module
    for returns in ("new", "resumed"):
        world = World()
        c = module.HiSparseConnector(config(), "worker", world)
        c.register_kv_caches({})
        worker = c.connector_worker
        world.gather([2])
        c.start_load_kv(eager(151), scheduler_output=scheduler_output(new=[("a", 150, T)], blocks=owned(world, a=2)),
                        request_ids=["a"],
                        request_state_indices=torch.tensor([2], dtype=torch.int32))
        c.start_load_kv(None)   # the step "a" was preempted in: no forward
        assert worker.ess.state_of == {"a": 2}
        # Back on the same state index, its prompt recomputed up to its last token, which it decodes.
        world.state_blocks[2] = torch.flip(world.state_blocks[2], [0])
        world.gather([2])
        row = ("a", 150, T)
        out = scheduler_output(new=[row], blocks=owned(world, a=2)) if returns == "new" else \
            scheduler_output(cached=[row], resumed=["a"], blocks=owned(world, a=2))
        c.start_load_kv(eager(151), scheduler_output=out, request_ids=["a"],
                        request_state_indices=torch.tensor([2], dtype=torch.int32))
        assert worker.ess.state_of == {"a": 2}
        got = worker.ess_engine.read_entries(2, 0, 0, np.empty((150, 656), np.uint8))
        np.testing.assert_array_equal(got, world.host_rows(0, 2, 0, 150))
        c.connector_worker.shutdown()


def test_a_host_cache_outside_vllms_pool_is_refused(connector_module):
    module, _ = connector_module
    world = World()
    world.handles[0].runtime.registered_host_pool = world.registered[4096:]
    c = module.HiSparseConnector(config(), "worker", world)
    with pytest.raises(ess.InvalidArgument, match="layer 0's host cache is at byte -4096"):
        c.register_kv_caches({})


def test_a_lazy_host_mirror_is_refused(connector_module):
    module, _ = connector_module
    with pytest.raises(ValueError, match="eager_host_mirror"):
        module.HiSparseConnector(config(eager=False), "worker", World())
    assert module.HiSparseConnector(config(eager=False), "scheduler", World()).connector_worker is None


def test_the_forward_metadata_is_the_leaders_and_required(connector_module):
    """start_load_kv takes the leader layer's metadata (the attn_metadata keyword under a FULL graph, else the
    forward context's); without one it refuses by name (the scheduler's counts are an upper bound under async
    scheduling), and a forward with micro-batches is refused when the connector is made."""
    module, _ = connector_module
    world = World()
    c = module.HiSparseConnector(config(), "worker", world)
    c.register_kv_caches({})
    world.gather([2])
    out = scheduler_output(new=[("a", 150, T)], blocks=owned(world, a=2))
    kwargs = dict(scheduler_output=out, request_ids=["a"], request_state_indices=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="attention metadata is NoneType"):
        c.start_load_kv(types.SimpleNamespace(attn_metadata=None), **kwargs)
    with pytest.raises(ValueError, match="no target-model index-group leader layer \\(layers.0\\)"):
        c.start_load_kv(None, attn_metadata={"layers.1": attn(151)["layers.0"], "layers.3": attn(151)["layers.0"]},
                        **kwargs)
    with pytest.raises(ValueError, match="a dict by layer name"):
        c.start_load_kv(types.SimpleNamespace(attn_metadata=[attn(151), attn(151)]), **kwargs)
    assert c.connector_worker.ess.state_of == {}
    c.start_load_kv(eager(151), **kwargs)
    assert c.connector_worker.ess.state_of == {"a": 2}
    c.connector_worker.shutdown()
    micro = config()
    micro.parallel_config.use_ubatching = True
    with pytest.raises(ValueError, match="micro-batching"):
        module.HiSparseConnector(micro, "worker", World())


def test_reset_capture_state_resets_ess(connector_module, monkeypatch):
    """connector.py reset_capture_state -> the worker's reset_hot_state, which upstream runs over the leader
    runtimes it gathered before ESS's went on the handles: ESS's worker resets its engine there, once."""
    module, _ = connector_module
    world = World()
    c = module.HiSparseConnector(config(), "worker", world)
    c.register_kv_caches({})
    resets = []
    monkeypatch.setattr(UpstreamWorker, "reset_hot_state", lambda self: resets.append("upstream"), raising=False)
    monkeypatch.setattr(c.connector_worker.ess, "reset", lambda: resets.append("ess"))
    c.connector_worker.reset_hot_state()
    assert resets == ["upstream", "ess"]
    c.connector_worker.shutdown()


def test_a_hot_region_gives_esss_rows_and_the_engines_memory_must_fit(connector_module):
    """A request vLLM gives hot regions (each hot group's blocks in the scheduler output) has ESS's rows placed there,
    a layer's in its group's region, its reserved rows among them; one without is read in place (no rows). ESS allocates no rows of its own: only its
    engine's state lies outside vLLM's KV cache, and it must fit in the memory gpu_memory_utilization leaves outside
    vLLM's budget, whose unallocated part (activations, CUDA graphs) is still free when it is made."""
    module, _ = connector_module
    world = World()
    c = module.HiSparseConnector(config(), "worker", world)
    c.register_kv_caches({})
    decode = c.connector_worker.ess
    world.gather([2, 0])
    c.start_load_kv(eager(151, 71), scheduler_output=scheduler_output(new=[("a", 150, T), ("b", 70, T)],
                                                                      blocks=owned(world, a=2, b=0),
                                                                      hot={"a": ([7], [9])}),
                    request_ids=["a", "b"], request_state_indices=torch.tensor([2, 0], dtype=torch.int32))
    assert decode.placed == {2: [28, 36]} and decode.in_place_state[:2].tolist() == [-1, 0]   # ESS blocks 4k
    assert decode.rows[:2].tolist() == [2, -1]
    engine = c.connector_worker.ess_engine
    reserved = REGION * BLOCK - T
    # vLLM block k is ESS's block 4k (the attention views' block stride is 4 x 64 rows).
    assert [engine.buffer_row(2, reserved, layer) for layer in range(3)] == \
        [7 * 4 * BLOCK + reserved] * 2 + [9 * 4 * BLOCK + reserved]
    # "b" gets its hot regions a step later (appended to a cached request's empty hot lists).
    c.start_load_kv(eager(152, 72), scheduler_output=scheduler_output(cached=[("a", 151, T), ("b", 71, T)],
                                                                      hot={"b": ([3], [4])}),
                    request_ids=["a", "b"], request_state_indices=torch.tensor([2, 0], dtype=torch.int32))
    assert decode.placed == {2: [28, 36], 0: [12, 16]} and decode.rows[:2].tolist() == [2, 0]
    with pytest.raises(ess.InvalidArgument, match="has 2 blocks in hot group 0; a hot region is 1"):
        c.start_load_kv(eager(153), scheduler_output=scheduler_output(new=[("x", 152, T)], blocks=owned(world, x=1),
                                                                      hot={"x": ([4, 5], [6])}),
                        request_ids=["x"], request_state_indices=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ess.InvalidArgument, match="has hot regions in groups \\[1\\] of 2"):
        c.start_load_kv(eager(153), scheduler_output=scheduler_output(new=[("x", 152, T)], blocks=owned(world, x=1),
                                                                      hot={"x": ([], [6])}),
                        request_ids=["x"], request_state_indices=torch.tensor([1], dtype=torch.int32))
    c.connector_worker.shutdown()
    GiB, total = 2**30, 80 * 2**30

    def device_at(utilization):
        """vLLM's KV cache fills its budget but for 2 GiB of activations and CUDA graphs still to come: what its
        allocator holds, and what is free, when the connector registers."""
        held = total * utilization - 2 * GiB
        return total - held, held

    engine = 9 * GiB // 10
    assert module.check_device_memory(engine, *device_at(0.92)[:1], total, 0.92, device_at(0.92)[1], "cuda:0") == engine
    free, held = device_at(0.995)   # 0.40 GiB of 80 outside a 0.995 budget
    with pytest.raises(ValueError, match="engine's state .LRU state, step scratch, page tables. needs 0.90 GiB and "
                                         "cuda:0 has 0.40 GiB outside vLLM's budget .gpu_memory_utilization 0.995 of "
                                         "80.00 GiB; 2.40 GiB free, 77.60 GiB held by vLLM's allocator.: set "
                                         "gpu_memory_utilization to at most 0.988"):
        module.check_device_memory(engine, free, total, 0.995, held, "cuda:0")
    # The utilization the message names leaves room; a little more does not.
    assert module.check_device_memory(engine, *device_at(0.988)[:1], total, 0.988, device_at(0.988)[1], "cuda:0")
    with pytest.raises(ValueError, match="at most"):
        module.check_device_memory(engine, *device_at(0.989)[:1], total, 0.989, device_at(0.989)[1], "cuda:0")


def test_hot_groups_of_different_region_sizes_are_refused(connector_module):
    module, _ = connector_module
    world = World()
    world.kv_cache_groups[2].kv_cache_spec = HiSparseHotSpec(REGION + 1)
    c = module.HiSparseConnector(config(), "worker", world)
    with pytest.raises(ValueError, match=r"hot cache groups \[1, 2\] have regions of \[1, 2\] blocks"):
        c.register_kv_caches({})


def test_a_hot_region_too_small_for_the_top_k_is_refused(connector_module, monkeypatch):
    module, _ = connector_module
    monkeypatch.setattr(module, "max_decode_query_len", lambda config: 49)
    world = World()
    c = module.HiSparseConnector(config(), "worker", world)
    with pytest.raises(ValueError, match="leaves 15 LRU rows beside the T = 49 reserved ones; one query token's "
                                         "top-k needs 16: set device_buffer_size to at least 65"):
        c.register_kv_caches({})


def test_adaptive_verification_is_accepted_with_the_forwards_lengths(connector_module, monkeypatch):
    """enable_adaptive_verification (which vLLM 0.33.0 itself refuses with the backends that read fp8_ds_mla:
    test_vllm_conformance.py): the forward's decode tokens are the drafts the model runner kept on the device (fewer
    than the scheduler's), and its seq_lens are the rows' lengths, staged on the device without a read back. (The
    rows' tokens and bytes: test_vllm_replay.py::test_adaptive_verification_rows_decided_on_the_device.)"""
    module, _ = connector_module
    monkeypatch.setattr(module, "max_decode_query_len", lambda config: 3)
    world = World()
    adaptive = config(speculative=True)
    adaptive.speculative_config.enable_adaptive_verification = True
    c = module.HiSparseConnector(adaptive, "worker", world)
    c.register_kv_caches({})
    worker = c.connector_worker
    assert worker.ess.adaptive and worker.ess_engine.info.query_tokens == 3
    world.gather([2, 0])
    out = scheduler_output(new=[("a", 150, 3), ("b", 70, 3)], blocks=owned(world, a=2, b=0))
    forward = attn(152, 71)   # "a" kept one of its two drafts, "b" none
    forward["layers.0"].num_decode_tokens = 3
    c.start_load_kv(None, scheduler_output=out, request_ids=["a", "b"],
                    request_state_indices=torch.tensor([2, 0], dtype=torch.int32), attn_metadata=forward)
    assert worker.ess.state_of == {"a": 2, "b": 0} and worker.ess.device_reads == 1   # the new requests' states
    assert worker.ess.lengths[:2].tolist() == [152, 71]
    assert worker.ess_engine.request(2) == (2, 153), "ESS holds the scheduler's count, an upper bound"
    c.connector_worker.shutdown()


def test_an_engine_refused_by_the_decode_state_is_given_back(connector_module, monkeypatch):
    """A refusal of EssDecode's (made after the engine) closes the engine again."""
    module, _ = connector_module
    made = []

    class Recorded(module.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(module, "Engine", Recorded)

    def refused(*args, **kwargs):
        raise ess.InvalidArgument("EssDecode: refused")

    monkeypatch.setattr(module, "EssDecode", refused)
    c = module.HiSparseConnector(config(speculative=True), "worker", World())
    with pytest.raises(ess.InvalidArgument, match="EssDecode: refused"):
        c.register_kv_caches({})
    assert c.connector_worker.ess_engine is None and len(made) == 1 and made[0]._handle is None


@pytest.mark.parametrize("version,checked,refused", [
    ("0.34.0", None, True),          # another release
    ("0.34.0", "0.34.0", False),     # re-checked against it and said so
    ("0.34.0", "0.33.0", True),      # the override names another release
    (None, None, True),              # no version to compare
])
def test_a_release_other_than_the_checked_one_is_refused_by_name(connector_module, monkeypatch, version, checked,
                                                                  refused):
    module, _ = connector_module
    monkeypatch.setattr(sys.modules["vllm"], "__version__", version)
    c = config()
    if checked is not None:
        c.kv_transfer_config.kv_connector_extra_config["ess_checked_vllm"] = checked
    if refused:
        with pytest.raises(ValueError, match=f"vLLM {version}: this connector is checked against vLLM 0.33.0"):
            module.HiSparseConnector(c, "worker", World())
    else:
        assert module.HiSparseConnector(c, "worker", World()).connector_worker is not None


def registered(module, monkeypatch, value, layers=None):
    """The connector's worker registered with ESS_OVERLAP = value (and ESS_OVERLAP_LAYERS = layers)."""
    monkeypatch.setenv("ESS_OVERLAP", value)
    if layers is not None:
        monkeypatch.setenv("ESS_OVERLAP_LAYERS", layers)
    c = module.HiSparseConnector(config(), "worker", World())
    c.register_kv_caches({})
    return c


@pytest.mark.parametrize("value,layers,schedules", [
    ("da", None, ["da", "da", "da"]),
    ("layerwise", "a - a a", ["da", "none", "da"]),   # by the model's layer index of each target layer
    ("layerwise", "- - - a", None),                   # no target layer runs DA
])
def test_the_overlap_schedule_reaches_the_decode_and_wraps_flashmla(connector_module, monkeypatch, value, layers,
                                                                    schedules):
    module, _ = connector_module
    c = registered(module, monkeypatch, value, layers)
    overlap = c.connector_worker.ess.overlap
    assert (overlap.schedules if overlap is not None else None) == schedules
    wrapped = getattr(FlashMLASparseImpl._fp8_flash_mla_kernel, "ess_original", None) is not None
    assert wrapped == (schedules is not None)
    module.vllm_overlap.unpatch()
    c.connector_worker.shutdown()


def test_da_on_another_attention_backend_or_cache_is_refused_at_registration(connector_module, monkeypatch):
    """A DA layer whose attention is not vLLM's FlashMLA sparse FP8 decode (another backend, another cache dtype) is
    refused when the connector registers, by name, the engine given back; a layer without DA may be anything."""
    module, _ = connector_module
    monkeypatch.setenv("ESS_OVERLAP", "layerwise")
    monkeypatch.setenv("ESS_OVERLAP_LAYERS", "a - a")
    other = config()
    other.compilation_config.static_forward_context["layers.2"].impl = types.SimpleNamespace()
    c = module.HiSparseConnector(other, "worker", World())
    with pytest.raises(ess.InvalidArgument, match="layer 'layers.2.hisparse_hot' attends with SimpleNamespace"):
        c.register_kv_caches({})
    assert c.connector_worker.ess_engine is None
    assert getattr(FlashMLASparseImpl._fp8_flash_mla_kernel, "ess_original", None) is None
    fine = config()   # layer 1 runs no DA: its backend is not read
    fine.compilation_config.static_forward_context["layers.1"].impl = types.SimpleNamespace()
    c = module.HiSparseConnector(fine, "worker", World())
    c.register_kv_caches({})
    assert c.connector_worker.ess.overlap.schedules == ["da", "none", "da"]
    module.vllm_overlap.unpatch()
    c.connector_worker.shutdown()
    bf16 = config()   # a layer of kv_cache_dtype_skip_layers: its own cache dtype
    bf16.compilation_config.static_forward_context["layers.0"].impl.kv_cache_dtype = "auto"
    c = module.HiSparseConnector(bf16, "worker", World())
    with pytest.raises(ess.InvalidArgument, match="layer 'layers.0.hisparse_hot''s cache is auto"):
        c.register_kv_caches({})
    assert c.connector_worker.ess_engine is None
    assert getattr(FlashMLASparseImpl._fp8_flash_mla_kernel, "ess_original", None) is None


@pytest.mark.parametrize("value,layers", [("dba", None), ("layerwise", "a b - b")])
def test_dba_layers_have_their_indexers_split(connector_module, monkeypatch, value, layers):
    """A DBA layer's indexer is served by the model's layer index of its attention (vllm_indexer_split.py wraps the
    DSA attention's indexer name, once); shutdown stops serving it."""
    module, _ = connector_module
    worker = registered(module, monkeypatch, value, layers).connector_worker
    overlap = worker.ess.overlap
    dba = [l for l, s in enumerate(overlap.schedules) if s == "dba"]
    assert dba == ([0, 1, 2] if layers is None else [1])
    handles = [h for h in worker.cache_handles if not h.draft_layer]
    assert {i: (rt, name) for i, (rt, name) in overlap.indexers.items()} == {
        l: (handles[l].runtime, f"layers.{l}") for l in dba}
    dsa = sys.modules["vllm.models.deepseek_v32.attention"]
    try:
        assert dsa.sparse_attn_indexer.ess_original is sparse_attn_indexer
        assert overlap in module.vllm_indexer_split._SERVED
        worker.shutdown()
        assert overlap not in module.vllm_indexer_split._SERVED
    finally:
        module.vllm_indexer_split.unpatch(dsa)
        module.vllm_overlap.unpatch()
    assert dsa.sparse_attn_indexer is sparse_attn_indexer


@pytest.mark.parametrize("value,layers,match", [
    ("layerwise", "a c a", "layer 1's schedule 'c' is not one or two of"),
    ("layerwise", "a a", "ESS_OVERLAP_LAYERS has 2 layers"),
    ("fast", None, "ESS_OVERLAP = 'fast'"),
])
def test_an_overlap_schedule_not_served_is_refused_and_the_engine_given_back(connector_module, monkeypatch, value,
                                                                            layers, match):
    module, _ = connector_module
    monkeypatch.setenv("ESS_OVERLAP", value)
    if layers is not None:
        monkeypatch.setenv("ESS_OVERLAP_LAYERS", layers)
    c = module.HiSparseConnector(config(), "worker", World())
    with pytest.raises(ess.InvalidArgument, match=match):
        c.register_kv_caches({})
    assert c.connector_worker.ess_engine is None
    assert getattr(FlashMLASparseImpl._fp8_flash_mla_kernel, "ess_original", None) is None
