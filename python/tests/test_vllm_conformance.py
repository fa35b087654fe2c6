"""ess.integrations.vllm / vllm_connector against the pinned vLLM release's own source (0.33.0, from
scripts/upstream.sh under build/upstream; its absence fails):

- every attribute read, assignment and method call vLLM makes on a HiSparse cache handle's runtime, found by an
  AST scan (vllm_callsites.py), binds to ESS's HiSparseRuntime (name, positional and keyword arguments, members
  read on the attribute), unless it runs before the connector puts ESS's runtimes on the handles;
- swap_in and begin_forward have upstream's parameters;
- the connector overrides only methods upstream's classes define, with their parameters (its own are named
  _ess_*), reads only what the release defines, and vLLM's configuration loads it by module path under upstream's name."""
import ast
import inspect
import os
import tempfile

import pytest

import vllm_callsites
from callsite_ast import binds
from ess.integrations import vllm as adapter
from ess.integrations import vllm_overlap

SOURCE = vllm_callsites.default_source()
CONNECTOR = os.path.join(os.path.dirname(adapter.__file__), "vllm_connector.py")

# Call sites that never see ESS's runtime, and why.
BEFORE = "vLLM binds its KV caches (v1/hisparse/binding.py init_hisparse_kv_cache) before the connector exists"
INSIDE = ("upstream's HiSparseConnectorWorker.register_kv_caches, which EssConnectorWorker.register_kv_caches runs "
          "before it puts ESS's runtimes on the handles")
EXCLUDED = {
    ("v1/hisparse/binding.py", "release_hisparse_profiling_cache"): BEFORE,
    ("v1/hisparse/binding.py", "bind_hisparse_kv_caches"): BEFORE,
    ("v1/hisparse/runtime.py", "initialize_hisparse_runtime_buffers"): BEFORE,
    ("distributed/kv_transfer/kv_connector/v1/hisparse/worker.py", "register_kv_caches"): INSIDE,
    ("distributed/kv_transfer/kv_connector/v1/hisparse/worker.py", "initialize"): INSIDE,
    ("distributed/kv_transfer/kv_connector/v1/hisparse/worker.py", "_init_dma"): INSIDE,
    ("distributed/kv_transfer/kv_connector/v1/hisparse/worker.py", "shutdown"):
        "EssConnectorWorker.shutdown gives the handles upstream's runtimes back first",
}


def path(rel):
    return os.path.join(SOURCE, *rel.split("/"))


@pytest.fixture(scope="module")
def uses():
    if not os.path.isdir(SOURCE):
        pytest.fail(f"the pinned vLLM sources are not at {SOURCE}: run scripts/upstream.sh")
    found = vllm_callsites.scan(SOURCE)
    assert len(found) >= 20, "the scan found almost nothing: the release's layout changed"
    return found


def key(u):
    return (u.path.replace(os.sep, "/"), u.function)


def test_every_use_binds_or_runs_before_ess(uses):
    cls = adapter.HiSparseRuntime
    missing = []
    for u in uses:
        if key(u) in EXCLUDED:
            continue
        member = getattr(cls, u.name, None)
        if u.name == "<passed>":
            ok = False
        elif u.store:
            ok = isinstance(member, property) and member.fset is not None
        elif u.call:
            ok = callable(member) and not u.starred and binds(member, u.positional, u.keywords)
        else:
            ok = member is not None
        if ok and u.members:
            fields = adapter.HotView._fields if u.name == "hot" else ()
            ok = all(m in fields for m in u.members)
        if not ok:
            missing.append(f"{u.where()}: {'call' if u.call else 'store' if u.store else 'read'} {u.name}"
                           + (f"({u.positional} positional, {u.keywords})" if u.call else "")
                           + (f" .{'.'.join(u.members)}" if u.members else ""))
    assert not missing, "vLLM uses what ESS's runtime lacks:\n" + "\n".join(missing)


def test_the_excluded_table_names_real_call_sites(uses):
    """A stale entry would hide a new call site."""
    found = {key(u) for u in uses}
    stale = sorted(k for k in EXCLUDED if k not in found)
    assert not stale, f"EXCLUDED names call sites the release no longer has: {stale}"


