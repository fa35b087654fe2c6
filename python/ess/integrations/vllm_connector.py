"""ESS as vLLM 0.33.0's HiSparse KV connector, loaded by module path (no vLLM source change):

    vllm serve deepseek-ai/DeepSeek-V3.2 --kv-transfer-config '{"kv_connector": "HiSparseConnector",
        "kv_connector_module_path": "ess.integrations.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_pool_gib": 256}}'

KVConnectorFactory.get_connector_class imports this module and takes its `HiSparseConnector`; the class keeps
upstream's name, so vLLM's configuration treats it as HiSparse's (VllmConfig infers hisparse_config,
hisparse_host_pool_gib reads host_pool_gib). It is upstream's connector with one change on the worker: when
vLLM registers its KV caches, every target-model HiSparse layer's cache handle gets ESS's HiSparseRuntime
(ess.integrations.vllm), over one ESS engine whose host pool is vLLM's own (its per-layer host caches as
foreign pages) and whose rows are in vLLM's hot regions (its GPU slab: the hot caches' attention views), and
start_load_kv stages ESS's step after upstream's. The scheduler side, vLLM's host pool
(allocated, checked against free memory and shared across the node's TP ranks by vLLM), its mirror, page
transfers and prefill staging are upstream's, unchanged.

This module imports vLLM; the tests check it against the pinned release's source without importing it
(test_vllm_conformance.py)."""
from __future__ import annotations

import logging
import math

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import connector as _upstream
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.worker import HiSparseConnectorWorker
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import max_decode_query_len
from vllm.v1.hisparse.layout import HISPARSE_HOT_SUFFIX as HOT_SUFFIX
from vllm.v1.kv_cache_interface import HiSparseHotSpec

from .._errors import InvalidArgument
from ..engine import Engine
from . import vllm_indexer_split, vllm_overlap
from ._overlap import layers_from_environment, schedule_from_environment
from .vllm import (KERNEL_BLOCK, VLLM_VERSION, EssDecode, HiSparseRuntime, fresh_from_output, host_pool_layout,
                   scheduled_from_output, source_blocks_from_output)

logger = logging.getLogger("ess.integrations.vllm")


