"""The split combine of `mla_decode`: a small Mosaic GPU kernel that merges the fp32 partial outputs of a
sequence's KV splits (or its pieces) by their log-sum-exp."""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mla_decode.config import LATENT_DIM, ROWS, MlaDecodeConfig
from pallas_kernels.mla_decode.steps import _LN2, _M_INIT


def _combine(
    o_part, lse_part, *, out_dtype, config: MlaDecodeConfig, interpret, pieces=None, transposed=False, rows_out=None
):
    """Split combine: o [B, S, Rp, 512] f32 and lse [B, S, Rp] (log2) -> out [B, Rp, 512], lse (ln).

    ``rows_out`` (R, a multiple of 8 below Rp = 64: the query rows that are real when fewer than a block): out is
    [B, R, 512], the block's first R rows written through SMEM by TMA (a slice of the padded output was a kernel
    launch of its own); lse stays [B, Rp].

    With ``pieces`` = (piece_start [B], num_pieces [B]) int32 (the pieces schedule): o [NS,
    Rp, 512] and lse [NS, Rp] by piece slot, sequence b's pieces in slots [piece_start[b],
    piece_start[b] + num_pieces[b]) (none for an empty sequence: out = 0, lse = -inf).

    With ``transposed`` (the fp8 transposed body's partials, R <= 32 query rows): o [..., 512, R] in, out [B,
    512, R] out (lse as above, R rows), each block a [combine_block_cols, R] tile, so the R rows are merged as
    they are instead of padded to 64.

    One CTA per (64 rows, combine_block_cols columns, sequence) streams the S partial tiles through
    SMEM and keeps an online log-sum-exp, so no split count limits it. Empty splits carry
    lse = -inf and o = 0, so they weigh exp2(-inf) = 0.
    """
    if pieces is None:
        B, S = o_part.shape[:2]
    else:
        B = pieces[0].shape[0]
    Rp = lse_part.shape[-1]
    rows = Rp if transposed else ROWS  # query rows a CTA merges
    G = Rp // rows
    cb = config.combine_block_cols
    C = LATENT_DIM // cb
    wgmma_layout = plgpu.Layout.WGMMA
    # The query rows run along the tile's rows, or (transposed) along its columns.
    row_layout = plgpu.Layout.WGMMA.reduce(0 if transposed else 1)
    tile, along = ((cb, rows), 1) if transposed else ((rows, cb), 0)
    if rows_out is not None and (transposed or G != 1 or rows_out % 8 or not 0 < rows_out < rows):
        raise ValueError(f"combine: rows_out = {rows_out} must be a multiple of 8 below one block of {rows} rows")
    out_shape = (B, LATENT_DIM, Rp) if transposed else (B, rows_out or Rp, LATENT_DIM)
    scratch = [] if rows_out is None else [plgpu.SMEM((rows, cb), out_dtype)]
    # A TMA copy into SMEM must start on 128 bytes, and the pipeline's second slot of an lse block starts one block
    # after the first: a block of 16 f32 (the transposed body at R = 16) put it on 64 and the GPU faulted with a
    # misaligned address. So the lse partials' rows are padded to 32 (a few KB in XLA) and the block sliced in SMEM.
    lse_cols = -(-rows // 32) * 32
    if lse_cols != rows:
        lse_part = jnp.pad(lse_part, [(0, 0)] * (lse_part.ndim - 1) + [(0, lse_cols - rows)])
    for block in (tile, (lse_cols,)):  # (the interpreter does not check TMA alignment: this does, on any host)
        if math.prod(block) * 4 % 128:
            raise ValueError(f"combine: an f32 block {block} is not a multiple of 128 bytes (its TMA slots misalign)")

    @functools.partial(
        plgpu.kernel,
        out_type=(jax.ShapeDtypeStruct(out_shape, out_dtype), jax.ShapeDtypeStruct((B, Rp), jnp.float32)),
        scratch_types=scratch,
        grid=(C, G, B),
        grid_names=("c", "g", "b"),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    def mla_decode_combine(*refs):
        c, g, b = lax.axis_index("c"), lax.axis_index("g"), lax.axis_index("b")

        def o_block(lead):
            """The block of a partial (``lead``: its leading indices) at this CTA's rows and columns."""
            return (*lead, c, 0) if transposed else (*lead, g, c)

        if rows_out is not None:
            *refs, out_smem = refs
        if pieces is None:
            o_ref, lse_ref, out_ref, lse_out_ref = refs
            steps = (S,)
            o_spec = plgpu.BlockSpec((None, None, *tile), lambda s: o_block((b, s)))
            lse_spec = plgpu.BlockSpec((None, None, lse_cols), lambda s: (b, s, g))
        else:
            o_ref, lse_ref, start_ref, count_ref, out_ref, lse_out_ref = refs
            first = start_ref[b]
            steps = (count_ref[b],)
            o_spec = plgpu.BlockSpec((None, *tile), lambda s: o_block((first + s,)))
            lse_spec = plgpu.BlockSpec((None, lse_cols), lambda s: (first + s, g))

        def body(idx, o_smem, lse_smem, carry):
            del idx
            acc, m, l = carry
            lse = plgpu.load(lse_smem.at[pl.ds(0, rows)] if lse_cols != rows else lse_smem, layout=row_layout)
            o = plgpu.load(o_smem, layout=wgmma_layout)
            m_new = jnp.maximum(m, lse)
            alpha = jnp.exp2(m - m_new)
            w = jnp.exp2(lse - m_new)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [along]) + o * lax.broadcast_in_dim(w, o.shape, [along])
            return acc, m_new, l * alpha + w

        acc, m, l = plgpu.emit_pipeline(
            body,
            grid=steps,
            max_concurrent_steps=2,
            in_specs=[o_spec, lse_spec],
            init_carry=(
                plgpu.layout_cast(jnp.zeros(tile, jnp.float32), wgmma_layout),
                plgpu.layout_cast(jnp.full((rows,), _M_INIT, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout),
            ),
        )(o_ref, lse_ref)
        l_safe = jnp.where(l == 0.0, 1.0, l)
        o = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [along])).astype(out_ref.dtype)
        if transposed:
            out_ref[b, pl.ds(c * cb, cb), :] = o
        elif rows_out is not None:  # the block's first rows_out rows only
            out_smem[...] = o
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, rows_out)], out_ref.at[b, :, pl.ds(c * cb, cb)])
            plgpu.wait_smem_to_gmem(0)
        else:
            out_ref[b, pl.ds(g * ROWS, ROWS), pl.ds(c * cb, cb)] = o

        @pl.when(c == 0)
        def _():
            lse_out_ref[b, pl.ds(g * rows, rows)] = (m + jnp.log2(l)) * _LN2

    if pieces is None:
        return mla_decode_combine(o_part, lse_part)
    return mla_decode_combine(o_part, lse_part, *pieces)
