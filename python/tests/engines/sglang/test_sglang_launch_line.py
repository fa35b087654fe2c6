"""`ess plan --engine sglang`'s launch lines read by SGLang 0.5.23's own argument parser: the flags ESS prints are
SGLang's (server_args.prepare_server_args: argparse over ServerArgs.add_cli_args, then ServerArgs itself with its
checks), over a local copy of the model's config.json (ServerArgs reads the config, never the weights), with
`--device cpu` added for this machine. Each value lands in the ServerArgs field the plan meant, and the
hisparse config is what SGLang's own parser (mem_cache/sparsity/factory.py) resolves."""
import json

import pytest

import deepseek_v32_config
import ess

CASES = [
    dict(hardware="h200", contexts=[32768], min_otps=15, nodes=1, gpus_per_node=8, ep=8),       # 8 x H200
    dict(hardware="h200", contexts=[131072], min_otps=10, no_tbo=True),                         # the paper's 4 x 8
    dict(hardware="paper-table1", contexts=[32768], min_otps=15, mtp=1),
    dict(hardware="h200", contexts=[4096], min_otps=15),                                         # all-on-GPU wins
    dict(hardware="h200", contexts=[131072], min_otps=10, no_tbo=True, modes=["layerwise"]),     # ESS_OVERLAP_LAYERS
]


@pytest.fixture
def model_dir(tmp_path):
    return deepseek_v32_config.write(tmp_path)


def server_args(flags, model_dir):
    """A launch line's flags through SGLang's own parser (server_args.prepare_server_args), the model's
    config.json from `model_dir`, the placeholders of a multi-node line filled in, `--device cpu` added."""
    from sglang.srt.server_args import prepare_server_args
    flags = list(flags)
    flags[flags.index("--model-path") + 1] = str(model_dir)
    for placeholder, value in (("<rank>", "0"), ("<host:port>", "127.0.0.1:5000")):
        if placeholder in flags:
            flags[flags.index(placeholder)] = value
    return prepare_server_args(flags + ["--device", "cpu", "--skip-tokenizer-init"])


@pytest.mark.parametrize("case", CASES, ids=["8xH200", "4x8-128K", "no-MTP", "all-on-GPU", "layer-wise"])
def test_the_launch_line_is_sglangs(case, model_dir, monkeypatch):
    plan = ess.plan(engine="sglang", **case)
    assert plan["engine"] == "sglang"
    for p in plan["plans"]:
        assert p["found"], p
        launch = p["launch"]
        argv = launch["argv"]
        chosen = p["chosen"]
        offload = chosen["offload"]
        # ESS's launcher takes sglang.launch_server's arguments; all-on-GPU is SGLang's own server.
        assert argv[:3] == ["python", "-m", "ess.integrations.sglang_launch" if offload else "sglang.launch_server"]
        args = server_args(argv[3:], model_dir)
        dep = plan["deployment"]
        assert args.kv_cache_dtype == "fp8_e4m3"
        assert args.context_length == p["context"]
        assert args.max_running_requests == chosen["batch"] * dep["attention_data_parallel"]
        assert args.mem_fraction_static == dep["mem_fraction_static"]
        assert args.tp_size == dep["nodes"] * dep["gpus_per_node"]
        assert args.enable_two_batch_overlap == chosen["two_batch_overlap"]
        if dep["mtp_tokens"] > 1:
            assert args.speculative_num_draft_tokens == dep["mtp_tokens"]
        assert args.enable_hisparse == offload and args.disable_radix_cache == offload
        if not offload:
            assert launch["env"] == [] and args.hisparse_config is None
            continue
        config = json.loads(args.hisparse_config)
        assert config["device_buffer_size"] == chosen["slots"] and config["top_k"] == 2048
        assert config["device_buffer_size"] >= max(1, dep["mtp_tokens"]) * 2048 or dep["mtp_tokens"] == 1
        overlap = chosen["overlap"]
        assert (f"ESS_OVERLAP={overlap}" in launch["env"]) == (overlap != "none")
        assert "ESS_RESIDENCY=adaptive" in launch["env"]
        # Every ESS setting of the line is one the adapter reads as the plan meant it.
        from ess.integrations.sglang._common import residency_from_environment
        from ess.integrations.sglang.overlap import schedule_from_environment
        for setting in launch["env"]:
            name, value = setting.split("=", 1)
            monkeypatch.setenv(name, value)
        assert residency_from_environment() == "adaptive"
        assert schedule_from_environment() == overlap
        assert overlap == "layerwise" or case.get("modes") != ["layerwise"], overlap
        if overlap == "layerwise":   # every layer's codes, as the adapter reads them for a pool of the model's layers
            from ess.integrations.sglang.overlap import layers_from_environment
            layers = layers_from_environment(0, deepseek_v32_config.CONFIG["num_hidden_layers"])
            assert len(layers) == 61 and all(set(g) <= {"none", "da", "dba"} for g in layers), layers
        if overlap in ("da", "dba"):
            assert args.dsa_decode_backend == "flashmla_kv"


