"""`ess plan --engine vllm`'s launch lines read by vLLM 0.33.0's own argument parser and configuration: the flags ESS
prints are `vllm serve`'s (EngineArgs.add_cli_args over FlexibleArgumentParser, then EngineArgs.from_cli_args), and
the configuration vLLM builds from them (EngineArgs.create_engine_config, with its HiSparse checks: the connector by
name, the host pool, Model Runner V2, the CUDA-graph mode) holds what the plan meant, over a local copy of the
model's config.json (vLLM reads the config, never the weights). CUDA's platform answers while the configuration is
built (test_vllm_scheduler.py's cuda_configuration: vLLM's HiSparse refuses any other)."""
import pytest

import deepseek_v32_config
import ess
from test_vllm_scheduler import cuda_configuration

CASES = [
    dict(hardware="h200", contexts=[32768], min_otps=15, nodes=1, gpus_per_node=8, ep=8),       # 8 x H200
    dict(hardware="h200", contexts=[131072], min_otps=10),                                       # the paper's 4 x 8
    dict(hardware="paper-table1", contexts=[32768], min_otps=15, mtp=1),
    dict(hardware="h200", contexts=[4096], min_otps=15, nodes=1, gpus_per_node=8, ep=8),        # all-on-GPU wins
    dict(hardware="h200", contexts=[131072], min_otps=10, modes=["layerwise"]),                  # per layer
]
HBM_GB = {"h200": 150.75, "paper-table1": 150.75}   # configs/hardware/*.json hbm_capacity_gb
PLACEHOLDERS = {"<start>": "0", "<host>": "127.0.0.1", "<port>": "5000", "<rank>": "0"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return deepseek_v32_config.write(tmp_path_factory.mktemp("deepseek-v3.2"))


def engine_args(argv, model_dir):
    """`vllm serve MODEL FLAGS...` through vLLM's own parser: the model as a local copy, placeholders filled."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    assert argv[:2] == ["vllm", "serve"]
    flags = [PLACEHOLDERS.get(a, a) for a in argv[3:]]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", str(model_dir), "--skip-tokenizer-init", *flags]))


@pytest.mark.parametrize("case", CASES, ids=["8xH200", "4x8-128K", "no-MTP", "all-on-GPU", "layerwise"])
def test_the_launch_line_is_vllms(case, model_dir):
    plan = ess.plan(engine="vllm", **case)
    assert plan["engine"] == "vllm" and not plan["deployment"]["two_batch_overlap"]
    dep = plan["deployment"]
    for p in plan["plans"]:
        assert p["found"], p
        chosen, launch = p["chosen"], p["launch"]
        mode = chosen["overlap"]
        assert not chosen["two_batch_overlap"] and "low_load" not in p
        # The environment the line sets is what the connector reads (vllm_connector.py overlap_schedules): the
        # plan's schedule of each of the model's 61 layers.
        env_set = dict(e.split("=", 1) for e in launch["env"])
        assert env_set.get("ESS_OVERLAP", "none") == mode
        if mode != "none":
            from ess.integrations.vllm_connector import overlap_schedules
            names = [f"model.layers.{i}.self_attn.attn" for i in range(61)]
            if mode == "layerwise":
                codes = {"a": "da", "b": "dba", "-": "none"}
                expected = [codes[group[0]] for group in chosen["layer_modes"].split()[:61]]
            else:
                expected = [mode] * 61
            with pytest.MonkeyPatch.context() as env:
                for name, value in env_set.items():
                    env.setenv(name, value)
                assert overlap_schedules(names) == expected
        args = engine_args(launch["argv"], model_dir)
        dp = dep["attention_data_parallel"]
        assert args.data_parallel_size == dp and args.tensor_parallel_size * dp == dep["nodes"] * dep["gpus_per_node"]
        assert args.enable_expert_parallel == (dep["expert_parallel"] > 1)
        assert args.max_model_len == p["context"] and args.max_num_seqs == chosen["batch"]
        assert args.kv_cache_dtype == "fp8_ds_mla"
        if dep["mtp_tokens"] > 1:
            assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": dep["mtp_tokens"] - 1}
        else:
            assert args.speculative_config is None
        if not chosen["offload"]:
            assert args.kv_transfer_config is None and args.gpu_memory_utilization == dep["mem_fraction_static"]
            continue
        transfer = args.kv_transfer_config
        assert (transfer.kv_connector, transfer.kv_connector_module_path) == \
            ("HiSparseConnector", "ess.integrations.vllm_connector")
        # vLLM's host pool holds every request of the engine at the full context.
        host = transfer.kv_connector_extra_config["host_pool_gib"] * 2**30
        assert host >= chosen["batch"] * p["context"] * (61 + (dep["mtp_tokens"] > 1)) * 656   # + the MTP layer
        # ESS's rows are a request's hot region (ess/integrations/vllm_connector.py: its slots are the region's
        # cdiv(device_buffer_size, 64) x 64 rows less T), inside vLLM's budget.
        buffer = args.attention_config.hisparse_config.device_buffer_size
        T = dep["mtp_tokens"]
        assert buffer == chosen["slots"] + T and -(-buffer // 64) * 64 - T >= chosen["slots"]
        assert chosen["slots"] >= max(1, dep["mtp_tokens"]) * 2048 or dep["mtp_tokens"] == 1
        # Outside vLLM's budget only ESS's engine state (about 1 GiB): the utilization leaves it room.
        hbm = HBM_GB[plan["hardware"]] * 1e9
        assert args.gpu_memory_utilization <= dep["mem_fraction_static"] - 2**30 / hbm


@pytest.mark.parametrize("case", CASES[:2], ids=["8xH200", "4x8-128K"])
def test_vllm_builds_its_configuration_from_the_launch_line(case, model_dir):
    """vLLM's own configuration from the line (create_engine_config: its HiSparse checks included) carries the
    HiSparse connector, its host pool and device buffer, MTP and the parallel layout."""
    p = ess.plan(engine="vllm", **case)["plans"][0]
    args = engine_args(p["launch"]["argv"], model_dir)
    with cuda_configuration():
        config = args.create_engine_config()
    assert config.attention_config.hisparse_config.device_buffer_size == p["chosen"]["slots"] + 2   # + T
    assert config.kv_transfer_config.has_connector("HiSparseConnector")
    assert config.speculative_config.num_speculative_tokens == 1
    assert config.scheduler_config.max_num_seqs == p["chosen"]["batch"]
    assert config.use_v2_model_runner
