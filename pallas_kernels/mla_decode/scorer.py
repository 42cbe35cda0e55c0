"""`mla_decode`'s scorer bodies over bf16 pages: one warpgroup scores each page once (Q·Kᵀ, the online softmax,
P·V over 128 columns), two others accumulate P·V over 192 columns each, beside a TMA warpgroup that streams the
pages, per sequence split or piece (`_decode_partials_scorer`, the default on bf16 pages)."""

from __future__ import annotations

import functools

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mla_decode.config import KEY_DIM, LATENT_DIM, PAGE_SIZE, ROWS, MlaDecodeConfig
from pallas_kernels.mla_decode.schedule import _main_out_geometry, _Plan, _split_pages
from pallas_kernels.mla_decode.steps import (
    _BF16_TRANSFORMS,
    _LN2,
    _LOG2E,
    _M_INIT,
    _kernel_refs,
    _pv_product,
    _row_limits,
    _zero_v_tail,
)

_SCORER_COLS = 128  # P·V columns of the scoring warpgroup
_ACC_COLS = (LATENT_DIM - _SCORER_COLS) // 2  # 192 for each of the two accumulating ones
SCORER_MEMORY_REGISTERS = 24  # the TMA warpgroup's registers (setmaxnreg): a loop issuing copies


def _scorer_compute_registers(memory_registers: int = SCORER_MEMORY_REGISTERS) -> int:
    """Registers a thread of each of the three compute warpgroups asks for (setmaxnreg): the 64 K of
    the register file less the TMA warpgroup's share, split three ways, rounded down to a multiple
    of 8."""
    return min(256, (512 - memory_registers) // 3) // 8 * 8


def _scorer_scratch(nslots: int) -> dict:
    """SMEM and barriers of a scorer body: Q, ``nslots`` page slots, the scorer's P and its (alpha, l), the
    barriers between the TMA warpgroup, the scorer and the two accumulating warpgroups."""
    return dict(
        q_smem=plgpu.SMEM((ROWS, KEY_DIM), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        kv_smem=plgpu.SMEM((nslots, PAGE_SIZE, KEY_DIM), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        p_smem=plgpu.SMEM((ROWS, PAGE_SIZE), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        stat_smem=plgpu.SMEM((2, ROWS), jnp.float32),  # alpha, l of the page's P
        q_bar=plgpu.Barrier(),
        kv_ready=plgpu.Barrier(num_barriers=nslots),
        kv_free=plgpu.Barrier(num_arrivals=3, num_barriers=nslots),
        p_ready=plgpu.Barrier(),
        p_free=plgpu.Barrier(num_arrivals=2),
    )


def _scorer_kernel(out_type, grid, grid_names, scratch, interpret, num_threads=4):
    """The `plgpu.kernel` decorator of a scorer body: four warpgroups (scorer, two accumulating, TMA)."""
    return functools.partial(
        plgpu.kernel,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=num_threads,
        thread_name="wg",
        scratch_types=scratch,
        # Every reduction is along rows, inside a warp: no cross-warp reduction scratch needed.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret,
    )


def _decode_partials_scorer(
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
    """`_decode_partials` with a dedicated scoring warpgroup (bf16 pages, per_sequence and pieces schedules).

    Four warpgroups a CTA (row block g, split s, sequence b; on the pieces schedule (row block g, piece row c)
    with b, the first page and the pages read from row c of ``schedule``, a `PieceSchedule`'s `kernel_refs`),
    each with its own loop over the split's pages:
    * warpgroup 3 (TMA) loads Q, then streams the pages through ``max_concurrent_steps`` slots
      (``kv_ready[slot]``), refilling a slot once all three compute warpgroups have released it
      (``kv_free[slot]``, 3 arrivals);
    * warpgroup 0 (the scorer) zeroes the V tail of a sequence's partial last page, computes
      S = Q·Kᵀ of each page once (64 rows x 64 tokens over 576 columns) and the online softmax
      (running max and sum in its registers; the mask only on pages that need one), writes P
      (bf16, a wgmma tile) with the page's rescale alpha and running sum l to SMEM (``p_ready``),
      then accumulates P·V over columns [0, 128) itself;
    * warpgroups 1 and 2 accumulate P·V over columns [128, 320) and [320, 512): wait ``p_ready``,
      rescale by alpha, P·V with the tensor cores reading P from SMEM, then release P (``p_free``,
      2 arrivals), which the scorer waits for before writing the next page's P.
    So each page's Q·Kᵀ is computed once (8.9 MFLOP a page and CTA, against 13.6 for the plain
    body), and while the accumulating warpgroups run P·V of page i the scorer runs Q·Kᵀ of page
    i + 1. Registers: ptxas refuses an instruction that needs more than the launch's cap, 128 a
    thread for four warpgroups, even after setmaxnreg, hence the 128 / 192 / 192 split: 64 and 96
    accumulator registers a thread. The warpgroups still set their registers (24 for the TMA one,
    160 for the others), which removes spill code (docs/PERFORMANCE.md,
    "Decode kernel beside FlashMLA and vLLM's Triton kernel").

    Each warpgroup writes its columns of the split's result after its loop (an empty split too:
    out 0, lse -inf; a piece row with no piece writes nothing). SMEM: Q 72 KB + two 72 KB page slots + P
    8 KB + 0.5 KB = 224.5 KB. Outputs as `_decode_partials` (per_sequence or pieces)."""
    B, Rp, _ = q_rows.shape
    pps = plan_.pages_per_split
    pieces = plan_.schedule == "pieces"
    final = plan_.num_splits == 1 and not pieces
    scale_log2 = scale * _LOG2E
    nslots = config.max_concurrent_steps
    c0 = _SCORER_COLS
    acc_cols = _ACC_COLS
    out_type, grid, grid_names = _main_out_geometry(B, Rp, plan_, q_rows.dtype)
    scratch = _scorer_scratch(nslots)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    compute_registers = _scorer_compute_registers(SCORER_MEMORY_REGISTERS)
    # Keys every query row of the sequence sees: the first causal query row sees s_q - 1 fewer.
    lag = s_q - 1 if causal else 0

    @_scorer_kernel(out_type, grid, grid_names, scratch, interpret)
    def mla_decode_partials_scorer(
        *refs,
        q_smem,
        kv_smem,
        p_smem,
        stat_smem,
        q_bar,
        kv_ready,
        kv_free,
        p_ready,
        p_free,
    ):
        (q_ref, kv_ref, bt_ref, lens_ref, off_ref), sched_refs, (o_ref, lse_ref) = _kernel_refs(refs, 5, pieces)
        g, wg = lax.axis_index("g"), lax.axis_index("wg")
        rows = pl.ds(g * ROWS, ROWS)
        if pieces:
            (piece_ref,) = sched_refs
            c = lax.axis_index("c")
            b, first_page, n_pages, slot = (piece_ref[c, k] for k in range(4))
            out_index = (slot, rows)
            seq_len = lens_ref[b]
        else:
            s, b = lax.axis_index("s"), lax.axis_index("b")
            seq_len = lens_ref[b]
            first_page = s * pps
            n_pages = _split_pages(seq_len, first_page, pps)
            out_index = (b, rows) if final else (b, s, rows)
        # An empty split writes its empty result (the combine reads every split); a piece row with no piece nothing.
        live = n_pages > 0 if pieces else True

        def page(i):
            """(slot, first key) of step i, once its page has landed."""
            slot = lax.rem(i, nslots)
            plgpu.barrier_wait(kv_ready.at[slot])
            return slot, (first_page + i) * PAGE_SIZE

        def write_out(cols, acc, l):
            l_safe = jnp.where(l == 0.0, 1.0, l)
            o = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(o_ref.dtype)

            @pl.when(live)
            def _():
                o_ref[(*out_index, cols)] = o

        def issue(i):
            """Page i's copy into its slot (by the TMA warpgroup)."""
            slot = lax.rem(i, nslots)
            plgpu.copy_gmem_to_smem(
                kv_ref.at[bt_ref[b, first_page + i] + off_ref[0]], kv_smem.at[slot], kv_ready.at[slot]
            )

        @pl.when(wg == 3)
        def _memory():
            plgpu.set_max_registers(SCORER_MEMORY_REGISTERS, action="decrease")

            @pl.loop(0, n_pages)
            def _(i):
                slot = lax.rem(i, nslots)

                @pl.when(i == 0)
                def _():
                    plgpu.copy_gmem_to_smem(q_ref.at[b, rows], q_smem, q_bar)

                @pl.when(i >= nslots)
                def _():
                    plgpu.barrier_wait(kv_free.at[slot])

                issue(i)

            # Observe the last releases too, so that every barrier ends with all its phases waited
            # (the interpreter checks this when the barriers are freed).
            @pl.loop(jnp.maximum(n_pages - nslots, 0), n_pages)
            def _(i):
                plgpu.barrier_wait(kv_free.at[lax.rem(i, nslots)])

        def zeros(cols):
            return plgpu.layout_cast(jnp.zeros((ROWS, cols), jnp.float32), wgmma_layout)

        m0 = plgpu.layout_cast(jnp.full((ROWS,), _M_INIT, jnp.float32), row_layout)
        l0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)

        @pl.when(wg == 0)
        def _scorer():
            plgpu.set_max_registers(compute_registers, action="increase")

            def step(i, carry):
                acc, m, l = carry
                slot, page_start = page(i)
                kv = kv_smem.at[slot]
                _zero_v_tail(kv, seq_len - page_start, 0, LATENT_DIM)  # for every P·V warpgroup

                @pl.when(i == 0)
                def _():
                    plgpu.barrier_wait(q_bar)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, kv.transpose((1, 0)))
                    return acc_ref[...]

                sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE), jnp.float32))

                def masked():
                    key = page_start + plgpu.broadcasted_iota(jnp.int32, (ROWS, PAGE_SIZE), 1, layout=wgmma_layout)
                    limit = _row_limits(seq_len, g, heads=heads, s_q=s_q, causal=causal)
                    return jnp.where(key < limit, sc, -jnp.inf)

                # Only a page reaching past what the first query row sees needs the mask.
                sc = lax.cond(page_start + PAGE_SIZE <= seq_len - lag, lambda: sc, masked)
                # The scale is folded into exp2's argument (scale > 0 keeps the row maxima maxima).
                m_new = jnp.maximum(m, sc.max(axis=1) * scale_log2)
                alpha = jnp.exp2(m - m_new)
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
                return acc, m_new, l

            acc, m, l = lax.fori_loop(0, n_pages, step, (zeros(c0), m0, l0))

            @pl.when(n_pages > 0)
            def _():  # the last page's P released (see the memory warpgroup's last loop)
                plgpu.barrier_wait(p_free)

            write_out(pl.ds(0, c0), acc, l)
            lse2 = m + jnp.log2(l)

            @pl.when(live)
            def _():
                lse_ref[out_index] = lse2 * _LN2 if final else lse2

        @pl.when((wg == 1) | (wg == 2))
        def _accumulate():
            plgpu.set_max_registers(compute_registers, action="increase")
            cols = pl.ds(c0 + (wg - 1) * acc_cols, acc_cols)

            def step(i, carry):
                acc, _ = carry
                slot, _ = page(i)
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
                return acc, l

            acc, l = lax.fori_loop(0, n_pages, step, (zeros(acc_cols), l0))
            write_out(cols, acc, l)

    return mla_decode_partials_scorer(
        q_rows, kv_pages, block_table, seq_lens, page_offset, *(schedule if pieces else ())
    )