def upstream_def(rel, cls, name):
    tree = ast.parse(open(path(rel), encoding="utf-8").read())
    klass = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    assert klass is not None, f"{rel} no longer defines {cls}"
    return next((n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def parameters(fn: ast.FunctionDef):
    a = fn.args
    return ([x.arg for x in a.posonlyargs + a.args], [x.arg for x in a.kwonlyargs], a.vararg is not None,
            a.kwarg is not None)


def test_swap_in_and_begin_forward_have_upstreams_parameters():
    runtime = "v1/hisparse/runtime.py"
    for name in ("swap_in", "begin_forward"):
        theirs = parameters(upstream_def(runtime, "HiSparseRuntime", name))
        ours = parameters(ast.parse(inspect.getsource(getattr(adapter.HiSparseRuntime, name)).strip()).body[0])
        assert (ours[0], sorted(ours[1]), ours[2], ours[3]) == (theirs[0], sorted(theirs[1]), theirs[2], theirs[3]), \
            f"{name}: ours {ours}, upstream's {theirs}"


CONNECTOR_BASES = {
    "EssConnectorWorker": ("distributed/kv_transfer/kv_connector/v1/hisparse/worker.py", "HiSparseConnectorWorker"),
    "HiSparseConnector": ("distributed/kv_transfer/kv_connector/v1/hisparse/connector.py", "HiSparseConnector"),
}
# Where a method the connector overrides may be defined upstream: the base, then the base's own bases.
UPSTREAM_CHAIN = {
    "HiSparseConnector": [("distributed/kv_transfer/kv_connector/v1/hisparse/connector.py", "HiSparseConnector"),
                          ("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1")],
}


def inherited_def(name, method):
    """The upstream definition the connector class `name`'s method overrides: its base's, else the nearest one."""
    rel, base = CONNECTOR_BASES[name]
    for rel, cls in UPSTREAM_CHAIN.get(name, [(rel, base)]):
        fn = upstream_def(rel, cls, method)
        if fn is not None:
            return fn
    return None


def test_the_connector_overrides_only_what_upstream_defines():
    tree = ast.parse(open(CONNECTOR, encoding="utf-8").read())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert sorted(c.name for c in classes) == sorted(CONNECTOR_BASES)
    for c in classes:
        rel, base = CONNECTOR_BASES[c.name]
        assert ast.unparse(c.bases[0]).split(".")[-1] == base
        for fn in (n for n in c.body if isinstance(n, ast.FunctionDef)):
            theirs = inherited_def(c.name, fn.name)
            if fn.name.startswith("_ess_"):   # ours alone, under a prefix no upstream name has
                assert theirs is None, f"{c.name}.{fn.name} shadows upstream's"
                continue
            assert theirs is not None, f"{c.name}.{fn.name}: upstream's {base} has no such method"
            assert parameters(fn) == parameters(theirs), \
                f"{c.name}.{fn.name}{parameters(fn)} vs upstream's {parameters(theirs)}"


def test_finished_requests_reach_the_connectors_get_finished():
    """v1/worker/gpu/kv_connector.py ActiveKVConnector.post_forward (after every step, no_forward's too) passes
    the step's finished_req_ids to get_transfer_results, which KVConnectorBase_V1 answers from get_finished and
    HiSparseConnector does not override: the connector's get_finished sees every finished request."""
    post = upstream_def("v1/worker/gpu/kv_connector.py", "ActiveKVConnector", "post_forward")
    assert "self.kv_connector.get_transfer_results(finished_req_ids)" in ast.unparse(post)
    no_forward = upstream_def("v1/worker/gpu/kv_connector.py", "ActiveKVConnector", "no_forward")
    assert "self.post_forward(finished_req_ids)" in ast.unparse(no_forward)
    results = upstream_def("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1",
                           "get_transfer_results")
    assert "self.get_finished(finished_req_ids)" in ast.unparse(results)
    rel, cls = CONNECTOR_BASES["HiSparseConnector"]
    assert upstream_def(rel, cls, "get_transfer_results") is None
    assert upstream_def(rel, cls, "get_finished") is None, "upstream's HiSparseConnector defines get_finished now"


def assigned_on_self(rel, cls):
    tree = ast.parse(open(path(rel), encoding="utf-8").read())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    names = {n.target.id for n in klass.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    names |= {n.name for n in klass.body if isinstance(n, ast.FunctionDef)}
    for n in ast.walk(klass):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                  and t.value.id == "self"}
    return names


# What vllm_connector.py (and scheduled_from_output) read on vLLM's objects: each must be in the release.
READ = [
    ("distributed/kv_transfer/kv_connector/v1/hisparse/worker.py", "HiSparseConnectorWorker",
     {"vllm_config", "kv_cache_config", "cache_handles", "host_caches", "_group_leaders", "register_kv_caches",
      "shutdown"}),
    ("v1/kv_cache_interface.py", "KVCacheConfig", {"host_group_ids", "kv_cache_groups"}),
    ("v1/kv_cache_interface.py", "KVCacheGroupSpec", {"layer_names", "kv_cache_spec"}),
    ("v1/kv_cache_interface.py", "HiSparseHotSpec", {"blocks_per_request"}),
    ("v1/hisparse/runtime.py", "HiSparseCacheHandle", {"runtime", "draft_layer", "source_block_table", "block_table",
                                                       "view"}),
    ("v1/hisparse/runtime.py", "HiSparseRuntime",
     {"region_stride", "device", "index_group", "registered_host_pool", "is_group_leader", "hot"}),
    ("v1/hisparse/runtime.py", "PagedCacheView", {"cache", "attention_cache", "block_size", "attention_block_stride"}),
    ("v1/hisparse/runtime.py", "HiSparseIndexGroup", {"shared_topk", "swap_stats"}),
    ("v1/hisparse/runtime.py", "_SharedTopKState", {"device_topk_rows"}),
    ("distributed/kv_transfer/kv_connector/v1/hisparse/connector.py", "HiSparseConnector",
     {"connector_worker", "start_load_kv"}),
    ("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1", {"_get_connector_metadata"}),
    ("distributed/kv_transfer/kv_connector/v1/hisparse/connector.py", "HiSparseConnectorMetadata",
     {"all_context_pages_resident"}),
    ("v1/core/sched/output.py", "SchedulerOutput",
     {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "finished_req_ids",
      "preempted_req_ids"}),
    ("v1/core/sched/output.py", "NewRequestData", {"req_id", "num_computed_tokens", "block_ids"}),
    ("v1/core/sched/output.py", "CachedRequestData",
     {"req_ids", "num_computed_tokens", "resumed_req_ids", "new_block_ids"}),
    ("config/attention.py", "HiSparseConfig", {"eager_host_mirror"}),
    ("config/attention.py", "AttentionConfig", {"hisparse_config"}),
    ("config/vllm.py", "VllmConfig", {"attention_config", "scheduler_config", "model_config", "parallel_config",
                                      "cache_config", "speculative_config", "compilation_config"}),
    ("config/cache.py", "CacheConfig", {"gpu_memory_utilization"}),
    ("config/compilation.py", "CompilationConfig", {"static_forward_context"}),
    # (vllm_overlap.py: the DA's two FlashMLA sparse methods; the attention layer's impl, check_da_backend)
    ("model_executor/layers/attention/mla_attention.py", "MLAAttention", {"impl"}),
    ("model_executor/layers/attention/mla_attention.py", "MLACommonBaseImpl", {"kv_cache_dtype"}),
    ("v1/attention/backends/mla/flashmla_sparse.py", "FlashMLASparseImpl", {"fp8_decode_padded_heads", "softmax_scale"}),
    ("model_executor/layers/attention/sparse_mla_attention.py", "SparseMLACommonImpl",
     {"index_group", "index_group_index"}),   # FlashMLASparseImpl's base
    ("config/speculative.py", "SpeculativeConfig", {"enable_adaptive_verification"}),
    ("config/parallel.py", "ParallelConfig", {"use_ubatching"}),
    ("forward_context.py", "ForwardContext", {"attn_metadata"}),
    ("model_executor/layers/attention/sparse_mla_attention.py", "SparseMLACommonMetadata",
     {"num_decodes", "num_decode_tokens", "seq_lens"}),
    ("config/scheduler.py", "SchedulerConfig", {"max_num_seqs", "async_scheduling"}),
    ("config/model.py", "ModelConfig", {"max_model_len"}),
]


@pytest.mark.parametrize("rel,cls,names", READ, ids=[r[1] for r in READ])
def test_what_the_connector_reads_is_in_the_release(rel, cls, names):
    missing = names - assigned_on_self(rel, cls)
    assert not missing, f"{rel} {cls} has none of {sorted(missing)}"


def test_the_connectors_imports_are_in_the_release():
    """Every `from vllm.X import name` of vllm_connector.py names a module of the release that defines it."""
    tree = ast.parse(open(CONNECTOR, encoding="utf-8").read())
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 0 and
               (n.module or "").startswith("vllm.")]
    assert len(imports) >= 3
    for node in imports:
        rel = node.module.split(".", 1)[1].replace(".", "/")
        module = path(rel + ".py") if os.path.exists(path(rel + ".py")) else path(rel + "/__init__.py")
        assert os.path.exists(module), f"vllm.{rel} is not in the release"
        if os.path.isdir(path(rel)) and not module.endswith("__init__.py"):
            continue
        top = ast.parse(open(module, encoding="utf-8").read()).body
        defined = {n.name for n in top if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in top if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        defined |= {a.asname or a.name for n in top if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        for alias in node.names:
            sub = os.path.exists(path(f"{rel}/{alias.name}.py")) or os.path.isdir(path(f"{rel}/{alias.name}"))
            assert alias.name in defined or sub, f"vllm.{node.module.split('.', 1)[1]} has no {alias.name}"


def test_start_load_kv_gets_what_the_connector_reads():
    """v1/worker/gpu/kv_connector.py ActiveKVConnector._build_load_kwargs passes the keys start_load_kv reads, and
    upstream's start_load_kv takes them as **kwargs."""
    fn = upstream_def("v1/worker/gpu/kv_connector.py", "ActiveKVConnector", "_build_load_kwargs")
    keys = {k.arg for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "dict"
            for k in n.keywords}
    keys |= {n.slice.value for n in ast.walk(fn) if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)}
    assert {"scheduler_output", "request_state_indices", "request_ids", "attn_metadata"} <= keys, keys
    assert parameters(upstream_def("distributed/kv_transfer/kv_connector/v1/hisparse/connector.py",
                                   "HiSparseConnector", "start_load_kv"))[3]


def test_esss_rows_in_hot_regions_read_what_vllm_binds():
    """The connector's hot regions rest on: upstream's worker listing its cache handles hot group by hot group, each
    group's layer names in order (hot_group_of); a layer's hot cache and resident view being one slab with one
    layout, its handle's block table the residency table by state row (binding.py); a hot region handed out whole
    and held until the request goes (single_type_kv_cache_manager.py HiSparseHotManager); pages unpinned only for
    a request that has one (coordinator.py), so a request without one reads every page in place; FlashMLA reading
    the hot cache's attention view (index_group.py physical_kv_cache); vLLM's own resident resolution mapping
    block x attention block stride + offset by state index (the triton conversion ESS's in-place rows follow)."""
    worker = ast.unparse(upstream_def("distributed/kv_transfer/kv_connector/v1/hisparse/worker.py",
                                      "HiSparseConnectorWorker", "register_kv_caches"))
    assert ("for group in self.kv_cache_config.kv_cache_groups:\n        if not isinstance(group.kv_cache_spec, "
            "HiSparseHotSpec):\n            continue\n        for cache_name in group.layer_names:") in worker
    binding = open(path("v1/hisparse/binding.py"), encoding="utf-8").read()
    assert "block_table=residency[resident_source_index]," in binding
    assert "resident.cache.data_ptr() != hot.cache.data_ptr()" in binding
    assert 'raise RuntimeError("HiSparse resident and hot layouts must match.")' in binding
    hot = ast.unparse(upstream_def("v1/core/single_type_kv_cache_manager.py", "HiSparseHotManager",
                                   "allocate_new_blocks"))
    assert "num_new_blocks = self.blocks_per_request - len(req_blocks)" in hot
    coordinator = ast.unparse(upstream_def("v1/hisparse/coordinator.py", "HiSparseCoordinator", "_page_became_clean"))
    assert "if self._can_read_from_host(request_id):\n        self._unpin_page(request_id, state, page_idx)" \
        in coordinator
    assert "return cache.runtime.hot.attention_cache" in ast.unparse(
        upstream_def("v1/attention/backends/mla/index_group.py", "HiSparseMLAIndexGroup", "physical_kv_cache"))
    convert = ast.unparse(upstream_def("v1/attention/backends/mla/index_group.py", "HiSparseMLAIndexGroup",
                                       "convert_logical_to_physical_topk"))
    assert "block_stride_rows=leader.view.attention_block_stride" in convert
    assert "idx_mapping=leader.runtime.request_state_indices" in convert


def test_the_newest_entries_and_adaptive_verification_rest_on_upstreams_facts():
    """With hot regions ESS fills each row's reserved rows on the device from vLLM's resident tail pages, and maps the
    swap's tokens from req_id_per_token, which adaptive verification needs. That rests on: a request's last
    ACTIVE_TAIL_PAGES (2) pages never unpinned (coordinator.py _resident_page_blocks), every appended page sent in
    the residency updates (take_residency_updates); req_id_per_token built from the device's query_start_loc
    (backend.py token_to_req_indices), the decode swap given it with num_valid_rows the device's token count
    (index_group.py); adaptive verification deciding each row's drafts on the device (reallocate_drafts writes
    query_start_loc there), the host's counts its even spread (compact_batch), and FlashMLA sparse not opting out
    of that mismatch (supports_device_cpu_query_lens_mismatch, not overridden)."""
    types_py = open(path("v1/hisparse/types.py"), encoding="utf-8").read()
    assert f"ACTIVE_TAIL_PAGES = {adapter.ACTIVE_TAIL_PAGES}\n" in types_py
    tail = ast.unparse(upstream_def("v1/hisparse/coordinator.py", "HiSparseCoordinator", "_resident_page_blocks"))
    assert "if page_idx >= num_pages - ACTIVE_TAIL_PAGES or block is None:\n            return None" in tail
    updates = ast.unparse(upstream_def("v1/hisparse/coordinator.py", "HiSparseCoordinator", "take_residency_updates"))
    assert "pages=[*stale_pages, *range(start, num_pages)]" in updates
    mapping = ast.unparse(upstream_def("v1/attention/backend.py", "CommonAttentionMetadata", "token_to_req_indices"))
    assert "compute_token_to_req_indices(self.query_start_loc, buffer" in mapping
    convert = ast.unparse(upstream_def("v1/attention/backends/mla/index_group.py", "HiSparseMLAIndexGroup",
                                       "convert_logical_to_physical_topk"))
    assert "num_valid_rows=attn_metadata.query_start_loc[-1:]" in convert
    reallocate = ast.unparse(upstream_def("v1/worker/gpu/spec_decode/adaptive_verification.py",
                                          "AdaptiveVerificationManager", "reallocate_drafts"))
    assert "torch.cumsum(capacities + num_non_draft_tokens_gpu, dim=0, out=self.query_start_loc[1:num_reqs + 1])" \
        in reallocate
    compact = ast.unparse(upstream_def("v1/worker/gpu/spec_decode/adaptive_verification.py",
                                       "AdaptiveVerificationManager", "compact_batch"))
    assert "draft_lens_cpu[:num_verification_reqs] = draft_budget // num_verification_reqs" in compact
    backend = open(path("v1/attention/backends/mla/flashmla_sparse.py"), encoding="utf-8").read()
    assert "supports_device_cpu_query_lens_mismatch" not in backend
    # ...but vLLM 0.33.0 refuses adaptive verification on the backends that read fp8_ds_mla: FlashMLA sparse's and
    # FlashInfer's (SM120) metadata builders replay uniform batches only, with no varlen bound, and the manager raises
    # for such a backend. When a release allows it, this fails: docs/integration.md's "Adaptive verification" then
    # says it runs.
    for rel, cls in (("v1/attention/backends/mla/flashmla_sparse.py", "FlashMLASparseMetadataBuilder"),
                     ("v1/attention/backends/mla/flashinfer_mla_sparse.py", "FlashInferMLASparseMetadataBuilder")):
        builder = next(n for n in ast.parse(open(path(rel), encoding="utf-8").read()).body
                       if isinstance(n, ast.ClassDef) and n.name == cls)
        text = ast.unparse(builder)
        assert "_cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH" in text, cls
        assert "get_varlen_cudagraph_max_query_len" not in text, cls
    manager = ast.unparse(next(n for n in ast.parse(open(path("v1/worker/gpu/spec_decode/adaptive_verification.py"),
                                                          encoding="utf-8").read()).body
                               if isinstance(n, ast.FunctionDef) and n.name == "maybe_create_adaptive_verification_manager"))
    assert "get_varlen_cudagraph_unsupported_backend(attn_groups, vllm_config, max_query_len" in manager
    assert "Adaptive verification replays decode cudagraphs whose per-request" in manager
    assert "return not cls.is_ssm()" in ast.unparse(
        upstream_def("v1/attention/backend.py", "AttentionBackend", "supports_device_cpu_query_lens_mismatch"))


def test_the_host_block_table_is_kept_from_the_scheduler_output_as_vllms_runner_keeps_it():
    """source_blocks_from_output follows the GPU model runner (v1/worker/gpu/model_runner.py): a new request's
    block_ids overwrite its table, a cached request's new_block_ids are appended; the table the handles read is the
    host source group's (v1/hisparse/binding.py); and the counts run ahead under upstream's condition."""
    runner = "v1/worker/gpu/model_runner.py"
    add = ast.unparse(upstream_def(runner, "GPUModelRunner", "add_requests"))
    assert "self.block_tables.append_block_ids(req_index, new_req_data.block_ids, overwrite=True)" in add
    update = ast.unparse(upstream_def(runner, "GPUModelRunner", "update_requests"))
    assert "zip(reqs.req_ids, reqs.num_computed_tokens, reqs.new_block_ids)" in update
    assert "self.block_tables.append_block_ids(req_index, req_new_block_ids, overwrite=False)" in update
    binding = open(path("v1/hisparse/binding.py"), encoding="utf-8").read()
    assert "(source_group_id,) = kv_cache_config.host_group_ids" in binding
    assert "cache_handle.source_block_table = block_tables.input_block_tables[\n            source_group_id\n" \
        in binding
    connector = ast.unparse(ast.parse(open(path("distributed/kv_transfer/kv_connector/v1/hisparse/connector.py"),
                                           encoding="utf-8").read()))
    assert ("async_speculative=bool(vllm_config.scheduler_config.async_scheduling and speculative_config is not "
            "None)") in connector


def test_a_multiconnector_hands_esss_connector_every_call_it_serves_by():
    """A disaggregated decode instance runs ESS's connector inside vLLM's MultiConnector beside a transfer connector
    (engines/vllm/test_vllm_scheduler.py builds one with NIXL's): MultiConnector (multi_connector.py) forwards to
    each of its connectors the calls ESS's serves by (its KV caches registered, its own metadata bound, start_load_kv
    with every keyword, the transfer results that reach get_finished, the capture reset, the shutdown)."""
    rel = "distributed/kv_transfer/kv_connector/v1/multi_connector.py"
    calls = {
        "register_kv_caches": "c.register_kv_caches(kv_caches)",
        "bind_connector_metadata": "c.bind_connector_metadata(cm)",
        "start_load_kv": "c.start_load_kv(forward_context, **kwargs)",
        "get_transfer_results": "connector.get_transfer_results(finished_req_ids)",
        "reset_capture_state": "c.reset_capture_state()",
        "shutdown": ".shutdown()",
    }
    for method, call in calls.items():
        fn = upstream_def(rel, "MultiConnector", method)
        assert fn is not None and call in ast.unparse(fn), f"MultiConnector.{method} no longer does {call}"


def test_the_lazy_host_mirror_is_refused_for_upstreams_reason():
    """The connector refuses eager_host_mirror=False with the reason vLLM's own HiSparseConfig gives: decode rows then
    stay resident-only and reach the host pool only at a spill (ESS reads its misses from the host pool)."""
    doc = " ".join(open(path("config/attention.py"), encoding="utf-8").read().split())
    assert "When disabled, decode rows stay resident-only and evicted pages are copied to host at spill time." in doc
    assert "decode rows resident-only" in open(CONNECTOR, encoding="utf-8").read()


def test_the_forward_metadata_reaches_start_load_kv():
    """v1/worker/gpu/model_runner.py execute_model: under a FULL graph pre_forward gets attn_metadata= (which
    _build_load_kwargs passes on); eager and piecewise, pre_forward runs inside set_forward_context(attn_metadata,
    ...), and ActiveKVConnector._start_load_kv hands start_load_kv that forward context. The sparse MLA metadata's
    decode split is split_decodes_and_prefills' (FlashMLA sparse: require_uniform_decodes), and its seq_lens the
    common metadata's (model_states/default.py prepare_attn: the device's, from num_computed_tokens.gpu)."""
    runner = ast.unparse(upstream_def("v1/worker/gpu/model_runner.py", "GPUModelRunner", "execute_model"))
    assert "self.kv_connector.pre_forward(scheduler_output, input_batch, attn_metadata=attn_metadata)" in runner
    eager = runner.index("self.kv_connector.pre_forward(scheduler_output, input_batch)")
    assert runner.rfind("with set_forward_context(attn_metadata,", 0, eager) > runner.rfind(
        "pre_forward(scheduler_output, input_batch, attn_metadata=attn_metadata)", 0, eager)
    start = ast.unparse(upstream_def("v1/worker/gpu/kv_connector.py", "ActiveKVConnector", "_start_load_kv"))
    assert "self.kv_connector.start_load_kv(get_forward_context(), **load_kwargs)" in start
    build = ast.unparse(upstream_def("model_executor/layers/attention/sparse_mla_attention.py",
                                     "SparseMLACommonMetadataBuilder", "build"))
    assert "split_decodes_and_prefills(common_attn_metadata, decode_threshold=self.reorder_batch_threshold or 1" \
        in build and "require_uniform=self.require_uniform_decodes" in build
    assert "seq_lens=common_attn_metadata.seq_lens" in build and "num_decodes=num_decodes" in build
    flashmla = open(path("v1/attention/backends/mla/flashmla_sparse.py"), encoding="utf-8").read()
    assert "require_uniform_decodes: ClassVar[bool] = True" in flashmla


def test_a_request_preempted_without_a_forward_returns_as_fresh():
    """What start_step(fresh=) stands on: in a step with no tokens model_runner.py execute_model frees the
    preempted requests' states (finish_requests) and calls no_forward, whose pre_forward has no batch and whose
    post_forward gets the finished ids only; states.py hands out the state freed last first; and the scheduler
    sends a resumed request as new under model runner v2 (schedule) or marks it in resumed_req_ids
    (_make_cached_request_data): the ids fresh_from_output reads."""
    finish = ast.unparse(upstream_def("v1/worker/gpu/model_runner.py", "GPUModelRunner", "finish_requests"))
    assert "finished_req_ids = finished_req_ids.union(preempted_req_ids)" in finish
    runner = ast.unparse(upstream_def("v1/worker/gpu/model_runner.py", "GPUModelRunner", "execute_model"))
    assert runner.index("self.finish_requests(scheduler_output)") < runner.index(
        "self.kv_connector.no_forward(scheduler_output)")
    no_forward = ast.unparse(upstream_def("v1/worker/gpu/kv_connector.py", "ActiveKVConnector", "no_forward"))
    assert "self.pre_forward(scheduler_output)" in no_forward
    assert "self.post_forward(finished_req_ids)" in no_forward and "preempted" not in no_forward
    states = open(path("v1/worker/gpu/states.py"), encoding="utf-8").read()
    assert "self.free_indices.pop()" in states and "self.free_indices.append(req_idx)" in states
    schedule = ast.unparse(upstream_def("v1/core/sched/scheduler.py", "Scheduler", "schedule"))
    assert "if self.use_v2_model_runner:\n        scheduled_new_reqs.extend(scheduled_resumed_reqs)" in schedule
    cached = ast.unparse(upstream_def("v1/core/sched/scheduler.py", "Scheduler", "_make_cached_request_data"))
    assert "resumed_req_ids.add(req_id)" in cached and "resumed_req_ids=resumed_req_ids" in cached


def test_vllm_loads_the_connector_by_module_path_under_upstreams_name():
    """factory.py get_connector_class imports kv_connector_module_path and takes the class named kv_connector;
    config/vllm.py infers hisparse_config from has_connector("HiSparseConnector") and config/kv_transfer.py reads
    host_pool_gib for that name: ours keeps it."""
    factory = open(path("distributed/kv_transfer/kv_connector/factory.py"), encoding="utf-8").read()
    assert "importlib.import_module(connector_module_path)" in factory
    assert "getattr(connector_module, connector_name)" in factory
    assert 'has_connector("HiSparseConnector")' in open(path("config/vllm.py"), encoding="utf-8").read()
    assert '== "HiSparseConnector"' in open(path("config/kv_transfer.py"), encoding="utf-8").read()
    tree = ast.parse(open(CONNECTOR, encoding="utf-8").read())
    assert "HiSparseConnector" in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


def test_the_scan_can_fail():
    """The scan sees a call ESS's runtime cannot bind (a made-up module in a scratch tree)."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "made_up.py"), "w") as f:
            f.write("# hisparse\ndef f(cache, x):\n    cache.runtime.swap_in(x, block_size=64)\n"
                    "    r = cache.runtime\n    r.not_a_member\n    cache.runtime.hot.not_a_field\n")
        found = vllm_callsites.scan(d)
    assert {(u.name, u.call, u.positional, tuple(u.members)) for u in found} == {
        ("swap_in", True, 1, ()), ("not_a_member", False, 0, ()), ("hot", False, 0, ("not_a_field",))}
    assert not binds(adapter.HiSparseRuntime.swap_in, 1, ["block_size"])
    assert getattr(adapter.HiSparseRuntime, "not_a_member", None) is None
    assert "not_a_field" not in adapter.HotView._fields


def test_the_da_wraps_flashmlas_fp8_decode_where_vllm_calls_it():
    """vllm_overlap.py's wrappers take vLLM's own parameters, and vLLM's HiSparse FP8 decode runs through them: the
    separate prefill / decode path sends a host-backed decode to _host_backed_fp8_decode (the mixed-batch path is off
    under HiSparse), which swaps through the index group and hands the table to _fp8_flash_mla_kernel; the kernel
    call returns FlashMLA's (out, lse)."""
    rel = "v1/attention/backends/mla/flashmla_sparse.py"
    decode = upstream_def(rel, "FlashMLASparseImpl", "_host_backed_fp8_decode")
    kernel = upstream_def(rel, "FlashMLASparseImpl", "_fp8_flash_mla_kernel")
    assert parameters(decode) == (["self", "q", "topk_indices", "attn_metadata", "kernel_metadata", "num_decodes"], [],
                                  False, False)
    assert parameters(kernel) == (["self", "q", "kv_c_and_k_pe_cache", "topk_indices", "kernel_metadata"], [], False,
                                  False)
    for name, upstream in (("_host_backed_fp8_decode", decode), ("_fp8_flash_mla_kernel", kernel)):
        wrapper = vllm_overlap._WRAPS[name](None)   # the wrapper's own signature: vLLM's
        assert list(inspect.signature(wrapper).parameters) == parameters(upstream)[0], name
    body = ast.unparse(decode)
    assert "self.index_group.convert_logical_to_physical_topk(" in body
    assert "physical_topk = physical_topk.view(num_decodes, q.shape[1], -1)" in body
    assert "self._fp8_flash_mla_kernel(q=q, kv_c_and_k_pe_cache=" in body and "topk_indices=physical_topk" in body
    assert "out, lse = flash_mla_with_kvcache(" in ast.unparse(kernel) and "return (out, lse)" in ast.unparse(kernel)
    separate = ast.unparse(upstream_def(rel, "FlashMLASparseImpl", "_forward_fp8_kv_separate_prefill_decode"))
    assert "if uses_host_cache: return self._host_backed_fp8_decode(" in " ".join(separate.split())
    # check_da_backend finds a hot cache's attention layer as upstream's worker finds its handle: the name less
    # ".hisparse_hot", in the static forward context, where MLAAttention registers itself with its impl.
    worker = ast.unparse(upstream_def("distributed/kv_transfer/kv_connector/v1/hisparse/worker.py",
                                      "HiSparseConnectorWorker", "register_kv_caches"))
    assert "layer_name = cache_name[:-len(HISPARSE_HOT_SUFFIX)]" in worker
    assert "cache_handles.append(_get_hisparse_cache(forward_context, layer_name))" in worker
    layer = ast.unparse(upstream_def("model_executor/layers/attention/mla_attention.py", "MLAAttention", "__init__"))
    assert "self.impl = impl" in layer and "compilation_config.static_forward_context[prefix] = self" in layer
    init = ast.unparse(upstream_def(rel, "FlashMLASparseMetadataBuilder", "__init__"))
    assert "self.fp8_use_mixed_batch = self.num_heads < MIN_HEADS_FOR_BF16_PREFILL and (not self.use_hisparse)" \
        in init


def module_def(rel, name):
    tree = ast.parse(open(path(rel), encoding="utf-8").read())
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    assert fn is not None, f"{rel} no longer defines {name}"
    return fn


def fields(rel, cls):
    tree = ast.parse(open(path(rel), encoding="utf-8").read())
    klass = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    assert klass is not None, f"{rel} no longer defines {cls}"
    return [n.target.id for n in klass.body if isinstance(n, ast.AnnAssign)]


def test_the_dba_split_calls_vllms_indexer_as_its_dsa_attention_does():
    """vllm_indexer_split.py's facts: vLLM's CUDA DSA attention (deepseek_v32/attention.py, which DeepSeek-V3.2 and
    GLM-5 load on CUDA) calls sparse_attn_indexer by its module's name, eagerly, before the layer's swap; the
    function takes the arguments the split narrows, clears and inserts only where told, reads the decode rows from
    the first of q, weights and the top-k buffer by the metadata's counts, and reads the narrowed metadata's
    fields; the builder's uniformity flag and paged-MQA schedule are as the split computes them per half; the
    indexer's k cache and the attention share the layer's name prefix (extract_layer_index)."""
    attention = "models/deepseek_v32/attention.py"
    source = open(path(attention), encoding="utf-8").read()
    assert "from vllm.model_executor.layers.sparse_attn_indexer import (" in source
    assert "import vllm.models.deepseek_v32" not in source
    call = upstream_def(attention, "DeepseekV32Attention", "_sparse_indexer_and_attn")
    assert [ast.unparse(d) for d in call.decorator_list] == ["eager_break_during_capture"]
    body = ast.unparse(call)
    assert body.index("sparse_attn_indexer(q_c, self.indexer.k_cache.prefix,") < body.index(
        "self.impl.prepare_for_batch(attn_metadata)") < body.index("self.impl.forward_mqa(")
    assert 'prefix=f"{prefix}.indexer"' in source and 'prefix=f"{prefix}.attn"' in source
    assert 'prefix=f"{prefix}.k_cache"' in source
    rel = "model_executor/layers/sparse_attn_indexer.py"
    fn = module_def(rel, "sparse_attn_indexer")
    names = parameters(fn)[0]
    for name in ("hidden_states", "k_cache_prefix", "q_quant", "q_scale", "k", "weights", "topk_tokens",
                 "topk_indices_buffer", "skip_k_cache_insert", "use_pcp", "dcp_world_size", "skip_topk_buffer_clear",
                 "candidate_blocks"):
        assert name in names, name
    text = " ".join(ast.unparse(fn).split())
    for fact in ("attn_metadata_narrowed = attn_metadata[k_cache_prefix]",
                 "if not skip_k_cache_insert:",
                 "if not skip_topk_buffer_clear: topk_indices_buffer[:hidden_states.shape[0]] = -1",
                 "needs_padded_path = decode_metadata.requires_padding or num_decode_tokens % decode_lens.shape[0] != 0",
                 "padded_q_quant_decode_tokens = q_quant[:num_decode_tokens].reshape(decode_lens.shape[0], -1, "
                 "*q_quant.shape[1:])",
                 "seq_lens = decode_metadata.seq_lens[:batch_size]",
                 "mqa_logits_mx_inputs(padded_q_quant_cast, padded_q_scale, weights[:num_padded_tokens])",
                 "decode_metadata.block_table, decode_metadata.schedule_metadata",
                 "topk_indices = topk_indices_buffer[:num_padded_tokens, :topk_tokens]"):
        assert fact in text, fact
    indexer = "v1/attention/backends/mla/indexer.py"
    assert fields(indexer, "DeepSeekV32IndexerDecodeMetadata") == [
        "block_table", "seq_lens", "decode_lens", "requires_padding", "schedule_metadata", "global_seq_lens",
        "per_req_decode_lens", "decode_is_uniform", "write_max_decode_len", "indices"]
    for name in ("num_decodes", "num_decode_tokens", "num_prefills", "slot_mapping", "decode"):
        assert name in fields(indexer, "DeepseekV32IndexerMetadata"), name
    build = " ".join(ast.unparse(upstream_def(indexer, "DeepseekV32IndexerMetadataBuilder", "build")).split())
    for fact in ("write_is_uniform = min_decode_len == max_decode_len", "decode_is_uniform=write_is_uniform",
                 "metadata = get_paged_mqa_logits_metadata(seq_lens, self.kv_cache_spec.num_states, self.num_sms, "
                 "indices=decode_indices)",
                 "if current_platform.is_cuda() and has_deep_gemm():"):
        assert fact in build, fact
    init = ast.unparse(upstream_def(indexer, "DeepseekV32IndexerMetadataBuilder", "__init__"))
    assert "sm_count = num_compute_units(self.device.index)" in init and "self.num_sms = sm_count" in init
    # Where the wrapper runs: a FULL graph (HiSparse's decode graphs) is captured under torch.cuda.graph with no
    # breakable capture, so the DSA attention's call runs inside it and a replay runs the captured split; the capture
    # runs no connector pre_forward (no start_load_kv: ESS stages no step for it), then resets the capture state.
    breakable = " ".join(ast.unparse(module_def("compilation/breakable_cudagraph.py",
                                                "eager_break_during_capture")).split())
    assert "capture = BreakableCUDAGraphCapture.current() if capture is None: return fn(*args, **kwargs)" in breakable
    manager = " ".join(ast.unparse(upstream_def("v1/worker/gpu/cudagraph_utils.py", "CudaGraphManager",
                                                "capture")).split())
    assert "torch.cuda.graph(" in manager and "forward_fn(CUDAGraphMode.NONE)" in manager
    capture = ast.unparse(upstream_def("v1/worker/gpu/model_runner.py", "GPUModelRunner", "capture_model"))
    assert "pre_forward" not in capture and "self.kv_connector.reset_capture_state()" in capture
    config = open(path("config/vllm.py"), encoding="utf-8").read()
    assert '"HiSparse does not support cudagraph_mode=FULL; use "' in config
    assert '"FULL_AND_PIECEWISE (the default), which captures FULL graphs "' in config
    # The halves' schedule takes the paged cache's block (DeepGEMM's block_size: the cache's second dimension).
    assert "kv_cache: Paged KV-cache of shape [num_blocks, block_size, 1, D+4]" in " ".join(
        ast.unparse(module_def("utils/deep_gemm.py", "fp8_fp4_paged_mqa_logits")).split())
    assert "return kv_cache.unsqueeze(-2)" in ast.unparse(module_def(rel, "kv_cache_as_quant_view"))
    # The first half's swap gets what the layer's swap gets (index_group.py).
    convert = " ".join(ast.unparse(upstream_def("v1/attention/backends/mla/index_group.py", "HiSparseMLAIndexGroup",
                                                "convert_logical_to_physical_topk")).split())
    for fact in ("req_id_per_token = attn_metadata.req_id_per_token[:num_tokens]",
                 "block_size=attn_metadata.block_size", "num_valid_rows=attn_metadata.query_start_loc[-1:]"):
        assert fact in convert, fact
