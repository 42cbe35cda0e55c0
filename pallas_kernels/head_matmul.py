"""Per-head products against one layer of a head-interleaved stack, read in place: MLA's absorbed W_UK (folded into
the query) and W_UV (applied to the attention's latent output) at decode (Pallas, Triton backend).

Dimension letters: M rows (B·T of a decode step), H heads, K a head's contraction, N its output width, L layers
of a scanned stack, R and P the stack's rows and a head's columns (MLA's `wkv_b` kernel [L, kv_lora_rank,
H·(qk_nope_head_dim + v_head_dim)]).

Grid (H, N / block_n, split over K): program (h, j, s) multiplies head h's rows by that head's weights, read in
place at the layer index (a scalar, may be traced), as `stacked_matmul` does for a whole projection (its configs,
row loads and `Partials`). `stacked_head_matmul_reference` is the same in plain XLA.

`absorbed_query` is W_UK's product for the decode kernel's query, finished in the same launch: each head's q_pe
rotated beside it and the rows laid out and padded as `mla_decode` takes them (`QueryRows`).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend
from pallas_kernels.latent_write import rotate, rotation
from pallas_kernels.mla_decode import QueryRows, SplitPartials
from pallas_kernels.mla_decode.steps import _M_INIT
from pallas_kernels.stacked_matmul import (
    FEW_ROWS,
    Partials,
    StackedMatmulConfig,
    _block_m,
    _blocks,
    _load_rows,
    _shape_problems,
    _split,
)

# 32 columns a program and no split over K: a head's W_UK (128 x 512) is 16 programs of one 128-deep chunk, its
# W_UV (512 x 128) 4 programs of two 256-deep chunks, and no partials to sum. On an H100 (2026-12-06, the sweep in
# results/2026-12-06-h100-mtp-census-projection-sweep/, V2-Lite's 16 heads at 1 / 2 / 32 rows) W_UK took 3.7 / 3.8
# / 4.7 µs against 5.5 / 5.4 / 6.4 with 64-wide blocks split over K (the sum included), W_UV 3.5 / 3.6 / 4.0 against
# 4.2 / 4.3 / 5.0.
# W_UV's 256-deep chunks only below FEW_ROWS rows: at 32 its 128-deep ones were faster (3.7 against 4.0 µs), and at
# 128 rows four stages of a 128 x 256 row tile do not fit a program's shared memory.
_F32 = jnp.float32
HEAD_CONFIG = StackedMatmulConfig(block_n=32, block_k=128, split_k=1)  # W_UK (contract_rows=False); W_UV from 16 rows
HEAD_ROWS_CONFIG = StackedMatmulConfig(block_n=32, block_k=256, split_k=1)  # W_UV (contract_rows=True) below 16 rows


def _head_config(M: int, contract_rows: bool) -> StackedMatmulConfig:
    """`stacked_head_matmul`'s default config for M rows (W_UV's with ``contract_rows``)."""
    return HEAD_ROWS_CONFIG if contract_rows and M < FEW_ROWS else HEAD_CONFIG


def stacked_head_matmul_problems(
    M: int, H: int, K: int, N: int, config: StackedMatmulConfig | None = None, *, contract_rows: bool = False
):
    """Why `stacked_head_matmul` cannot take per-head [M, K] · [K, N] products over H heads (empty when it can);
    `config` None: the call's default (`HEAD_ROWS_CONFIG` with ``contract_rows`` below `FEW_ROWS` rows, else
    `HEAD_CONFIG`)."""
    if config is None:
        config = _head_config(M, contract_rows)
    return _shape_problems(M, K, N, config)


def stacked_head_matmul_reference(
    x_MHK, w_LRC, layer, *, col_offset: int, contract_rows: bool, width: int | None = None
):
    """The per-head products of `stacked_head_matmul` in plain XLA -> f32 [M, H, N]."""
    M, H, K = x_MHK.shape
    w = lax.dynamic_index_in_dim(w_LRC, layer, axis=0, keepdims=False)  # [R, H·P]
    w_RHP = w.reshape(w.shape[0], H, -1).astype(x_MHK.dtype)
    if contract_rows:  # w[k, h, off + n]
        return jnp.einsum(
            "mhk,khn->mhn", x_MHK, w_RHP[..., col_offset : col_offset + width], preferred_element_type=jnp.float32
        )
    return jnp.einsum(
        "mhk,nhk->mhn", x_MHK, w_RHP[..., col_offset : col_offset + K], preferred_element_type=jnp.float32
    )


def _split_weights(lse_ref, h, splits: int):
    """Head h's weight of each KV split in its merged output, fp32 [Sp, 1] (Sp: splits to a power of two, the rest
    0): exp2(lse_s - max) / their sum, the combine's log-sum-exp merge (`SplitPartials`)."""
    Sp = pl.next_power_of_2(splits)
    mask = (jnp.arange(Sp) < splits)[:, None]
    lse = plt.load(lse_ref.at[pl.ds(0, Sp), pl.ds(h, 1)], mask=mask, other=-jnp.inf)  # [Sp, 1], base 2
    w = jnp.exp2(lse - jnp.maximum(jnp.max(lse, axis=0, keepdims=True), _M_INIT))
    total = jnp.sum(w, axis=0, keepdims=True)
    return w / jnp.where(total == 0.0, 1.0, total)


