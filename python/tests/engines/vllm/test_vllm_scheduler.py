"""ESS's connector under vLLM 0.33.0's own scheduler: vLLM's configuration, KV cache planning, scheduler, KV cache
manager, HiSparse coordinator and connector factory build on this CPU, load ESS's `HiSparseConnector` by module path
and drive it step by step; every step's real `SchedulerOutput`, connector metadata and host block table then run
ESS's decode (the replay of test_vllm_replay.py, its world's host blocks now vLLM's own), whose rows and bytes are
checked against the independent LRU model and the full cache.

  config      config/vllm.py VllmConfig(kv_transfer_config=HiSparseConnector at ess.integrations.vllm_connector):
              hisparse_config inferred from the connector's name, HiSparse's own checks
  KV caches   v1/engine/core.py EngineCore._initialize_kv_caches, the engine core's half: register_all_kvcache_specs,
              resolve_kv_cache_layout (FlashMLA sparse's and the indexer's layouts), get_global_kv_cache_groups,
              get_kv_cache_configs (v1/hisparse/layout.py: the host source group, resident and hot groups, the host
              pool's blocks), generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes
  scheduler   EngineCore.__init__: scheduler_config.get_scheduler_cls() (AsyncScheduler: async scheduling is vLLM's
              default), which builds the connector through KVConnectorFactory (ESS's class, scheduler role) and binds
              it to its KV cache manager (get_hisparse_coordinator)
  requests    v1/request.py Request with get_request_block_hasher's hasher (prefix caching on)
  steps       EngineCore.step_with_batch_queue: schedule N (the connector's build_connector_meta inside), the worker
              runs N, the scheduler takes N's ModelRunnerOutput after N + 1 is scheduled; the output carries the
              connector worker's metadata (HiSparseConnectorWorkerMetadata: every page transfer of the step enqueued
              and completed), which update_connector_output hands to the coordinator

What stands in, each for one reason:
- the model's KV cache specs (MLAAttentionSpec of the sparse MLA layer and of the indexer, as
  mla_attention.py and deepseek_v2.py's Indexer return them): the worker builds them from the model on a GPU;
- the platform, for the config and the scheduler only: vLLM's CUDA platform does not import without libcuda, and its
  CPU platform reconfigures the engine for its own MLA backend (block size 16, async scheduling, chunked prefill
  and prefix caching off); CUDA's check_and_update_config (platforms/cuda.py: it sets the worker class) and is_cuda
  stand in while they are built;
- the worker (kv_connector/v1/hisparse/worker.py needs CUDA streams and pinned memory) and the model runner: the
  replay's, in upstream's order (test_vllm_replay.py cites each function); the row mirror's writes come from the
  metadata's real SparseKVRowMirror spans, checked against the host block table ESS reads."""
import contextlib
import json

import numpy as np
import pytest
import torch

from ess.integrations import vllm as adapter
import test_vllm_replay as replay_module
from test_vllm_replay import BLOCK, CTX, HOST_BLOCKS, K, LAYERS, STATES, Replay

# Imported before CUDA's configuration stands in: it imports vLLM's worker modules, which would take CUDA's branches.
import ess.integrations.vllm_connector  # noqa: F401
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.config import AttentionConfig, ParallelConfig
from vllm.config.attention import HiSparseConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (MultiConnector,
                                                                          MultiKVConnectorWorkerMetadata)
from vllm.platforms import current_platform
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config, get_request_block_hasher,
                                         init_none_hash, resolve_cache_hit_alignment_tokens,
                                         resolve_kv_cache_block_sizes, update_kv_cache_capacity)
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec, MLAAttentionSpec, SparseCacheRole
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.utils.hashing import get_hash_fn_by_name

ENTRY = 656
MAX_NUM_SEQS = 4   # <= STATES, the replay's engine's requests


