"""Shared-index layers (GLM-5.2's index sharing) among SGLang 0.5.23's own objects: the pattern is what SGLang
computes for a GLM-5 config (ServerArgs over a local config.json, ModelConfig.from_server_args, then
hisparse_coordinator's own resolve_shared_index_layers, as model_runner.maybe_init_hisparse_coordinator passes it to
the coordinator), the pools SGLang's (test_sglang_objects.Stack), and each decode step runs the layers in order, a
shared layer handed its leader's top-k tensor itself (forward_mla.py: a `skip_topk` layer reuses the carried
prev_topk_indices).

Checks: every byte FlashMLA reads is the full cache's, at every layer, step after step, with the followers' steps
started at their leader's swap (the engine counts every follower's step at the leader's call and none at the
follower's); the tables and bytes equal those of the same run with the prefetch off (the pattern not passed), with
two-batch overlap's micro-batches as well. Mutations that fail: a follower's step run on another layer's pool.
SGLANG_DISABLE_HISPARSE_PREFETCH (what `ess plan` sets to turn the prefetch off) makes SGLang pass no pattern.

The model facts: ESS's ModelSpec (through `ess verify --format json`, every layer of the model) makes shared exactly
the layers SGLang's dsa_layer_skips_topk does, for the shipped GLM-5 and GLM-5.2 configs and for each field SGLang
derives the pattern from; the shipped GLM-5 shape is transformers' GlmMoeDsaConfig default (zai-org/GLM-5)."""
import contextlib
import json
import random

import numpy as np
import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.hisparse_coordinator import resolve_shared_index_layers
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs

import ess
from ess.integrations import sglang as adapter
from ess.integrations.sglang import shared_index
from test_sglang_da import forward_batches_of, step_batches, write_step_kv
from test_sglang_objects import CTX, K, World, cpu_kernels, host_memory_unregistered  # noqa: F401

GLM5_LAYERS = 6


@contextlib.contextmanager
def published(model_dir):
    """SGLang's settings published for the config.json in `model_dir` (ServerArgs, as its launcher does), and that
    model's hf_text_config as ModelConfig.from_server_args reads it (transformers' class for the architecture); the
    settings taken back after."""
    context = get_context()
    saved = (context._server_args, context._config_bags, context.parallel._config,
             context.flags.capture.enable_torch_compile)
    try:
        server_args = ServerArgs(model_path=str(model_dir), device="cpu", skip_tokenizer_init=True)
        context.set_server_args(server_args)
        yield ModelConfig.from_server_args(server_args).hf_text_config
    finally:
        (context._server_args, context._config_bags, context.parallel._config,
         context.flags.capture.enable_torch_compile) = saved


def resolved_pattern(model_dir):
    """What model_runner.maybe_init_hisparse_coordinator passes as shared_index_layers for that model."""
    with published(model_dir) as config:
        return resolve_shared_index_layers(hf_text_config=config)


@pytest.fixture
def glm5_dir(tmp_path):
    """A six-layer GLM-5 (GlmMoeDsaForCausalLM) config.json with index_topk_freq 3."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "num_hidden_layers": GLM5_LAYERS,
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": 128, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "index_topk": K, "index_n_heads": 4, "index_head_dim": 128,
        "vocab_size": 1000, "max_position_embeddings": CTX, "torch_dtype": "bfloat16", "n_routed_experts": 8,
        "num_experts_per_tok": 2, "index_topk_freq": 3}))
    return tmp_path


@pytest.fixture
def glm5_pattern(glm5_dir):
    """SGLang's pattern for it: layers 2, 3 and 5 reuse the top-k of layers 1 and 4 (configs/model_config.py
    dsa_layer_skips_topk)."""
    pattern = resolved_pattern(glm5_dir)
    assert pattern == [False, False, True, True, False, True]
    return pattern


def test_the_plans_switch_is_the_one_sglang_reads(glm5_dir, monkeypatch):
    """`ess plan` turns the prefetch off with SGLANG_DISABLE_HISPARSE_PREFETCH=1: SGLang's own
    resolve_shared_index_layers then passes no pattern, and ESS's coordinator swaps every layer itself."""
    monkeypatch.setenv("SGLANG_DISABLE_HISPARSE_PREFETCH", "1")
    assert resolved_pattern(glm5_dir) is None


