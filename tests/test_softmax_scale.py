"""The YaRN softmax scale takes `mscale_all_dim`, and the RoPE cos/sin scale the ratio of the two mscales.

DEEPSEEK_SEMANTICS.md: softmax scale = qk_head_dim**-0.5 * m**2 with m = 0.1 * mscale_all_dim * ln(factor) + 1
(the official code's `args.mscale` plays the role of HF's `mscale_all_dim`), and HF scales cos/sin by
m(mscale) / m(mscale_all_dim). The released configs and every other test config set mscale ==
mscale_all_dim, where the two cannot be told apart; the configs here set them differently.

Hand-computed, factor 40 (ln 40 = 3.6888795):
  m(1.0) = 1.36888795, m(1.0)**2 = 1.87385421;  m(0.5) = 1.18444397, m(0.5)**2 = 1.40290752
  tiny's qk_head_dim = 32 + 16 = 48, 48**-0.5 = 0.14433757
  mscale 0.5, mscale_all_dim 1.0: scale 0.14433757 * 1.87385421 = 0.27046756,
    cos/sin x 1.18444397 / 1.36888795 = 0.86525999
  mscale 1.0, mscale_all_dim 0.5: scale 0.14433757 * 1.40290752 = 0.20249226,
    cos/sin x 1.36888795 / 1.18444397 = 1.15572199
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import MLA, ModelConfig
from mla_jax.rope import rope_cos_sin

# (mscale, mscale_all_dim, softmax scale, cos/sin scale), from the docstring's arithmetic
CASES = [(0.5, 1.0, 0.27046756, 0.86525999), (1.0, 0.5, 0.20249226, 1.15572199)]


def _cfg(mscale, mscale_all_dim):
    return ModelConfig.tiny().replace(rope_factor=40.0, mscale=mscale, mscale_all_dim=mscale_all_dim)


@pytest.mark.parametrize("mscale, mscale_all_dim, scale, _", CASES)
def test_softmax_scale_uses_mscale_all_dim(mscale, mscale_all_dim, scale, _):
    """Guards the mutation: `ModelConfig.softmax_scale` computes m from `mscale` instead of `mscale_all_dim`
    (it would give 0.2025 for the first case and 0.2705 for the second)."""
    assert _cfg(mscale, mscale_all_dim).softmax_scale == pytest.approx(scale, rel=1e-7)


def test_released_presets_scale():
    """Guards: the presets' YaRN fields (DEEPSEEK_SEMANTICS.md: V3 0.135234, V2-Lite 0.114721)."""
    assert ModelConfig.deepseek_v3().softmax_scale == pytest.approx(0.135234, abs=1e-6)
    assert ModelConfig.deepseek_v2_lite().softmax_scale == pytest.approx(0.114721, abs=1e-6)


@pytest.mark.parametrize("mscale, mscale_all_dim, scale, _", CASES)
def test_config_json_keeps_the_two_mscales_apart(mscale, mscale_all_dim, scale, _):
    """Guards the mutation: `from_hf` reading `rope_scaling.mscale` into `mscale_all_dim` (or the reverse)."""
    d = _cfg(1.0, 1.0).to_hf_dict()
    key = "rope_parameters" if "rope_parameters" in d else "rope_scaling"
    d[key] = {**d[key], "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.mscale, cfg.mscale_all_dim) == (mscale, mscale_all_dim)
    assert cfg.softmax_scale == pytest.approx(scale, rel=1e-7)


@pytest.mark.parametrize("mscale, mscale_all_dim, _, factor", CASES)
def test_rope_cos_sin_scale_is_the_mscale_ratio(mscale, mscale_all_dim, _, factor):
    """Guards the mutation: the cos/sin attention factor with the two mscales swapped (or either alone)."""
    cos, sin = rope_cos_sin(_cfg(mscale, mscale_all_dim), jnp.arange(7, dtype=jnp.int32)[None])
    np.testing.assert_allclose(np.sqrt(np.asarray(cos) ** 2 + np.asarray(sin) ** 2), factor, rtol=1e-6)


@pytest.mark.parametrize("absorbed", [False, True], ids=["decompressed", "absorbed"])
def test_mla_layer_scales_scores_by_the_config_property(absorbed):
    """Guards the mutation: an attention path that computes its own scale (e.g. from `cfg.mscale`) instead of
    using `cfg.softmax_scale`, whose value the tests above check by hand. A config whose property is
    overridden to the hand value gives the same output bit for bit; overridden to twice that, another one."""

    cfg = _cfg(0.5, 1.0)
    mla = MLA(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))

    def output_with(layer_cfg):  # the same weights; the layer reads its config when called
        mla.cfg = layer_cfg
        return np.asarray(mla(x, pos, absorbed=absorbed))

    def scaled(value):
        cls = type("Scaled", (ModelConfig,), {"softmax_scale": property(lambda self: value)})
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})

    y = output_with(cfg)
    np.testing.assert_array_equal(output_with(scaled(cfg.softmax_scale)), y)
    assert np.abs(output_with(scaled(2 * cfg.softmax_scale)) - y).max() > 1e-3