@contextlib.contextmanager
def cuda_configuration():
    """CUDA's platform answers while the config and the scheduler are built (see the module's docstring)."""
    cls = type(current_platform)
    saved = {name: cls.__dict__.get(name) for name in ("is_cuda", "check_and_update_config")}

    def check_and_update_config(_, vllm_config):   # platforms/cuda.py CudaPlatform.check_and_update_config
        if vllm_config.parallel_config.worker_cls == "auto":
            vllm_config.parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"

    cls.is_cuda = lambda self: True
    cls.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(cls, name)
            else:
                setattr(cls, name, value)


def model_folder(tmp_path):
    """A two-layer DeepSeek-V3.2 (config.json only: the scheduler reads the model's shape, never its weights)."""
    config = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "num_hidden_layers": LAYERS,
              "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
              "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
              "q_lora_rank": 128, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
              "index_topk": K, "index_n_heads": 4, "index_head_dim": 128, "max_position_embeddings": 4096,
              "vocab_size": 1000, "rope_theta": 10000, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
              "hidden_act": "silu", "tie_word_embeddings": False, "scoring_func": "sigmoid",
              "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.0}
    folder = tmp_path / "deepseek-v3.2-2-layers"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def layer_specs():
    """What the model's layers report (mla_attention.py MLAAttention.get_kv_cache_spec with fp8_ds_mla: 656-byte
    entries, the index group's leader; deepseek_v2.py Indexer.get_kv_cache_spec: the indexer's keys)."""
    specs = {}
    for layer in range(LAYERS):
        specs[f"model.layers.{layer}.self_attn.attn"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla", state_content_bytes=ENTRY, topk_buffer_width=K, is_index_group_leader=True)
        specs[f"model.layers.{layer}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER)
    return specs


def hisparse_extra_config():
    """ESS's connector's kv_connector_extra_config: vLLM's host pool, at most the replay world's host blocks."""
    return {"host_pool_gib": HOST_BLOCKS * LAYERS * BLOCK * ENTRY / 2**30}


class VllmScheduler:
    """vLLM's configuration, KV cache plan and scheduler, in the engine core's order; device_bytes: the memory the
    workers report for the KV cache (small: requests move to host reads)."""

    def __init__(self, tmp_path, device_bytes, transfer=None, **config):
        model = ModelConfig(model=str(model_folder(tmp_path)), skip_tokenizer_init=True, max_model_len=CTX,
                            dtype="bfloat16")
        transfer = transfer or KVTransferConfig(kv_connector="HiSparseConnector", kv_role="kv_both",
                                                kv_connector_module_path="ess.integrations.vllm_connector",
                                                kv_connector_extra_config=hisparse_extra_config())
        with cuda_configuration():
            config = VllmConfig(
                model_config=model, kv_transfer_config=transfer,
                cache_config=CacheConfig(block_size=BLOCK, cache_dtype="fp8_ds_mla"),
                scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256,
                                                 max_model_len=CTX, is_encoder_decoder=False), **config)
            specs = [layer_specs()]
            register_all_kvcache_specs(config)
            backends = [FlashMLASparseBackend, DeepseekV32IndexerBackend]
            resolve_kv_cache_layout(config, [[layout.name for layout in get_supported_kv_cache_layouts(backends)]],
                                    list(specs[0].values()))
            groups = get_global_kv_cache_groups(config, specs)
            worker_configs = get_kv_cache_configs(config, specs, [device_bytes], groups)
            for worker_config in worker_configs:
                worker_config.kv_cache_layout = config.cache_config.kv_cache_layout
            kv_cache_config = generate_scheduler_kv_cache_config(worker_configs)
            config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
            config.cache_config.block_size = min(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
                                                 if g.kv_cache_spec.prefix_cacheable)
            update_kv_cache_capacity(config, kv_cache_config)
            block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
            alignment = resolve_cache_hit_alignment_tokens(kv_cache_config, config, block_size, hash_block_size)
            for c in (*worker_configs, kv_cache_config):
                c.hash_block_size, c.cache_hit_alignment_tokens = hash_block_size, alignment
            from vllm.v1.structured_output import StructuredOutputManager
            scheduler_cls = config.scheduler_config.get_scheduler_cls()
            self.scheduler = scheduler_cls(vllm_config=config, kv_cache_config=kv_cache_config,
                                           structured_output_manager=StructuredOutputManager(config),
                                           include_finished_set=False, log_stats=False, block_size=block_size,
                                           hash_block_size=hash_block_size)
        self.config, self.kv_cache_config, self.worker_kv_cache_config = config, kv_cache_config, worker_configs[0]
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(hash_block_size, hash_fn, config.num_hash_lookahead_tokens)
        self.connector = self.scheduler.connector
        # ESS's connector: the scheduler's, or one of a MultiConnector's (multi_connector.py sub_connectors).
        subs = self.connector.sub_connectors if isinstance(self.connector, MultiConnector) else [self.connector]
        self.hisparse_index = next(i for i, c in enumerate(subs)
                                   if type(c).__module__ == "ess.integrations.vllm_connector")
        self.parts = len(subs) if isinstance(self.connector, MultiConnector) else None
        self.coordinator = subs[self.hisparse_index].connector_scheduler.coordinator

    def hisparse_metadata(self, metadata):
        """The connector metadata of ESS's connector (MultiConnector's build_connector_meta: one per connector)."""
        return metadata if self.parts is None else metadata.metadata[self.hisparse_index]

    def worker_metadata(self, meta):
        """ESS's connector's worker metadata as the worker's connector returns it (MultiConnector's
        build_connector_worker_meta: one per connector, None for the others)."""
        if self.parts is None or meta is None:
            return meta
        return MultiKVConnectorWorkerMetadata(
            metadata=tuple(meta if i == self.hisparse_index else None for i in range(self.parts)))

    def add(self, rid, prompt, max_tokens):
        self.scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                           None, block_hasher=self.hasher))

    def host_blocks(self, rid):
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[self.coordinator.host_group_id])


