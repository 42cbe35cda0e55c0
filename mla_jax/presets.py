"""The named model shapes: the bodies of `mla_jax.config.ModelConfig`'s presets (`ModelConfig.deepseek_v3()`,
`.deepseek_v2()`, `.deepseek_v2_lite()`, `.tiny()`, `.builtin()`, whose docstrings say what each is), each a function
of the config class `cls`."""

from __future__ import annotations


def deepseek_v3(cls):
    return cls()


def deepseek_v2_lite(cls):
    return cls(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        scoring_func="softmax",
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        rope_theta=10000.0,
        rope_type="yarn",
        rope_factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=0.707,
        mscale_all_dim=0.707,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        num_mtp_layers=0,
        bos_token_id=100000,
        eos_token_id=100001,
        model_type="deepseek_v2",
    )


def deepseek_v2(cls):
    return cls(
        vocab_size=102400,
        hidden_size=5120,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=60,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=160,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=8,
        topk_group=3,
        scoring_func="softmax",
        topk_method="group_limited_greedy",
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
        first_k_dense_replace=1,
        rope_type="yarn",
        rope_factor=40.0,
        original_max_position_embeddings=4096,
        mscale=0.707,
        mscale_all_dim=0.707,
        num_mtp_layers=0,
        bos_token_id=100000,
        eos_token_id=100001,
        model_type="deepseek_v2",
    )


def tiny(cls):
    return cls(
        vocab_size=264,
        hidden_size=128,
        intermediate_size=320,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rope_type="yarn",
        rope_factor=4.0,
        original_max_position_embeddings=512,
        mscale=1.0,
        mscale_all_dim=1.0,
        max_position_embeddings=2048,
        num_mtp_layers=1,
        bos_token_id=256,
        eos_token_id=257,
        model_type="deepseek_v3",
    )


def builtin(cls):
    return cls.tiny().replace(
        num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16
    )
