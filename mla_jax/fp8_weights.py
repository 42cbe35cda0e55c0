"""FP8 linear weights as DeepSeek-V3/R1 release them: e4m3 values with one fp32 scale per 128x128 block.

Dimension letters: M rows of activations (tokens), K a projection's input width, N its output width,
E routed experts; nb = ceil(N/128), kb = ceil(K/128) blocks.

The format (`quantization_config` of the release: `quant_method "fp8"`, `fmt "e4m3"`,
`weight_block_size [128, 128]`): a weight is kept in torch's layout, w [N, K] (K contiguous, what Hopper's
FP8 tensor-core instructions read), as `float8_e4m3fn` values q, with `scale_inv` float32 [nb, kb]:

    W[n, k] = q[n, k] * scale_inv[n // 128, k // 128]

Edge blocks are partial (a width that is not a multiple of 128 gets ceil blocks, the last one covering the
remainder), as in the release. Stacked weights (the routed experts, [E, N, K] with scales [E, nb, kb]) carry
the leading axes through every function here.

What is quantized (the release's choice, mirrored by `models.checkpoint`): every projection of the decoder
layers and of the MTP block: the attention's `wq` | `wq_a`, `wq_b`, `wkv_a`, `wkv_b`, `wo`; the dense MLP's
and the shared experts' `gate_proj` / `up_proj` / `down_proj`; the routed experts. Embeddings, norms, the
router gate and its bias, the LM head and the MTP `eh_proj` stay as released (dense, in `param_dtype`).

The one computation (`fp8_linear`, what `Fp8Linear` and every FP8 projection call): y = x · Wᵀ. Its jnp
reference (`fp8_linear_reference`) is the DeepSeek-V3 inference code's `gemm_impl="bf16"` recipe: the weight
blocks dequantized to the compute dtype (fp32 products q · scale, rounded once), then the same dot as a dense
`nnx.Linear` (on a GPU, bf16 operands accumulate in fp32). Activations are NOT quantized there: the 1x128
activation tiles of the recipe's `gemm_impl="fp8"` belong to the FP8 GEMM kernel, whose error budget is its
own. `impl` (`pallas_kernels.backend.IMPLS`) is resolved in one place, `resolve_fp8_gemm_impl`, which asks
the kernel that would run: `pallas_kernels.fp8_matvec` for decode-shaped calls (at most `MATVEC_ROWS` rows, or
a layer of a stack read in place), `pallas_kernels.fp8_gemm.fp8_matmul` above (Mosaic GPU, the recipe's 1x128
activation tiles; bf16 compute only), the reference where neither serves.

`wkv_b` is kept in FP8 like the others and dequantized where MLA uses it as a whole matrix (the decompressed
attention reads `MLA.wkv_b_LHK()`, as the reference `MLA.forward` does with `weight_dequant`; the absorbed W_UK /
W_UV einsums each dequantize only their half, in the stored layout: `dequantize_group_rows`).

FP8 variables are `Fp8Weight` / `Fp8Scale` (`nnx.Variable`s, not `nnx.Param`): an FP8 model serves; it
does not train.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import initializers
from pallas_kernels import backend
from pallas_kernels.fp8_gemm import dequantize_blocks as kernel_dequantize_blocks
from pallas_kernels.fp8_gemm import fp8_matmul, fp8_matmul_problems
from pallas_kernels.fp8_gemm.config import FP8_MAX, QUANT_BLOCK
from pallas_kernels.fp8_matvec import MAX_ROWS as MATVEC_ROWS
from pallas_kernels.fp8_matvec import fp8_matvec, fp8_matvec_problems

FP8_BLOCK = QUANT_BLOCK  # the release's weight_block_size, both dims (the FP8 GEMM's scaling block)
FP8_DTYPE = jnp.float8_e4m3fn
WEIGHT_FORMATS = (None, "fp8")  # `weights=` of the model and the loader: None = dense in param_dtype
FP8_GEMM_IMPLS = backend.IMPLS
_F32 = jnp.float32


def check_weights(weights) -> None:
    """ValueError (one line) unless `weights` is one of `WEIGHT_FORMATS`."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be None (dense, in param_dtype) or 'fp8', got {weights!r}")


