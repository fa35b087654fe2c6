"""DeepSeek-V3.2-Exp's config.json as the engines' own configuration code reads it (SGLang's ServerArgs, vLLM's
ModelConfig and its MTP draft config): the architecture, the MLA and DSA index sizes, the MoE and MTP fields. The
engines read the config, never the weights, so a folder holding this file stands in for the model in the launch-line
tests (engines/*/test_*_launch_line.py)."""
import json

CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "num_hidden_layers": 61,
    "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 128, "num_key_value_heads": 128,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "torch_dtype": "bfloat16", "n_routed_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1, "n_group": 8, "topk_group": 4, "n_shared_experts": 1, "rope_theta": 10000,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "tie_word_embeddings": False}


def write(folder):
    """The config.json in `folder`; returns the folder."""
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder
