"""FP8 routed experts (`Fp8Experts`) and their grouped GEMM off the decode kernel, dequantized a chunk at a time.

Dimension letters: as `models.experts` (E experts, D hidden_size, I moe_intermediate_size, M assignment rows sorted
by expert), plus C a chunk of one projection's output columns (of I for gate / up, of D for down).

The decode kernel (`pallas_kernels.moe_decode_fp8`) reads the e4m3 experts in place. Every other grouped GEMM
(`ragged_dot`, the Mosaic GPU `ragged_dot_mgpu`) multiplies bf16 (or f32) weights, so the experts are dequantized
first (the jnp reference recipe: dequantize, then matmul), but never a whole layer (V3: 22.5 GB in bf16) nor a
scanned stack of them: `fp8_grouped` cuts each projection along its OUTPUT columns (gate / up along I, down along
D) into chunks of at most `DEQUANT_BYTES` of dequantized weights, and runs the grouped GEMM over every row for
one chunk at a time (a `lax.fori_loop`), writing the chunk's columns of h [M, I] (then of y [M, D]) in place.

Why output columns and not chunks of experts: each output column of a grouped GEMM is the full contraction of
its row with one column of its expert, so a column chunk computes every product once and each result as the
whole GEMM does (no partial sums), and the GEMM keeps all M rows with all E groups. A chunk of experts would
own a ragged, data-dependent run of the sorted rows; a static-shape GEMM over it must span all M rows (the Mosaic
GPU kernel's grid is cdiv(M, block_m) + G - 1 row tiles, each running its full K loop whatever the groups hold),
so the GEMM's work would grow with the number of chunks. The bytes moved are those of dequantizing the layer whole
(each e4m3 weight read once, written once in bf16 and read once by the GEMM); only the temporaries shrink.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import fp8_weights, initializers
from mla_jax.config import ModelConfig
from pallas_kernels.fp8_gemm import dequantize_blocks as kernel_dequantize_blocks

_F32 = jnp.float32
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DEQUANT_BYTES = 1 << 30  # the dequantized weights one chunk of `fp8_grouped` holds, at most (see `chunk_columns`)


class Fp8Experts(nnx.Module):
    """The E routed experts in FP8 as released (`mla_jax.fp8_weights`): per projection p of gate_proj / up_proj
    [E, I, D] and down_proj [E, D, I] (torch's [out, in] per expert), `p_fp8` (`Fp8Weight`, e4m3) and
    `p_scale_inv` (`Fp8Scale`, fp32 [E, ceil(out/128), ceil(in/128)]). `blocks()` gives them as stored (what the
    decode kernel reads in place and `fp8_grouped` dequantizes a chunk at a time); `stacked(dtype)` dequantizes
    them whole into `models.experts.Experts`' layout (the "dense" oracle's operands)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = initializers.normal(cfg.initializer_range)
        for name, shape in zip(PROJECTIONS, ((E, I, D), (E, I, D), (E, D, I))):
            q, s = fp8_weights.random_blocks(init, rngs.params(), shape)
            setattr(self, name + "_fp8", fp8_weights.Fp8Weight(q))
            setattr(self, name + "_scale_inv", fp8_weights.Fp8Scale(s))

    def blocks(self) -> tuple[jax.Array, ...]:
        """(gate [E, I, D], up [E, I, D], down [E, D, I] e4m3, then their fp32 scales) as stored."""
        return tuple(getattr(self, p + "_fp8")[...] for p in PROJECTIONS) + tuple(
            getattr(self, p + "_scale_inv")[...] for p in PROJECTIONS
        )

    def stacked(self, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate [E, D, I], up [E, D, I], down [E, I, D]) dequantized whole to `dtype`."""
        return dequantize_experts(self.blocks(), dtype)


def dequantize_experts(blocks, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`Fp8Experts.blocks()`-shaped arrays (any leading axes) -> (gate [.., D, I], up [.., D, I], down [.., I, D])
    dequantized whole to `dtype` (`mla_jax.fp8_weights.dequantize_blocks`, transposed to `Experts`' layout)."""
    return tuple(fp8_weights.dequantize_blocks(q, s, dtype).swapaxes(-1, -2) for q, s in zip(blocks[:3], blocks[3:]))


