"""ess.integrations.sglang.HiSparseCoordinator against the pinned SGLang release's own source: every
call and attribute access SGLang makes on its coordinator, found by an AST scan of the release
(sglang_callsites.py), binds to our class: the name exists, and the call's positional and keyword
arguments bind to our signature; what SGLang uses on the coordinator's attributes (mem_pool_host.
alloc_paged_token_slots(...), spec_swap.scratch_capacity, num_real_reqs.fill_(...)) exists on, and binds
to, what a built coordinator holds there. A use in a configuration ESS refuses at construction must be one the
refusal covers (none is left: the DSA, DeepSeek-V4 and MiniMax-M3 paths all bind).

The sources come from scripts/upstream.sh (build/upstream/sglang-0.5.23); their absence fails."""
import ast
import inspect
import textwrap
import os

import pytest

import sglang_callsites
from callsite_ast import binds
from ess.integrations import sglang as adapter

SOURCE = sglang_callsites.default_source()

# Call sites that only run in a configuration the constructor refuses by name, and that refusal.
REFUSED = {}


@pytest.fixture(scope="module")
def scanned():
    if not os.path.isdir(SOURCE):
        pytest.fail(f"the pinned SGLang sources are not at {SOURCE}: run scripts/upstream.sh")
    uses, constructions = sglang_callsites.scan(SOURCE)
    assert uses and constructions, "the scan found nothing: the release's layout changed"
    return uses, constructions


def adapter_modules():
    """Every module of the adapter package (its sources are read, not only __init__'s)."""
    import importlib
    import pkgutil
    return [adapter] + [importlib.import_module(f"{adapter.__name__}.{m.name}") for m in pkgutil.iter_modules(adapter.__path__)]


