"""A decode step's way into its MoE layer in one kernel: the attention's residual add, the post-attention RMSNorm
and the router's fp32 logits (Pallas, Triton backend).

Dimension letters: T tokens, D hidden width, E routed experts, L layers of a scanned stack, S split-K partials.

Between a decode layer's attention and its routing XLA ran four small kernels a layer: the residual add with the
norm's sum of squares, the norm, and the router's fp32 matvec as a product and a reduction (XLA makes no GEMM of
one row; of more it copies the layer's router out of the stack first). `moe_gate` is one launch over E / `block_e`
programs. Each loads the T rows of the residual and of the attention's output (or its split-K `Partials`, summed
as they are loaded: `wo`'s kernel hands them on unsummed), a row a load, takes each row's sum of squares over D,
then walks D again a chunk at a time: normalises the chunk, and adds its products with its `block_e` columns of
the router into the logits, in fp32 (a product and a sum: fp32 products, no tensor-core rounding). The first
program also writes the chunk of h (the residual after the add) and of y (the normalised rows, the experts'
input). The norm's weight and the router may be a scanned stack's ([L, D], [L, D, E]), read at `layer` in place.

The arithmetic is the model's (`moe_gate_reference`): a = the attention rows in x's dtype (partials summed in fp32
first); h = x + a in x's dtype; y = `rms_norm`(h, weight) in `dtype`; logits = y (as fp32) · router, fp32.
The logits equal an fp32 dot's up to the order of the sum over D.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend
from pallas_kernels.stacked_matmul import Partials, rms_norm

# The rows (T) a call serves, each a load of its own that every program repeats: a B = 1 decode step's row or a
# verify step's few. On an H100 (2026-12-07) the kernel took 9.5 µs a layer at one row but 99.5 at 32, where XLA's
# add, norm and router product take ~11: 2.1 ms a V2-Lite step at B = 32.
MAX_ROWS = 4
BLOCK_E = 4  # router columns a program computes (fewer experts: all of them); 16 measured slower (see PERFORMANCE)
PRODUCT = 4096  # elements of a program's chunk product [block_d, block_e]: block_d = PRODUCT / block_e up to 8 rows
_F32 = jnp.float32


def _blocks(T: int, D: int, E: int) -> tuple[int, int]:
    """(block_d, block_e): the chunk narrows past 8 rows, whose chunks a program holds at once."""
    block_e = min(BLOCK_E, E)
    tiles = 1 << max(0, (T + 7) // 8 - 1).bit_length()  # eight rows a tile, to a power of two
    return min(D, PRODUCT // block_e // tiles), block_e


def moe_gate_problems(T: int, D: int, E: int) -> list[str]:
    """Why `moe_gate`'s kernel cannot serve T rows of width D into E experts (empty when it can)."""
    block_d, block_e = _blocks(T, D, E)
    out = []
    if not 1 <= T <= MAX_ROWS:
        out.append(f"T = {T} rows: the kernel loads 1 to {MAX_ROWS} rows, a load each")
    if E % block_e:
        out.append(f"E = {E} experts is not a multiple of the {block_e} columns a program computes")
    if D % block_d:
        out.append(f"D = {D} is not a multiple of the {block_d}-wide chunks the kernel walks")
    return out


def _layer_of(a, layer, ndim: int):
    """`a` itself, or row `layer` of a stack with one more axis than `ndim`."""
    return a if a.ndim == ndim else a[layer]


def moe_gate_reference(x_TD, attn, norm_weight, router, layer=None, *, eps: float, dtype=None):
    """`moe_gate` in plain jnp -> (h [T, D] x's dtype, y [T, D] `dtype`, logits fp32 [T, E])."""
    a = attn.total() if isinstance(attn, Partials) else attn
    h = x_TD + a.reshape(x_TD.shape).astype(x_TD.dtype)
    y = rms_norm(h, _layer_of(norm_weight, layer, 1), eps).astype(dtype or x_TD.dtype)
    r = _layer_of(router, layer, 2).astype(_F32)
    return h, y, jnp.dot(y.astype(_F32), r, precision=lax.Precision.HIGHEST)


