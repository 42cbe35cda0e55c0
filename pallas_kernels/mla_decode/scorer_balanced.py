"""`mla_decode`'s scorer body walking the balanced schedule's runs (`_decode_partials_scorer_balanced`): the scorer
body of `pallas_kernels.mla_decode.scorer` (its scratch, kernel decorator and column split) with every warpgroup
following a run of pages that may cross sequences."""

from __future__ import annotations

import functools

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mla_decode.config import LATENT_DIM, PAGE_SIZE, ROWS, MlaDecodeConfig
from pallas_kernels.mla_decode.schedule import _main_out_geometry, _Plan
from pallas_kernels.mla_decode.scorer import (
    _ACC_COLS,
    _SCORER_COLS,
    SCORER_MEMORY_REGISTERS,
    _scorer_compute_registers,
    _scorer_kernel,
    _scorer_scratch,
)
from pallas_kernels.mla_decode.steps import (
    _LOG2E,
    _M_INIT,
    _pv_product,
    _row_limits,
    _zero_v_tail,
)


def _walk(i, b, run_start, n_steps, ends_ref, lens_ref):
    """Where step i of a CTA's run is: (b, page_start, seq_len, first, last) of global page run_start + i, given
    the sequence b of step i - 1 (or the run's first sequence). A sequence's pages are contiguous and runs go in
    order, so b only moves forward: past the sequences that end at or before the page (empty ones included),
    usually none. ``first`` / ``last``: the page begins / ends the CTA's piece of sequence b."""
    gp = run_start + i
    b = lax.while_loop(lambda b: ends_ref[b] <= gp, lambda b: b + 1, b)
    seq_len = lens_ref[b]
    pos = gp - (ends_ref[b] - pl.cdiv(seq_len, PAGE_SIZE))
    return b, pos * PAGE_SIZE, seq_len, (i == 0) | (pos == 0), (i == n_steps - 1) | (gp + 1 >= ends_ref[b])