def decode(w, steps, seed, shared, micro_batches=False):
    """Decode steps in SGLang's order; per layer (and micro-batch) the step's KV written, then the swap: a layer that
    runs its indexer gets fresh picks, a shared one (shared[layer]) its leader's top-k tensor itself. Every byte read
    checked; returns every swap's table and the engine steps each swap ran, (layer, steps)."""
    rng, s, c = random.Random(seed), w.s, w.s.coord
    tables, steps_run = [], []
    for _ in range(steps):
        rids, idx, lens, device = w.prepare_decode()
        batches = step_batches(rids, idx, lens, micro_batches)
        carried = {}   # batch -> (top-k tensor, picks) of its last layer with an indexer
        for layer in range(s.layers):
            write_step_kv(w, rids, device, layer)
            for lo, hi, part_idx, part_lens in forward_batches_of(batches, layer):
                if shared[layer]:
                    topk, picks = carried[(lo, hi)]
                else:
                    pad = part_idx.shape[0] - (hi - lo)
                    picks = [sorted(rng.sample(range(w.length[r]), min(K, w.length[r]))) for r in rids[lo:hi]]
                    topk = torch.tensor([p + [-1] * (K - len(p)) for p in picks] + [[0] + [-1] * (K - 1)] * pad,
                                        dtype=torch.int32)
                    carried[(lo, hi)] = (topk, picks)
                before = c.engine.stats().steps
                table = c.swap_in_selected_pages(part_idx, part_lens, topk, layer)
                steps_run.append((layer, c.engine.stats().steps - before))
                for b, r in enumerate(rids[lo:hi]):
                    got = s.rows(layer)[table[b, :len(picks[b])].to(torch.int64)].numpy()
                    assert np.array_equal(got, w.full[r][layer, picks[b]]), (layer, r)
                tables.append(table.clone())
    return tables, steps_run


def glm5_world(pattern, seed=3):
    w = World(adapter.HiSparseCoordinator, seed=seed, layers=GLM5_LAYERS, shared_index_layers=pattern)
    for rid, n in (("a", 300), ("b", 70), ("c", 150)):
        w.prefill(rid, n)
    assert sorted(w.collect()) == ["a", "b", "c"]
    return w


@pytest.mark.parametrize("micro_batches", [False, True])
def test_followers_steps_start_at_their_leaders_swap_and_serve_the_same_bytes(glm5_pattern, micro_batches):
    """With SGLang's pattern passed (prefetch on): a leader's swap runs its own step and every follower's, a
    follower's swap none; every byte read is the full cache's; the tables equal those without the pattern."""
    on, off = glm5_world(glm5_pattern), glm5_world(None)
    assert on.s.coord.shared_index.groups == {1: [2, 3], 4: [5]} and off.s.coord.shared_index is None
    tables_on, steps_on = decode(on, 5, seed=7, shared=glm5_pattern, micro_batches=micro_batches)
    tables_off, steps_off = decode(off, 5, seed=7, shared=glm5_pattern, micro_batches=micro_batches)
    followers = {1: 2, 4: 1}
    assert all(n == (0 if glm5_pattern[layer] else 1 + followers.get(layer, 0)) for layer, n in steps_on), steps_on
    assert all(n == 1 for _, n in steps_off)
    assert len(tables_on) == len(tables_off)
    for a, b in zip(tables_on, tables_off):
        assert torch.equal(a, b)
    for w in (on, off):
        for rid in list(w.reqs):
            w.finish(rid)
        assert w.free_sizes() == w.free_at_start


def test_a_follower_prefetched_into_another_layers_pool_fails(glm5_pattern, monkeypatch):
    """Mutation: the followers' steps run on the next layer's pool (their rows chosen, another pool filled)."""
    real = shared_index.SharedIndexPrefetch._outputs

    class OnTheNextLayer:
        def __init__(self, step):
            self.step = step

        def step_async(self, layer, *args):
            self.step.step_async((layer + 1) % GLM5_LAYERS, *args)

    def outputs(self, *args):
        physical, locs, padding, step = real(self, *args)
        return physical, locs, padding, OnTheNextLayer(step)
    monkeypatch.setattr(shared_index.SharedIndexPrefetch, "_outputs", outputs)
    with pytest.raises(AssertionError):
        decode(glm5_world(glm5_pattern), 3, seed=7, shared=glm5_pattern)