class EssConnectorWorker(HiSparseConnectorWorker):
    """Upstream's worker (vLLM's host pool, mirror, transfers), with ESS's runtimes on the target layers."""

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        config = self.vllm_config
        targets = [(i, h) for i, h in enumerate(self.cache_handles) if not h.draft_layer]
        first = targets[0][1].runtime
        device = torch.device(first.device)
        cuda = device.type == "cuda"
        T = max_decode_query_len(config)
        max_num_reqs = config.scheduler_config.max_num_seqs
        topk = first.index_group.shared_topk.device_topk_rows.shape[1]
        # ESS's rows are in vLLM's hot regions: a request vLLM moves to host reads gets blocks_per_request blocks of
        # its GPU slab in each hot cache group (HiSparseHotManager.require_hot), which ESS's engine addresses as its
        # regions (Engine.place), its T reserved rows among them; FlashMLA reads the slab (the hot caches' attention
        # views) at ESS's rows.
        self.ess_hot_groups, region_group, region_blocks = hot_groups_of(self.kv_cache_config,
                                                                          [i for i, _ in targets])
        slots = region_blocks * KERNEL_BLOCK - T
        floor = min(topk, config.model_config.max_model_len)
        if slots < floor:
            raise ValueError(f"ESS's HiSparse connector: a hot region of {region_blocks} blocks of {KERNEL_BLOCK} rows "
                             f"(device_buffer_size {first.region_stride}) leaves {slots} LRU rows beside the T = {T} "
                             f"reserved ones; one query token's top-k needs {floor}: set device_buffer_size to at least "
                             f"{floor + T}")
        # Each layer's attention view runs from its own offset in vLLM's one slab to the slab's end (PagedCacheView.bind:
        # raw[byte_offset:]), so a later layer's has fewer rows: every view is cut to the shortest, which still holds
        # every vLLM block's rows (block k of a layer at k x attention_block_stride rows, its layer offset below that).
        views = [h.runtime.hot.attention_cache for _, h in targets]
        latent = [v[:min(u.shape[0] for u in views)] for v in views]
        strides = {h.runtime.hot.attention_block_stride for _, h in targets}
        if len(strides) != 1:
            raise ValueError(f"ESS's HiSparse connector: the hot caches' attention block strides differ ({strides})")
        # vLLM's host pool: the one pinned (or node-shared) allocation behind every layer's host cache.
        backing = first.registered_host_pool
        pages = host_pool_layout(backing, [self.host_caches[i] for i, _ in targets])
        if cuda:
            free, total = torch.cuda.mem_get_info(device)
            memory = (free, total, config.cache_config.gpu_memory_utilization, torch.cuda.memory_reserved(device),
                      device)
        self.ess_engine = Engine(
            layers=len(targets), max_requests=max_num_reqs, max_context=config.model_config.max_model_len,
            topk=topk, query_tokens=T, slots=slots, reserve_newest=True, backend="cuda" if cuda else "cpu",
            device=device.index or 0, latent=latent, region_blocks=region_blocks, region_group=region_group,
            host_memory=backing.numpy(), host_memory_pinned=cuda, foreign_pages=pages)
        if cuda:   # what the engine holds on the device beside vLLM's KV cache (its LRU state, scratch, tables)
            try:
                check_device_memory(self.ess_engine.device_bytes(), *memory)
            except ValueError:
                self.ess_engine.close()
                self.ess_engine = None
                raise
        synchronize = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
        # The scheduler's computed-token counts run ahead of the device's only under async scheduling with
        # speculative decoding (upstream's HiSparseConnectorScheduler async_speculative, connector.py).
        speculative = config.speculative_config
        run_ahead = bool(config.scheduler_config.async_scheduling and speculative is not None)
        # Adaptive verification (config/speculative.py enable_adaptive_verification) trims the verify rows' drafts on
        # the device (v1/worker/gpu/spec_decode/adaptive_verification.py reallocate_drafts).
        adaptive = bool(speculative is not None and speculative.enable_adaptive_verification)
        try:
            # ESS_OVERLAP: each target layer's schedule (vllm_overlap.py: DA inside FlashMLA's FP8 sparse decode;
            # vllm_indexer_split.py: DBA's indexer split).
            names = hot_layer_names(self.kv_cache_config, [i for i, _ in targets])
            overlap = overlap_schedules(names)
            if overlap is not None:
                check_da_backend(config, [n for n, s in zip(names, overlap) if s != "none"])
            self.ess = EssDecode(self.ess_engine, latent, max_num_reqs, targets[0][1].source_block_table,
                                 device=device, synchronize=synchronize, counts_run_ahead=run_ahead,
                                 attention_block_stride=strides.pop(), region_group=region_group,
                                 adaptive_verification=adaptive, overlap=overlap)
        except InvalidArgument:
            self.ess_engine.close()
            self.ess_engine = None
            raise
        if self.ess.overlap is not None:   # a DA or DBA layer: FlashMLA's FP8 sparse decode runs it in two parts
            vllm_overlap.patch()
        # The host source group (v1/hisparse/binding.py: the handles' source_block_table is its block table).
        (self.ess_source_group,) = self.kv_cache_config.host_group_ids
        self.ess_upstream_runtimes = {}
        for layer, (i, handle) in enumerate(targets):
            self.ess_upstream_runtimes[i] = handle.runtime
            handle.runtime = HiSparseRuntime(self.ess, layer, handle, upstream=handle.runtime)
            if self.ess.overlap is not None and self.ess.overlap.runs_dba(layer):
                # DBA: the layer's indexer (by the model's layer index) swaps the batch's first half
                # (vllm_indexer_split.py); the forward's metadata of the layer's attention gives the swap's rows.
                self.ess.overlap.serve_indexer(extract_layer_index(names[layer]), handle.runtime,
                                               names[layer].removesuffix(HOT_SUFFIX))
        if self.ess.overlap is not None and self.ess.overlap.indexers:
            vllm_indexer_split.serve(self.ess.overlap)
            vllm_indexer_split.patch()

    def reset_hot_state(self):
        # HiSparseConnector.reset_capture_state (after CUDA-graph capture): upstream's leader runtimes, which
        # worker.py gathered before ESS's went on the handles, then every ESS request's device residency.
        super().reset_hot_state()
        if getattr(self, "ess", None) is not None:
            self.ess.reset()

    def shutdown(self):
        # Upstream's release_pinned_state frees what its own runtimes hold (vLLM's host pool, which ESS's engine
        # sits on): give the handles theirs back and close ESS's engine first.
        for i, runtime in getattr(self, "ess_upstream_runtimes", {}).items():
            self.cache_handles[i].runtime = runtime
        if getattr(self, "ess", None) is not None:
            if self.ess.overlap is not None:
                vllm_indexer_split.unserve(self.ess.overlap)
            self.ess.close()
        if getattr(self, "ess_engine", None) is not None:
            self.ess_engine.close()
            self.ess_engine = None
        super().shutdown()


def hot_layer_names(kv_cache_config, handles):
    """The layer names of the upstream worker's cache handles `handles` (worker.py register_kv_caches lists them hot
    group by hot group, each group's layer names in order)."""
    names = [name for group in kv_cache_config.kv_cache_groups if isinstance(group.kv_cache_spec, HiSparseHotSpec)
             for name in group.layer_names]
    return [names[i] for i in handles]