def scale_shape(n: int, k: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    """(ceil(n / block), ceil(k / block)): the scales of an [n, k] weight."""
    return -(-n // block), -(-k // block)


# ------------------------------------------------------------------------------------------
# Quantize / dequantize (jnp)
# ------------------------------------------------------------------------------------------
def _check_pair(q_NK, scale, block: int) -> None:
    if q_NK.ndim < 2 or scale.ndim != q_NK.ndim:
        raise ValueError(
            f"fp8 blocks: a weight [..., N, K] and scales [..., nb, kb] of its rank, got {q_NK.shape} and {scale.shape}"
        )
    want = q_NK.shape[:-2] + scale_shape(*q_NK.shape[-2:], block)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"fp8 blocks: scales {tuple(scale.shape)} do not match weight {tuple(q_NK.shape)} in {block}x{block} "
            f"blocks (expected {want})"
        )


def quantize_blocks(w_NK: jax.Array, block: int = FP8_BLOCK) -> tuple[jax.Array, jax.Array]:
    """float [..., N, K] -> (e4m3 [..., N, K], fp32 scale_inv [..., nb, kb]) with W ≈ q · scale per block.

    scale = max(amax of the block, 1e-12) / 448 (the release's convention), q = w / scale rounded to
    nearest e4m3. Partial edge blocks take the amax of the values they hold.
    """
    if w_NK.ndim < 2:
        raise ValueError(f"quantize_blocks needs a weight [..., N, K], got shape {w_NK.shape}")
    *lead, n, k = w_NK.shape
    nb, kb = scale_shape(n, k, block)
    w = jnp.asarray(w_NK, _F32)
    pad = [(0, 0)] * len(lead) + [(0, nb * block - n), (0, kb * block - k)]
    blocks = jnp.pad(w, pad).reshape(*lead, nb, block, kb, block)
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(-3, -1)), 1e-12) / FP8_MAX  # [..., nb, kb]
    q = jnp.clip(blocks / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k]
    return q, scale.astype(_F32)


def random_blocks(init, key: jax.Array, shape) -> tuple[jax.Array, jax.Array]:
    """A random FP8 weight [..., N, K]: `quantize_blocks(init(key, shape, float32))` (`init` an nnx initializer)
    for at most `initializers.MAX_BUCKETED` elements. A larger weight is drawn and quantized in one jitted program a
    slab of whole 128-row blocks (whole matrices when N is not a multiple of 128) at a time
    (`initializers.fill_slabs`: slab i drawn by `init` from `fold_in(key, i)`), so its float32 values never exist
    whole (a V3 layer's routed experts: 45 GB)."""
    shape = tuple(int(d) for d in shape)
    if math.prod(shape) <= initializers.MAX_BUCKETED:
        return quantize_blocks(init(key, shape, _F32))
    return _random_blocks_in_slabs(key, init=init, shape=shape)


