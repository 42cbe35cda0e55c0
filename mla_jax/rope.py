"""Rotary position embedding with YaRN, in fp32, as DeepSeek's official code and HF transformers.

Only the R = qk_rope_head_dim slice of queries and keys is rotated. The released weights use
the *interleaved* pair layout: pair i is (x[2i], x[2i+1]) and is rotated by frequency i; the
output stays interleaved (official `apply_rotary_emb`). Because queries and keys are rotated
the same way, q·k equals HF's result (HF de-interleaves into a half layout at run time); only
the layout of a cached roped key differs, and the cache is ours. `rope_interleave=False`
configs use the half layout (pair i is (x[i], x[i + R/2])).

YaRN (DEEPSEEK_SEMANTICS.md §1.3): inv_freq[i] = theta**(-2i/R); dimensions below the
correction range keep their frequency, above it are divided by `factor`, with a linear ramp
between. cos/sin are multiplied by HF's `attention_factor` (1.0 for the released configs);
the softmax-side mscale lives in `ModelConfig.softmax_scale`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from mla_jax.config import ModelConfig, yarn_get_mscale
from pallas_kernels.latent_write import rotate, rotation


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The rotary dimension whose wavelength makes `num_rotations` turns over `max_pos` tokens."""
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_correction_range(cfg: ModelConfig) -> tuple[int, int]:
    """(low, high) pair indices of the YaRN ramp, truncated with floor/ceil and clamped to [0, R-1]."""
    dim = cfg.qk_rope_head_dim
    low = math.floor(_correction_dim(cfg.beta_fast, dim, cfg.rope_theta, cfg.original_max_position_embeddings))
    high = math.ceil(_correction_dim(cfg.beta_slow, dim, cfg.rope_theta, cfg.original_max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair angular frequencies, float32 [R/2] (YaRN-corrected when cfg.rope_type == 'yarn')."""
    dim = cfg.qk_rope_head_dim
    base = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    if cfg.rope_type != "yarn":
        return base.astype(np.float32)
    low, high = yarn_correction_range(cfg)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: keep the original frequency (high-frequency pairs); 0: interpolate by factor
    freqs = base / np.float32(cfg.rope_factor) * (1.0 - keep) + base * keep
    return freqs.astype(np.float32)


def attention_factor(cfg: ModelConfig) -> float:
    """HF's cos/sin scale: mscale(f, mscale) / mscale(f, mscale_all_dim) when both are set, else mscale(f)."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.mscale and cfg.mscale_all_dim:
        return yarn_get_mscale(cfg.rope_factor, cfg.mscale) / yarn_get_mscale(cfg.rope_factor, cfg.mscale_all_dim)
    return yarn_get_mscale(cfg.rope_factor)


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_frequencies, attention_factor): what `rotation` turns positions into cos / sin with."""
    return inv_frequencies(cfg), attention_factor(cfg)


def rope_cos_sin(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin float32 [..., R/2] for integer `positions` [...] (`pallas_kernels.latent_write.rotation`)."""
    return rotation(positions, *rope_frequencies(cfg))


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, *, interleave: bool = True) -> jnp.ndarray:
    """Rotate the last axis of `x` [B, T, ..., R] by cos/sin [B, T, R/2] (broadcast over the middle axes), in fp32,
    cast back to x.dtype: `pallas_kernels.latent_write.rotate`, the formula the latent's page-writing kernel uses."""
    return rotate(x, cos, sin, interleave=interleave)