def _kernel(layer_ref, x_ref, a_ref, w_ref, r_ref, h_ref, y_ref, l_ref, *, T, D, S, eps, block_d, block_e):
    """Refs: the layer [1]; x [T, D]; the attention rows [T', D] (S = 0) or partials [S, T', D], T' >= T; the norm's
    weight [D] or [L, D]; the router [D, E] or [L, D, E] fp32; out h, y [T, D] and the logits [T, E]."""
    j = pl.program_id(0)
    layer = layer_ref[0]
    weighted = jnp.result_type(w_ref.dtype, x_ref.dtype)
    cols = pl.ds(pl.multiple_of(j * block_e, block_e), block_e)

    def rows_h(k):
        d = pl.ds(pl.multiple_of(k * block_d, block_d), block_d)
        hs = []
        for t in map(jnp.int32, range(T)):  # (static indices as int32 scalars: a Python int is not an index here)
            if S:
                a = plt.load(a_ref.at[jnp.int32(0), t, d])
                for s in range(1, S):
                    a = a + plt.load(a_ref.at[jnp.int32(s), t, d])
            else:
                a = plt.load(a_ref.at[t, d])
            a = a.astype(x_ref.dtype).astype(_F32)
            hs.append((plt.load(x_ref.at[t, d]).astype(_F32) + a).astype(x_ref.dtype))
        return d, hs

    def squares(k, acc):
        return tuple(s + jnp.sum(jnp.square(h.astype(_F32))) for s, h in zip(acc, rows_h(k)[1]))

    sums = lax.fori_loop(0, D // block_d, squares, (jnp.float32(0.0),) * T)
    scales = [lax.rsqrt(s / D + eps) for s in sums]

    def chunk(k, accs):
        d, hs = rows_h(k)
        w = plt.load(w_ref.at[d] if len(w_ref.shape) == 1 else w_ref.at[layer, d]).astype(_F32)
        r = plt.load(r_ref.at[d, cols] if len(r_ref.shape) == 2 else r_ref.at[layer, d, cols])  # [block_d, block_e]
        ys = [  # `rms_norm`'s: the normalised row in x's dtype, times the weight in their promoted dtype
            (w * (h.astype(_F32) * c).astype(x_ref.dtype).astype(_F32)).astype(weighted).astype(y_ref.dtype)
            for h, c in zip(hs, scales)
        ]

        @pl.when(j == 0)
        def _():
            for t in range(T):
                plt.store(h_ref.at[jnp.int32(t), d], hs[t])
                plt.store(y_ref.at[jnp.int32(t), d], ys[t])

        return tuple(acc + jnp.sum(y.astype(_F32)[:, None] * r, axis=0) for acc, y in zip(accs, ys))

    logits = lax.fori_loop(0, D // block_d, chunk, (jnp.zeros((block_e,), _F32),) * T)
    for t in range(T):
        plt.store(l_ref.at[jnp.int32(t), cols], logits[t])


def moe_gate(x_TD, attn, norm_weight, router, layer=None, *, eps: float, dtype=None, impl: str | None = "auto"):
    """The residual add, the post-attention RMSNorm and the router's logits of T decode rows, in one kernel.

    Args:
      x_TD: [T, D] the residual stream (bf16 or f32).
      attn: [T, D] the attention's output, or its split-K `Partials` (of [T, D] rows), added in x's dtype.
      norm_weight: [D] the RMSNorm's weight, or a scanned stack's [L, D] (then `layer` picks the row, in place).
      router: [D, E] fp32 router kernel (x · router = logits), or a stack's [L, D, E].
      layer: int scalar (may be traced), with stacks.
      eps: the RMSNorm's epsilon.
      dtype: y's dtype (the experts' input; None: x's).
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU where `moe_gate_problems`
        is empty, else `moe_gate_reference`).
    Returns (h [T, D] in x's dtype: x + attn; y [T, D] in `dtype`: `rms_norm`(h, weight); logits fp32 [T, E]).
    """
    T, D = x_TD.shape
    E = router.shape[-1]
    parts = isinstance(attn, Partials)
    rows = attn.parts if parts else attn
    if rows.shape[-1] != D or (rows.ndim != 3 or rows.shape[1] < T if parts else rows.size != T * D):
        want = f"Partials [S, >= T={T}, D={D}]" if parts else f"[T={T}, D={D}] (any leading axes)"
        raise ValueError(f"moe_gate: the attention rows must be {want}, got {tuple(rows.shape)}")
    if norm_weight.shape[-1] != D or router.shape[-2] != D or norm_weight.ndim - 1 != router.ndim - 2:
        raise ValueError(
            f"moe_gate: norm weight [D={D}] and router [D={D}, E] (or stacks of both) expected, got "
            f"{tuple(norm_weight.shape)} and {tuple(router.shape)}"
        )
    stacked = norm_weight.ndim == 2
    if stacked and layer is None:
        raise ValueError("moe_gate: stacked weights need `layer`, got None")
    impl = backend.choose(impl, moe_gate_problems(T, D, E), name="moe_gate impl")
    dtype = jnp.dtype(dtype or x_TD.dtype)
    if impl == "reference":
        return moe_gate_reference(x_TD, attn, norm_weight, router, layer, eps=eps, dtype=dtype)
    block_d, block_e = _blocks(T, D, E)
    S = rows.shape[0] if parts else 0
    a = rows if parts else rows.reshape(T, D)
    layer = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    return pl.pallas_call(
        functools.partial(_kernel, T=T, D=D, S=S, eps=eps, block_d=block_d, block_e=block_e),
        out_shape=(
            jax.ShapeDtypeStruct((T, D), x_TD.dtype),
            jax.ShapeDtypeStruct((T, D), dtype),
            jax.ShapeDtypeStruct((T, E), _F32),
        ),
        grid=(E // block_e,),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=impl == "interpret",
        name="moe_gate",
    )(layer, x_TD, a, norm_weight, router.astype(_F32))