@functools.partial(jax.jit, static_argnames=("init", "shape"))
def _random_blocks_in_slabs(key: jax.Array, *, init, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    *lead, n, k = shape
    unit = FP8_BLOCK if n % FP8_BLOCK == 0 else n  # rows a slab takes together: no scaling block is cut
    units = math.prod(lead) * n // unit
    per = initializers.largest_divisor(units, initializers.MAX_BUCKETED // (unit * k))
    sds = jax.ShapeDtypeStruct
    out = (sds((units, unit, k), FP8_DTYPE), sds((units, *scale_shape(unit, k)), _F32))
    q, s = initializers.fill_slabs(key, out, per, lambda kk: quantize_blocks(init(kk, (per, unit, k), _F32)))
    return q.reshape(shape), s.reshape(*lead, *scale_shape(n, k))


def dequantize_blocks(q_NK: jax.Array, scale: jax.Array, dtype=_F32) -> jax.Array:
    """e4m3 [..., N, K] · fp32 scale_inv [..., nb, kb] -> [..., N, K] in `dtype` (fp32 products, rounded once;
    `pallas_kernels.fp8_gemm.dequantize_blocks`, the FP8 GEMM's own).

    ValueError (one line) when the scales' shape is not the weight's in FP8_BLOCK x FP8_BLOCK blocks."""
    _check_pair(q_NK, scale, FP8_BLOCK)
    return kernel_dequantize_blocks(q_NK, scale).astype(dtype)


# ------------------------------------------------------------------------------------------
# The one FP8 matmul: which implementation, and the jnp reference
# ------------------------------------------------------------------------------------------
def fp8_gemm_problems(m: int, n: int, k: int, *, dtype=jnp.bfloat16, stacked: bool = False) -> list[str]:
    """Why the Pallas kernel for an [m, k] x [n, k]ᵀ product in compute `dtype` cannot serve it ([] when it can).

    The kernel is `pallas_kernels.fp8_matvec` for m <= `MATVEC_ROWS` and for a weight `stacked` (a layer of a
    stack, read in place: only it does that), else `pallas_kernels.fp8_gemm.fp8_matmul`, which quantizes the
    activations to e4m3 (DeepSeek-V3's bf16 recipe) and so serves bf16 compute only."""
    if stacked or m <= MATVEC_ROWS:
        return fp8_matvec_problems(m, n, k)
    out = fp8_matmul_problems(m, n, k)
    if jnp.dtype(dtype) != jnp.bfloat16:
        out.append(f"compute dtype {jnp.dtype(dtype).name}: fp8_matmul quantizes the activations (a bf16 recipe)")
    return out


def resolve_fp8_gemm_impl(
    impl: str | None, m: int, n: int, k: int, *, dtype=jnp.bfloat16, stacked: bool = False
) -> str:
    """`impl` of `FP8_GEMM_IMPLS` -> "kernel" | "interpret" | "reference" for an [m, k] x [n, k]ᵀ product:
    `pallas_kernels.backend.choose` over `fp8_gemm_problems` ("auto": the kernel on a Hopper GPU where it
    serves, else the reference; "kernel" / "interpret" that it cannot serve: ValueError naming why)."""
    return backend.choose(impl, fp8_gemm_problems(m, n, k, dtype=dtype, stacked=stacked), name="fp8_gemm_impl")


def fp8_linear_reference(x_MK: jax.Array, w_NK: jax.Array, scale: jax.Array, *, dtype) -> jax.Array:
    """x [..., K] · dequantize(w [N, K], scale)ᵀ -> [..., N] in `dtype`: the weight dequantized to `dtype`,
    then a dense `nnx.Linear`'s dot (activations not quantized)."""
    w = dequantize_blocks(w_NK, scale, dtype)
    x = jnp.asarray(x_MK, dtype)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def fp8_linear(
    x: jax.Array, w_NK: jax.Array, scale: jax.Array, *, dtype, impl: str | None = "auto", layer=None
) -> jax.Array:
    """y = x · Wᵀ for an FP8 block-scaled W: x [..., K] (any float), w [N, K] e4m3, scale fp32 [nb, kb] ->
    [..., N] in `dtype`. Every FP8 projection of the model computes through here.

    With `layer` (an int scalar, may be traced), w is a scanned stack [L, N, K] with scales [L, nb, kb] and
    layer `layer` is used, read in place by the kernel (the reference takes the slice).

    `impl` (`FP8_GEMM_IMPLS`) is resolved by `resolve_fp8_gemm_impl`; "reference" is `fp8_linear_reference`.
    ValueError (one line) for a weight that is not e4m3, or scales that do not match it."""
    stacked = layer is not None
    form = "a stack [L, N, K] (a layer was given)" if stacked else "[N, K]"
    if w_NK.ndim != 2 + stacked or w_NK.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_linear: the weight must be float8_e4m3fn {form}, got {w_NK.dtype} {w_NK.shape}")
    if x.shape[-1] != w_NK.shape[-1]:
        raise ValueError(f"fp8_linear: x [..., {x.shape[-1]}] does not match the weight [..., N, K] = {w_NK.shape}")
    _check_pair(w_NK, scale, FP8_BLOCK)
    n, k = w_NK.shape[-2:]
    m = math.prod(x.shape[:-1])
    resolved = resolve_fp8_gemm_impl(impl, m, n, k, dtype=dtype, stacked=stacked)
    if resolved == "reference":
        if stacked:
            w_NK, scale = (jax.lax.dynamic_index_in_dim(a, layer, axis=0, keepdims=False) for a in (w_NK, scale))
        return fp8_linear_reference(x, w_NK, scale, dtype=dtype)
    x_MK = x.reshape(m, k)
    if stacked or m <= MATVEC_ROWS:
        rows_dtype = dtype if jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(_F32)) else jnp.bfloat16
        y_MN = fp8_matvec(x_MK.astype(rows_dtype), w_NK, scale, layer, impl=resolved)
    else:
        y_MN = fp8_matmul(x_MK.astype(jnp.bfloat16), w_NK, scale, impl=resolved)
    return y_MN.reshape(x.shape[:-1] + (n,)).astype(dtype)


# ------------------------------------------------------------------------------------------
# The model's FP8 variables and projection
# ------------------------------------------------------------------------------------------
class Fp8Weight(nnx.Variable):
    """The e4m3 values of a block-scaled weight, [N, K] (stacked: [E, N, K]), in the release's layout."""


class Fp8Scale(nnx.Variable):
    """The fp32 `weight_scale_inv` of an `Fp8Weight`, [nb, kb] (stacked: [E, nb, kb])."""


class Fp8Linear(nnx.Module):
    """A bias-free projection [..., K] -> [..., N] with an FP8 weight: `weight_fp8` (`Fp8Weight` [N, K]) and
    `scale_inv` (`Fp8Scale` [nb, kb]). Built from a random dense init quantized by `random_blocks` (a loader
    overwrites both). `dtype`: the compute and output dtype; `impl`: `fp8_linear`'s."""

    def __init__(
        self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=_F32, kernel_init=None, impl="auto"
    ):
        init = kernel_init or nnx.initializers.lecun_normal()
        q, s = random_blocks(init, rngs.params(), (out_features, in_features))
        self.weight_fp8 = Fp8Weight(q)
        self.scale_inv = Fp8Scale(s)
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        self.impl = impl

    def dense_kernel(self, dtype=None) -> jax.Array:
        """The dequantized weight as a dense kernel [K, N] (nnx.Linear's layout) in `dtype` (default: the
        compute dtype)."""
        return dequantize_blocks(self.weight_fp8[...], self.scale_inv[...], dtype or self.dtype).T

    def __call__(self, x: jax.Array, *, layer=None, impl: str | None = None) -> jax.Array:
        """x [..., K] -> [..., N]. `layer`: the variables hold a scanned stack's [L, ...] and this is its layer
        `layer` (`mla_jax.linear.project`); `impl` overrides the module's."""
        w, s = self.weight_fp8[...], self.scale_inv[...]
        return fp8_linear(x, w, s, dtype=self.dtype, impl=impl or self.impl, layer=layer)


def linear(in_features: int, out_features: int, *, weights, rngs, dtype, param_dtype, kernel_init):
    """The projection layer of a `weights` format (`WEIGHT_FORMATS`): a bias-free `nnx.Linear` (kernel
    [in, out] in `param_dtype`) for None, an `Fp8Linear` for "fp8"."""
    check_weights(weights)
    if weights == "fp8":
        return Fp8Linear(in_features, out_features, rngs=rngs, dtype=dtype, kernel_init=kernel_init)
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=False,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=kernel_init,
        rngs=rngs,
    )