def overlap_schedules(layer_names):
    """ESS_OVERLAP's schedule of each layer (None: none anywhere): da or dba everywhere, or layer-wise from
    ESS_OVERLAP_LAYERS by the model's layer index (vLLM's extract_layer_index of the layer name), a group's first
    code (vLLM runs no micro-batches under HiSparse)."""
    mode = schedule_from_environment()
    if mode == "none":
        return None
    if mode in ("da", "dba"):
        return [mode] * len(layer_names)
    ids = [extract_layer_index(name) for name in layer_names]
    layers = layers_from_environment(0, max(ids) + 1)
    return [layers[i][0] for i in ids]


def check_da_backend(config, hot_names):
    """A DA or DBA layer's decode must be vLLM's FlashMLA sparse FP8 decode, which vllm_overlap.py runs in two parts:
    each layer's attention (the static forward context's layer of the hot cache's name less ".hisparse_hot", as
    upstream's worker finds its handle) has a FlashMLASparseImpl over an fp8_ds_mla cache (the layer's own
    kv_cache_dtype, which kv_cache_dtype_skip_layers may set apart from the server's). Refused by name otherwise."""
    impl_class = vllm_overlap.flashmla_sparse_impl()
    context = config.compilation_config.static_forward_context
    for name in hot_names:
        layer = context.get(name.removesuffix(HOT_SUFFIX))
        impl = getattr(layer, "impl", None)
        if not isinstance(impl, impl_class):
            raise InvalidArgument(f"ESS_OVERLAP: DA runs inside vLLM's FlashMLA sparse FP8 decode; layer {name!r} "
                                  f"attends with {type(impl).__name__}: set ESS_OVERLAP = none (or choose the "
                                  "FLASHMLA_SPARSE attention backend)")
        if impl.kv_cache_dtype != "fp8_ds_mla":
            raise InvalidArgument(f"ESS_OVERLAP: DA runs inside FlashMLA's FP8 sparse decode (kv_cache_dtype "
                                  f"fp8_ds_mla); layer {name!r}'s cache is {impl.kv_cache_dtype}: set ESS_OVERLAP = "
                                  "none")


def hot_groups_of(kv_cache_config, handles):
    """The hot cache groups of the upstream worker's cache handles `handles` (worker.py register_kv_caches lists them
    group by group, each group's layer names in order; v1/hisparse/layout.py packs the layers into groups of one
    indexer page each): the KV cache groups in order, each handle's index among them (ESS's region group of the
    layer) and their blocks_per_request (HiSparseHotSpec: a hot region, the same in every group)."""
    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, HiSparseHotSpec):
            groups += [g] * len(group.layer_names)
    wanted = sorted({groups[i] for i in handles})
    sizes = {kv_cache_config.kv_cache_groups[g].kv_cache_spec.blocks_per_request for g in wanted}
    if len(sizes) != 1:
        raise ValueError(f"ESS's HiSparse connector: the hot cache groups {wanted} have regions of {sorted(sizes)} "
                         "blocks; ESS keeps one region size")
    return wanted, [wanted.index(groups[i]) for i in handles], sizes.pop()


def check_device_memory(engine_bytes, free, total, utilization, allocator_held, device):
    """The ESS engine's own device memory (Engine.device_bytes(): its LRU state, step scratch and page tables; its rows
    are in vLLM's hot regions, inside vLLM's KV cache) against the memory vLLM's budget leaves; free and
    allocator_held as they were before the engine was made. vLLM sizes its KV cache so that its process fits in
    gpu_memory_utilization x total (v1/worker/gpu_worker.py determine_available_memory: weights, the KV cache, the
    activation peak and the CUDA graphs' estimate); when its KV cache is registered the activations and graphs are
    not allocated yet, so their share is still free. Of the free memory, ESS may take only what lies outside that
    budget: free - (budget - what vLLM's allocator holds) (stricter by vLLM's memory outside its allocator, the CUDA
    context's). Refused by name, with the utilization that would leave room, when it does not fit."""
    budget = math.ceil(total * utilization)
    room = free - max(0, budget - allocator_held)
    if engine_bytes > room:
        fits = math.floor((utilization - (engine_bytes - room) / total) * 1000) / 1000
        raise ValueError(f"ESS's HiSparse connector: its engine's state (LRU state, step scratch, page tables) needs "
                         f"{engine_bytes / 2**30:.2f} GiB and {device} has {max(room, 0) / 2**30:.2f} GiB outside "
                         f"vLLM's budget (gpu_memory_utilization {utilization} of {total / 2**30:.2f} GiB; "
                         f"{free / 2**30:.2f} GiB free, {allocator_held / 2**30:.2f} GiB held by vLLM's allocator): set "
                         f"gpu_memory_utilization to at most {fits}, or lower max_num_seqs or device_buffer_size")
    return engine_bytes


