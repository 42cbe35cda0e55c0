"""The parameter initializer of every module: a normal draw that compiles once per size bucket.

`nnx.initializers.normal` calls `jax.random.normal(key, shape)`, a jitted function that XLA compiles
once per parameter shape; its threefry graph costs ~0.3-0.6 s of XLA:CPU compile each, so building
`DeepSeekModel(ModelConfig.tiny())` eagerly spent ~12 of its ~20 s compiling the same random
generator for 30-odd shapes (measured). `normal` here draws a flat
vector whose length is the next power of 4 (at least 4**5) and takes its first prod(shape) values:
one generator compile per bucket, and a cheap slice/reshape/scale per shape. The values are i.i.d.
N(0, stddev^2) as before (a prefix of i.i.d. draws), drawn in float32 and rounded to `dtype` once.

Large parameters (over `MAX_BUCKETED` elements) draw their exact shape: a bucket may be up to 4x
the parameter, which matters for memory, not for compile time, at those sizes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

MIN_BUCKET = 4**5
MAX_BUCKETED = 1 << 22


def bucket_size(n: int) -> int:
    """The length of the flat draw that holds n values: the next power of 4, at least MIN_BUCKET."""
    size = MIN_BUCKET
    while size < n:
        size *= 4
    return size


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "stddev"))
def _shape_prefix(flat: jax.Array, *, shape: tuple[int, ...], dtype, stddev: float) -> jax.Array:
    return (flat[: math.prod(shape)].reshape(shape) * stddev).astype(dtype)


def normal(stddev: float = 1e-2):
    """An nnx initializer `(key, shape, dtype) -> array` of N(0, stddev^2) values (see the module doc)."""

    def init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        n = math.prod(shape)
        if n == 0 or n > MAX_BUCKETED:
            return (jax.random.normal(key, shape, jnp.float32) * stddev).astype(dtype)
        flat = jax.random.normal(key, (bucket_size(n),), jnp.float32)
        return _shape_prefix(flat, shape=shape, dtype=jnp.dtype(dtype), stddev=float(stddev))

    return init
