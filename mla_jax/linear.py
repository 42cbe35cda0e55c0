"""A layer's projections, applied as `nnx.Linear` or, inside a scanned stack's decode step, to the whole stack.

A scan over stacked layers slices every weight for its iteration, and a slice that feeds a GEMM is copied:
a decode step would copy each projection's weights before reading them. For decode-sized calls on a kernel
backend, `models.deepseek` passes the projections named in `STACKED_PROJECTIONS` whole (their kernels
[L, K, N]) and tells the layer which of them it is (`Stacked`); `project` then reads layer `index` of the
stack in place with `pallas_kernels.stacked_matmul`. A projection whose kernel is 2-D (a layer of its own,
or one the kernel does not serve) is applied as the `nnx.Linear` it is.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import backend
from pallas_kernels.stacked_matmul import MAX_ROWS, stacked_matmul, stacked_matmul_problems

# A decoder layer's projections (module paths inside `models.layer.DecoderLayer`) that may be passed whole.
# Not `wkv_b` (read as [L, H, N+V] by the absorbed einsums) nor the router (fp32, HIGHEST precision).
STACKED_PROJECTIONS = frozenset(
    {
        ("self_attn", "wq"),
        ("self_attn", "wq_a"),
        ("self_attn", "wq_b"),
        ("self_attn", "wkv_a"),
        ("self_attn", "wo"),
        ("mlp", "gate_proj"),
        ("mlp", "up_proj"),
        ("mlp", "down_proj"),
        ("mlp", "shared_experts", "gate_proj"),
        ("mlp", "shared_experts", "up_proj"),
        ("mlp", "shared_experts", "down_proj"),
    }
)


class Stacked(NamedTuple):
    """This layer is layer `index` (an int scalar, may be traced) of a scanned stack whose projections in
    `STACKED_PROJECTIONS` may hold the whole stack's kernels; `impl` ("kernel" | "interpret") runs them."""

    index: jax.Array
    impl: str


def stacked_impl(cache_impl: str | None, rows: int) -> str | None:
    """The implementation whole-stack projections run by in a cached call of `rows` tokens (B·T) whose
    cache runs its kernels by `cache_impl`, or None when the projections stay sliced (the reference
    backend, or more rows than a decode-shaped call)."""
    impl = backend.resolve(cache_impl)
    if impl == "reference" or rows > MAX_ROWS:
        return None
    return impl


def stacked_filter(rows: int):
    """An nnx filter of the projection kernels to pass whole for a call of `rows` tokens: those in
    `STACKED_PROJECTIONS` whose [L, K, N] the kernel serves."""

    def keep(path, value) -> bool:
        if path[-1] != "kernel" or tuple(path[:-1]) not in STACKED_PROJECTIONS:
            return False
        shape = value.shape if hasattr(value, "shape") else value[...].shape
        return len(shape) == 3 and not stacked_matmul_problems(rows, shape[1], shape[2])

    return keep


def project(lin, x: jax.Array, stacked: Stacked | None = None) -> jax.Array:
    """`lin(x)`; with `stacked` and an `nnx.Linear` holding a whole-stack kernel [L, K, N], x · kernel[stacked.index]
    read in place. x [..., K] -> [..., N] in `lin.dtype` (x's and the kernel's promoted dtype when None). Other
    projections (`mla_jax.fp8_weights.Fp8Linear`) are called as they are."""
    if stacked is None or not isinstance(lin, nnx.Linear) or lin.kernel[...].ndim == 2:
        return lin(x)
    kernel = lin.kernel[...]
    dtype = lin.dtype or jnp.result_type(x.dtype, kernel.dtype)
    y = stacked_matmul(x.reshape(-1, x.shape[-1]).astype(dtype), kernel, stacked.index, impl=stacked.impl)
    return y.reshape(x.shape[:-1] + (kernel.shape[-1],))