def worker_connector(vllm):
    """The worker's connector as vLLM builds it (v1/worker/gpu_worker.py -> ensure_kv_transfer_initialized ->
    KVConnectorFactory.create_connector(config, WORKER, kv_cache_config)), under CUDA's configuration."""
    with cuda_configuration():
        return KVConnectorFactory.create_connector(vllm.config, KVConnectorRole.WORKER, vllm.worker_kv_cache_config)


def mirrored_rows(mirrors):
    """The host rows a request's SparseKVRowMirror spans write, in token order."""
    return [row for m in mirrors for row in range(m.destination_start, m.destination_start + m.num_rows)]


class Driven:
    """vLLM's scheduler driving the replay: its outputs become the replay's batches, its host blocks the world's.
    transfer: vLLM's KV transfer configuration (default: ESS's connector alone). hot_regions: ESS's rows in vLLM's
    hot regions as the connector keeps them (the replay's hot_regions), the world's GPU blocks vLLM's own: each
    request's resident pages and hot region from vLLM's KV cache manager, the residency table from the connector
    metadata's residency updates, the hot group's blocks from the scheduler output."""

    def __init__(self, tmp_path, device_bytes, seed=3, transfer=None, hot_regions=False):
        self.vllm = VllmScheduler(tmp_path, device_bytes, transfer=transfer)
        # vLLM's resident and hot cache groups, one pair per layer at these sizes (v1/hisparse/layout.py packs as many
        # layers in a group as one indexer page holds), in the order the coordinator's managers have them.
        groups = self.vllm.kv_cache_config.kv_cache_groups
        self.hot_groups = [g for g, x in enumerate(groups) if isinstance(x.kv_cache_spec, HiSparseHotSpec)]
        self.resident_groups = [g for g, x in enumerate(groups) if isinstance(x.kv_cache_spec, HiSparseResidentSpec)]
        coordinator = self.vllm.coordinator
        assert [m.kv_cache_group_id for m in coordinator.hot_managers] == self.hot_groups
        assert [m.kv_cache_group_id for m in coordinator.resident_managers] == self.resident_groups
        assert len(self.hot_groups) == len(self.resident_groups) == LAYERS
        region = groups[self.hot_groups[0]].kv_cache_spec.blocks_per_request if hot_regions else 0
        # Async scheduling without speculative decoding: the connector takes the scheduler's counts as true.
        self.replay = Replay(T=1, slots=region * BLOCK - 1 if hot_regions else 24, seed=seed, async_scheduling=True,
                             counts_run_ahead=False, hot_regions=region,
                             slab_blocks=self.vllm.kv_cache_config.num_blocks)
        if hot_regions:
            world = self.replay.world
            world.ensure_resident = lambda rid, tokens: None    # vLLM's KV cache manager allocates
            world.unpin_clean = lambda rid: None                # and vLLM's coordinator unpins
            world.go_hot = None
        # Every adoption (a request's first decode step in ESS): the only steps that may read the device.
        self.adoptions, engine = 0, self.replay.decode.engine
        adopt = engine.adopt

        def counted(*args, **kwargs):
            self.adoptions += 1
            return adopt(*args, **kwargs)
        engine.adopt = counted
        self.device_reads_checked = 0
        world = self.replay.world
        world.allocate = lambda rid, tokens: None           # vLLM's KV cache manager allocates
        world.free = lambda rid: (world.blocks.__setitem__(rid, []), world.slab and world.free_slab(rid))
        self.prompts, self.prompt_len, self.state = {}, {}, {}
        self.free_states = list(range(STATES))[::-1]   # v1/worker/gpu/states.py: the last freed is handed out first
        self.pending = None   # the step the scheduler has not seen the output of (step_with_batch_queue)
        self.all_resident_steps = self.host_read_steps = self.mirror_rows_checked = 0
        self.transfers = self.host_copies = 0
        self.prefix_hits, self.preempted = {}, set()
        self.hot_requests = set()   # hot regions: the requests vLLM gave one
        self.fresh = set()
        # ESS is told which requests are handed their blocks afresh from vLLM's own output (the connector's
        # fresh_from_output), which must be the ones the worker does not hold.
        self.replay.seen_fresh = self.seen_fresh

    def seen_fresh(self, fresh):
        assert set(fresh) == self.fresh, f"vLLM hands {sorted(self.fresh)} blocks afresh, the worker lacks {fresh}"
        return sorted(self.fresh)

    def add(self, rid, prompt_len, max_tokens, rng, prefix_of=None, prefix=0):
        prompt = [int(t) for t in rng.integers(0, 900, prompt_len)]
        if prefix_of is not None:
            prompt[:prefix] = self.prompts[prefix_of][:prefix]
        self.prompts[rid] = prompt
        self.prompt_len[rid] = prompt_len
        self.replay.world.new_request(rid, prompt_len)
        if prefix_of is not None:   # the full cache agrees on the shared prefix (the same tokens)
            self.replay.world.full[rid][:, :prefix] = self.replay.world.full[prefix_of][:, :prefix]
        self.vllm.add(rid, prompt, max_tokens)

    def step(self):
        """One engine-core step; False when the scheduler has nothing left."""
        scheduler, world = self.vllm.scheduler, self.replay.world
        if not scheduler.has_requests() and self.pending is not None:
            self.finish(*self.pending)   # the engine core waits for the batch in flight
            self.pending = None
        if not scheduler.has_requests():
            return False
        output = scheduler.schedule()
        metadata = self.vllm.hisparse_metadata(output.kv_connector_metadata)
        finished, preempted = set(output.finished_req_ids), set(output.preempted_req_ids or ())
        self.preempted |= preempted
        for rid in finished | preempted:
            if rid in self.state:
                self.free_states.append(self.state.pop(rid))
        # worker.py start_step -> _copy_host_blocks: the host pool's copy-on-write copies run before the forward.
        copies = metadata.host_block_copies
        for copy in copies:
            for host in world.host:
                src, dst = copy.src_block_id * BLOCK, copy.dst_block_id * BLOCK
                host[dst:dst + BLOCK] = host[src:src + BLOCK].clone()
        self.host_copies += len(copies)
        scheduled = adapter.scheduled_from_output(output)
        if not scheduled:
            self.replay.no_forward(finished, preempted)
        else:
            # The model runner's batch (v1/worker/gpu/model_runner.py, Model Runner V2: HiSparse requires it):
            # decodes first, for the decode split.
            ids = list(output.num_scheduled_tokens)
            self.fresh = adapter.fresh_from_output(output) & set(ids)
            batch = [r for r in ids if scheduled[r].num_scheduled_tokens <= self.replay.T
                     and scheduled[r].num_computed_tokens >= self.prompt_len[r]]
            batch += [r for r in ids if r not in batch]
            for rid in batch:
                if rid not in self.state:
                    self.state[rid] = self.free_states.pop()
                world.blocks[rid] = self.vllm.host_blocks(rid)
                c = scheduled[rid].num_computed_tokens
                if rid in self.fresh:
                    world.length[rid] = c   # a prefix-cache hit is computed already; a resumed request starts over
                    if c:
                        self.prefix_hits[rid] = c
                assert c == world.length[rid], f"{rid}: vLLM computed {c}, the model {world.length[rid]}"
                # The row mirror writes the step's rows at the host blocks ESS reads them from.
                n = scheduled[rid].num_scheduled_tokens
                tokens = np.arange(c, c + n)
                expected = [world.blocks[rid][t // BLOCK] * BLOCK + t % BLOCK for t in tokens]
                assert mirrored_rows(metadata.row_mirrors.get(rid, ())) == expected, rid
                self.mirror_rows_checked += n
            resident = metadata.all_context_pages_resident
            self.all_resident_steps += resident
            self.host_read_steps += not resident
            decode, reads, adoptions = self.replay.decode, self.replay.decode.device_reads, self.adoptions
            if world.slab:   # the GPU side as vLLM's KV cache manager and connector metadata have it
                self.gpu_side(output, metadata, batch)
            # The connector's start_load_kv: the host source group's blocks from vLLM's own output.
            new_blocks = adapter.source_blocks_from_output(output, self.vllm.coordinator.host_group_id)
            self.replay.step(batch, [self.state[r] for r in batch],
                             {r: tuple(scheduled[r]) for r in batch}, finished=finished, preempted=preempted,
                             all_resident=resident, new_blocks=new_blocks)
            # ESS's copy of vLLM's host block table is the scheduler's, and the device is read back only in a step
            # that adopts a request (its state index).
            for rid in batch:
                assert decode.blocks_of[rid] == world.blocks[rid], f"{rid}: ESS's host blocks are not vLLM's"
            assert decode.device_reads - reads == (self.adoptions > adoptions), \
                f"{decode.device_reads - reads} device reads in a step with {self.adoptions - adoptions} adoptions"
            self.device_reads_checked += 1
        transfers = [t.transfer_id for t in (metadata.command.page_transfers if metadata.command else [])]
        self.transfers += len(transfers)
        if self.pending is not None:
            self.finish(*self.pending)
        self.pending = (output, transfers, [c.dst_block_id for c in copies])
        return True

    def gpu_side(self, output, metadata, batch):
        """Hot regions: each request's resident pages (None: a page read from the host) and hot region from vLLM's
        KV cache manager, the residency updates from the connector metadata (kv_connector/v1/hisparse/connector.py
        build_connector_meta: coordinator.take_residency_updates), the hot group's blocks from the scheduler output
        (the connector's source_blocks_from_output)."""
        world, manager = self.replay.world, self.vllm.scheduler.kv_cache_manager
        for rid in batch:
            ids = manager.get_block_ids(rid)
            world.resident_pages[rid] = [[b or None for b in ids[g]] for g in self.resident_groups]
            if all(ids[g] for g in self.hot_groups):
                world.hot[rid] = [list(ids[g]) for g in self.hot_groups]
                self.hot_requests.add(rid)
            else:
                assert not any(ids[g] for g in self.hot_groups), f"{rid}: hot regions in some groups only"
                world.hot.pop(rid, None)
        updates = dict(metadata.residency_updates or {})
        world.residency_updates = lambda requests: updates
        hot = [adapter.source_blocks_from_output(output, g) for g in self.hot_groups]
        world.hot_output = lambda requests, fresh: hot

    def finish(self, output, transfers, copied):
        """The worker's ModelRunnerOutput for `output`: a token for every request past its prompt, and the
        connector worker's metadata (its page transfers enqueued and completed, its host copies run)."""
        ids = list(output.num_scheduled_tokens)
        done = adapter.scheduled_from_output(output)
        sampled = [[7] if sum(done[r]) >= self.prompt_len[r] else [] for r in ids]
        meta = (HiSparseConnectorWorkerMetadata(enqueued_transfer_counts={t: 1 for t in transfers},
                                                completed_transfer_counts={t: 1 for t in transfers},
                                                completed_host_copy_dst_ids=tuple(copied))
                if transfers or copied else None)
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled,
                                   kv_connector_output=KVConnectorOutput(
                                       kv_connector_worker_meta=self.vllm.worker_metadata(meta)))
        self.vllm.scheduler.update_from_output(output, result)

    def run(self, limit=400):
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError(f"vLLM's scheduler still has requests after {limit} steps")


def test_the_connector_is_loaded_by_vllms_factory_and_bound_to_its_coordinator(tmp_path):
    vllm = VllmScheduler(tmp_path, 32 << 20)
    assert type(vllm.connector).__module__ == "ess.integrations.vllm_connector"
    assert vllm.config.attention_config.hisparse_config is not None   # inferred from the connector's name
    assert vllm.config.scheduler_config.async_scheduling
    assert 8 <= vllm.kv_cache_config.hisparse_host_num_blocks <= HOST_BLOCKS


def test_the_worker_connector_is_esss_over_upstreams_worker(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.worker import HiSparseConnectorWorker
    connector = worker_connector(VllmScheduler(tmp_path, 32 << 20))
    assert type(connector.connector_worker).__name__ == "EssConnectorWorker"
    assert isinstance(connector.connector_worker, HiSparseConnectorWorker)


def test_a_host_pool_without_decode_rows_is_refused_by_name(tmp_path):
    vllm = VllmScheduler(tmp_path, 32 << 20,
                         attention_config=AttentionConfig(hisparse_config=HiSparseConfig(eager_host_mirror=False)))
    with pytest.raises(ValueError, match="eager_host_mirror=True"):
        worker_connector(vllm)


def test_micro_batching_with_hisparse_is_refused_by_vllm_itself(tmp_path):
    """HiSparse needs Model Runner V2, which 0.33.0 builds without dual batch overlap: vLLM refuses the
    combination before any connector is made (ESS's own refusal of micro-batching is for a release that allows
    it)."""
    with pytest.raises(ValueError, match="dual batch overlap"):
        VllmScheduler(tmp_path, 32 << 20, parallel_config=ParallelConfig(enable_dbo=True))


def serve(tmp_path, device_bytes, transfer=None, hot_regions=True):
    """The connector's layout (hot_regions: ESS's rows in vLLM's hot regions, the others read in place)."""
    rng = np.random.default_rng(11)
    driven = Driven(tmp_path, device_bytes, transfer=transfer, hot_regions=hot_regions)
    driven.add("a", 300, 40, rng)
    driven.add("b", 190, 60, rng)
    driven.add("c", 250, 30, rng, prefix_of="a", prefix=128)
    driven.add("d", 120, 50, rng)
    driven.add("e", 70, 20, rng)
    driven.run()
    return driven


@pytest.mark.parametrize("device_bytes", [32 << 20, 2 << 20, 1 << 20])
def test_decode_under_vllms_scheduler_serves_the_full_caches_bytes(tmp_path, device_bytes):
    """Chunked prefills beside decodes, requests finishing and new ones taking their states; with less device
    memory vLLM moves requests to host reads (its HiSparse coordinator: hot regions, pages spilled), and with less
    still it preempts requests and resumes them, and a request hits another's cached prefix. Every decode step's
    rows and bytes against the model and the full cache (the replay's checks)."""
    driven = serve(tmp_path, device_bytes)
    assert driven.replay.forwards_served > 50
    assert driven.device_reads_checked > 50 and driven.replay.decode.device_reads < driven.device_reads_checked / 3
    assert driven.mirror_rows_checked >= 300 + 190 + 250 - 128 + 120 + 70
    assert not driven.vllm.scheduler.has_requests()
    assert driven.transfers > 0   # the coordinator's page transfers, acknowledged as the worker does
    if device_bytes == 32 << 20:   # everything stays resident (vLLM reads the pages in place)
        assert driven.host_read_steps == 0
    else:
        assert driven.host_read_steps > 40
    if device_bytes == 1 << 20:
        # c on a's prefix; a preempted request resumed on its own cached pages
        assert driven.preempted and driven.prefix_hits["c"] == 128
        assert set(driven.prefix_hits) - {"c"} <= driven.preempted


def test_esss_rows_in_vllms_hot_regions_under_its_scheduler(tmp_path):
    """The connector's layout under vLLM's own scheduler: ESS's rows in the hot regions vLLM's HiSparse coordinator
    hands out (the hot group's blocks of its real outputs) and, until a request has one, its rows read in place at
    the resident pages the real residency updates name; every decode step's rows and bytes against the model, the
    residency table and the full cache, as the replay checks them."""
    rng = np.random.default_rng(11)
    driven = Driven(tmp_path, 2 << 20, hot_regions=True)
    for rid, prompt, tokens in (("a", 300, 40), ("b", 190, 60), ("d", 120, 50), ("e", 70, 20)):
        driven.add(rid, prompt, tokens, rng)
    driven.add("c", 250, 30, rng, prefix_of="a", prefix=128)
    driven.run()
    assert driven.replay.forwards_served > 50 and driven.host_read_steps > 30
    assert len(driven.hot_requests) >= 2, "vLLM moved no request to host reads"
    assert min(driven.replay.rows_checked.values()) > 50, driven.replay.rows_checked
    # Ids of requests with a hot region on pages vLLM's coordinator still held resident, read in place there.
    assert driven.replay.hot_ids_in_place > 50, driven.replay.hot_ids_in_place
    assert not driven.vllm.scheduler.has_requests()


def test_a_load_rising_past_vllms_memory_wall_and_falling_back(tmp_path):
    """Nothing to pay at low load, under vLLM's own scheduler: one request, then one more every few steps, past the
    device memory where vLLM moves requests to host reads (hot regions: ESS's rows), then falling back as they
    finish. While the load is light every row is read in place at vLLM's resident pages (no ESS row, no copy); once
    it is not, ESS serves the requests vLLM moved; every step's rows and bytes checked as the replay checks them."""
    rng = np.random.default_rng(5)
    driven = Driven(tmp_path, 2 << 20, hot_regions=True)
    checked = driven.replay.rows_checked
    driven.add("a", 150, 40, rng)
    for _ in range(8):
        driven.step()
    assert checked["in place"] > 0 and checked["hot"] == 0, checked   # one request: nothing offloaded
    for rid, prompt, tokens in (("b", 190, 50), ("c", 250, 40), ("d", 120, 50), ("e", 300, 30)):
        driven.add(rid, prompt, tokens, rng)
        for _ in range(6):
            driven.step()
    driven.run()
    assert driven.hot_requests and checked["hot"] > 20, checked
    assert not driven.vllm.scheduler.has_requests()


def pd_decode_transfer():
    """A disaggregated decode instance's KV transfer configuration, as vLLM's docs and its HiSparse check
    (config/vllm.py: NixlConnector, MooncakeStoreConnector or MultiConnector are HiSparse's validated paths) have
    it: MultiConnector over NIXL's transfer connector (the prefill's KV) and ESS's HiSparse connector."""
    return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_consumer", kv_connector_extra_config={
        "connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
            {"kv_connector": "HiSparseConnector", "kv_role": "kv_consumer",
             "kv_connector_module_path": "ess.integrations.vllm_connector",
             "kv_connector_extra_config": hisparse_extra_config()}]})