def _head_kernel(
    layer_ref,
    x_ref,
    *refs,
    bm,
    bn,
    bk,
    k_steps,
    K,
    N,
    P,
    col_offset,
    contract_rows,
    n_rows,
    Px,
    x_dtype,
    splits,
    heads,
):
    """``splits`` (a count, or None): x_ref holds one sequence's KV-split partials [S, Rp, Px] (row t·H + h: query
    token t, head h of ``heads``) and the next ref their lse [S, Rp]; each chunk of head h's `n_rows` rows (a query
    token each) is their merge (`SplitPartials`), rounded to x_dtype as the combine's."""
    lse_ref, w_ref, o_ref = refs if splits else (None, *refs)
    h, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    one_row = n_rows == 1  # fewer than FEW_ROWS: read as they are (one repeated over the dot's rows)
    rows = pl.ds(0, 1 if one_row else bm)
    if splits:
        weights = [_split_weights(lse_ref, t * heads + h, splits) for t in range(n_rows)]  # a query token's each
        Sp = weights[0].shape[0]

    def merged_rows(k0):
        """Head h's rows of the chunk at k0, each the merge of its KV splits' partials: [1, bk], or [bm, bk]."""
        mask = (jnp.arange(Sp) < splits)[:, None]
        x = row_id = None
        for t, a in enumerate(weights):
            o = plt.load(x_ref.at[pl.ds(0, Sp), t * heads + h, pl.ds(k0, bk)], mask=mask, other=0.0)  # [Sp, bk] f32
            row = jnp.sum(o * a, axis=0, keepdims=True).astype(x_dtype)  # [1, bk]
            if one_row:
                return row
            if x is None:
                row_id = lax.broadcasted_iota(jnp.int32, (bm, bk), 0)
                x = jnp.zeros((bm, bk), x_dtype)
            x = jnp.where(row_id == t, jnp.broadcast_to(row, (bm, bk)), x)
        return x

    def chunk(t, acc):
        k0 = (s * k_steps + t) * bk
        if splits:  # the KV splits' partials of head h's rows, merged
            x = merged_rows(k0)
        else:
            x = _load_rows(x_ref, n_rows, bm, rows, pl.ds(h * Px + k0, bk), x_dtype)  # [bm, bk]
        if one_row:
            x = jnp.broadcast_to(x, (bm, bk))
        if contract_rows:  # w tile [bk, bn]: rows k, the head's columns off + n
            w = plt.load(w_ref.at[layer, pl.ds(k0, bk), pl.ds(h * P + col_offset + j * bn, bn)])
            return acc + plt.dot(x, w)
        w = plt.load(w_ref.at[layer, pl.ds(j * bn, bn), pl.ds(h * P + col_offset + k0, bk)])  # [bn, bk]
        return acc + plt.dot(x, w, trans_b=True)

    acc = lax.fori_loop(0, k_steps, chunk, jnp.zeros((bm, bn), jnp.float32))
    if one_row:
        acc = jnp.max(acc, axis=0, keepdims=True)  # the rows are equal: any one of them
    plt.store(o_ref.at[s, rows, pl.ds(h * N + j * bn, bn)], acc)