def dequantize_group_rows(layer: Fp8Linear, groups: int, lo: int, hi: int) -> jax.Array:
    """Rows [lo, hi) of each of `groups` equal groups of an `Fp8Linear`'s output rows, dequantized to its compute
    dtype in the stored layout -> [groups, hi - lo, in]: row g·n + r of w times its block's scale, r in [lo, hi)
    (n = out / groups). The same values as `Fp8Linear.dense_kernel()` reshaped [in, groups, n] and sliced, without
    its transpose and without the rows a caller does not read (MLA's W_UK / W_UV: half of `wkv_b` each)."""
    w, scale = layer.weight_fp8[...], layer.scale_inv[...]
    O, I = w.shape
    if O % groups or not 0 <= lo < hi <= O // groups:
        raise ValueError(f"rows [{lo}, {hi}) of {groups} groups do not fit the {O} output rows")
    n = O // groups
    s = jnp.repeat(scale.astype(_F32), QUANT_BLOCK, axis=0)[:O].reshape(groups, n, -1)[:, lo:hi]  # [g, hi-lo, ib]
    s = jnp.repeat(s, QUANT_BLOCK, axis=-1)[..., :I]
    return (w.reshape(groups, n, I)[:, lo:hi].astype(_F32) * s).astype(layer.dtype)


def dense_kernel(layer) -> jax.Array:
    """A projection's weight as a dense kernel [in, out]: an `nnx.Linear`'s kernel as stored, an
    `Fp8Linear`'s dequantized to its compute dtype."""
    return layer.dense_kernel() if isinstance(layer, Fp8Linear) else layer.kernel[...]
