"""The bucketed normal initializer (mla_jax/initializers.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import initializers


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