def chunk_columns(n: int, column_bytes: int, budget: int | None = None) -> int:
    """The chunk width of `fp8_grouped` over n output columns whose dequantized weights take `column_bytes` a
    column: the widest divisor of n within `budget` bytes (None: `DEQUANT_BYTES`), a multiple of 128 (the
    weights' scaling block and the GEMM kernels' tile) when n is one; never narrower than 128 columns (or the
    narrowest divisor), even over the budget. V3 (E 256, D 7168, I 2048, bf16): gate and up together 128 columns
    (0.94 GB), down 1 024 (1.07 GB)."""
    budget = DEQUANT_BYTES if budget is None else budget
    unit = fp8_weights.FP8_BLOCK if n % fp8_weights.FP8_BLOCK == 0 else 1
    units = n // unit
    fits = [d for d in range(1, units + 1) if units % d == 0 and d * unit * column_bytes <= budget]
    return unit * max(fits, default=1)


def dequantize_rows(q_ENK, scale, first: jax.Array, E: int, row0: jax.Array, rows: int, dtype) -> jax.Array:
    """Rows [row0, row0 + rows) of experts [first, first + E) of a stack of FP8 weights q [E', N, K] e4m3 with
    scales fp32 [E', ceil(N/128), ceil(K/128)], dequantized -> [E, rows, K] in `dtype`: the values of
    `mla_jax.fp8_weights.dequantize_blocks` (fp32 products q · scale, rounded once), without touching any other
    row. `first` and `row0` may be traced."""
    K = q_ENK.shape[-1]
    q = jax.lax.dynamic_slice(q_ENK, (first, row0, 0), (E, rows, K))
    block_R = (row0 + jnp.arange(rows)) // fp8_weights.FP8_BLOCK
    s = jnp.take(jax.lax.dynamic_slice_in_dim(scale, first, E, axis=0), block_R, axis=1)  # [E, rows, kb]
    return kernel_dequantize_blocks(q, s).astype(dtype)  # a scale of `rows` rows: one scale row per weight row


def fp8_grouped(
    x_MD: jax.Array, blocks, gdot, *, num_experts: int, expert_offset=None, budget: int | None = None
) -> jax.Array:
    """silu(x W_g) * (x W_u) W_d for each row of x [M, D] (rows sorted by expert) with FP8 experts `blocks`
    (`Fp8Experts.blocks()`: gate / up [E', I, D], down [E', D, I] e4m3 + their scales), experts
    [expert_offset, expert_offset + num_experts) of them (a traced layer · E into a whole stack, or None: 0 and
    E' = num_experts). `gdot(lhs [M, K], rhs [E, N, K]) -> [M, N]` is the grouped GEMM over the rows' groups with the
    weights as stored, read transposed (the caller's `ragged_dot` or Mosaic GPU grouped GEMM with its group sizes:
    a transpose of the chunks here, XLA:GPU moved onto the whole FP8 stacks). -> [M, D] in x's dtype; the weights are
    dequantized to x's dtype in column chunks of at most `budget` bytes (`chunk_columns`), so no whole layer of
    dequantized experts exists. Rows past the groups hold what `gdot` gives them there."""
    gate_q, up_q, down_q, gate_s, up_s, down_s = blocks
    M, D = x_MD.shape
    E, I = num_experts, gate_q.shape[1]
    dt = x_MD.dtype
    first = jnp.asarray(0 if expert_offset is None else expert_offset, jnp.int32)
    size = jnp.dtype(dt).itemsize
    ci = chunk_columns(I, 2 * E * D * size, budget)  # gate and up together
    cd = chunk_columns(D, E * I * size, budget)

    def hidden(c, h_MI):
        i0 = c * ci
        g_ECD, u_ECD = (dequantize_rows(q, s, first, E, i0, ci, dt) for q, s in ((gate_q, gate_s), (up_q, up_s)))
        h_MC = jax.nn.silu(gdot(x_MD, g_ECD)) * gdot(x_MD, u_ECD)
        return jax.lax.dynamic_update_slice_in_dim(h_MI, h_MC.astype(dt), i0, axis=1)

    h_MI = jax.lax.fori_loop(0, I // ci, hidden, jnp.zeros((M, I), dt))

    def out(c, y_MD):
        d0 = c * cd
        w_ECI = dequantize_rows(down_q, down_s, first, E, d0, cd, dt)
        return jax.lax.dynamic_update_slice_in_dim(y_MD, gdot(h_MI, w_ECI).astype(dt), d0, axis=1)

    return jax.lax.fori_loop(0, D // cd, out, jnp.zeros((M, D), dt))