def test_the_recipes_launch_lines_are_sglangs(model_dir):
    """Every launch line of docs/recipes.md (ESS's and stock HiSparse's beside it) read by SGLang's own parser, as
    above; stock HiSparse's with upstream's default hisparse config (mem_cache/sparsity/factory.py)."""
    import pathlib
    import shlex
    page = (pathlib.Path(__file__).resolve().parents[4] / "docs" / "recipes.md").read_text()
    lines, command = [], None
    for line in page.splitlines():   # a command starts with its settings or `python -m`, continues after a `\`
        text = line.strip()
        if command is None and (text.startswith("python -m ") or text.startswith("ESS_OVERLAP=")
                                or text.startswith("ESS_RESIDENCY=")):
            command = ""
        if command is not None:
            command += " " + text.removesuffix("\\")
            if not text.endswith("\\"):
                if "vllm" not in shlex.split(command)[:3]:   # vLLM's lines: engines/vllm/test_vllm_launch_line.py
                    lines.append(shlex.split(command))
                command = None
    stock = [argv for argv in lines if argv[:3] == ["python", "-m", "sglang.launch_server"]]
    ess_lines = [argv for argv in lines if "ess.integrations.sglang_launch" in argv]
    # One ESS line per context planned for SGLang (two recipes of two contexts), stock HiSparse beside each.
    assert len(ess_lines) == 4 and len(stock) == len(ess_lines), (len(ess_lines), len(stock))
    for argv in lines:
        start = argv.index("-m") + 2
        env = [a for a in argv[:start - 2] if "=" in a]
        args = server_args(argv[start:], model_dir)
        assert args.enable_hisparse
        config = json.loads(args.hisparse_config)
        if argv in stock:
            assert env == [] and config == {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 2}
        else:
            assert "ESS_RESIDENCY=adaptive" in env and config["device_buffer_size"] >= 4096


def test_minimax_m3s_launch_line_is_sglangs_with_one_kv_head_a_rank(tmp_path, monkeypatch):
    """MiniMax-M3's plan (attention TP over the node, the shipped minimax-m3-tp8 deployment) read by SGLang's own
    parser over the shipped config: TP and EP 8, no DP attention and SGLang's default MoE (the all-reduce the plan
    modelled, not DeepEP's all-to-all), the model's own KV dtype, a device_buffer_size that holds a step's blocks
    (hisparse_coordinator.py asserts n_blocks x block <= it), and one KV head a rank (the coordinator's head_num == 1
    condition)."""
    import pathlib
    config = pathlib.Path(__file__).resolve().parents[4] / "configs" / "models" / "minimax-m3.json"
    (tmp_path / "config.json").write_text(config.read_text())
    plan = ess.plan(engine="sglang", model=str(config), hardware="h200", contexts=[32768])
    dep = plan["deployment"]
    assert dep["name"] == "minimax-m3-tp8" and dep["attention_tensor_parallel"] == 8
    (p,) = plan["plans"]
    assert p["found"] and p["chosen"]["offload"] and p["chosen"]["overlap"] == "none", p
    launch, chosen = p["launch"], p["chosen"]
    argv = launch["argv"]
    assert argv[:3] == ["python", "-m", "ess.integrations.sglang_launch"]
    args = server_args(argv[3:], tmp_path)
    assert args.tp_size == 8 and args.ep_size == 8
    assert not args.enable_dp_attention and args.dp_size == 1
    assert args.moe_a2a_backend == "none"
    assert args.kv_cache_dtype == "auto"
    assert args.max_running_requests == chosen["batch"] and args.context_length == 32768
    assert args.enable_hisparse and args.disable_radix_cache
    hisparse = json.loads(args.hisparse_config)
    assert hisparse["device_buffer_size"] == chosen["slots"] >= 16 * 128
    assert hisparse["device_buffer_size"] >= hisparse["top_k"]
    assert launch["env"] == ["ESS_RESIDENCY=adaptive"]
    # One KV head a rank needs attention TP a multiple of the KV heads (models/minimax_m3.py: a rank holds
    # max(1, num_key_value_heads // attn_tp)); SGLang's ModelConfig cannot load the config here (this transformers
    # release has no minimax_m3 type, the checkpoint's remote code supplies it).
    kv_heads = json.loads(config.read_text())["num_key_value_heads"]
    assert args.tp_size >= kv_heads and args.tp_size % kv_heads == 0
