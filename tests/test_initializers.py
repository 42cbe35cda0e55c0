"""The bucketed normal initializer (mla_jax/initializers.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import initializers
from tests.tiers import full


@pytest.mark.parametrize(
    "n, expected",
    [(1, 1024), (1024, 1024), (1025, 4096), (4096, 4096), (4097, 16384), (1 << 20, 1 << 20), ((1 << 20) + 1, 1 << 22)],
)
def test_bucket_size_is_the_next_power_of_four(n, expected):
    """Guards the bucket arithmetic: a bucket smaller than the parameter would fail the slice; an
    off-by-one power would quadruple every draw."""
    assert initializers.bucket_size(n) == expected


@pytest.mark.parametrize(
    "shape, dtype",
    [((64, 96), jnp.float32), ((3, 40, 24), jnp.bfloat16), ((5000,), jnp.float32), ((2100, 2100), jnp.bfloat16)],
)
def test_draws_are_normal_with_the_given_stddev_shape_and_dtype(shape, dtype):
    """The values are N(0, std^2) in the asked shape and dtype, bucketed or not (the last shape is over
    MAX_BUCKETED). Catches a dropped stddev, a zero-filled tail of the prefix (a slice past the draw),
    a reshape that repeats values, and the dtype left at float32."""
    std = 0.02
    x = initializers.normal(std)(jax.random.key(3), shape, dtype)
    assert x.shape == shape and x.dtype == dtype
    v = np.asarray(x, np.float64).ravel()
    n = v.size
    assert abs(v.mean()) < 5 * std / np.sqrt(n)
    assert abs(v.std() / std - 1) < 5 / np.sqrt(2 * n) + 0.01
    tail = v[-max(n // 8, 1) :]  # the end of the prefix is drawn too, not padding
    assert np.count_nonzero(tail) == tail.size
    assert np.unique(v).size > 0.9 * n if dtype == jnp.float32 else True


def test_keys_and_shapes_in_one_bucket_give_their_own_values():
    """Two keys give different parameters; one key gives a prefix of the same draw for two shapes of
    one bucket (what the bucketing does), i.e. shape changes the layout only, not the stream."""
    init = initializers.normal(1.0)
    a = init(jax.random.key(0), (16, 32))
    b = init(jax.random.key(1), (16, 32))
    assert not np.allclose(a, b)
    c = init(jax.random.key(0), (8, 32))
    np.testing.assert_array_equal(np.asarray(c).ravel(), np.asarray(a).ravel()[:256])


def test_largest_divisor_within_a_limit():
    """Against a brute-force search: a wrong divisor would make the slabs of a large draw miss or overrun the
    parameter's elements."""
    for n, limit in [(720720, 5000), (2 * 3 * 1009 * 1013, 6000), (97, 50), (1 << 20, 1 << 20), (12, 0)]:
        assert initializers.largest_divisor(n, limit) == max([1] + [d for d in range(1, limit + 1) if n % d == 0])


def test_a_large_draw_is_its_slabs_each_from_its_own_key(monkeypatch):
    """A parameter over MAX_BUCKETED elements (here 4 slabs of 1024) is slab i = N(0, std^2) drawn from
    fold_in(key, i), in the flat order of the parameter. Catches every slab drawn from one key (repeated values),
    a slab written at another's place, a scale or cast left out."""
    monkeypatch.setattr(initializers, "MAX_BUCKETED", 1024)
    key = jax.random.key(7)
    got = np.asarray(initializers.normal(0.5)(key, (8, 512), jnp.float32)).reshape(4, 1024)
    for i in range(4):
        want = np.asarray(jax.random.normal(jax.random.fold_in(key, i), (1024,), jnp.float32)) * np.float32(0.5)
        np.testing.assert_array_equal(got[i], want)
    assert np.unique(got).size == got.size
    with pytest.raises(ValueError, match=r"^fill_slabs: slabs of 3 rows must tile every output's 8 rows"):
        initializers.fill_slabs(key, (jax.ShapeDtypeStruct((8,), jnp.float32),), 3, lambda k: (jnp.zeros(3),))


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


def test_a_draw_past_two_to_the_31_elements_places_slabs_by_their_index():
    """A parameter of more than 2**31 elements (a V3 expert stack is 7.5e9) places slab i by its index along a slab
    axis, never at the element offset i · per: that int32 product wrapped past 2**31 and every slab beyond stayed
    zero (the GPU test of the FP8 experts at V3 widths then compared two all-zero layers: 0 / 0). Traced only (the
    draw itself takes minutes on a CPU): no update's start index is a product. Catches the offset coming back."""
    n = (1 << 31) + 2 * initializers.MAX_BUCKETED
    jaxpr = jax.make_jaxpr(lambda k: initializers.normal(64.0)(k, (n,), jnp.float8_e4m3fn))(jax.random.key(3))
    eqns = list(_eqns(jaxpr.jaxpr))
    made_by = {id(v): e for e in eqns for v in e.outvars}

    def from_a_product(v) -> bool:  # v, or anything it is computed from, an integer product
        e = made_by.get(id(v))
        if e is None:
            return False
        if e.primitive.name == "mul" and jnp.issubdtype(v.aval.dtype, jnp.integer):
            return True
        return any(from_a_product(u) for u in e.invars if hasattr(u, "aval"))

    updates = [e for e in eqns if e.primitive.name == "dynamic_update_slice"]
    assert updates
    for e in updates:
        assert not any(from_a_product(v) for v in e.invars[2:]), e


@pytest.mark.parametrize(
    "weights", full([None, "fp8"], ["fp8"], "the fp8 build draws its bf16 parameters through the same initializer")
)
def test_model_init_program_holds_no_float32_parameter(weights):
    """The init program of a model with wide routed experts (2 scanned MoE layers of 32 experts 2048 x 2048, and
    the MTP layer's), dense bf16 or FP8, holds no float32 array (nor random bits, uint32) of a quarter of one
    layer's projection or more: it held the float32 draw of every large parameter under the layers' vmap (the
    whole stack's: the 28 GiB that kept the V3 cut from being built on an H100) and, for FP8, the quantizer's
    float32 blocks. XLA:CPU compile only (the model is never built), with the optimisations a real run has."""
    from flax import nnx

    from mla_jax import ModelConfig
    from models import DeepSeekModel
    from tests import hlo
    from tests.xla_opt import optimized

    cfg = ModelConfig.tiny().replace(
        n_routed_experts=32, hidden_size=2048, moe_intermediate_size=2048, intermediate_size=256, num_hidden_layers=3
    )
    make = lambda: DeepSeekModel(  # noqa: E731
        cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, weights=weights
    )
    with optimized():
        text = jax.jit(lambda: nnx.state(make())).lower().compile().as_text()
    layer_f32 = cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size * 4
    assert hlo.buffers(text, layer_f32 // 4, dtypes=("f32", "u32")) == []