def leader_metadata(worker, forward_context, attn_metadata):
    """The forward's sparse MLA metadata of an index-group leader layer (its decode split and true seq_lens): the
    one vLLM passes with a FULL graph (v1/worker/gpu/model_runner.py: kv_connector.pre_forward(...,
    attn_metadata=)), else the forward context's (eager and piecewise: pre_forward runs inside
    set_forward_context(attn_metadata, ...)). Refused by name when there is none: ESS would take the scheduler's
    num_computed_tokens, an upper bound under async scheduling with speculative decoding."""
    if attn_metadata is None:
        attn_metadata = getattr(forward_context, "attn_metadata", None)
    if not isinstance(attn_metadata, dict):
        raise ValueError(f"ESS's HiSparse connector: the forward's attention metadata is "
                         f"{type(attn_metadata).__name__}; a dict by layer name expected (micro-batching is not "
                         "served)")
    found = next((m for name, handle in worker._group_leaders
                  if not handle.draft_layer and (m := attn_metadata.get(name)) is not None), None)
    if found is None:
        raise ValueError("ESS's HiSparse connector: the forward's attention metadata has no target-model "
                         "index-group leader layer "
                         f"({', '.join(name for name, h in worker._group_leaders if not h.draft_layer)})")
    return found


def check_release(vllm_config):
    """The connector is checked against vLLM VLLM_VERSION (its call sites, its objects' behaviour): another release
    is refused by name, unless kv_connector_extra_config's "ess_checked_vllm" names that very release (whoever set
    it re-ran test_vllm_conformance.py and the replays against it), which is then logged."""
    import vllm
    version = getattr(vllm, "__version__", None)
    if version == VLLM_VERSION:
        return
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = (getattr(transfer, "kv_connector_extra_config", None) or {}) if transfer is not None else {}
    if version is not None and extra.get("ess_checked_vllm") == version:
        logger.warning("ESS's HiSparse connector runs under vLLM %s (checked against %s; ess_checked_vllm says %s "
                       "was checked too)", version, VLLM_VERSION, version)
        return
    raise ValueError(f"ESS's HiSparse connector: vLLM {version}: this connector is checked against vLLM "
                     f"{VLLM_VERSION}; re-run python/tests/test_vllm_conformance.py and the vLLM replays against "
                     f"{version} first, then set kv_connector_extra_config \"ess_checked_vllm\": \"{version}\"")


class HiSparseConnector(_upstream.HiSparseConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        check_release(vllm_config)   # before anything of upstream's is built
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            if vllm_config.parallel_config.use_ubatching:
                raise ValueError("ESS's HiSparse connector does not serve micro-batching (enable_dbo / ubatch_size "
                                 "> 1): start_step reads one forward's attention metadata")
            if not vllm_config.attention_config.hisparse_config.eager_host_mirror:
                raise ValueError("ESS's HiSparse connector needs eager_host_mirror=True: without it vLLM keeps "
                                 "decode rows resident-only and copies a page to its host pool only when it spills it "
                                 "(config/attention.py HiSparseConfig.eager_host_mirror), while ESS reads every "
                                 "decoded token's entry it misses from that host pool")
            self.connector_worker = EssConnectorWorker(vllm_config, kv_cache_config)

    def get_finished(self, finished_req_ids):
        # Every step's finished requests, a step without a forward included (v1/worker/gpu/kv_connector.py
        # ActiveKVConnector.post_forward -> get_transfer_results -> get_finished): ESS releases them at its next
        # start_step (a step without a forward brings no start_load_kv, so it would otherwise never see them).
        worker = self.connector_worker
        if worker is not None and getattr(worker, "ess", None) is not None:
            worker.ess.note_finished(finished_req_ids)
        return super().get_finished(finished_req_ids)

    def start_load_kv(self, forward_context, **kwargs):
        super().start_load_kv(forward_context, **kwargs)
        worker = self.connector_worker
        output, request_ids = kwargs.get("scheduler_output"), kwargs.get("request_ids")
        if output is None or request_ids is None:
            return   # no forward this step
        metadata = self._get_connector_metadata()
        worker.ess.start_step(request_ids, kwargs["request_state_indices"], scheduled_from_output(output),
                              finished=output.finished_req_ids, preempted=output.preempted_req_ids or (),
                              fresh=fresh_from_output(output),
                              all_context_pages_resident=metadata.all_context_pages_resident,
                              attn_metadata=leader_metadata(worker, forward_context, kwargs.get("attn_metadata")),
                              new_blocks=source_blocks_from_output(output, worker.ess_source_group),
                              hot_blocks=[source_blocks_from_output(output, g) for g in worker.ess_hot_groups])