def _decode_partials_scorer_balanced(
    q_rows,
    kv_pages,
    block_table,
    seq_lens,
    *,
    s_q,
    heads,
    causal,
    scale,
    plan_: _Plan,
    config: MlaDecodeConfig,
    interpret,
    schedule,
):
    """The scorer body (`_decode_partials_scorer`) walking the balanced schedule (``schedule``: a
    `BalancedSchedule`'s `kernel_refs`, ends and ctas): CTA (g, c) reads run c of the batch's pages, which may
    cross sequences, and writes one fp32 partial per sequence piece to slot c + b (`_main_out_geometry`).

    Every warpgroup walks the run itself (`_walk`: one scalar, the current sequence, carried; the next sequence
    found by a forward step that almost never loops), so no warpgroup carries more than the per-sequence body's
    state. A piece's start needs no reset of the accumulators: the scorer sends alpha = 0 with the piece's first
    P (and restarts its running max), and every warpgroup multiplies its accumulator by alpha anyway. A piece's
    end: each warpgroup writes its columns (scaled by that page's running sum), the scorer the lse. Q: only the
    scorer reads it; after the Q·Kᵀ of a piece's last page it releases Q (``q_free``), and the TMA warpgroup,
    once it has issued the copy of the next piece's first page, loads the next sequence's Q (``q_bar``), which the
    scorer waits for at that page. SMEM as the per-sequence scorer body."""
    B, Rp, _ = q_rows.shape
    scale_log2 = scale * _LOG2E
    nslots = config.max_concurrent_steps
    c0, acc_cols = _SCORER_COLS, _ACC_COLS
    out_type, grid, grid_names = _main_out_geometry(B, Rp, plan_, q_rows.dtype)
    scratch = dict(_scorer_scratch(nslots), q_free=plgpu.Barrier())
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    compute_registers = _scorer_compute_registers()
    lag = s_q - 1 if causal else 0

    @_scorer_kernel(out_type, grid, grid_names, scratch, interpret)
    def mla_decode_partials_scorer_balanced(
        q_ref,
        kv_ref,
        bt_ref,
        lens_ref,
        ends_ref,
        cta_ref,
        o_ref,
        lse_ref,
        *,
        q_smem,
        kv_smem,
        p_smem,
        stat_smem,
        q_bar,
        q_free,
        kv_ready,
        kv_free,
        p_ready,
        p_free,
    ):
        g, c = lax.axis_index("g"), lax.axis_index("c")
        wg = lax.axis_index("wg")
        rows = pl.ds(g * ROWS, ROWS)
        run_start = cta_ref[c, 0]
        n_steps = cta_ref[c, 1] - run_start
        b_first = cta_ref[c, 2]
        walk = functools.partial(_walk, run_start=run_start, n_steps=n_steps, ends_ref=ends_ref, lens_ref=lens_ref)

        def write_out(b, cols, acc, l):
            l_safe = jnp.where(l == 0.0, 1.0, l)
            o_ref[c + b, rows, cols] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])

        @pl.when(wg == 3)
        def _memory():
            plgpu.set_max_registers(SCORER_MEMORY_REGISTERS, action="decrease")

            @pl.when(n_steps > 0)
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[b_first, rows], q_smem, q_bar)

            def step(i, b):
                b, page_start, _, first, _ = walk(i, b)
                slot = lax.rem(i, nslots)

                @pl.when(i >= nslots)
                def _():
                    plgpu.barrier_wait(kv_free.at[slot])

                page = bt_ref[b, page_start // PAGE_SIZE]
                plgpu.copy_gmem_to_smem(kv_ref.at[page], kv_smem.at[slot], kv_ready.at[slot])

                @pl.when(first & (i > 0))
                def _():  # the scorer is done with the previous piece's Q
                    plgpu.barrier_wait(q_free)
                    plgpu.copy_gmem_to_smem(q_ref.at[b, rows], q_smem, q_bar)

                return b

            lax.fori_loop(0, n_steps, step, b_first)

            @pl.loop(jnp.maximum(n_steps - nslots, 0), n_steps)
            def _(i):  # observe the last releases too (the interpreter checks every phase was waited)
                plgpu.barrier_wait(kv_free.at[lax.rem(i, nslots)])

        def zeros(cols):
            return plgpu.layout_cast(jnp.zeros((ROWS, cols), jnp.float32), wgmma_layout)

        m0 = plgpu.layout_cast(jnp.full((ROWS,), _M_INIT, jnp.float32), row_layout)
        l0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)

        @pl.when(wg == 0)
        def _scorer():
            plgpu.set_max_registers(compute_registers, action="increase")

            def step(i, carry):
                acc, m, l, b = carry
                b, page_start, seq_len, first, last = walk(i, b)
                slot = lax.rem(i, nslots)
                plgpu.barrier_wait(kv_ready.at[slot])
                kv = kv_smem.at[slot]
                _zero_v_tail(kv, seq_len - page_start, 0, LATENT_DIM)  # for every P·V warpgroup

                @pl.when(first)
                def _():
                    plgpu.barrier_wait(q_bar)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, kv.transpose((1, 0)))
                    return acc_ref[...]

                sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE), jnp.float32))

                @pl.when(last & (i + 1 < n_steps))
                def _():  # Q·Kᵀ of the piece's last page done: the next piece's Q may land
                    plgpu.barrier_arrive(q_free)

                def masked():
                    key = page_start + plgpu.broadcasted_iota(jnp.int32, (ROWS, PAGE_SIZE), 1, layout=wgmma_layout)
                    limit = _row_limits(seq_len, g, heads=heads, s_q=s_q, causal=causal)
                    return jnp.where(key < limit, sc, -jnp.inf)

                sc = lax.cond(page_start + PAGE_SIZE <= seq_len - lag, lambda: sc, masked)
                # A piece restarts the softmax: its first page forgets the previous piece (alpha = 0 for all).
                # (A scalar predicate does not broadcast implicitly under warpgroup semantics.)
                fresh = jnp.broadcast_to(first, m.shape)
                m = jnp.where(fresh, m0, m)
                m_new = jnp.maximum(m, sc.max(axis=1) * scale_log2)
                alpha = jnp.where(fresh, jnp.zeros_like(m), jnp.exp2(m - m_new))
                p = jnp.exp2(sc * scale_log2 - lax.broadcast_in_dim(m_new, sc.shape, [0]))
                l = l * alpha + p.sum(axis=1)

                @pl.when(i > 0)
                def _():  # both accumulating warpgroups are done with the previous page's P
                    plgpu.barrier_wait(p_free)

                p_smem[...] = p.astype(jnp.bfloat16)
                stat_smem[0] = alpha
                stat_smem[1] = l
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready)
                acc = _pv_product(
                    acc * lax.broadcast_in_dim(alpha, acc.shape, [0]),
                    p_smem,
                    kv.at[:, pl.ds(0, c0)],
                    config.interpretable,
                )
                plgpu.barrier_arrive(kv_free.at[slot])

                @pl.when(last)
                def _():
                    write_out(b, pl.ds(0, c0), acc, l)
                    lse_ref[c + b, rows] = m_new + jnp.log2(l)

                return acc, m_new, l, b

            lax.fori_loop(0, n_steps, step, (zeros(c0), m0, l0, b_first))

            @pl.when(n_steps > 0)
            def _():  # the last page's P released (see the memory warpgroup's last loop)
                plgpu.barrier_wait(p_free)

        @pl.when((wg == 1) | (wg == 2))
        def _accumulate():
            plgpu.set_max_registers(compute_registers, action="increase")
            cols = pl.ds(c0 + (wg - 1) * acc_cols, acc_cols)

            def step(i, carry):
                acc, b = carry
                b, _, _, _, last = walk(i, b)
                slot = lax.rem(i, nslots)
                plgpu.barrier_wait(kv_ready.at[slot])
                plgpu.barrier_wait(p_ready)
                alpha = plgpu.load(stat_smem.at[0], layout=row_layout)
                l = plgpu.load(stat_smem.at[1], layout=row_layout)
                acc = _pv_product(
                    acc * lax.broadcast_in_dim(alpha, acc.shape, [0]),
                    p_smem,
                    kv_smem.at[slot, :, cols],
                    config.interpretable,
                )
                plgpu.barrier_arrive(p_free)
                plgpu.barrier_arrive(kv_free.at[slot])

                @pl.when(last)
                def _():
                    write_out(b, cols, acc, l)

                return acc, b

            lax.fori_loop(0, n_steps, step, (zeros(acc_cols), b_first))

    return mla_decode_partials_scorer_balanced(q_rows, kv_pages, block_table, seq_lens, *schedule)
