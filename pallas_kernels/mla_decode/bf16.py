"""`mla_decode`'s plain / split-QK body over bf16 pages (`_decode_partials`, two compute warpgroups each owning
256 output columns beside a TMA warpgroup that streams the pages); the scorer bodies are in `scorer`."""

from __future__ import annotations

import functools

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mla_decode.config import KEY_DIM, LATENT_DIM, PAGE_SIZE, ROWS, MlaDecodeConfig
from pallas_kernels.mla_decode.schedule import _main_out_geometry, _Plan, _schedule_steps
from pallas_kernels.mla_decode.steps import (
    _BF16_TRANSFORMS,
    _LOG2E,
    _kernel_refs,
    _online_softmax,
    _pv_accumulate,
    _row_limits,
    _zero_v_tail,
)


def _decode_partials(
    q_rows,
    kv_pages,
    block_table,
    seq_lens,
    page_offset,
    *,
    s_q,
    heads,
    causal,
    scale,
    plan_: _Plan,
    config: MlaDecodeConfig,
    interpret,
    schedule=None,
):
    """Main kernel. With one split it returns the final (out [B, Rp, 512] bf16, lse [B, Rp] f32 ln);
    with several, fp32 partials (o [B, S, Rp, 512], lse [B, S, Rp] in log2) for `_combine`.
    With ``schedule`` (plan_.schedule "pieces": a `PieceSchedule`'s `kernel_refs`): fp32 partials per piece
    slot (o [NS, Rp, 512], lse [NS, Rp] in log2, `_main_out_geometry`); slots no piece takes are never written."""
    B, Rp, _ = q_rows.shape
    final = plan_.num_splits == 1 and not plan_.planned
    scale_log2 = scale * _LOG2E
    out_type, grid, grid_names = _main_out_geometry(B, Rp, plan_, q_rows.dtype)
    scratch = dict(q_smem=plgpu.SMEM((ROWS, KEY_DIM), jnp.bfloat16, transforms=_BF16_TRANSFORMS), q_bar=plgpu.Barrier())
    if plan_.split_qk:
        # P (64 rows x 64 tokens, bf16, untiled so each warpgroup can store its 32-token half and
        # both can load all of it into registers), row maxima and row sums of each warpgroup, and
        # the two per-page rendezvous barriers. 9 KB: what is left of the 227 KB after Q and two KV
        # stages (221 KB) holds it; a 64x64 fp32 S would not fit.
        scratch["p_full_smem"] = plgpu.SMEM((ROWS, PAGE_SIZE), jnp.bfloat16)
        scratch["stat_smem"] = plgpu.SMEM((2, 2, ROWS), jnp.float32)  # [max|sum, wg, row]
        scratch["max_bar"] = plgpu.Barrier(num_arrivals=2)
        scratch["p_bar"] = plgpu.Barrier(num_arrivals=2)
    if config.interpretable:
        scratch["p_smem"] = plgpu.SMEM((2, ROWS, PAGE_SIZE), jnp.bfloat16, transforms=_BF16_TRANSFORMS)
    half = LATENT_DIM // 2
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    # Grid x (fastest) = row block, so the CTAs reading the same pages for different heads run
    # side by side and the second read hits L2; then the split, then the batch.
    @functools.partial(
        plgpu.kernel,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        scratch_types=scratch,
        # The split-QK buffers fill SMEM to the last KB, so give back the cross-warp reduction
        # scratch (2 KB by default); its reductions are all along rows, inside a warp.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, **({"reduction_scratch_bytes": 0} if plan_.split_qk else {})
        ),
        interpret=interpret,
    )
    def mla_decode_partials(
        *refs, q_smem, q_bar, p_smem=None, p_full_smem=None, stat_smem=None, max_bar=None, p_bar=None
    ):
        (q_ref, kv_ref, bt_ref, lens_ref, off_ref), sched_refs, (o_ref, lse_ref) = _kernel_refs(refs, 5, plan_.planned)
        g = lax.axis_index("g")
        wg = lax.axis_index("wg")
        rows = pl.ds(g * ROWS, ROWS)
        cols = pl.ds(wg * half, half)  # this compute warpgroup's share of the 512 output columns
        steps = _schedule_steps(
            plan_,
            q_ref=q_ref,
            o_ref=o_ref,
            lse_ref=lse_ref,
            q_smem=q_smem,
            q_bar=q_bar,
            rows=rows,
            cols=cols,
            final=final,
            bt_ref=bt_ref,
            lens_ref=lens_ref,
            off_ref=off_ref,
            sched_refs=sched_refs,
        )

        def zero_v_tail(kv, valid):  # this warpgroup's V columns
            _zero_v_tail(kv, valid, wg * half, half)

        def body_split_qk(idx, kv, carry):
            # Warpgroup w scores tokens [32w, 32w+32) of the page. Rendezvous 1 (max_bar): both halves'
            # row maxima are in SMEM. Rendezvous 2 (p_bar): both P halves and row sums are. The
            # buffers are single: a warpgroup rewrites its maxima only after passing the other's p_bar
            # arrival of the previous page (which follows the other's read of them), and its P half and
            # sums only after the other's max_bar arrival of this page (which follows the other's
            # loads of P and sums for the previous page).
            (i,) = idx
            (acc, m, l), at = steps.begin(i, carry)
            page_start, seq_len = at.page_start, at.seq_len
            zero_v_tail(kv, seq_len - page_start)
            tokens = pl.ds(wg * (PAGE_SIZE // 2), PAGE_SIZE // 2)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, kv.at[tokens].transpose((1, 0)))
                return acc_ref[...]

            sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE // 2), jnp.float32)) * scale_log2
            key = (
                page_start
                + wg * (PAGE_SIZE // 2)
                + plgpu.broadcasted_iota(jnp.int32, (ROWS, PAGE_SIZE // 2), 1, layout=wgmma_layout)
            )
            limit = _row_limits(seq_len, g, heads=heads, s_q=s_q, causal=causal, shape=(ROWS, PAGE_SIZE // 2))
            sc = jnp.where(key < limit, sc, -jnp.inf)
            stat_smem[0, wg] = sc.max(axis=1)
            plgpu.barrier_arrive(max_bar)
            plgpu.barrier_wait(max_bar)
            m_new = jnp.maximum(
                m,
                jnp.maximum(
                    plgpu.load(stat_smem.at[0, 0], layout=row_layout), plgpu.load(stat_smem.at[0, 1], layout=row_layout)
                ),
            )
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
            p_full_smem[:, tokens] = p.astype(jnp.bfloat16)
            stat_smem[1, wg] = p.sum(axis=1)
            plgpu.barrier_arrive(p_bar)
            plgpu.barrier_wait(p_bar)
            l = (
                l * alpha
                + plgpu.load(stat_smem.at[1, 0], layout=row_layout)
                + plgpu.load(stat_smem.at[1, 1], layout=row_layout)
            )
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = plgpu.load(p_full_smem, layout=wgmma_layout)
            return pv_update(acc, p16, kv.at[:, cols]), m_new, l

        def pv_update(acc, p16, v):
            """acc + P·V for this warpgroup's columns; P (64 x 64 bf16) in registers."""
            return _pv_accumulate(acc, p16, v, p_smem.at[wg] if config.interpretable else None)

        def body(idx, kv, carry):
            (i,) = idx
            (acc, m, l), at = steps.begin(i, carry)
            page_start, seq_len = at.page_start, at.seq_len
            zero_v_tail(kv, seq_len - page_start)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, kv.transpose((1, 0)))
                return acc_ref[...]

            sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE), jnp.float32)) * scale_log2
            p16, acc, m_new, l = _online_softmax(
                sc, acc, m, l, page_start, _row_limits(seq_len, g, heads=heads, s_q=s_q, causal=causal)
            )
            return pv_update(acc, p16, kv.at[:, cols]), m_new, l

        plgpu.emit_pipeline_warp_specialized(
            body_split_qk if plan_.split_qk else body,
            grid=(steps.n_steps,),
            memory_registers=config.memory_registers,
            num_compute_wgs=2,
            wg_axis="wg",
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=steps.compute_context,
            in_specs=[
                plgpu.BlockSpec(
                    (None, PAGE_SIZE, KEY_DIM), lambda i: (steps.page_of(i), 0, 0), transforms=_BF16_TRANSFORMS
                )
            ],
        )(kv_ref)

    if plan_.planned:
        return mla_decode_partials(q_rows, kv_pages, block_table, seq_lens, page_offset, *schedule)
    return mla_decode_partials(q_rows, kv_pages, block_table, seq_lens, page_offset)


# The scorer body (`MlaDecodeConfig.scorer`): one warpgroup scores each page once, two others
# accumulate P·V, beside the TMA warpgroup; the tensor cores run the scorer's Q·Kᵀ of one page while
# the accumulating warpgroups run P·V of the one before.
