"""Micro model configs shared by the checkpoint, training and kernel-path tests (every feature on, tiny sizes), and
the cached decode step those kernel-path tests run on two backends."""

from mla_jax import ModelConfig

# A DeepSeek-V3-style config.json in miniature: q LoRA, YaRN, grouped sigmoid routing, one MTP layer.
MICRO_V3 = ModelConfig.from_hf_dict(
    dict(
        model_type="deepseek_v3",
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
        routed_scaling_factor=2.5,
        rope_scaling=dict(
            type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
        ),
    )
)


def narrow_v2_lite(layers: int) -> ModelConfig:
    """DeepSeek-V2-Lite's structure (1 dense layer then MoE layers, 64 experts top-6, softmax greedy
    routing, no q LoRA, YaRN) at `layers` layers with narrow widths: compile-time and HLO studies."""
    return ModelConfig.deepseek_v2_lite().replace(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=4096,
    )


def decode_step_on_both_backends(model, seed: int = 0):
    """A cached model's decode step, two rows after a 4-token prefill, on the "interpret" and the "reference"
    cache backends (fp32 pages, 8 pages of 16 tokens, each row's table one page) -> ((logits, jaxpr as text) of the
    interpret step, the same of the reference step): the harness of the tests that check a kernel path of the
    decode step against the plain one and count its launches."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mla_jax.kv_cache import KVCache
    from models import Engine

    e = Engine(model, page_size=16, num_pages=8, max_batch=2, kv_dtype=jnp.float32)
    B, S = 2, 5
    ids = jnp.asarray(np.random.default_rng(seed).integers(0, model.cfg.vocab_size, (B, S)), jnp.int32)
    table = jnp.asarray([[0], [1]], jnp.int32)
    fwd = jax.jit(lambda ids, positions, cache: model(ids, positions, cache=cache))

    def run(impl):
        cache = KVCache.create(e.cache.pages, table, jnp.zeros((B,), jnp.int32), impl=impl)
        _, cache = fwd(ids[:, :-1], jnp.broadcast_to(jnp.arange(S - 1), (B, S - 1)), cache)
        last = (ids[:, -1:], jnp.full((B, 1), S - 1, jnp.int32), cache)
        return fwd(*last)[0], str(jax.make_jaxpr(fwd)(*last))

    return run("interpret"), run("reference")