def stacked_head_matmul(
    x_MHK,
    w_LRC,
    layer,
    *,
    col_offset: int,
    contract_rows: bool,
    width: int | None = None,
    config: StackedMatmulConfig | None = None,
    impl: str | None = "auto",
    keep_splits: bool = False,
    k_cols: int | None = None,
):
    """Per-head products against one layer of a head-interleaved stack, read in place -> f32 [M, H, N] (with
    ``keep_splits`` and fewer than `FEW_ROWS` rows: the kernel's `Partials` of rows [M, H·N] in x's dtype).

    `w_LRC` [L, R, H·P] holds for head h the columns [h·P, (h + 1)·P) (MLA's `wkv_b` kernel: R = kv_lora_rank,
    P = qk_nope_head_dim + v_head_dim). Layer `layer` (an int scalar, may be traced) is used:
      contract_rows=True:  y[m, h, n] = Σ_k x[m, h, k] · w[layer, k, h·P + col_offset + n], K = R, N = `width`
                           (W_UV applied to the attention's latent output);
      contract_rows=False: y[m, h, n] = Σ_k x[m, h, k] · w[layer, n, h·P + col_offset + k], N = R
                           (W_UK folded into the query).
    Grid (H, N / block_n, split over K): `config` None takes `HEAD_CONFIG` (W_UK; W_UV from 16 rows) or
    `HEAD_ROWS_CONFIG` (W_UV below 16 rows), which do not split K; a config that does leaves the split partials to
    XLA's sum. Rows are padded to a power of two >= 16 (the smallest tensor-core M), M <= `MAX_ROWS`, except fewer
    than 16, read as they are (`_load_rows`); a single row repeated over the dot's 16 rows (V2-Lite B = 1 on an
    H100: 139 against 151 µs a step for the two calls a layer).
    x may be `Partials` of [M, H, Px] (fewer than 16 rows: summed as loaded); `k_cols`: the contraction takes the
    first `k_cols` of each head's Px columns (MLA's q_nope within a head's query; None: all, K = Px). x may be
    `pallas_kernels.mla_decode.SplitPartials` (the decode kernel's output before its split combine): with
    ``contract_rows`` at one sequence (B = 1: a decode step's row, a verify step's s_q rows) and a power-of-two count
    of splits, each program merges its head's splits as it loads them (the combine's launch goes); otherwise they
    are merged first (`combined()`).
    impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU, else the reference).
    """
    merge = None
    if isinstance(x_MHK, SplitPartials):
        B, s_q, H, L = x_MHK.shape
        S = x_MHK.o.shape[1]
        if contract_rows and B == 1 and k_cols is None and S & (S - 1) == 0 and backend.resolve(impl) != "reference":
            merge, x_MHK = x_MHK, jax.ShapeDtypeStruct((s_q, H, L), x_MHK.dtype)  # merged as loaded, in the kernel
        else:
            x_MHK = x_MHK.combined().reshape(B * s_q, H, L)
    if config is None:
        config = _head_config(x_MHK.shape[0], contract_rows)
    if x_MHK.ndim != 3 or w_LRC.ndim != 3:
        raise ValueError(f"x must be [M, H, K] and w a stack [L, R, H·P], got {x_MHK.shape} and {w_LRC.shape}")
    M, H, Px = x_MHK.shape
    K = Px if k_cols is None else k_cols
    if not 0 < K <= Px:
        raise ValueError(f"k_cols = {k_cols} must be in [1, {Px}], the columns of x's heads")
    if isinstance(x_MHK, Partials) and M >= FEW_ROWS:
        x_MHK = x_MHK.total()
    if not isinstance(x_MHK, Partials) and K < Px:
        x_MHK, Px = x_MHK[..., :K], K
    L, R, C = w_LRC.shape
    if C % H:
        raise ValueError(f"w's {C} columns do not split into H = {H} heads")
    P = C // H
    if contract_rows:
        if R != K or width is None or col_offset + width > P:
            raise ValueError(f"contract_rows: w's rows R = {R} must equal K = {K} and col_offset + width <= P = {P}")
        N = width
    else:
        if col_offset + K > P:
            raise ValueError(f"col_offset + K = {col_offset + K} is more than the head's P = {P} columns")
        N = R
    problems = stacked_head_matmul_problems(M, H, K, N, config, contract_rows=contract_rows)
    if problems:
        raise ValueError("stacked_head_matmul: " + "; ".join(problems))
    impl = backend.resolve(impl)
    if impl == "reference":
        x = x_MHK.total()[..., :K] if isinstance(x_MHK, Partials) else x_MHK
        return stacked_head_matmul_reference(
            x, w_LRC, layer, col_offset=col_offset, contract_rows=contract_rows, width=N
        )
    bm = _block_m(M)
    bk, bn = _blocks(K, N, config)
    steps = K // bk
    split = _split(steps, H * (N // bn), config)
    Mp = 1 if M == 1 else bm  # the partials' rows (a single row: measured faster than padded to 16 rows)
    if merge is not None:  # one sequence's split partials [S, Rp, 512] and their lse [S, Rp]
        x = (merge.o[0], merge.lse[0])
    elif isinstance(x_MHK, Partials):
        x = (x_MHK.parts,)
    else:
        x = ((x_MHK if M < FEW_ROWS else jnp.pad(x_MHK, ((0, Mp - M), (0, 0), (0, 0)))).reshape(-1, H * Px),)
    partials = pl.pallas_call(
        functools.partial(
            _head_kernel,
            bm=bm,
            bn=bn,
            bk=bk,
            k_steps=steps // split,
            K=K,
            N=N,
            P=P,
            col_offset=col_offset,
            contract_rows=contract_rows,
            n_rows=M if M < FEW_ROWS else bm,
            Px=Px,
            x_dtype=x_MHK.dtype,
            splits=None if merge is None else merge.o.shape[1],
            heads=H,
        ),
        out_shape=jax.ShapeDtypeStruct((split, Mp, H * N), jnp.float32),
        grid=(H, N // bn, split),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=impl == "interpret",
        name="stacked_head_matmul",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), *x, w_LRC.astype(x_MHK.dtype))
    if keep_splits and M < FEW_ROWS:
        return Partials(partials, (M, H * N), jnp.dtype(x_MHK.dtype))
    return jnp.sum(partials, axis=0)[:M].reshape(M, H, N)


# ------------------------------------------------------------------------------------------------
# The decode kernel's query in one launch
# ------------------------------------------------------------------------------------------------


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def absorbed_query_problems(B: int, s_q: int, H: int, N: int, R: int, L: int) -> list[str]:
    """Why `absorbed_query`'s kernel cannot make the query of B sequences of s_q tokens, H heads of N nope and R
    rotary columns, over an L-wide latent (empty when it can)."""
    out = []
    Tp = QueryRows.padded(s_q, H) // H
    if QueryRows.padded(s_q, H) % H or B * Tp > FEW_ROWS:
        out.append(f"B·{Tp} = {B * Tp} padded query rows a head: more than one {FEW_ROWS}-row tile")
    if not _pow2(N) or N < 16:
        out.append(f"N = {N} nope columns is not a power of two >= 16 (one dot's contraction)")
    if not (R % 2 == 0 and _pow2(R // 2)):
        out.append(f"R = {R} rotary columns is not twice a power of two (a load a half)")
    if L % HEAD_CONFIG.block_n:
        out.append(f"L = {L} latent columns is not a multiple of {HEAD_CONFIG.block_n}")
    return out


def absorbed_query_reference(
    q, w_LRC, layer, positions_BT, inv_freq, *, heads, nope, rope_scale=1.0, interleave=True, dtype=jnp.bfloat16
):
    """`absorbed_query` in plain XLA: `MLA.absorb_query`'s arithmetic, padded into `QueryRows`."""
    B, s_q = positions_BT.shape
    x = (q.total() if isinstance(q, Partials) else q)[: B * s_q].reshape(B, s_q, heads, -1)
    q_lat = stacked_head_matmul_reference(
        x[..., :nope].reshape(B * s_q, heads, nope), w_LRC, layer, col_offset=0, contract_rows=False
    ).reshape(B, s_q, heads, -1)
    q_pe = rotate(x[..., nope:], *rotation(jnp.maximum(positions_BT, 0), inv_freq, rope_scale), interleave=interleave)
    return QueryRows.of(jnp.concatenate([q_lat.astype(x.dtype), q_pe], axis=-1).astype(dtype))


def _query_kernel(
    layer_ref,
    pos_ref,
    x_ref,
    xp_ref,
    w_ref,
    f_ref,
    o_ref,
    *,
    B,
    s_q,
    Tp,
    N,
    Px,
    P,
    L,
    R,
    S,
    bn,
    interleave,
    scale,
    x_dtype,
):
    """Program (h, j): head h's latent columns [j·bn, (j + 1)·bn) of every row (j < L / bn), or its rotary columns
    (j = L / bn). Refs: the layer [1]; positions [B·s_q]; the query rows [B·s_q', H·Px] or their S partials
    [S, B·s_q', H·Px], and the same viewed as [..., H·Px / 2, 2] (an interleaved rotary pair a row); W_UK's stack
    [L', L, H·P]; the frequencies [R/2]; the rows [B·Tp, H, L + R]."""
    h, j = pl.program_id(0), pl.program_id(1)
    real = [(b * s_q + t, b * Tp + t) for b in range(B) for t in range(s_q)]  # (query row, its padded row)
    padding = [b * Tp + t for b in range(B) for t in range(s_q, Tp)]
    out = o_ref.dtype

    def load(ref, *at):  # ref[at], partials summed in fp32 and rounded to the rows' dtype
        if not S:
            return plt.load(ref.at[at])
        parts = [plt.load(ref.at[(jnp.int32(s), *at)]) for s in range(S)]
        return functools.reduce(jnp.add, parts).astype(x_dtype)

    @pl.when(j < L // bn)
    def _():
        bm = FEW_ROWS
        row_id = lax.broadcasted_iota(jnp.int32, (bm, N), 0)
        x = jnp.zeros((bm, N), x_dtype)
        for i, (r, _) in enumerate(real):
            row = load(x_ref, pl.ds(r, 1), pl.ds(h * Px, N))  # [1, N]
            x = jnp.where(row_id == i, jnp.broadcast_to(row, (bm, N)), x)
        w = plt.load(w_ref.at[layer_ref[0], pl.ds(j * bn, bn), pl.ds(h * P, N)])  # [bn, N]
        acc = plt.dot(x, w, trans_b=True)  # [bm, bn] fp32, row i: real row i's
        acc_id = lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
        for i, (_, m) in enumerate(real):
            y = jnp.sum(jnp.where(acc_id == i, acc, 0.0), axis=0, keepdims=True)
            plt.store(o_ref.at[pl.ds(m, 1), h, pl.ds(j * bn, bn)], y.astype(x_dtype).astype(out))
        for m in padding:
            plt.store(o_ref.at[pl.ds(m, 1), h, pl.ds(j * bn, bn)], jnp.zeros((1, bn), out))

    @pl.when(j == L // bn)
    def _():
        half = R // 2
        f = plt.load(f_ref.at[pl.ds(0, half)])
        for r, m in real:
            if interleave:  # pair i is row (h·Px + N) / 2 + i of the pairs' view
                re, im = (load(xp_ref, jnp.int32(r), pl.ds((h * Px + N) // 2, half), jnp.int32(c)) for c in (0, 1))
            else:
                re, im = (load(x_ref, jnp.int32(r), pl.ds(h * Px + N + c, half)) for c in (0, half))
            re, im = re.astype(_F32), im.astype(_F32)
            angles = jnp.maximum(pos_ref[r], 0).astype(_F32) * f  # `rotation` (padding: as position 0)
            cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
            y_re, y_im = ((y.astype(x_dtype).astype(out)) for y in (re * cos - im * sin, re * sin + im * cos))
            if interleave:  # `rotate`
                plt.store(o_ref.at[pl.ds(m, 1), h, pl.ds(L, R)], jnp.stack([y_re, y_im], axis=-1).reshape(1, R))
            else:
                plt.store(o_ref.at[jnp.int32(m), h, pl.ds(L, half)], y_re)
                plt.store(o_ref.at[jnp.int32(m), h, pl.ds(L + half, half)], y_im)
        for m in padding:
            plt.store(o_ref.at[pl.ds(m, 1), h, pl.ds(L, R)], jnp.zeros((1, R), out))


def absorbed_query(
    q,
    w_LRC,
    layer,
    positions_BT,
    inv_freq,
    *,
    heads: int,
    nope: int,
    rope_scale: float = 1.0,
    interleave: bool = True,
    dtype=jnp.bfloat16,
    impl: str | None = "auto",
) -> QueryRows:
    """The decode kernel's query in one launch: per head [q_nope · W_UK ; rope(q_pe)] in `dtype`, laid out and padded
    as `mla_decode` takes it (`QueryRows`) -> `MLA.absorb_query`'s values without the XLA launch that rotated,
    concatenated and padded them.

    Args:
      q: the per-head query rows [B·s_q, H·(N + R)] (head h's nope columns then its rotary ones; more rows allowed,
        the first B·s_q used), or their split-K `Partials`, summed as loaded and rounded to their dtype.
      w_LRC: wkv_b's stack [L', L, H·P] (head h's columns [h·P, h·P + N) are its W_UK: y = x · w[layer, :, cols]ᵀ);
        layer: an int scalar (may be traced), read in place.
      positions_BT: int32 [B, s_q] the tokens' positions (a negative one, padding, rotated as position 0); inv_freq
        fp32 [R/2] and rope_scale: `rotation`'s; interleave: the rotary pairs' layout (`rotate`).
      heads, nope: H and N. dtype: the rows' (bf16 for the decode kernel); q_lat is rounded to q's dtype first,
        as the model's concatenation does.
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU where
        `absorbed_query_problems` is empty, else `absorbed_query_reference`).
    """
    B, s_q = positions_BT.shape
    H, N, R = heads, nope, 2 * len(inv_freq)
    rows = q.parts if isinstance(q, Partials) else q
    Lw, L, C = w_LRC.shape
    Px = rows.shape[-1] // H
    if rows.shape[-1] != H * (N + R) or rows.shape[-2] < B * s_q or rows.ndim != (3 if isinstance(q, Partials) else 2):
        raise ValueError(
            f"absorbed_query: q must be rows [>= B·s_q = {B * s_q}, H·(N + R) = {H * (N + R)}] (or their Partials), "
            f"got {tuple(rows.shape)}"
        )
    if C % H or C // H < N:
        raise ValueError(f"absorbed_query: w's {C} columns do not hold H = {H} heads of >= N = {N} columns")
    kw = dict(heads=H, nope=N, rope_scale=rope_scale, interleave=interleave, dtype=dtype)
    impl = backend.choose(impl, absorbed_query_problems(B, s_q, H, N, R, L), name="absorbed_query impl")
    if impl == "reference":
        return absorbed_query_reference(q, w_LRC, layer, positions_BT, inv_freq, **kw)
    Rp = QueryRows.padded(s_q, H)
    Tp, bn = Rp // H, HEAD_CONFIG.block_n
    out = pl.pallas_call(
        functools.partial(
            _query_kernel,
            B=B,
            s_q=s_q,
            Tp=Tp,
            N=N,
            Px=Px,
            P=C // H,
            L=L,
            R=R,
            S=rows.shape[0] if isinstance(q, Partials) else 0,
            bn=bn,
            interleave=interleave,
            scale=float(rope_scale),
            x_dtype=jnp.dtype(q.dtype),
        ),
        out_shape=jax.ShapeDtypeStruct((B * Tp, H, L + R), dtype),
        grid=(H, L // bn + 1),
        compiler_params=plt.CompilerParams(num_warps=HEAD_CONFIG.num_warps, num_stages=1),
        interpret=impl == "interpret",
        name="absorbed_query",
    )(
        jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
        positions_BT.reshape(B * s_q).astype(jnp.int32),
        rows,
        rows.reshape(rows.shape[:-1] + (rows.shape[-1] // 2, 2)),
        w_LRC.astype(q.dtype),
        jnp.asarray(inv_freq, _F32),
    )
    return QueryRows(out.reshape(B, Rp, L + R), s_q, H)