def instance_attributes(cls):
    """Names construction assigns on self (read from our own source): __init__'s, and those of the methods of the
    class __init__ calls on self (the constructor's steps: _build)."""
    def method(name):
        fn = getattr(cls, name)
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    init = method("__init__")
    steps = [init] + [method(n.func.attr) for n in ast.walk(init)
                      if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                      and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"
                      and n.func.attr.startswith("_") and callable(getattr(cls, n.func.attr, None))]
    return {t.attr for fn in steps for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_the_constructor_call_binds(scanned):
    _, constructions = scanned
    for c in constructions:
        assert binds(adapter.HiSparseCoordinator.__init__, c.positional, c.keywords), \
            f"{c.path}:{c.line} ({c.function}) constructs HiSparseCoordinator with {c.positional} positional " \
            f"and {c.keywords}; ours is {inspect.signature(adapter.HiSparseCoordinator.__init__)}"


def test_every_use_binds_or_is_refused_at_construction(scanned):
    uses, _ = scanned
    cls = adapter.HiSparseCoordinator
    attributes = instance_attributes(cls)
    missing = []
    for u in uses:
        refused = REFUSED.get((u.path.replace(os.sep, "/"), u.function))
        member = getattr(cls, u.name, None)
        exists = member is not None or u.name in attributes
        if u.call:
            ok = exists and callable(member) and not u.starred and binds(member, u.positional, u.keywords)
        else:
            ok = exists
        if not ok and refused is None:
            missing.append(f"{u.where()}: {'call' if u.call else 'attribute'} {u.name}"
                           + (f"({u.positional} positional, {u.keywords})" if u.call else ""))
    assert not missing, "SGLang uses what our coordinator lacks:\n" + "\n".join(missing)


def test_members_of_attributes_bind(scanned):
    """coordinator.X.Y as SGLang uses it, on a coordinator built on the replay's stand-in pools."""
    from test_sglang_replay import build
    uses, _ = scanned
    coordinator, _ = build()
    missing, seen = [], 0
    for u in uses:
        if (u.path.replace(os.sep, "/"), u.function) in REFUSED:
            continue
        for m in u.members:
            seen += 1
            member = getattr(getattr(coordinator, u.name), m.name, None)
            ok = member is not None
            if ok and m.call:
                ok = callable(member) and not m.starred and (
                    not _has_signature(member) or binds_bound(member, m.positional, m.keywords))
            if not ok:
                missing.append(f"{m.where()}: {u.name}.{m.name}" + (f"({m.positional} positional, {m.keywords})"
                                                                   if m.call else ""))
    coordinator.destroy()
    assert seen >= 4, "the scan found none of the attribute members SGLang uses: the release's layout changed"
    assert not missing, "SGLang uses what our coordinator's attributes lack:\n" + "\n".join(missing)


def binds_bound(method, positional, keywords):
    try:
        inspect.signature(method).bind(*([None] * positional), **{k: None for k in keywords})
        return True
    except TypeError:
        return False


def _has_signature(fn):
    try:
        inspect.signature(fn)
        return True
    except (TypeError, ValueError):   # a builtin (torch's Tensor.fill_)
        return False


def test_the_refused_table_names_real_call_sites(scanned):
    """A stale entry would hide a new call site: each must still be where SGLang uses the coordinator."""
    uses, _ = scanned
    found = {(u.path.replace(os.sep, "/"), u.function) for u in uses}
    stale = sorted(k for k in REFUSED if k not in found)
    assert not stale, f"REFUSED names call sites the release no longer has: {stale}"


def test_results_are_read_as_upstream_reads_them(scanned):
    """Attributes SGLang reads on what a call returns (e.g. get_token_stats().device_tokens) are fields of
    our return type."""
    uses, _ = scanned
    fields = {"get_token_stats": set(adapter.HiSparseTokenStats._fields)}
    for u in uses:
        if u.name in fields:
            extra = set(u.result_attributes) - fields[u.name]
            assert not extra, f"{u.where()} reads {sorted(extra)} on {u.name}()'s result"
    assert any(u.name == "get_token_stats" and u.result_attributes for u in uses)


def test_upstream_stats_type_has_our_fields():
    """Our HiSparseTokenStats (used where SGLang does not import) has upstream's fields, in order."""
    path = os.path.join(SOURCE, "srt", "managers", "hisparse_coordinator.py")
    tree = ast.parse(open(path, encoding="utf-8").read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HiSparseTokenStats")
    upstream = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert tuple(upstream) == adapter.HiSparseTokenStats._fields


def test_the_scan_can_fail():
    """The scan sees a call our class cannot bind (a made-up module in a scratch tree)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "srt"))
        with open(os.path.join(d, "srt", "made_up.py"), "w") as f:
            f.write("def f(self, b):\n    c = self.hisparse_coordinator\n"
                    "    c.swap_in_selected_pages(1, 2, 3, 4, 5)\n    c.not_a_method()\n")
        uses, _ = sglang_callsites.scan(d)
    names = {(u.name, u.positional) for u in uses}
    assert names == {("swap_in_selected_pages", 5), ("not_a_method", 0)}
    cls = adapter.HiSparseCoordinator
    assert not binds(cls.swap_in_selected_pages, 5, [])
    assert getattr(cls, "not_a_method", None) is None


def test_the_settings_read_are_in_the_release():
    """Every SGLang setting the coordinator reads (adapter._sglang_setting(bag, path)) is a field of the namespace
    class whose _NS_PATH is the bag's name and the path's prefix (srt/arg_groups/fields/*.py), read by the release
    at that path too: a flat name for a nested field reads as absent."""
    tree = ast.Module(body=[n for m in adapter_modules() for n in ast.parse(inspect.getsource(m)).body], type_ignores=[])
    reads = {(n.args[0].value, n.args[1].value) for n in ast.walk(tree)
             if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "_sglang_setting"}
    assert ("get_disagg", "disaggregation_mode") in reads
    fields_dir = os.path.join(SOURCE, "srt", "arg_groups", "fields")
    namespaces = {}
    for name in os.listdir(fields_dir):
        if name.endswith(".py"):
            for cls in ast.parse(open(os.path.join(fields_dir, name), encoding="utf-8").read()).body:
                if not isinstance(cls, ast.ClassDef):
                    continue
                ns = next((n.value.value for n in cls.body if isinstance(n, ast.Assign) and
                           any(getattr(t, "id", "") == "_NS_PATH" for t in n.targets)), None)
                if ns is not None:
                    namespaces[ns] = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    for bag, path in reads:
        *sub, field = path.split(".")
        ns = ".".join([bag[len("get_"):]] + sub)
        assert field in namespaces.get(ns, set()), f"{bag}().{path}: no field {field} in namespace {ns!r}"
        grep = f"{bag}().{path}"
        assert any(grep in open(os.path.join(root, f), encoding="utf-8").read()
                   for root, _, files in os.walk(os.path.join(SOURCE, "srt")) for f in files if f.endswith(".py")), \
            f"the release never reads {grep}"


def _function(path, cls_name, name):
    tree = ast.parse(open(os.path.join(SOURCE, path), encoding="utf-8").read())
    scope = tree if cls_name is None else next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return next(n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_da_hooks_bind_to_the_release():
    """What overlap.py relies on in the release's DSA decode (layers/attention/dsa_backend.py) and its FlashMLA
    interface: forward_decode(self, q, k, v, layer, forward_batch, ...) reads self.hisparse_coordinator, swaps with
    layer.layer_id and dispatches on self.dsa_decode_impl; _forward_flashmla_kv imports flash_mla_with_kvcache
    from the interface module inside the function (resolved at each call, so ESS's wrapper is what it calls) and
    passes the swap's table as indices=page_table_1.unsqueeze(1) by keyword; the interface returns (out, lse);
    merge_state(prefix_output, prefix_lse, suffix_output, suffix_lse, ...)."""
    from ess.integrations.sglang import overlap
    dsa = os.path.join("srt", "layers", "attention", "dsa_backend.py")
    decode = _function(dsa, "DeepseekSparseAttnBackend", "forward_decode")
    assert [a.arg for a in decode.args.args[:6]] == ["self", "q", "k", "v", "layer", "forward_batch"]
    source = ast.unparse(decode)
    for needed in ("self.hisparse_coordinator.swap_in_selected_pages(", "layer.layer_id",
                   "self._resolve_kpool_tail_backend(topk_indices, self.dsa_decode_impl)",
                   "dsa_impl == 'flashmla_kv'", "self._forward_flashmla_kv("):
        assert needed in source, needed
    # The verify forward: forward_extend swaps [bs, T, K] in its target-verify branch, viewed as bs x T rows, and
    # runs the decode backend's kernel (flashmla_kv: _forward_flashmla_kv).
    extend = _function(dsa, "DeepseekSparseAttnBackend", "forward_extend")
    assert [a.arg for a in extend.args.args[:6]] == ["self", "q", "k", "v", "layer", "forward_batch"]
    source = ast.unparse(extend)
    for needed in ("if forward_batch.forward_mode.is_target_verify():",
                   "self.hisparse_coordinator.swap_in_selected_pages(forward_batch.req_pool_indices, "
                   "metadata.dsa_seqlens_expanded, grouped_topk_indices, layer.layer_id).view(num_reqs * num_steps, -1)",
                   "self.dsa_decode_impl if forward_batch.forward_mode.is_target_verify()",
                   "elif dsa_impl == 'flashmla_kv':", "self._forward_flashmla_kv("):
        assert needed in source, needed
    kv = _function(dsa, "DeepseekSparseAttnBackend", "_forward_flashmla_kv")
    local = [n for n in ast.walk(kv) if isinstance(n, ast.ImportFrom)]
    assert [(n.module, [a.name for a in n.names]) for n in local] == \
        [(overlap.FLASH_MLA_INTERFACE, ["flash_mla_with_kvcache"])]
    calls = [n for n in ast.walk(kv) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "flash_mla_with_kvcache"]
    assert len(calls) == 1 and not calls[0].args
    kwargs = {k.arg: ast.unparse(k.value) for k in calls[0].keywords}
    assert "indices" in ast.unparse(kv) and "indices = page_table_1.unsqueeze(1)" in ast.unparse(kv)
    assert kwargs["indices"] == "indices" and kwargs["is_fp8_kvcache"] == "True"
    # The kpool tail rule only reroutes flashmla_sparse: a flashmla_kv decode stays flashmla_kv.
    kpool = ast.unparse(_function(os.path.join("srt", "layers", "attention", "dsa", "dsa_backend_kpool.py"),
                                  "DeepseekSparseAttnBackendKPoolMixin", "_resolve_kpool_tail_backend"))
    assert "dsa_impl != 'flashmla_sparse'" in kpool
    interface = _function(os.path.join("kernels", "ops", "attention", "flash_mla_interface.py"), None,
                          "flash_mla_with_kvcache")
    assert ast.unparse(interface.returns) == "Tuple[torch.Tensor, torch.Tensor]"
    assert "indices" in [a.arg for a in interface.args.args]
    merge = _function(os.path.join("srt", "layers", "attention", "merge_state.py"), None, "merge_state")
    assert [a.arg for a in merge.args.args[:4]] == ["prefix_output", "prefix_lse", "suffix_output", "suffix_lse"]
    # The backend's __init__ sets the attribute forward_decode dispatches on.
    init = ast.unparse(_function(dsa, "DeepseekSparseAttnBackend", "__init__"))
    assert "self.dsa_decode_impl: _DSA_IMPL_T = get_exec().kernel.dsa_decode_backend" in init


def test_the_dba_hooks_bind_to_the_release():
    """What indexer_split.py relies on in the release's DSA indexer (layers/attention/dsa/dsa_indexer.py):
    forward_cuda calls self._get_topk_paged(forward_batch, layer_id, q_fp8, weights, metadata) for decode and target
    verify, metadata from get_attn_backend().get_indexer_metadata, then broadcasts the result only under
    SGLANG_DSA_TOPK_BROADCAST; _get_topk_paged reads of the metadata exactly the getters HalfIndexerMetadata narrows
    and its top-k transform with (logits, topk) only; q_offset is the sum of the extend lengths and B the seqlens'
    rows; rows past q_offset are padded with -1; the unfused top-k transform takes ke_offset as the lengths; the
    forward context gives the backend (has_forward_context, get_attn_backend)."""
    from ess.integrations.sglang import indexer_split
    path = os.path.join("srt", "layers", "attention", "dsa", "dsa_indexer.py")
    paged = _function(path, "Indexer", "_get_topk_paged")
    assert [a.arg for a in paged.args.args] == ["self", "forward_batch", "layer_id", "q_fp8", "weights", "metadata"]
    read = {n.attr for n in ast.walk(paged) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "metadata"}
    narrowed = {"get_seqlens_int32", "get_page_table_64", "get_page_table_1", "get_seqlens_expanded",
                "get_dsa_extend_len_cpu", "topk_transform"}
    assert read == narrowed, read ^ narrowed
    source = ast.unparse(paged)
    for needed in ("getattr(metadata, 'paged_mqa_schedule_metadata', None)",
                   "getattr(metadata, 'paged_mqa_ctx_lens_2d', None)",
                   "q_offset = sum(metadata.get_dsa_extend_len_cpu())", "B = metadata.get_seqlens_int32().shape[0]",
                   "topk_result = metadata.topk_transform(logits, self.index_topk)",
                   "if schedule_metadata is None:", "if not _is_hip and q_offset < q_fp8.shape[0]:"):
        assert needed in source, needed
    forward = ast.unparse(_function(path, "Indexer", "forward_cuda"))
    for needed in ("metadata = get_attn_backend().get_indexer_metadata(layer_id, forward_batch)",
                   "topk_result = self._get_topk_paged(forward_batch, layer_id, q_fp8, weights, metadata)",
                   "forward_batch.forward_mode.is_target_verify()",
                   "topk_result = _broadcast_indexer_topk_from_rank0(topk_result)"):
        assert needed in forward, needed
    broadcast = ast.unparse(_function(path, None, "_broadcast_indexer_topk_from_rank0"))
    assert "envs.SGLANG_DSA_TOPK_BROADCAST.get()" in broadcast
    meta = ast.unparse(_function(os.path.join("srt", "layers", "attention", "dsa", "dsa_indexer_metadata.py"),
                                 "DSAIndexerMetadata", "topk_transform"))
    assert "seq_lens_topk = ke_offset" in meta and "force_unfused_topk=self.force_unfused_topk" in meta
    topk = ast.unparse(_function(os.path.join("srt", "layers", "attention", "dsa", "dsa_topk_backend.py"),
                                 "DSATopKBackend", "topk_transform"))
    assert "if not envs.SGLANG_DSA_FUSE_TOPK.get() or force_unfused_topk:" in topk
    assert "return self.topk_func(logits, lengths, topk, row_starts=row_starts)" in topk
    for mode in ("is_decode", "is_target_verify"):   # the forward modes the split applies to
        _function(os.path.join("srt", "model_executor", "forward_batch_info.py"), "ForwardMode", mode)
    context = os.path.join("srt", "model_executor", "forward_context.py")
    for name in ("has_forward_context", "get_attn_backend"):
        _function(context, None, name)
    assert indexer_split.INDEXER_MODULE == "sglang.srt.layers.attention.dsa.dsa_indexer"


def test_the_shared_index_facts_are_the_releases():
    """What shared_index.py relies on: model_runner passes resolve_shared_index_layers(hf_text_config=...) as the
    coordinator's shared_index_layers (one flag per layer, from dsa_layer_skips_topk); a shared (skip_topk) layer runs
    no indexer and carries the previous layer's top-k tensor through unchanged (forward_mla.py should_run_indexer,
    maybe_capture_indexer_topk passing its argument back), so a follower's swap gets its leader's selection;
    upstream's own swap serves a shared layer from the prefetch its anchor started (the event wait, no swap kernel),
    and its grouping asserts on a shared layer with no anchor before it (ESS refuses that pattern by name)."""
    runner = ast.unparse(_function(os.path.join("srt", "model_executor", "model_runner.py"), "ModelRunner",
                                   "maybe_init_hisparse_coordinator"))
    assert "shared_index_layers=resolve_shared_index_layers(hf_text_config=self.model_config.hf_text_config)" \
        in runner
    coordinator = os.path.join("srt", "managers", "hisparse_coordinator.py")
    resolve = ast.unparse(_function(coordinator, None, "resolve_shared_index_layers"))
    assert "pattern = [dsa_layer_skips_topk(hf_text_config, i) for i in range(num_layers)]" in resolve
    swap = ast.unparse(_function(coordinator, "HiSparseCoordinator", "swap_in_selected_pages"))
    for needed in ("if self._is_shared_index_layer[layer_id]:",
                   "self._prefetch_events[slot].wait(device_module.current_stream())",
                   "group = self._prefetch_groups.get(layer_id)"):
        assert needed in swap, needed
    groups = ast.unparse(_function(coordinator, None, "_build_prefetch_groups"))
    assert "assert anchor is not None" in groups
    mla = os.path.join("srt", "models", "deepseek_common", "attention_forward_methods", "forward_mla.py")
    gate = ast.unparse(_function(mla, "DeepseekMLAForwardMixin", "should_run_indexer"))
    assert "return not self.skip_topk or (self.is_nextn and prev_topk_indices is None)" in gate
    prepare = ast.unparse(_function(mla, "DeepseekMLAForwardMixin", "forward_absorb_prepare"))
    assert prepare.count("topk_indices = maybe_capture_indexer_topk(self.layer_id, prev_topk_indices)") >= 2
    capture = ast.unparse(_function(os.path.join("srt", "state_capturer", "indexer_topk.py"), None,
                                    "maybe_capture_indexer_topk"))
    assert capture.rstrip().endswith("return topk_indices")
    # Two-batch overlap with index sharing is refused at launch (the TBO path carries no top-k between layers):
    # `ess plan --engine sglang` keeps TBO off for such a model.
    tbo = ast.unparse(_function(os.path.join("srt", "arg_groups", "model_hook.py"), None,
                                "_validate_dsa_tbo_index_sharing"))
    for needed in ("if not cfg.enable_two_batch_overlap:", "index_topk_freq > 1", "'shared' in indexer_types",
                   "raise ValueError("):
        assert needed in tbo, needed
