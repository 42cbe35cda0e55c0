"""ModelConfig: presets equal the published config.json files; from_hf round-trips; invalid values are refused."""

import dataclasses
import json

import pytest

from mla_jax import ModelConfig

# The published Hugging Face config.json of DeepSeek-V3 (deepseek-ai/DeepSeek-V3), fields that matter.
V3_CONFIG_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

# The published config.json of DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite).
V2_LITE_CONFIG_JSON = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "tie_word_embeddings": False,
}


def _write(tmp_path, d):
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


def test_v3_preset_equals_published_config(tmp_path):
    cfg = ModelConfig.from_hf(_write(tmp_path, V3_CONFIG_JSON))
    assert cfg == ModelConfig.deepseek_v3()
    assert cfg.latent_dim == 576 and cfg.qk_head_dim == 192
    # DEEPSEEK_SEMANTICS.md §0: m = 0.1·ln(40)+1 = 1.36889, scale = 192**-0.5·m² = 0.135234
    assert cfg.softmax_scale == pytest.approx(0.135234, abs=1e-6)


def test_v2_lite_preset_equals_published_config(tmp_path):
    cfg = ModelConfig.from_hf(_write(tmp_path, V2_LITE_CONFIG_JSON))
    assert cfg == ModelConfig.deepseek_v2_lite()
    assert cfg.q_lora_rank is None
    assert cfg.softmax_scale == pytest.approx(0.114721, abs=1e-6)


def test_v3_preset_values():
    c = ModelConfig.deepseek_v3()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (
        7168,
        61,
        128,
        1536,
        512,
    )
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group, c.routed_scaling_factor) == (
        256,
        8,
        8,
        4,
        2.5,
    )
    assert (c.scoring_func, c.topk_method, c.first_k_dense_replace, c.num_mtp_layers) == ("sigmoid", "noaux_tc", 3, 1)


@pytest.mark.parametrize("preset", ["tiny", "deepseek_v3", "deepseek_v2_lite", "deepseek_v2"])
def test_from_hf_round_trip(tmp_path, preset):
    cfg = getattr(ModelConfig, preset)()
    assert ModelConfig.from_hf(_write(tmp_path, cfg.to_hf_dict())) == cfg
    # the file path itself is accepted too
    assert ModelConfig.from_hf(tmp_path / "config.json") == cfg


def test_from_hf_rope_parameters_v5_layout(tmp_path):
    d = dict(V3_CONFIG_JSON)
    rope = dict(d.pop("rope_scaling"))
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = d.pop("rope_theta")
    d["rope_parameters"] = rope
    assert ModelConfig.from_hf(_write(tmp_path, d)) == ModelConfig.deepseek_v3()


def test_from_hf_without_yarn(tmp_path):
    d = dict(V2_LITE_CONFIG_JSON, rope_scaling=None)
    cfg = ModelConfig.from_hf(_write(tmp_path, d))
    assert cfg.rope_type == "default"
    assert cfg.softmax_scale == pytest.approx(192**-0.5)


def test_from_hf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("qk_rope_head_dim", 63, "qk_rope_head_dim=63"),
        ("hidden_size", 0, "hidden_size=0"),
        ("num_attention_heads", -4, "num_attention_heads=-4"),
        ("kv_lora_rank", 0, "kv_lora_rank=0"),
        ("q_lora_rank", 0, "q_lora_rank=0"),
        ("topk_group", 9, "topk_group=9"),
        ("scoring_func", "relu", "scoring_func='relu'"),
        ("topk_method", "random", "topk_method='random'"),
        ("num_experts_per_tok", 300, "num_experts_per_tok=300"),
        ("n_group", 3, "n_group=3"),
        ("first_k_dense_replace", 62, "first_k_dense_replace=62"),
        ("rope_type", "ntk", "rope_type='ntk'"),
    ],
)
def test_invalid_values_name_field_and_value(field, value, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        dataclasses.replace(ModelConfig.deepseek_v3(), **{field: value})


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig.tiny().hidden_size = 3  # type: ignore[misc]
