"""mla-jax: DeepSeek-style Multi-head Latent Attention for JAX (config, YaRN RoPE, MLA, latent cache)."""

from mla_jax.attention import (
    MLA,
    attention_mask,
    mla_absorbed_attention,
    mla_decompressed_attention,
    mla_naive_attention,
)
from mla_jax.config import ModelConfig
from mla_jax.kv_cache import CacheFullError, PagedLatentCache
from mla_jax.norm import RMSNorm
from mla_jax.rope import apply_rope, attention_factor, inv_frequencies, rope_cos_sin

__all__ = [
    "CacheFullError",
    "MLA",
    "ModelConfig",
    "PagedLatentCache",
    "RMSNorm",
    "apply_rope",
    "attention_factor",
    "attention_mask",
    "inv_frequencies",
    "mla_absorbed_attention",
    "mla_decompressed_attention",
    "mla_naive_attention",
    "rope_cos_sin",
]
