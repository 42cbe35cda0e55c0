"""A layer's projections, applied as `nnx.Linear` or, inside a scanned stack's decode step, to the whole stack.

A scan over stacked layers slices every weight for its iteration, and a slice that feeds a GEMM is copied:
a decode step would copy each projection's weights before reading them. For decode-sized calls on a kernel
backend, `models.deepseek` passes the projections named in `STACKED_PROJECTIONS` whole (their kernels
[L, K, N]) and tells the layer which of them it is (`Stacked`); `project` then reads layer `index` of the
stack in place with `pallas_kernels.stacked_matmul`. FP8 projections (`mla_jax.fp8_weights.Fp8Linear`) go the
same way: their e4m3 weights [L, N, K] and scales [L, nb, kb] pass whole and `pallas_kernels.fp8_matvec` reads
the layer's in place. MLA's `wkv_b` (`HEAD_PROJECTIONS`) passes whole too, read per head by
`pallas_kernels.head_matmul.stacked_head_matmul` in the absorbed products. A projection whose weights are
2-D (a layer of its own, or one the kernel does not serve) is applied as the module it is.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.fp8_weights import FP8_BLOCK, Fp8Linear
from pallas_kernels import backend
from pallas_kernels.fp8_matvec import fp8_matvec_problems
from pallas_kernels.stacked_matmul import (
    MAX_ROWS,
    NORM_ROWS,
    Partials,
    RowNorm,
    rms_norm,
    stacked_matmul,
    stacked_matmul_problems,
)

# A decoder layer's projections (module paths inside `models.layer.DecoderLayer`) that may be passed whole.
# Not `wkv_b` (read per head: `HEAD_PROJECTIONS`) nor the router (fp32, HIGHEST precision).
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


# Norms whose weights pass whole ([L, K]) with the projections: `Normed` rows' norm, applied by `stacked_matmul`
# reading its layer's row in place (sliced by the scan, a weight was copied by a kernel launch of its own a layer):
# a layer's input norm, and MLA's query norm between `wq_a` and `wq_b`.
STACKED_NORMS = frozenset({("input_layernorm",), ("self_attn", "q_norm")})

# Projections read per head by the absorbed attention (`MLA.absorb_query`, `MLA.output_from_latent`), passed whole
# as a bf16 / f32 kernel [L, R, H·P] for `pallas_kernels.head_matmul.stacked_head_matmul` (FP8 ones stay sliced).
HEAD_PROJECTIONS = frozenset({("self_attn", "wkv_b")})


class Normed(NamedTuple):
    """Rows with an RMSNorm still to apply: a decode layer's input `x` [..., K] (or `Partials`) and its `norm`
    (`mla_jax.norm.RMSNorm`, whose weight may be a scanned stack's whole [L, K]: then `index` is the layer).
    `project` applies the norm inside `pallas_kernels.stacked_matmul` where the kernel serves the projection (the
    norm's reduction and its normalising pad were two kernel launches a layer), else first (`apply`). `shape`,
    `ndim` and `dtype` are the normalised rows'."""

    x: jax.Array
    norm: nnx.Module
    index: jax.Array | None = None

    def weight(self) -> jax.Array:
        """The norm's weight [K] (layer `index` of its stack when the scan passed it whole, [L, K])."""
        w = self.norm.weight[...]
        return w if w.ndim == 1 else jax.lax.dynamic_index_in_dim(w, self.index, axis=0, keepdims=False)

    def apply(self) -> jax.Array:
        x = self.x.total() if isinstance(self.x, Partials) else self.x
        return rms_norm(x, self.weight(), self.norm.eps)

    @property
    def shape(self):
        return self.x.shape

    @property
    def ndim(self) -> int:
        return self.x.ndim

    @property
    def dtype(self):
        return jnp.result_type(self.norm.weight[...].dtype, self.x.dtype)


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
    """An nnx filter of the projection weights to pass whole for a call of `rows` tokens (and of the norms in
    `STACKED_NORMS`, whose rows, up to `NORM_ROWS`, the projections' kernel normalises): those of the modules in
    `STACKED_PROJECTIONS` whose stack the kernel serves: an `nnx.Linear`'s kernel [L, K, N] (`stacked_matmul`),
    `HEAD_PROJECTIONS`' kernels [L, R, H·P] (`stacked_head_matmul`, their MLA layer falls back to the layer's slice
    where it cannot serve the heads' widths),
    an `Fp8Linear`'s e4m3 weight [L, N, K] and its scales [L, nb, kb] (`fp8_matvec`, whose limits are on the rows
    alone, so a weight and its scales are passed or kept together)."""

    def keep(path, value) -> bool:
        shape = value.shape if hasattr(value, "shape") else value[...].shape
        if tuple(path[:-1]) in STACKED_NORMS:  # read by the projections' kernels (`Normed`)
            return path[-1] == "weight" and len(shape) == 2 and rows <= NORM_ROWS
        if tuple(path[:-1]) in HEAD_PROJECTIONS:  # its widths are checked where it is read (per head)
            return path[-1] == "kernel" and len(shape) == 3 and rows <= MAX_ROWS
        if tuple(path[:-1]) not in STACKED_PROJECTIONS:
            return False
        if len(shape) != 3:
            return False
        if path[-1] == "kernel":
            return not stacked_matmul_problems(rows, shape[1], shape[2])
        if path[-1] == "weight_fp8":
            return not fp8_matvec_problems(rows, shape[1], shape[2])
        if path[-1] == "scale_inv":  # the widths its blocks cover
            return not fp8_matvec_problems(rows, shape[1] * FP8_BLOCK, shape[2] * FP8_BLOCK)
        return False

    return keep


def project(lin, x: jax.Array | Normed | Partials, stacked: Stacked | None = None, *, keep_splits: bool = False):
    """`lin(x)`; with `stacked` and a module holding a whole stack (an `nnx.Linear`'s kernel [L, K, N], an
    `Fp8Linear`'s weight [L, N, K]), x · W[stacked.index] read in place. x [..., K] (or `Normed` rows, whose norm
    the stacked kernel applies, or `Partials`, which it sums as it loads them) -> [..., N] in `lin.dtype` (x's and
    the kernel's promoted dtype when None); ``keep_splits``: the stacked kernel's `Partials` where it has them."""
    kernel = lin.kernel[...] if isinstance(lin, nnx.Linear) else None
    if stacked is None or kernel is None or kernel.ndim == 2:
        if isinstance(x, Normed):
            x = x.apply()
        if isinstance(x, Partials):
            x = x.total()
        if stacked is None or not isinstance(lin, Fp8Linear) or lin.weight_fp8[...].ndim == 2:
            return lin(x)
        return lin(x, layer=stacked.index, impl=stacked.impl)
    return project_many((lin,), x, stacked, keep_splits=keep_splits)[0]  # a whole stack: one stacked_matmul


def project_many(lins, x: jax.Array | Normed | Partials, stacked: Stacked | None = None, *, keep_splits=False) -> tuple:
    """`project` of several projections of the same rows x (MLA's `wq` or `wq_a` beside `wkv_a`) -> a tuple. With
    `stacked` and every module an `nnx.Linear` holding a whole stack [L, K, N] of one L, K and dtype, one
    `stacked_matmul` launch computes them all (the rows and their norm read once, the column tiles one after another:
    a launch a layer fewer than one a projection); else each by `project`. ``keep_splits``: a bool, or one a module."""
    keeps = tuple(keep_splits) if isinstance(keep_splits, (tuple, list)) else (keep_splits,) * len(lins)
    kernels = [lin.kernel[...] if isinstance(lin, nnx.Linear) else None for lin in lins]
    dtypes = {None if k is None else (lin.dtype or jnp.result_type(x.dtype, k.dtype)) for lin, k in zip(lins, kernels)}
    whole = (
        stacked is not None
        and all(k is not None and k.ndim == 3 for k in kernels)
        and len({k.shape[:2] for k in kernels}) == 1
        and len(dtypes) == 1
    )
    if not whole:
        return tuple(project(lin, x, stacked, keep_splits=keep) for lin, keep in zip(lins, keeps, strict=True))
    if isinstance(x, Normed):
        rows, norm = x.x, RowNorm(x.norm.weight[...], x.norm.eps)
    else:
        rows, norm = x, None
    ys = stacked_matmul(
        rows.reshape(-1, x.shape[-1]),
        tuple(kernels),
        stacked.index,
        norm=norm,
        dtype=dtypes.pop(),
        impl=stacked.impl,
        keep_splits=keeps,
    )
    return tuple(y.reshape(x.shape[:-1] + (k.shape[-1],)) for y, k in zip(ys, kernels))
