"""The parameter initializer of every module: a normal draw that compiles once per size bucket, and large
parameters drawn a slab at a time.

`nnx.initializers.normal` calls `jax.random.normal(key, shape)`, a jitted function that XLA compiles
once per parameter shape; its threefry graph costs ~0.3-0.6 s of XLA:CPU compile each, so building
`DeepSeekModel(ModelConfig.tiny())` eagerly spent ~12 of its ~20 s compiling the same random
generator for 30-odd shapes (measured). `normal` here draws a flat
vector whose length is the next power of 4 (at least 4**5) and takes its first prod(shape) values:
one generator compile per bucket, and a cheap slice/reshape/scale per shape. The values are i.i.d.
N(0, stddev^2) as before (a prefix of i.i.d. draws), drawn in float32 and rounded to `dtype` once.

Large parameters (over `MAX_BUCKETED` elements) are drawn in one jitted program per shape that fills the
parameter in place, a slab of at most `MAX_BUCKETED` elements at a time (`fill_slabs`; slab i from
`jax.random.fold_in(key, i)`): their float32 values (and the generator's own temporaries, 16 bytes an element
on XLA:CPU) never exist for the whole parameter, nor for a whole stack of them under the layers' `nnx.vmap`
(a V3 stack of 2 MoE layers' experts is 28 GiB in float32).
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


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of n (>= 1) that is at most `limit`; 1 when `limit` < 1. (A slab of a parameter whose
    element count has no divisor near `MAX_BUCKETED`, a large prime, is small: the draw is then slow, never
    larger.)"""
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            best = max([best] + [c for c in (d, n // d) if c <= limit])
    return best


def fill_slabs(key: jax.Array, out, per: int, draw) -> tuple[jax.Array, ...]:
    """Arrays of the shapes and dtypes of `out` (a tuple of `jax.ShapeDtypeStruct`s with one leading axis R, a
    multiple of `per`) filled `per` leading rows at a time: rows [i·per, (i + 1)·per) are `draw(fold_in(key, i))`
    (a tuple of arrays [per, ...], cast to `out`'s dtypes), written in place by a `lax.fori_loop`. Traced inside
    one jitted program, only the outputs and one slab's temporaries exist at once."""
    R = out[0].shape[0]
    if R % per or any(o.shape[0] != R for o in out):
        raise ValueError(f"fill_slabs: slabs of {per} rows must tile every output's {R} rows, got {out}")

    def body(i, acc):
        parts = draw(jax.random.fold_in(key, i))
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(a, p.astype(a.dtype), i if per == 1 else i * per, axis=0)
            for a, p in zip(acc, parts)
        )

    # The loop's buffers start as slab 0 padded, not as zeros: XLA merges equal zero arrays of one program (two
    # parameters of one shape), and each loop updating the shared one in place would then copy it first.
    first = draw(jax.random.fold_in(key, 0))
    acc = tuple(jnp.pad(p.astype(o.dtype), [(0, R - per)] + [(0, 0)] * (p.ndim - 1)) for p, o in zip(first, out))
    return jax.lax.fori_loop(1, R // per, body, acc)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "stddev"))
def _shape_prefix(flat: jax.Array, *, shape: tuple[int, ...], dtype, stddev: float) -> jax.Array:
    return (flat[: math.prod(shape)].reshape(shape) * stddev).astype(dtype)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "stddev"))
def _normal_in_slabs(key: jax.Array, *, shape: tuple[int, ...], dtype, stddev: float) -> jax.Array:
    n = math.prod(shape)
    per = largest_divisor(n, MAX_BUCKETED)  # slabs tile the flat parameter exactly: no padded copy at the end

    def draw(k):
        return ((jax.random.normal(k, (1, per), jnp.float32) * stddev).astype(dtype),)

    # One slab a row, [n / per, per]: `fill_slabs` places row i at row i. Placed at element i·per of a flat
    # vector, the int32 offset wrapped past 2**31 elements and the rest of a V3-sized stack stayed zero.
    (slabs,) = fill_slabs(key, (jax.ShapeDtypeStruct((n // per, per), dtype),), 1, draw)
    return slabs.reshape(shape)


def normal(stddev: float = 1e-2):
    """An nnx initializer `(key, shape, dtype) -> array` of N(0, stddev^2) values (see the module doc)."""

    def init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        n = math.prod(shape)
        if n == 0:
            return jnp.zeros(shape, dtype)
        if n > MAX_BUCKETED:
            return _normal_in_slabs(key, shape=shape, dtype=jnp.dtype(dtype), stddev=float(stddev))
        flat = jax.random.normal(key, (bucket_size(n),), jnp.float32)
        return _shape_prefix(flat, shape=shape, dtype=jnp.dtype(dtype), stddev=float(stddev))

    return init
