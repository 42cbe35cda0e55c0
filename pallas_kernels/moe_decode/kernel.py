"""`moe_decode`'s two Pallas Triton launches (gate/up, down): the routed programs over their listed experts'
rows, `rt` (`MoeDecodeConfig.row_tile`, a power of two from 16 to 64) at a time, and the shared experts as more
programs of the same grids."""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8_gemm.config import QUANT_BLOCK
from pallas_kernels.fp8_matvec import prepare_rows, to_compute

ROW_TILE = 16  # the smallest row tile: the smallest M of a tensor-core dot (`MoeDecodeConfig.row_tile` >= it)


def _product(x, w_ref, s_ref, e, k0, block_k, c0, block_c, convert):
    """x [R, block_k] · W_e[k0 : k0 + block_k, c0 : c0 + block_c] in fp32. bf16 experts (`s_ref` None) are stored
    [E, K, N]; FP8 experts [E, N, K] e4m3 with scales [E, nb, kb]: the tile is converted in registers and its
    block's scale multiplies the product."""
    if s_ref is None:
        return plt.dot(x, plt.load(w_ref.at[e, pl.ds(k0, block_k), pl.ds(c0, block_c)]))
    w = to_compute(plt.load(w_ref.at[e, pl.ds(c0, block_c), pl.ds(k0, block_k)]), x.dtype, convert)
    return plt.dot(x, w, trans_b=True) * s_ref[e, c0 // QUANT_BLOCK, k0 // QUANT_BLOCK]


def _gate_up_rows(
    x_ref,
    wg_ref,
    wu_ref,
    sg_ref,
    su_ref,
    rf_ref,
    h_ref,
    w,
    start,
    n,
    c0,
    *,
    block_i,
    block_d,
    D,
    convert,
    rt,
    out_start=None,
    rows_of=None,
):
    """h[out_start + r, c0 : c0 + block_i] = silu(x[start + r]·W_gate[w]) * (x[start + r]·W_up[w]) over those
    columns for r < n (out_start None: start), `rt` rows at a time (rows past n neither read nor written); `w` the
    weights' leading index (expert or layer). `rows_of` (None: x's rows as they are): the x rows of rows
    [r0, r0 + rt), int [rt] (gathered in the loads)."""
    cols = pl.ds(c0, block_i)
    out_start = start if out_start is None else out_start

    def row_tile(t, carry):
        r0 = start + t * rt
        rmask = (r0 + jnp.arange(rt) < start + n)[:, None]
        rows = None if rows_of is None else rows_of(r0)[:, None]

        def chunk(k, accs):
            acc_g, acc_u = accs
            d = pl.ds(k * block_d, block_d)
            if rows is None:
                x = plt.load(x_ref.at[pl.ds(r0, rt), d], mask=rmask, other=0.0)  # [R, block_d]
            else:
                x = plt.load(x_ref.at[rows, k * block_d + jnp.arange(block_d)[None, :]], mask=rmask, other=0.0)
            acc_g += _product(x, wg_ref, sg_ref, w, k * block_d, block_d, c0, block_i, convert)
            acc_u += _product(x, wu_ref, su_ref, w, k * block_d, block_d, c0, block_i, convert)
            return acc_g, acc_u

        zero = jnp.zeros((rt, block_i), jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, D // block_d, chunk, (zero, zero))
        if rf_ref is not None:
            rf = plt.load(rf_ref.at[pl.ds(r0, rt), pl.ds(0, 1)], mask=rmask, other=1.0)  # [R, 1]
            acc_g, acc_u = acc_g * rf, acc_u * rf
        h = jax.nn.silu(acc_g) * acc_u
        plt.store(h_ref.at[pl.ds(out_start + t * rt, rt), cols], h.astype(h_ref.dtype), mask=rmask)
        return carry

    lax.fori_loop(0, pl.cdiv(n, rt), row_tile, 0)


def _gate_up_kernel(
    expert_ref, start_ref, size_ref, off_ref, x_ref, *refs, block_i, block_d, D, convert, rt, row_scaled, shared, gather
):
    """``row_scaled``: x holds rows scaled into f16 and the next ref their factors [rows, 1], which multiply the
    fp32 products before the SiLU. ``expert_ref``, ``start_ref``, ``size_ref``: each routed program's expert and rows.
    ``shared`` (None, or (A, I, T, M)): the last three inputs are the shared experts'
    layer [1], gate and up [L, D, S], their T token rows are x's rows [M, M + T), and the last output is their
    h [T', S]; programs A + h of axis 0 compute its columns [h·I, (h+1)·I). ``gather``: x is the T tokens [T, D] and
    the next ref the token of each routed row [M] (the shared programs read the T tokens as they are)."""
    tok_ref = None
    if gather:
        tok_ref, *refs = refs
    if shared is not None:
        *refs, layer_ref, wgs_ref, wus_ref, h_ref, hs_ref = refs
        refs = (*refs, h_ref)
    rf_ref = None
    if row_scaled:
        rf_ref, *refs = refs
    if convert is None:  # bf16 experts
        (wg_ref, wu_ref, h_ref), sg_ref, su_ref = refs, None, None
    else:
        wg_ref, wu_ref, sg_ref, su_ref, h_ref = refs
    p, j = pl.program_id(0), pl.program_id(1)
    kw = dict(block_i=block_i, block_d=block_d, D=D, convert=convert, rt=rt)
    routed_rows = shared_rows = None
    if gather:  # a routed row's token (its rt scalars loaded once a row tile); a shared row r is token r
        last, T_x = tok_ref.shape[0] - 1, x_ref.shape[0]
        lanes = jnp.arange(rt)

        def routed_rows(r0):
            tokens = jnp.zeros((rt,), jnp.int32)
            for i in range(rt):  # rows past the last are masked: any token will do
                tokens = jnp.where(lanes == i, tok_ref[jnp.minimum(r0 + i, last)], tokens)
            return tokens

        def shared_rows(r0):
            return jnp.minimum(r0 - M + lanes, T_x - 1)

    def routed():
        e = off_ref[0] + expert_ref[p]  # the expert's index in the weights (a layer stack, flattened)
        start, n = start_ref[p], size_ref[p]
        _gate_up_rows(
            x_ref, wg_ref, wu_ref, sg_ref, su_ref, rf_ref, h_ref, e, start, n, j * block_i, **kw, rows_of=routed_rows
        )

    if shared is None:
        routed()
        return
    A, I, T, M = shared  # A routed programs, then the shared ones
    pl.when(p < A)(routed)

    @pl.when(p >= A)
    def _():
        c0 = (p - A) * I + j * block_i
        layer = layer_ref[0]
        _gate_up_rows(
            x_ref, wgs_ref, wus_ref, None, None, None, hs_ref, layer, M, T, c0, **kw, out_start=0, rows_of=shared_rows
        )


def _down_rows(h_ref, wd_ref, sd_ref, y_ref, w, start, n, out_start, k_base, c0, *, block_o, block_k, I, convert, rt):
    """y[out_start + r, c0 : c0 + block_o] = h[start + r, k_base : k_base + I] · W_down[w][k_base : k_base + I,
    those columns] for r < n, `rt` rows at a time."""
    cols = pl.ds(c0, block_o)

    def row_tile(t, carry):
        r0 = start + t * rt
        rmask = (r0 + jnp.arange(rt) < start + n)[:, None]

        def chunk(k, acc):
            k0 = k_base + k * block_k
            h = plt.load(h_ref.at[pl.ds(r0, rt), pl.ds(k0, block_k)], mask=rmask, other=0.0)  # [R, block_k]
            return acc + _product(h, wd_ref, sd_ref, w, k0, block_k, c0, block_o, convert)

        acc = lax.fori_loop(0, I // block_k, chunk, jnp.zeros((rt, block_o), jnp.float32))
        plt.store(y_ref.at[pl.ds(out_start + t * rt, rt), cols], acc, mask=rmask)
        return carry

    lax.fori_loop(0, pl.cdiv(n, rt), row_tile, 0)


def _down_kernel(expert_ref, start_ref, size_ref, off_ref, h_ref, *refs, block_o, block_k, I, convert, rt, shared):
    """``shared`` (None, or (A, T, T')): the last three inputs are the shared experts' layer [1], h [T', S] and
    down weights [L, S, D], and the last output their partial products [S/I · T', D]: program A + h of axis 0
    writes rows [h·T', h·T' + T), the product of h's columns [h·I, (h+1)·I) (A: the routed programs)."""
    if shared is not None:
        *refs, layer_ref, hs_ref, wds_ref, y_ref, ys_ref = refs
        refs = (*refs, y_ref)
    if convert is None:
        (wd_ref, y_ref), sd_ref = refs, None
    else:
        wd_ref, sd_ref, y_ref = refs
    p, j = pl.program_id(0), pl.program_id(1)
    kw = dict(block_o=block_o, block_k=block_k, I=I, convert=convert, rt=rt)

    def routed():
        start, n = start_ref[p], size_ref[p]
        _down_rows(h_ref, wd_ref, sd_ref, y_ref, off_ref[0] + expert_ref[p], start, n, start, 0, j * block_o, **kw)

    if shared is None:
        routed()
        return
    A, T, Tp = shared  # A routed programs, then the shared ones
    pl.when(p < A)(routed)

    @pl.when(p >= A)
    def _():
        hh = p - A
        _down_rows(hs_ref, wds_ref, None, ys_ref, layer_ref[0], 0, T, hh * Tp, hh * I, j * block_o, **kw)


def _moe_decode_kernel(
    x_MD,
    group_sizes_E,
    gate,
    up,
    down,
    scales,
    expert_offset,
    *,
    config,
    interpret,
    shared=None,
    x_shared_TD=None,
    group_starts_E=None,
    expert_programs=None,
    row_tokens=None,
):
    """The two pallas_calls. bf16 experts: gate/up [E', D, I], down [E', I, D], `scales` None; FP8 experts:
    gate/up [E', I, D], down [E', D, I] e4m3 and `scales` (gate, up, down). `shared` (bf16 experts only): the
    shared experts run as S / I more programs of each grid -> (y [M, D], y_shared [T, D]), both f32. `row_tokens`
    (bf16 experts only): x_MD is the T tokens, row r is token row_tokens[r] (M rows), the shared experts' rows
    the tokens themselves. Rows go `config.row_tile` (rt) at a time, routed and shared alike: every buffer a tile
    reads or writes holds rt rows past the last one a tile can start at."""
    gather = row_tokens is not None
    rt = config.row_tile
    M, D = (row_tokens.shape[0], x_MD.shape[1]) if gather else x_MD.shape
    E = group_sizes_E.shape[0]
    fp8 = scales is not None
    I = gate.shape[1] if fp8 else gate.shape[2]
    dt = x_MD.dtype
    sizes = group_sizes_E.astype(jnp.int32)
    if group_starts_E is not None and group_starts_E.shape != sizes.shape:
        raise ValueError(f"group_starts must be [E={E}] like group_sizes, got shape {group_starts_E.shape}")
    starts = jnp.cumsum(sizes) - sizes if group_starts_E is None else group_starts_E.astype(jnp.int32)
    # axis 0's routed programs: their experts and rows (one an expert, or the caller's list)
    if expert_programs is None:
        programs = (jnp.arange(E, dtype=jnp.int32), starts, sizes)
    else:
        programs = tuple(jnp.asarray(a, jnp.int32) for a in expert_programs)
    A = programs[0].shape[0]
    off = jnp.reshape(jnp.asarray(expert_offset, jnp.int32), (1,))
    params = plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    convert = config.fp8_convert if fp8 else None
    if fp8:
        gate_up, down_w = (gate, up, scales[0], scales[1]), (down, scales[2])
    else:
        gate_up, down_w = (gate.astype(dt), up.astype(dt)), (down.astype(dt),)
    row_scaled = fp8 and config.f16(dt)
    h_dtype = jnp.float32 if row_scaled else dt  # f16 products: h stays fp32 until its rows are scaled
    x = x_MD
    if row_scaled:  # f16 rows scaled by powers of two, their factors beside them
        x, _, factors = prepare_rows(x_MD, "f16")
        gate_up = (jnp.pad(factors, ((0, rt), (0, 0)), constant_values=1.0), *gate_up)
    n_programs, gu_shared, down_shared = A, None, None
    gu_out = [jax.ShapeDtypeStruct((M + rt, I), h_dtype)]  # a tile starting at row M - 1 ends within them
    down_out = [jax.ShapeDtypeStruct((M + rt, D), jnp.float32)]
    if shared is not None:
        if fp8:
            raise ValueError("moe_decode_fp8 does not take shared experts")
        T = x_MD.shape[0] if gather else x_shared_TD.shape[0]
        Tp = pl.cdiv(T, rt) * rt  # whole row tiles: no tile reads past the buffer
        ws = [w.astype(dt) for w in (shared.gate_LDS, shared.up_LDS, shared.down_LSD)]
        ws = [w[None] if w.ndim == 2 else w for w in ws]  # one layer: a stack of one (a free reshape)
        S = ws[0].shape[-1]
        layer = jnp.reshape(jnp.asarray(shared.layer if shared.gate_LDS.ndim == 3 else 0, jnp.int32), (1,))
        n_programs += S // I
        if not gather:
            # the tokens' rows after the routed rows, in one array: one XLA fusion writes both (their norm, at B = 1
            # the routed rows' broadcast of the token), where two arrays were two
            x = jnp.concatenate([x, x_shared_TD])
        gate_up = (*gate_up, layer, ws[0], ws[1])
        gu_out.append(jax.ShapeDtypeStruct((Tp, S), dt))
        down_out.append(jax.ShapeDtypeStruct((S // I * Tp, D), jnp.float32))
        gu_shared, down_shared = (A, I, T, M), (A, T, Tp)
    if gather:  # the kernel gathers each row's token in its loads: no [M, D] rows made for it
        x = (x, row_tokens.astype(jnp.int32))
    else:  # the row tiles may read past the last row (masked); pad so that no address leaves the buffers
        x = (jnp.pad(x, ((0, rt), (0, 0))),)
    name = "moe_decode_fp8" if fp8 else "moe_decode"
    h = pl.pallas_call(
        functools.partial(
            _gate_up_kernel,
            block_i=config.block_i,
            block_d=config.block_d,
            D=D,
            convert=convert,
            rt=rt,
            row_scaled=row_scaled,
            shared=gu_shared,
            gather=gather,
        ),
        out_shape=tuple(gu_out) if shared is not None else gu_out[0],
        grid=(n_programs, I // config.block_i),
        compiler_params=params,
        interpret=interpret,
        name=name + "_gate_up",
    )(*programs, off, *x, *gate_up)
    if shared is not None:
        h, h_shared = h
        down_w = (*down_w, layer, h_shared, ws[2])
    h_factors = None
    if row_scaled:  # h's rows into f16 the same way; y's rows are multiplied back below
        h, _, h_factors = prepare_rows(h, "f16")
    y = pl.pallas_call(
        functools.partial(
            _down_kernel,
            block_o=config.block_o,
            block_k=config.block_k,
            I=I,
            convert=convert,
            rt=rt,
            shared=down_shared,
        ),
        out_shape=tuple(down_out) if shared is not None else down_out[0],
        grid=(n_programs, D // config.block_o),
        compiler_params=params,
        interpret=interpret,
        name=name + "_down",
    )(*programs, off, h, *down_w)
    if shared is not None:
        y, y_shared = y
        y_shared = jnp.sum(y_shared.reshape(S // I, Tp, D)[:, :T], axis=0)  # the S / I partials, in f32
    y = y[:M] if h_factors is None else y[:M] * h_factors[:M]
    # rows past the groups were never written. Their end is the last group's (the groups are the rows in expert
    # order): a scalar the masking fusion reads, where a sum over the groups was a kernel launch of its own.
    rows = jnp.arange(M)[:, None]
    y = jnp.where(rows < starts[-1] + sizes[-1], y, 0.0)
    return y if shared is None else (y, y_shared)