def test_inside_a_multiconnector_beside_nixl_ess_serves_the_decode(tmp_path):
    """vLLM's MultiConnector (multi_connector.py) builds NIXL's connector and ESS's (by module path) on the scheduler,
    binds both to its KV cache manager (ESS's to the HiSparse coordinator), and hands each its own metadata every
    step; ESS's serves every decode step lossless as it does alone. (The worker side of NIXL's connector needs the
    NIXL library and a GPU: the prefill's KV arriving over NIXL is not replayed here.)"""
    driven = serve(tmp_path, 2 << 20, transfer=pd_decode_transfer())
    connector = driven.vllm.connector
    assert isinstance(connector, MultiConnector)
    nixl, ess_connector = connector.sub_connectors   # "NixlConnector" names NIXL's pull connector in 0.33.0
    assert type(nixl).__module__.startswith("vllm.distributed.kv_transfer.kv_connector.v1.nixl")
    assert type(ess_connector).__module__ == "ess.integrations.vllm_connector"
    assert driven.vllm.config.attention_config.hisparse_config is not None   # inferred through MultiConnector
    assert driven.replay.forwards_served > 50 and driven.host_read_steps > 40 and driven.transfers > 0
    assert not driven.vllm.scheduler.has_requests()


def test_entries_missing_from_vllms_host_pool_fail(tmp_path, monkeypatch):
    """Mutation: the row mirror never lands. ESS reads its misses from vLLM's host pool at vLLM's host blocks, so
    its rows then hold other bytes than the full cache, and the replay says so."""
    monkeypatch.setattr(replay_module.VllmWorld, "mirrored", lambda self, rid, first, count: None)
    with pytest.raises(AssertionError, match="other bytes"):
        serve(tmp_path, 2 << 20)


def test_the_workload_is_recorded_under_vllms_scheduler(tmp_path, monkeypatch):
    """ESS_RECORD_TRACE with vLLM's own scheduler (requests moving to host reads): the first requests to decode,
    each step as the model selected its top-k and the length its last query saw."""
    import ess_trace
    path = tmp_path / "recorded.safetensors"
    monkeypatch.setenv("ESS_RECORD_TRACE", str(path))
    monkeypatch.setenv("ESS_RECORD_REQUESTS", "3")
    monkeypatch.setenv("ESS_RECORD_STEPS", "8")
    driven = serve(tmp_path, 2 << 20)
    driven.replay.decode.close()
    _, recorded = ess_trace.read_trace(str(path))
    assert len(recorded) == 3
    for x in recorded:
        want = driven.replay.handed[x["id"]][:8]
        np.testing.assert_array_equal(x["topk"], np.stack([ids for ids, _ in want]))
        np.testing.assert_array_equal(x["lengths"], [length for _, length in want])
