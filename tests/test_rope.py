"""YaRN RoPE against an independent float64 NumPy computation of the official formulas."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import ModelConfig
from mla_jax.rope import apply_rope, attention_factor, inv_frequencies, rope_cos_sin, yarn_correction_range


def yarn_freqs_f64(dim, theta, factor, orig, beta_fast, beta_slow):
    """DeepSeek-V3 inference/model.py precompute_freqs_cis, written out in float64."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)

    def corr(n):
        return dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    smooth = 1 - np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return freqs / factor * (1 - smooth) + freqs * smooth, (low, high)


@pytest.mark.parametrize("preset", ["deepseek_v3", "deepseek_v2_lite", "tiny"])
def test_yarn_frequencies_match_float64(preset):
    cfg = getattr(ModelConfig, preset)()
    ref, (low, high) = yarn_freqs_f64(
        cfg.qk_rope_head_dim,
        cfg.rope_theta,
        cfg.rope_factor,
        cfg.original_max_position_embeddings,
        cfg.beta_fast,
        cfg.beta_slow,
    )
    got = inv_frequencies(cfg)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert yarn_correction_range(cfg)[0] == low


def test_v3_correction_range_is_10_23():
    # DEEPSEEK_SEMANTICS.md §1.3: for dr=64 the ramp runs from pair 10 to pair 23.
    assert yarn_correction_range(ModelConfig.deepseek_v3()) == (10, 23)


def test_cos_sin_table_match_float64():
    cfg = ModelConfig.deepseek_v3()
    ref_f, _ = yarn_freqs_f64(64, 1e4, 40, 4096, 32, 1)
    pos = np.array([[0, 1, 17, 1000, 4095, 4096]], dtype=np.int32)
    ang = pos[..., None].astype(np.float64) * ref_f
    cos, sin = rope_cos_sin(cfg, jnp.asarray(pos))
    assert cos.dtype == jnp.float32
    # fp32 angles (as the official code computes them) round to ~eps·angle; 4096·6e-8 < 5e-4
    np.testing.assert_allclose(np.asarray(cos), np.cos(ang), atol=5e-4)
    np.testing.assert_allclose(np.asarray(sin), np.sin(ang), atol=5e-4)
    # at long positions the table is what fp32 angle arithmetic gives (the official code's precision),
    # up to XLA's fp32 range reduction of angles near 1e5 rad
    long = np.array([[65535, 163839]], dtype=np.int32)
    ang32 = (long[..., None].astype(np.float32) * ref_f.astype(np.float32)).astype(np.float64)
    np.testing.assert_allclose(np.asarray(rope_cos_sin(cfg, jnp.asarray(long))[0]), np.cos(ang32), atol=2e-3)


def test_attention_factor():
    assert attention_factor(ModelConfig.deepseek_v3()) == 1.0  # mscale == mscale_all_dim
    assert attention_factor(ModelConfig.deepseek_v2_lite()) == pytest.approx(1.0)
    cfg = ModelConfig.tiny().replace(mscale=None, mscale_all_dim=None)
    assert attention_factor(cfg) == pytest.approx(0.1 * math.log(cfg.rope_factor) + 1)  # HF fallback


def test_interleaved_rotation_is_complex_multiplication():
    cfg = ModelConfig.deepseek_v3()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 64)).astype(np.float32)
    pos = rng.integers(0, 2000, (2, 5)).astype(np.int32)
    cos, sin = rope_cos_sin(cfg, jnp.asarray(pos))
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin, interleave=True))
    f, _ = yarn_freqs_f64(64, 1e4, 40, 4096, 32, 1)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[:, :, None, None] * f)
    ref = np.stack([z.real, z.imag], -1).reshape(x.shape)
    np.testing.assert_allclose(got, ref, atol=2e-4)


def test_half_layout_equals_interleaved_after_permutation():
    # HF's rotate_half on de-interleaved rows == the official interleaved rotation, permuted.
    cfg = ModelConfig.tiny()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 4, 2, cfg.qk_rope_head_dim)).astype(np.float32)
    cos, sin = rope_cos_sin(cfg, jnp.arange(4, dtype=jnp.int32)[None])
    perm = np.concatenate([np.arange(0, cfg.qk_rope_head_dim, 2), np.arange(1, cfg.qk_rope_head_dim, 2)])
    inter = np.asarray(apply_rope(jnp.asarray(x), cos, sin, interleave=True))[..., perm]
    half = np.asarray(apply_rope(jnp.asarray(x[..., perm]), cos, sin, interleave=False))
    np.testing.assert_allclose(inter, half, atol=1e-6)


def test_scores_depend_only_on_relative_position():
    cfg = ModelConfig.tiny()
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, 16)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((1, 1, 1, 16)).astype(np.float32))

    def score(pq, pk):
        cq, sq = rope_cos_sin(cfg, jnp.array([[pq]]))
        ck, sk = rope_cos_sin(cfg, jnp.array([[pk]]))
        return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-4)


def test_bf16_input_keeps_dtype_and_rotates_in_fp32():
    cfg = ModelConfig.tiny()
    x = jnp.ones((1, 2, 16), jnp.bfloat16)
    cos, sin = rope_cos_sin(cfg, jnp.array([[0, 1000]], dtype=jnp.int32))
    y = apply_rope(x, cos, sin)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y[0, 0], np.float32), 1.0)  # position 0: identity
