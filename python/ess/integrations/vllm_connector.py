"""ESS as vLLM 0.33.0's HiSparse KV connector, loaded by module path (no vLLM source change):

    vllm serve deepseek-ai/DeepSeek-V3.2 --kv-transfer-config '{"kv_connector": "HiSparseConnector",
        "kv_connector_module_path": "ess.integrations.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_pool_gib": 256, "ess_host_gib": 256}}'

KVConnectorFactory.get_connector_class imports this module and takes its `HiSparseConnector`; the class keeps
upstream's name, so vLLM's configuration treats it as HiSparse's (VllmConfig infers hisparse_config,
hisparse_host_pool_gib reads host_pool_gib). It is upstream's connector with one change on the worker: when
vLLM registers its KV caches, every target-model HiSparse layer's cache handle gets ESS's HiSparseRuntime
(ess.integrations.vllm), and start_load_kv stages ESS's step after upstream's. The scheduler side, vLLM's host
pool, its mirror, page transfers and prefill staging are upstream's, unchanged.

This module imports vLLM; the tests check it against the pinned release's source without importing it
(test_vllm_conformance.py)."""
from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import connector as _upstream
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.worker import HiSparseConnectorWorker
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group
from vllm.v1.attention.backend import max_decode_query_len
from vllm.v1.hisparse.runtime import use_shared_hisparse_host_pool

from ..engine import Engine
from .vllm import (EssDecode, HiSparseRuntime, SharedHostPool, check_host_memory, latent_buffers,
                   scheduled_from_output)


class EssConnectorWorker(HiSparseConnectorWorker):
    """Upstream's worker (vLLM's host pool, mirror, transfers), with ESS's runtimes on the target layers."""

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        config = self.vllm_config
        extra = config.kv_transfer_config.kv_connector_extra_config
        targets = [(i, h) for i, h in enumerate(self.cache_handles) if not h.draft_layer]
        first = targets[0][1].runtime
        device = torch.device(first.device)
        cuda = device.type == "cuda"
        T = max_decode_query_len(config)
        max_num_reqs = config.scheduler_config.max_num_seqs
        slots = first.region_stride   # upstream's device_buffer_size: ESS's LRU slots per request-layer
        latent = latent_buffers(len(targets), max_num_reqs, slots + T, device=device)
        max_model_len = config.model_config.max_model_len
        host_bytes = int(float(extra["ess_host_gib"]) * 2**30) if "ess_host_gib" in extra else \
            max_num_reqs * max_model_len * len(targets) * 656
        writer, barrier = self._ess_host_pool(config, host_bytes, cuda)
        self.ess_engine = Engine(
            layers=len(targets), max_requests=max_num_reqs, max_context=max_model_len,
            topk=first.index_group.shared_topk.device_topk_rows.shape[1], query_tokens=T, slots=slots,
            reserve_newest=True, backend="cuda" if cuda else "cpu", device=device.index or 0, host_bytes=host_bytes,
            latent=latent, host_memory=None if self.ess_shared_pool is None else self.ess_shared_pool.buffer,
            host_memory_pinned=cuda and self.ess_shared_pool is not None)
        host_of = [self.host_caches[i] for i, _ in targets]
        source_table = targets[0][1].source_block_table
        block = self.kernel_block_size
        synchronize = (lambda: torch.cuda.current_stream(device).synchronize()) if cuda else (lambda: None)

        def read_host(state, first_token, count):
            # vLLM's host pool rows of the request's tokens: its host block table row, after every pending mirror.
            synchronize()
            blocks = source_table[state].cpu().to(torch.int64)
            tokens = torch.arange(first_token, first_token + count)
            rows = blocks[tokens // block] * block + tokens % block
            return torch.stack([host[rows] for host in host_of])

        self.ess = EssDecode(self.ess_engine, latent, max_num_reqs, read_host, device=device,
                             synchronize=synchronize, writer=writer, barrier=barrier)
        self.ess_upstream_runtimes = {}
        for layer, (i, handle) in enumerate(targets):
            self.ess_upstream_runtimes[i] = handle.runtime
            handle.runtime = HiSparseRuntime(self.ess, layer, handle, upstream=handle.runtime)

    def _ess_host_pool(self, config, host_bytes, cuda):
        """(writer, barrier): one pool per node under attention TP, as vLLM's own (use_shared_hisparse_host_pool):
        rank 0 creates and writes it, every rank maps and reads it. Otherwise the engine allocates its own."""
        self.ess_shared_pool, self.ess_registered = None, None
        if not use_shared_hisparse_host_pool(config):
            check_host_memory(host_bytes)
            return True, None
        writer = get_tensor_model_parallel_rank() == 0
        barrier = get_tp_group().barrier
        name = f"ess_{config.instance_id}_dp{config.parallel_config.data_parallel_index}"
        if writer:
            self.ess_shared_pool = SharedHostPool(name, host_bytes, create=True)
        barrier()
        if not writer:
            self.ess_shared_pool = SharedHostPool(name, host_bytes, create=False)
        if cuda:
            region = torch.frombuffer(self.ess_shared_pool.buffer, dtype=torch.uint8)
            err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region.nbytes, 3)  # portable | mapped
            if err.value != 0:
                raise RuntimeError(f"cudaHostRegister of ESS's shared host pool failed: {err}")
            self.ess_registered = region
        return writer, barrier

    def shutdown(self):
        # Upstream's release_pinned_state frees what its own runtimes hold: give the handles theirs back first.
        for i, runtime in getattr(self, "ess_upstream_runtimes", {}).items():
            self.cache_handles[i].runtime = runtime
        super().shutdown()
        if getattr(self, "ess_engine", None) is not None:
            self.ess_engine.close()
            self.ess_engine = None
        if getattr(self, "ess_registered", None) is not None:
            torch.cuda.cudart().cudaHostUnregister(self.ess_registered.data_ptr())
            self.ess_registered = None
        if getattr(self, "ess_shared_pool", None) is not None:
            self.ess_shared_pool.close()
            self.ess_shared_pool = None


class HiSparseConnector(_upstream.HiSparseConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            if not vllm_config.attention_config.hisparse_config.eager_host_mirror:
                raise ValueError("ESS's HiSparse connector needs eager_host_mirror=True: ESS admits a request from "
                                 "vLLM's host pool, which holds decode rows only with the eager mirror")
            self.connector_worker = EssConnectorWorker(vllm_config, kv_cache_config)

    def start_load_kv(self, forward_context, **kwargs):
        super().start_load_kv(forward_context, **kwargs)
        worker = self.connector_worker
        output, request_ids = kwargs.get("scheduler_output"), kwargs.get("request_ids")
        if output is None or request_ids is None:
            return   # no forward this step
        metadata = self._get_connector_metadata()
        # The forward's decode split, where vLLM passes its attention metadata (FULL graphs; not eager).
        attn = next((m for name, _ in worker._group_leaders
                     if (m := (kwargs.get("attn_metadata") or {}).get(name)) is not None), None)
        worker.ess.start_step(request_ids, kwargs["request_state_indices"].cpu(), scheduled_from_output(output),
                              finished=output.finished_req_ids, preempted=output.preempted_req_ids or (),
                              all_context_pages_resident=metadata.all_context_pages_resident,
                              forward=None if attn is None else (attn.num_decodes, attn.num_decode_tokens))
