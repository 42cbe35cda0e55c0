"""`mla_decode`'s bodies over fp8 pages (`pallas_kernels.page_format.FP8_PAGES`): the transposed body
(`_decode_partials_fp8_t`, R = s_q·H <= `NARROW_ROWS` query rows as the wgmma N, block scales folded into
the scores and P) and the padded 64-row body (`_decode_partials_fp8`, which dequantises each page into a
bf16 key buffer)."""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _fp8_tiles as _fp8
from pallas_kernels.mla_decode.config import KEY_DIM, LATENT_DIM, PAGE_SIZE, ROWS, MlaDecodeConfig
from pallas_kernels.mla_decode.schedule import _main_out_geometry, _Plan, _schedule_steps, _split_pages
from pallas_kernels.mla_decode.steps import (
    _BF16_TRANSFORMS,
    _LN2,
    _LOG2E,
    _M_INIT,
    _kernel_refs,
    _online_softmax,
    _pv_accumulate,
    _row_limits,
)


def _fp8_views(kv_u8):
    """(latent uint8 [N, 64, 656], scales f32 [N, 64, 164], rope bf16 [N, 64, 328]): bitcasts of
    one fp8 pages buffer (no copy); the kernel reads the latent bytes, the scales (fp32 words 128..131
    of a row) and the rope (bf16 elements 264..327) through them (`pallas_kernels._fp8_tiles`)."""
    N, G, W = kv_u8.shape
    as_f32 = lax.bitcast_convert_type(kv_u8.reshape(N, G, W // 4, 4), jnp.float32)
    as_bf16 = lax.bitcast_convert_type(kv_u8.reshape(N, G, W // 2, 2), jnp.bfloat16)
    return kv_u8, as_f32, as_bf16


def _decode_partials_fp8(
    q_rows,
    kv_u8,
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
    """`_decode_partials` over fp8 pages. Per page the two compute warpgroups first dequantise
    (e4m3 -> f16 -> f32, times the token's block scale, -> bf16; rows past the sequence end zeroed)
    their 256 latent columns into one shared bf16 [64, 576] key buffer in wgmma tiles (warpgroup 0
    adds the rope columns), meet at a barrier, then both run the plain body on that buffer (Q·Kᵀ
    over 576 columns, online softmax, P·V over their 256 columns); a second barrier per page keeps
    the buffer until both have finished P·V. The TMA stages hold the page's bytes as they are in
    HBM (untiled boxes through free bitcast views: latent bytes, fp32 scales, bf16 rope), read
    under Lane semantics (no swizzled layout fits those strided views). SMEM: Q 72 KB + two 41 KB
    stages  + the 72 KB buffer = 226 KB of the 227. Outputs and ``schedule`` as for
    `_decode_partials`."""
    B, Rp, _ = q_rows.shape
    final = plan_.num_splits == 1 and not plan_.planned
    scale_log2 = scale * _LOG2E
    out_type, grid, grid_names = _main_out_geometry(B, Rp, plan_, q_rows.dtype)
    scratch = dict(
        q_smem=plgpu.SMEM((ROWS, KEY_DIM), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        q_bar=plgpu.Barrier(),
        lat_smem=plgpu.SMEM((PAGE_SIZE, KEY_DIM), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        deq_bar=plgpu.Barrier(num_arrivals=2),
        free_bar=plgpu.Barrier(num_arrivals=2),
    )
    if config.interpretable:
        scratch["p_smem"] = plgpu.SMEM((2, ROWS, PAGE_SIZE), jnp.bfloat16, transforms=_BF16_TRANSFORMS)
    half = LATENT_DIM // 2
    lat_view, scale_view, rope_view = _fp8_views(kv_u8)

    @functools.partial(
        plgpu.kernel,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        scratch_types=scratch,
        # SMEM is full to the last KB: no cross-warp reduction scratch (every reduction is along
        # rows, inside a warp).
        # Lane semantics: the untiled stage views below (a 128-column block of a 256-byte row, a
        # scale column) have no swizzled layout for the warpgroup layout inference to pick.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, reduction_scratch_bytes=0, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
        interpret=interpret,
    )
    def mla_decode_partials_fp8(*refs, q_smem, q_bar, lat_smem, deq_bar, free_bar, p_smem=None):
        ins, sched_refs, (o_ref, lse_ref) = _kernel_refs(refs, 7, plan_.planned)
        q_ref, lat_ref, scale_ref, rope_ref, bt_ref, lens_ref, off_ref = ins
        g = lax.axis_index("g")
        wg = lax.axis_index("wg")
        rows = pl.ds(g * ROWS, ROWS)
        cols = pl.ds(wg * half, half)
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

        def pv_update(acc, p16):
            return _pv_accumulate(acc, p16, lat_smem.at[:, cols], p_smem.at[wg] if config.interpretable else None)

        def body(idx, lat_lo, lat_hi, scales, rope, carry):
            (i,) = idx
            (acc, m, l), at = steps.begin(i, carry)
            page_start, seq_len = at.page_start, at.seq_len
            # Both warpgroups are done with the previous page's buffer (their P·V) before it is rewritten.
            plgpu.barrier_arrive(free_bar)
            plgpu.barrier_wait(free_bar)
            _fp8_half_to_smem(wg, lat_lo, lat_hi, rope, seq_len - page_start, lat_smem, scales=scales)
            plgpu.barrier_arrive(deq_bar)
            plgpu.barrier_wait(deq_bar)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, lat_smem.transpose((1, 0)))
                return acc_ref[...]

            sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE), jnp.float32)) * scale_log2
            p16, acc, m_new, l = _online_softmax(
                sc, acc, m, l, page_start, _row_limits(seq_len, g, heads=heads, s_q=s_q, causal=causal)
            )
            return pv_update(acc, p16), m_new, l

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps.n_steps,),
            memory_registers=config.memory_registers,
            num_compute_wgs=2,
            wg_axis="wg",
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=steps.compute_context,
            in_specs=_fp8_in_specs(steps.page_of),
        )(lat_ref, lat_ref, scale_ref, rope_ref)

    if plan_.planned:
        args = (q_rows, lat_view, scale_view, rope_view, block_table, seq_lens, page_offset)
        return mla_decode_partials_fp8(*args, *schedule)
    return mla_decode_partials_fp8(q_rows, lat_view, scale_view, rope_view, block_table, seq_lens, page_offset)


# The transposed fp8 body (R = s_q * H <= 32 query rows): scores are computed as Sᵀ = K·Qᵀ with
# the page's 64 tokens as the wgmma M and the R query rows as N, and the output as Oᵀ = Vᵀ·Pᵀ,
# so no tensor work is spent on padding rows (the plain body pads R to 64 rows and both warpgroups
# score all 64 tokens: 13.6 MFLOP a page where this needs 2.2 at R = 16).
NARROW_ROWS = 32


def _use_transposed_fp8(s_q: int, heads: int, config: MlaDecodeConfig) -> bool:
    """Whether fp8 pages go through `_decode_partials_fp8_t` (see `MlaDecodeConfig.fp8_transposed`)."""
    fits = s_q * heads <= NARROW_ROWS
    if config.fp8_transposed is None:
        return fits
    if config.fp8_transposed and not fits:
        raise ValueError(f"fp8_transposed=True needs s_q * H <= {NARROW_ROWS} query rows, got s_q * H = {s_q * heads}")
    return config.fp8_transposed


def _fp8_in_specs(page_of):
    """The pipeline's in_specs over `_fp8_views`: each page's three parts as they are in HBM, in
    untiled TMA boxes of 256 latent bytes (two per row), 4 fp32 scales and 64 bf16 rope values a
    token (the views' offsets: byte 512 = fp32 word 128, byte 528 = bf16 element 264), as in
    `paged_gather`'s fp8 body."""
    half = LATENT_DIM // 2
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS
    return [
        plgpu.BlockSpec((None, PAGE_SIZE, half), lambda i: (page_of(i), 0, 0), oob_fill_mode=in_bounds),
        plgpu.BlockSpec((None, PAGE_SIZE, half), lambda i: (page_of(i), 0, 1), oob_fill_mode=in_bounds),
        plgpu.BlockSpec((None, PAGE_SIZE, 4), lambda i: (page_of(i), 0, _fp8.SCALE_WORD // 4), oob_fill_mode=in_bounds),
        plgpu.BlockSpec(
            (None, PAGE_SIZE, pl.Element(KEY_DIM - LATENT_DIM)),
            lambda i: (page_of(i), 0, _fp8.ROPE_HALF),
            oob_fill_mode=in_bounds,
        ),
    ]


def _fp8_half_to_smem(wg, lat_lo, lat_hi, rope, valid, dst, scales=None):
    """Warpgroup ``wg``'s 256 latent columns of an fp8 page (its stage views: latent bytes, fp32
    scales, bf16 rope) into ``dst`` (SMEM [64, 576] in wgmma tiles, bf16); warpgroup 0 also copies
    the rope (bf16 already) into columns 512..575. Rows past ``valid`` may hold anything, even NaN
    bytes or scales, and V must be 0 there (0 x NaN is NaN). Ends with `plgpu.commit_smem`.

    With ``scales`` (the padded body): e4m3 -> f16 -> f32 x the token's block scale -> bf16, rows
    past ``valid`` zeroed as they are written. Without (the transposed body, which applies the
    scales to the scores and to P): e4m3 -> f16 -> bf16, exact (every e4m3 value is a bf16 value);
    on a partial page (``valid`` < 64) this warpgroup's rows past the end are zeroed afterwards."""
    half = LATENT_DIM // 2
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = _fp8.BLOCK_LAYOUT.reduce(1)
    if scales is not None:
        tok = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, 128), 0, layout=_fp8.BLOCK_LAYOUT)
    for w, lat in enumerate((lat_lo, lat_hi)):

        @pl.when(wg == w)
        def _():
            for k in range(half // 128):
                x8 = plgpu.load(lat.at[:, pl.ds(k * 128, 128)], layout=_fp8.BLOCK_LAYOUT)
                x = lax.bitcast_convert_type(x8, jnp.float8_e4m3fn).astype(jnp.float16)
                if scales is not None:
                    sc = plgpu.load(scales.at[:, w * (half // 128) + k], layout=row_layout, optimized=False)
                    sc = plgpu.layout_cast(lax.broadcast_in_dim(sc, (PAGE_SIZE, 128), [0]), _fp8.BLOCK_LAYOUT)
                    x = x.astype(jnp.float32) * sc
                    x = jnp.where(tok < valid, x, 0.0)
                dst[:, pl.ds(w * half + k * 128, 128)] = x.astype(dst.dtype)
            if w == 0:
                dst[:, pl.ds(LATENT_DIM, KEY_DIM - LATENT_DIM)] = plgpu.load(rope, layout=_fp8.ROPE_LAYOUT)

    if scales is None:

        @pl.when(valid < PAGE_SIZE)
        def _():
            plgpu.commit_smem()
            tok = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE, 64), 0, layout=wgmma_layout)
            for k in range(half // 64):
                chunk = dst.at[:, pl.ds(wg * half + k * 64, 64)]
                x = plgpu.load(chunk, layout=wgmma_layout)
                chunk[...] = jnp.where(tok < valid, x, jnp.zeros_like(x))

    plgpu.commit_smem()


def _decode_partials_fp8_t(
    q_rows,
    kv_u8,
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
    """`_decode_partials` over fp8 pages for R = s_q * H <= 32 query rows, in transposed form.

    A CTA (split s, sequence b) keeps Q [R, 576] in SMEM. Per page, warpgroup w (0, 1) converts
    its 256 latent columns (blocks 2w and 2w+1 of 128) to bf16 without their scales, into its own
    half of a bf16 [64, 576] buffer (warpgroup 0 adds the rope), and computes its partial scores
    Sᵀ_w = Σ_k scale_k ⊙ (K8_k·Q_kᵀ) [64 tokens, R]: one wgmma per block, each scaled by the
    block's per-token scale along the tokens (rows). Warpgroup 1 hands its partial to warpgroup 0
    through SMEM (barrier s_bar); warpgroup 0 sums (plus the rope scores), runs the online softmax
    over the tokens (axis 0: cross-warp reductions, which only one warpgroup may run at a time,
    since they share Mosaic GPU's reduction scratch), and publishes, per latent block k, Pᵀ_k =
    scale_k ⊙ Pᵀ in bf16 (through transposed views of [R, 64] tiles; zero past the sequence, where
    a scale may be NaN), the rescale alpha, m and l (barrier p_bar). Both then rescale and
    accumulate Oᵀ_k += K8_kᵀ·Pᵀ_k [128, R] for their two blocks. Folding the scales into the
    scores and P leaves the per-element work of a page at e4m3 -> f16 -> bf16.

    A warpgroup's buffer half is read only by itself, so the buffer needs no cross-warpgroup
    barrier; the one-way hand-offs are single-buffered (warpgroup 1 rewrites its partial only after
    p_bar of the page before, which warpgroup 0 passes after reading it; warpgroup 0 rewrites the
    Pᵀ_k only after s_bar, which warpgroup 1 reaches after its P·V).

    Outputs are transposed: with one split (oᵀ [B, 512, R] in q's dtype, lse [B, R] f32 ln), else
    fp32 partials (oᵀ [B, S, 512, R], lse [B, S, R] in log2); on the pieces schedule (``schedule``: a
    `PieceSchedule`'s `kernel_refs`) CTA c runs the piece of table row c and writes fp32 partials by slot (oᵀ
    [W, 512, R], lse [W, R]; a row with no piece writes nothing). SMEM at R = 32: Q 36 KB, two 41 KB
    stages, the 72 KB buffer, 8 KB partial, 16 KB of Pᵀ_k: 216 KB."""
    B, R, _ = q_rows.shape
    S, pps = plan_.num_splits, plan_.pages_per_split
    pieces = plan_.schedule == "pieces"
    final = S == 1 and not pieces
    scale_log2 = scale * _LOG2E
    mma = jnp.bfloat16  # tensor-core inputs (f16 is no faster: docs/PERFORMANCE.md, "Tried and rejected")
    blk = 128  # latent columns per fp8 scale
    nblk = LATENT_DIM // blk  # 4; warpgroup w owns blocks 2w, 2w+1
    if final:
        out_type = (jax.ShapeDtypeStruct((B, LATENT_DIM, R), q_rows.dtype), jax.ShapeDtypeStruct((B, R), jnp.float32))
    elif pieces:
        W = plan_.num_ctas
        out_type = (jax.ShapeDtypeStruct((W, LATENT_DIM, R), jnp.float32), jax.ShapeDtypeStruct((W, R), jnp.float32))
    else:
        out_type = (
            jax.ShapeDtypeStruct((B, S, LATENT_DIM, R), jnp.float32),
            jax.ShapeDtypeStruct((B, S, R), jnp.float32),
        )
    scratch = dict(
        q_smem=plgpu.SMEM((R, KEY_DIM), mma, transforms=_BF16_TRANSFORMS),
        q_bar=plgpu.Barrier(),
        kv_smem=plgpu.SMEM((PAGE_SIZE, KEY_DIM), mma, transforms=_BF16_TRANSFORMS),
        part_smem=plgpu.SMEM(
            (PAGE_SIZE, R), jnp.float32, transforms=(plgpu.TilingTransform((8, R)), plgpu.SwizzleTransform(4 * R))
        ),
        p_smem=plgpu.SMEM((nblk, R, PAGE_SIZE), mma, transforms=_BF16_TRANSFORMS),
        stat_smem=plgpu.SMEM((3, R), jnp.float32),  # alpha, m, l
        s_bar=plgpu.Barrier(num_arrivals=1),
        p_bar=plgpu.Barrier(num_arrivals=1),
    )
    wgmma_layout = plgpu.Layout.WGMMA
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    lat_view, scale_view, rope_view = _fp8_views(kv_u8)

    @functools.partial(
        plgpu.kernel,
        out_type=out_type,
        grid=(plan_.num_ctas,) if pieces else (S, B),
        grid_names=("c",) if pieces else ("s", "b"),
        num_threads=3,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    def mla_decode_partials_fp8_t(*refs, q_smem, q_bar, kv_smem, part_smem, p_smem, stat_smem, s_bar, p_bar):
        n_in = 8 if pieces else 7
        q_ref, lat_ref, scale_ref, rope_ref, bt_ref, lens_ref, off_ref, *piece_ref = refs[:n_in]
        o_ref, lse_ref = refs[n_in:]
        wg = lax.axis_index("wg")
        if pieces:
            c = lax.axis_index("c")
            b, first_page, n_pages, slot = (piece_ref[0][c, k] for k in range(4))
            out_at = (slot,)
        else:
            s, b = lax.axis_index("s"), lax.axis_index("b")
            first_page = s * pps
            n_pages = _split_pages(lens_ref[b], first_page, pps)
            out_at = (b,) if final else (b, s)
        live = n_pages > 0 if pieces else True  # a piece row with no piece loads and writes nothing
        seq_len = lens_ref[b]
        table = bt_ref.at[b]
        shape = (PAGE_SIZE, R)  # (tokens, query rows)

        def block_scale(scales, k):
            """Block k's per-token scales (fp32 [64], row layout), broadcast along the query rows."""
            sc = plgpu.load(scales.at[:, k], layout=row_layout, optimized=False)
            return lax.broadcast_in_dim(sc, shape, [0])

        def scores(scales):
            def mm(accs):
                for j, acc_ref in enumerate(accs[:2]):
                    c = pl.ds((2 * wg + j) * blk, blk)
                    plgpu.wgmma(acc_ref, kv_smem.at[:, c], q_smem.at[:, c].transpose((1, 0)))

                @pl.when(wg == 0)
                def _():
                    rope = pl.ds(LATENT_DIM, KEY_DIM - LATENT_DIM)
                    plgpu.wgmma(accs[2], kv_smem.at[:, rope], q_smem.at[:, rope].transpose((1, 0)))

                return tuple(a[...] for a in accs)

            s0, s1, s_rope = pl.run_scoped(lambda *accs: mm(accs), *(plgpu.ACC(shape, jnp.float32) for _ in range(3)))
            return (s0 * block_scale(scales, 2 * wg) + s1 * block_scale(scales, 2 * wg + 1)) + s_rope

        def softmax(part, scales, page_start, m, l):
            """Warpgroup 0: the page's scores (its partial + warpgroup 1's), the online softmax over
            the tokens (axis 0); publishes the Pᵀ_k, alpha, m and l in SMEM."""
            sc = (part + plgpu.load(part_smem, layout=wgmma_layout)) * scale_log2
            key = page_start + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)
            if causal:  # query row r is token j = r // H (H a power of two), at seq_len - s_q + j
                j = lax.shift_right_logical(
                    plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout), int(math.log2(heads))
                )
                visible = key < seq_len - s_q + 1 + j
            else:
                visible = key < seq_len
            sc = jnp.where(visible, sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(axis=0))
            p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, shape, [1]))
            for k in range(nblk):  # past the sequence p is 0 but the scale may be NaN
                p_smem.at[k].transpose((1, 0))[...] = jnp.where(visible, p * block_scale(scales, k), 0.0).astype(mma)
            alpha = jnp.exp2(m - m_new)
            stat_smem[0] = alpha
            stat_smem[1] = m_new
            stat_smem[2] = l * alpha + p.sum(axis=0)
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_bar)

        def pv_update(accs):
            """Both warpgroups: Oᵀ_k = alpha * Oᵀ_k + K8_kᵀ·Pᵀ_k for their two blocks k, with the Pᵀ_k,
            alpha, m and l from SMEM."""
            alpha, m, l = (plgpu.load(stat_smem.at[k], layout=col_layout) for k in range(3))
            accs = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [1]) for a in accs)
            ops = [
                (
                    kv_smem.at[:, pl.ds((2 * wg + j) * blk, blk)].transpose((1, 0)),
                    p_smem.at[2 * wg + j].transpose((1, 0)),
                )
                for j in range(2)
            ]
            if config.interpretable:

                def pv_scoped(*refs):
                    for acc_ref, (v_t, p_t) in zip(refs, ops):
                        plgpu.wgmma(acc_ref, v_t, p_t)
                    return tuple(r[...] for r in refs)

                d = pl.run_scoped(pv_scoped, *(plgpu.ACC(a.shape, jnp.float32) for a in accs))
                accs = tuple(a + x for a, x in zip(accs, d))
            else:

                def pv(refs):
                    for acc_ref, (v_t, p_t) in zip(refs, ops):
                        plgpu.wgmma(acc_ref, v_t, p_t)

                accs = pl.run_state(pv)(tuple(plgpu.ACC.init(a) for a in accs))
            return accs, m, l

        def body(idx, lat_lo, lat_hi, scales, rope, carry):
            (i,) = idx
            accs, m, l = carry
            page_start = (first_page + i) * PAGE_SIZE
            # (The named scopes are what Mosaic GPU's profiler reports, by warpgroup and phase.)
            with jax.named_scope("convert"):
                _fp8_half_to_smem(wg, lat_lo, lat_hi, rope, seq_len - page_start, kv_smem)
            with jax.named_scope("qk"):
                part = scores(scales)

            @pl.when(wg == 1)
            def _():
                with jax.named_scope("hand_over"):
                    part_smem[...] = part
                    plgpu.barrier_arrive(s_bar)
                with jax.named_scope("wait_p"):
                    plgpu.barrier_wait(p_bar)

            @pl.when(wg == 0)
            def _():
                with jax.named_scope("wait_partial"):
                    plgpu.barrier_wait(s_bar)
                with jax.named_scope("softmax"):
                    softmax(part, scales, page_start, m, l)

            with jax.named_scope("pv"):
                return pv_update(accs)

        def compute_context(pipeline):
            @pl.when(live)
            def _():
                @pl.when(wg == 0)
                def _():
                    plgpu.copy_gmem_to_smem(q_ref.at[b], q_smem, q_bar)

                plgpu.barrier_wait(q_bar)

            zeros = lambda: plgpu.layout_cast(jnp.zeros((blk, R), jnp.float32), wgmma_layout)  # noqa: E731
            init = (
                (zeros(), zeros()),
                plgpu.layout_cast(jnp.full((R,), _M_INIT, jnp.float32), col_layout),
                plgpu.layout_cast(jnp.zeros((R,), jnp.float32), col_layout),
            )
            accs, m, l = pipeline(init)
            l_safe = lax.broadcast_in_dim(jnp.where(l == 0.0, 1.0, l), (blk, R), [1])
            lse2 = m + jnp.log2(l)

            @pl.when(live)
            def _():
                for j, acc in enumerate(accs):
                    cols = pl.ds((2 * wg + j) * blk, blk)
                    o_ref[(*out_at, cols)] = (acc / l_safe).astype(o_ref.dtype)

                @pl.when(wg == 0)
                def _():
                    lse_ref[out_at] = lse2 * _LN2 if final else lse2

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(n_pages,),
            memory_registers=config.memory_registers,
            num_compute_wgs=2,
            wg_axis="wg",
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
            in_specs=_fp8_in_specs(lambda i: table[first_page + i] + off_ref[0]),
        )(lat_ref, lat_ref, scale_ref, rope_ref)

    return mla_decode_partials_fp8_t(
        q_rows, lat_view, scale_view, rope_view, block_table, seq_lens, page_offset, *(schedule if pieces else ())
    )