def test_a_pattern_without_a_first_leader_is_refused_before_anything_is_taken():
    """A pattern whose layer 0 reuses a top-k (upstream's _build_prefetch_groups asserts on it): refused by name, and
    the HiSparse device allocator keeps every row it had."""
    w = World(adapter.HiSparseCoordinator, layers=GLM5_LAYERS)
    w.s.coord.destroy()
    adapter._common._return_top_rows(w.s.allocator)
    free = w.s.allocator.hisparse_attn_allocator.available_size()
    with pytest.raises(ess.InvalidArgument, match="layer 0 reuses a top-k"):
        adapter.HiSparseCoordinator(req_to_token_pool=w.s.req_to_token_pool,
                                    token_to_kv_pool_allocator=w.s.allocator, top_k=K, device_buffer_size=64,
                                    device="cpu", tp_group=None, host_to_device_ratio=2,
                                    shared_index_layers=[True] + [False] * (GLM5_LAYERS - 1))
    assert w.s.allocator.hisparse_attn_allocator.available_size() == free


def ess_program():
    """The `ess` program beside the libess the package loaded (a checkout's build tree), else the one on PATH."""
    import shutil
    from pathlib import Path
    from ess import _lib
    beside = Path(_lib.path).resolve().parents[2] / "tools" / "ess" / "ess"
    found = str(beside) if beside.is_file() else shutil.which("ess")
    assert found, f"no ess program beside {_lib.path} or on PATH"
    return found


def ess_shared_layers(config_path):
    """The layers ESS's ModelSpec makes shared, as `ess verify` reports them over every layer of the model."""
    import subprocess
    out = subprocess.run([ess_program(), "verify", "--model", str(config_path), "--layers", "78", "--requests", "1",
                          "--context", "64", "--steps", "1", "--topk", "16", "--slots", "32", "--warmup", "0",
                          "--format", "json"], check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    assert report["bitwise_equal"]
    return report["index_sharing"]["shared_layers"]


def sglang_shared_layers(model_dir):
    """SGLang's own reading of a config.json: dsa_layer_skips_topk per layer (configs/model_config.py)."""
    from sglang.srt.configs.model_config import dsa_layer_skips_topk
    with published(model_dir) as config:
        return [l for l in range(config.num_hidden_layers) if dsa_layer_skips_topk(config, l)]


SHIPPED = __import__("pathlib").Path(__file__).resolve().parents[4] / "configs" / "models"


@pytest.mark.parametrize("name,edit", [
    ("glm-5.json", {}),
    ("glm-5.2.json", {}),
    ("glm-5.2.json", {"indexer_types": None}),                                   # freq 4 / offset 3 alone
    ("glm-5.2.json", {"indexer_types": None, "index_skip_topk_offset": None}),  # the default offset
    ("glm-5.2.json", {"indexer_types": None, "index_topk_pattern": "FFS" * 26}),
], ids=["glm-5", "glm-5.2", "freq-offset", "freq-default-offset", "pattern"])
def test_the_shipped_glm_configs_share_indexers_as_sglang_reads_them(name, edit, tmp_path):
    """ESS's ModelSpec and SGLang (through transformers' GlmMoeDsaConfig) agree on which layers reuse a top-k, for
    the shipped configs and for each field SGLang derives the pattern from."""
    config = json.loads((SHIPPED / name).read_text())
    for key, value in edit.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = sglang_shared_layers(tmp_path)
    assert ess_shared_layers(tmp_path / "config.json") == theirs
    assert bool(theirs) == (name != "glm-5.json")


def test_the_shipped_glm_5_is_the_releases_glm_moe_dsa_default():
    """configs/models/glm-5.json holds the shape transformers' GlmMoeDsaConfig defaults to (its checkpoint is
    zai-org/GLM-5), in the field names ESS reads."""
    from transformers import GlmMoeDsaConfig
    ours, theirs = json.loads((SHIPPED / "glm-5.json").read_text()), GlmMoeDsaConfig()
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "vocab_size", "max_position_embeddings"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["architectures"] == ["GlmMoeDsaForCausalLM"] and ours["model_type"] == theirs.model_type
