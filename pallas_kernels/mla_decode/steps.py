"""The per-page steps every `mla_decode` body shares: row limits (masking), the online softmax in the exp2
domain, P·V accumulation, the zeroing of a partial last page's V rows, and the running (acc, m, l) carry."""

from __future__ import annotations

import math

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mla_decode.config import LATENT_DIM, PAGE_SIZE, ROWS

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Running max starts finite so that a row whose keys are all masked in a page gives
# exp2(-inf - m) = 0 rather than exp2(-inf + inf) = NaN.
_M_INIT = -1e30
# bf16 tiles as wgmma wants them: 8x64 tiles, 128-byte swizzle. Also splits the 576-wide rows
# into <=256-element TMA boxes.
_BF16_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _row_limits(seq_len, g, *, heads: int, s_q: int, causal: bool, shape=(ROWS, PAGE_SIZE)):
    """int32 ``shape`` (rows, keys) in the WGMMA layout: exclusive key bound of each query row of
    block g, broadcast along the keys."""
    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    if not causal:
        return jnp.full_like(row, 0) + seq_len
    # Row r of block g is query token j = (g*64 + r) // H; H is a power of two. Padding rows
    # (j >= s_q) get the full length, so they never go empty.
    j = lax.shift_right_logical(row + g * ROWS, int(math.log2(heads)))
    return jnp.minimum(seq_len - s_q + 1 + j, seq_len)


def _online_softmax(sc, acc, m, l, page_start, limit):
    """One page of the online softmax (exp2 domain), for a body whose warpgroup scored all 64 keys:
    scores sc [64 rows, 64 keys] (already times scale·log2 e) masked to keys < `limit` (per row, from
    `_row_limits`), then (P in bf16, acc rescaled, new running max, new running sum)."""
    key = page_start + plgpu.broadcasted_iota(jnp.int32, (ROWS, PAGE_SIZE), 1, layout=plgpu.Layout.WGMMA)
    sc = jnp.where(key < limit, sc, -jnp.inf)
    m_new = jnp.maximum(m, sc.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
    l = l * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p.astype(jnp.bfloat16), acc, m_new, l


def _pv_accumulate(acc, p16, v, p_ref=None):
    """acc + P·V on the tensor cores: P (64 x 64 bf16) in registers, V an SMEM ref [64, cols], acc fp32
    [64, cols] in registers. With `p_ref` (an SMEM [64, 64] bf16 tile: `MlaDecodeConfig.interpretable`)
    P is staged there first, since the interpreter cannot take the wgmma A operand from registers."""
    if p_ref is not None:
        p_ref[...] = p16
        plgpu.commit_smem()
        return _pv_product(acc, p_ref, v, interpretable=True)
    return _pv_product(acc, p16, v, interpretable=False)


def _zero_v_tail(kv, valid, start, ncols):
    """Zero rows >= ``valid`` of columns [start, start + ncols) of a page in SMEM (the tail of a
    sequence's last page is unwritten cache, maybe NaN, and 0 x NaN = NaN in P·V). Only on a
    partial page; ends with `plgpu.commit_smem` so the tensor cores see it."""
    wgmma_layout = plgpu.Layout.WGMMA

    @pl.when(valid < PAGE_SIZE)
    def _():
        tok = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, 64), 0, layout=wgmma_layout)
        for k in range(ncols // 64):
            chunk = kv.at[:, pl.ds(start + k * 64, 64)]
            x = plgpu.load(chunk, layout=wgmma_layout)
            chunk[...] = jnp.where(tok < valid, x, jnp.zeros_like(x))
        plgpu.commit_smem()


def _pv_product(acc, p, v, interpretable):
    """acc + P·V on the tensor cores, waited for: P (64 x 64 bf16) in registers or an SMEM wgmma tile,
    V an SMEM ref [64, cols], acc fp32 [64, cols] in registers. ``interpretable``: accumulate through
    `run_scoped` (the interpreter runs no `run_state` accumulator; P must then be in SMEM)."""
    if interpretable:

        def pv_scoped(acc_ref):
            plgpu.wgmma(acc_ref, p, v)
            return acc_ref[...]

        return acc + pl.run_scoped(pv_scoped, plgpu.ACC(acc.shape, jnp.float32))

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v)

    return pl.run_state(pv)(plgpu.ACC.init(acc))


def _kernel_refs(refs, num_inputs, planned):
    """A main kernel's refs: (its inputs, the device plan's refs (a `PieceSchedule`'s
    `kernel_refs`) or None, (o, lse))."""
    ins, rest = refs[:num_inputs], refs[num_inputs:]
    return ins, (rest[:-2] if planned else None), rest[-2:]


def _init_carry():
    """Online-softmax state of one compute warpgroup: (acc [64, 256], m [64], l [64]) f32."""
    return (
        plgpu.layout_cast(jnp.zeros((ROWS, LATENT_DIM // 2), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )


def _normalise(acc, m, l):
    """(o = acc / l, lse in log2). l == 0 only for rows that saw no key (an empty split or piece,
    or a query before every key): o = 0 and lse = -inf."""
    l_safe = jnp.where(l == 0.0, 1.0, l)
    return acc / lax.broadcast_in_dim(l_safe, acc.shape, [0]), m + jnp.log2(l)
