"""Decode-shaped projections over a stack of layers: `x @ w[layer]`, the weights read in place (Pallas, Triton backend).

Dimension letters: M rows (B·T of a decode step), K the projection's input width, N its output width,
L layers of a scanned stack.

A scanned model keeps each projection's weights as one [L, K, N] stack. A scan slices its inputs, and a
slice that feeds a GEMM is materialised: every decode step copies every projection's weights once
before reading them (XLA's async dynamic-slice fusions, about a millisecond a V2-Lite step). At a
single row XLA does not call a GEMM at all but writes a weight-sized product and reduces it. This
kernel takes the whole stack and the layer index (a scalar, may be traced) and reads layer `layer`'s
weights in place, once, with tensor-core dots:

  grid (M / block_m, N / block_n, split_k): program (i, j, s) accumulates x[i-th rows, s-th K range] ·
  w[layer, s-th K range, j-th columns] in fp32 over `block_k` chunks and writes that partial; the
  split_k partials are summed by XLA (a [split_k, M, N] fp32 reduce, small at decode).

The split over K gives a skinny call enough programs to keep the memory system busy; rows are padded to
a multiple of `block_m` (at least 16, the smallest tensor-core M), except fewer than 16 (a B = 1 decode step, an
MTP verify step of B = 1, a small batch), which the kernel reads as they are, a row a load, into the 16 rows of
its dots (a single row repeated over them): a pad is a kernel launch of its own. The partials keep 16 rows.

`norm` (a `RowNorm`): the rows are the input of an RMSNorm (`rms_norm`). Up to `NORM_ROWS` rows are normalised
inside the kernel: each program loads each whole row at once for its root mean square (a few 4 KB pieces, in
flight together), then normalises and scales each chunk it multiplies. A B = 1 decode layer's input norm, or an
MTP verify step's, then costs no launch of its own (XLA's reduction and the normalising pad were two). More rows
are normalised by XLA first (a program would load every row whole before its first product).

`Partials`: below `FEW_ROWS` rows a call may hand its split-K partials on unsummed (``keep_splits=True``), and a
call given `Partials` as its rows sums them as it loads them: a projection feeding another (MLA's `wq` / `wq_b`
into W_UK, W_UV into `wo`, `wq_a` into `wq_b`) then costs no reduction launch between the two.

Several stacks of one L and K (the projections of one layer input: MLA's `wq` or `wq_a`, and `wkv_a`) go in one
launch: their column tiles follow one another along the grid's columns, one split over K for all, the rows (and
their norm) loaded once a program as for one stack. V2-Lite's q and kv_a were two launches a layer (8.7 and 5.1 µs
at one row on an H100, kv_a's 2.4 MB latency-bound).

`stacked_matmul_reference` is the same function in plain XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend

MAX_ROWS = 128  # a decode step's rows (B·T) this kernel is for; larger calls are a GEMM's business
FEW_ROWS = 16  # rows below this (the smallest tensor-core M) are read as they are, a row a load
ANY_ROWS = "any_rows"  # keep_splits: `Partials` at any number of rows (for a consumer that sums a row's as it loads it)
NORM_ROWS = 4  # rows up to this are normalised in the kernel (`norm`): one decode row, or a B = 1 MTP verify step's
_F32 = jnp.float32


def rms_norm(x, weight, eps: float, *, weight_apart: bool = False):
    """DeepSeek's (HF transformers') RMSNorm: normalise in fp32, cast to x's dtype, scale by `weight` [..., K]
    -> the promoted dtype of x and weight. The one formula of `mla_jax.norm.RMSNorm` and of `RowNorm`.

    ``weight_apart`` (the same values): the weight's multiply is kept out of the normalising fusion (an optimization
    barrier on the normalised rows) for more than one row. Where the weight is a scanned layer's slice, XLA's row
    norm over 2 or more rows is a Triton fusion that cannot read a slice in place and copies it first (a launch a
    norm a layer, at every decode step of B >= 2 and every MTP verify step); apart, the multiply fuses into the
    norm's consumer, which reads the slice where it is."""
    xf = x.astype(_F32)
    y = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    if weight_apart and math.prod(x.shape[:-1]) > 1:
        y = lax.optimization_barrier(y)
    return weight * y


class RowNorm(NamedTuple):
    """An RMSNorm (`rms_norm`) of `stacked_matmul`'s rows, applied in the kernel: `weight` [K], or a scanned
    stack's [L, K] whose row `layer` the kernel reads in place (as it reads the projection's), `eps`."""

    weight: jax.Array
    eps: float


class Partials(NamedTuple):
    """Rows held as split-K partial products, not yet summed: `parts` fp32 [S, Mp, C] (S splits, Mp >= the rows),
    whose sum over S, its first rows cast to `dtype`, is the rows, of logical `shape` (`total`): [..., C], or with
    a row's C columns split further (per head: [M, H, C / H]). `stacked_matmul` and `stacked_head_matmul` return
    them with ``keep_splits=True`` (fewer than `FEW_ROWS` rows) and take them as rows, summing in their loads (the
    same sum in fp32, then the cast)."""

    parts: jax.Array
    shape: tuple
    dtype: jnp.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def total(self) -> jax.Array:
        """The rows [*shape] in `dtype`: the partials summed (by XLA)."""
        rows = math.prod(self.shape) // self.parts.shape[-1]
        return jnp.sum(self.parts, axis=0)[:rows].astype(self.dtype).reshape(self.shape)

    def reshape(self, *shape) -> Partials:
        """The same partials as rows of another logical shape (one -1 allowed): a row's C columns stay one row's,
        as its last axes."""
        shape = list(shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        size = math.prod(self.shape)
        if -1 in shape:
            shape[shape.index(-1)] = size // max(1, -math.prod(shape))
        C = self.parts.shape[-1]
        if math.prod(shape) != size or all(math.prod(shape[k:]) != C for k in range(len(shape))):
            raise ValueError(f"Partials of {size // C} rows of {C} cannot be rows of shape {tuple(shape)}")
        return self._replace(shape=tuple(shape))


def _rows_out(partials, M: int, dtype, keep_splits: bool, shape: tuple):
    """A call's result from its fp32 partials [S, Mp, N]: `Partials` (``keep_splits``, fewer than `FEW_ROWS`
    rows, or `ANY_ROWS`), else their sum's first M rows in `dtype`, [*shape]."""
    out = Partials(partials, tuple(shape), jnp.dtype(dtype))
    return out if keep_splits == ANY_ROWS or (keep_splits and M < FEW_ROWS) else out.total()


TARGET_PROGRAMS = 264  # about two programs a streaming multiprocessor of an H100/H200 (132)


@dataclasses.dataclass(frozen=True)
class StackedMatmulConfig:
    """Static tuning knobs of `stacked_matmul`.

    Attributes:
      block_n: output columns a program computes (divides N; a narrower N, a power of two >= 16, is one block).
      block_k: contraction chunk of a program's loop (divides K; likewise a narrower K is one chunk).
      split_k: programs along K (divides K / block_k); None: enough for about `TARGET_PROGRAMS` programs.
      num_warps, num_stages: Triton's launch knobs (warps a program; software-pipeline depth).
    """

    block_n: int = 64
    block_k: int = 128
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for f in ("block_n", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"StackedMatmulConfig.{f} must be a power of two >= 16, got {v}")
        if self.split_k is not None and self.split_k < 1:
            raise ValueError(f"StackedMatmulConfig.split_k must be >= 1 or None, got {self.split_k}")


def stacked_matmul_problems(M: int, K: int, N: int, config: StackedMatmulConfig = StackedMatmulConfig()) -> list[str]:
    """Why `stacked_matmul` cannot take an [M, K] · [K, N] projection (empty when it can)."""
    return _shape_problems(M, K, N, config)


def _blocks(K: int, N: int, config: StackedMatmulConfig) -> tuple[int, int]:
    """(block_k, block_n) of a call: the config's, or the whole width where it is narrower (a power of two >= 16)."""
    return min(config.block_k, K), min(config.block_n, N)


def _shape_problems(M: int, K: int, N: int, config: StackedMatmulConfig) -> list[str]:
    """Why an [M, K] · [K, N] product does not fit the kernels' blocks (`_blocks`), the split included."""
    out = []
    if M > MAX_ROWS:
        out.append(f"M = {M} rows is more than the {MAX_ROWS} a decode-shaped call takes")
    for (name, dim, block), b in zip((("K", K, config.block_k), ("N", N, config.block_n)), _blocks(K, N, config)):
        if dim % b or b < 16 or b & (b - 1):
            out.append(f"{name} = {dim} is not a multiple of the block {block} (nor a power of two >= 16 below it)")
    bk, bn = _blocks(K, N, config)
    if config.split_k is not None and K % bk == 0 and (K // bk) % config.split_k:
        out.append(f"split_k = {config.split_k} does not divide K / block_k = {K // bk}")
    smem = _smem_bytes(M, bk, bn, config)
    if M <= MAX_ROWS and smem > SMEM_BYTES:
        out.append(
            f"{config.num_stages} stages of a {_block_m(M)} x {bk} row tile and a {bk} x {bn} weight tile need "
            f"{smem} bytes of shared memory; an H100 / H200 program has {SMEM_BYTES}"
        )
    return out


SMEM_BYTES = 232_448  # shared memory a Triton program may use on an H100 / H200 (227 KB)


def _smem_bytes(M: int, block_k: int, block_n: int, config: StackedMatmulConfig, itemsize: int = 2) -> int:
    """Shared memory of a program's software pipeline: `num_stages` copies of its row tile and its weight tile
    (bf16 operands). A config over `SMEM_BYTES` fails to compile for the card (Triton: "out of resource")."""
    return config.num_stages * (_block_m(M) * block_k + block_k * block_n) * itemsize


def _block_m(M: int) -> int:
    return max(16, 1 << (M - 1).bit_length())


def _split(steps: int, programs: int, config: StackedMatmulConfig) -> int:
    """Programs along K for a call of `programs` output tiles whose contraction is `steps` chunks: the config's
    `split_k`, else the largest power of two dividing `steps` that keeps the call within `TARGET_PROGRAMS`."""
    if config.split_k is not None:
        return config.split_k
    s = 1
    while steps % (s * 2) == 0 and programs * s * 2 <= TARGET_PROGRAMS:
        s *= 2
    return s


def _split_k(M: int, K: int, N: int, config: StackedMatmulConfig) -> int:
    bk, bn = _blocks(K, N, config)
    return _split(K // bk, pl.cdiv(M, _block_m(M)) * (N // bn), config)


def stacked_matmul_reference(x_MK, w_LKN, layer, *, norm: RowNorm | None = None, dtype=None):
    """[norm](x) [M, K] · w_LKN[layer] [K, N] (fp32 accumulation) -> [M, N] in `dtype` (None: x's dtype)."""
    dtype = x_MK.dtype if dtype is None else dtype
    x = x_MK
    if norm is not None:
        g = norm.weight
        g = g if g.ndim == 1 else lax.dynamic_index_in_dim(g, layer, axis=0, keepdims=False)
        x = rms_norm(x_MK, g, norm.eps)
    w_KN = lax.dynamic_index_in_dim(w_LKN, layer, axis=0, keepdims=False)
    return jnp.dot(x.astype(dtype), w_KN.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)


def _validate(x_MK, w_LKN, config):
    if x_MK.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x_MK.shape}")
    if w_LKN.ndim != 3 or w_LKN.shape[1] != x_MK.shape[1]:
        raise ValueError(f"w must be a stack [L, K={x_MK.shape[1]}, N], got shape {w_LKN.shape}")
    problems = stacked_matmul_problems(x_MK.shape[0], w_LKN.shape[1], w_LKN.shape[2], config)
    if problems:
        raise ValueError("stacked_matmul: " + "; ".join(problems))


def _row_pieces(K: int) -> int:
    """The width of the pieces `_row_scale` loads a row in: the largest power of two dividing K, at most 2048."""
    return min(K & -K, 2048)


def _load_x(x_ref, rows: pl.Slice, k: pl.Slice, dtype):
    """x_ref[rows, k]; from split-K partials [S, Mp, K] (`Partials`), their sum over S cast to the rows' `dtype`."""
    if len(x_ref.shape) == 2:
        return plt.load(x_ref.at[rows, k])
    total = None
    for s in range(x_ref.shape[0]):
        part = plt.load(x_ref.at[jnp.int32(s), rows, k])
        total = part if total is None else total + part
    return total.astype(dtype)


def _row_scale(x_ref, K, eps, n_rows: int = 1, block_m: int = 1, dtype=None):
    """1 / the root mean square + eps of each of the `n_rows` rows of x [n_rows, K] (or of `Partials`' parts, the rows
    in `dtype`), fp32 [block_m, 1] (`rms_norm`'s; rows past `n_rows` 0). Each row is loaded in a few power-of-two
    pieces unrolled (one for K = 2048, seven of 1024 for 7168), all in flight at once: a loop of dependent loads
    before the first product cost 9 µs a call."""
    piece = _row_pieces(K)
    row_id = lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    scale = jnp.zeros((block_m, 1), _F32)
    for r in range(n_rows):
        ssq = jnp.zeros((1, 1), _F32)
        for t in range(K // piece):
            x = _load_x(x_ref, pl.ds(r, 1), pl.ds(t * piece, piece), dtype).astype(_F32)
            ssq = ssq + jnp.sum(x * x, axis=1, keepdims=True)
        rs = lax.rsqrt(ssq / K + eps)
        scale = rs if block_m == 1 else jnp.where(row_id == r, jnp.broadcast_to(rs, (block_m, 1)), scale)
    return scale


def _load_rows(x_ref, n_rows: int, block_m: int, rows: pl.Slice, k: pl.Slice, dtype=None):
    """x_ref[rows, k] as a [block_m, width] tile: `block_m` rows loaded as they are, or (`n_rows` < `FEW_ROWS`, x_ref
    holding just those rows, or `Partials`' parts: `_load_x`) each row loaded alone into its row of the tile, the
    rest 0; with `n_rows` = 1 the single row is loaded [1, width] and repeated by the caller."""
    if n_rows >= FEW_ROWS or n_rows == 1:
        return _load_x(x_ref, rows, k, dtype)
    x = None
    row_id = None
    for r in range(n_rows):
        row = _load_x(x_ref, pl.ds(r, 1), k, dtype)
        if x is None:
            width = row.shape[1]
            row_id = lax.broadcasted_iota(jnp.int32, (block_m, width), 0)
            x = jnp.zeros((block_m, width), row.dtype)
        x = jnp.where(row_id == r, jnp.broadcast_to(row, (block_m, width)), x)
    return x


def _kernel(layer_ref, x_ref, *refs, tiles, block_m, block_k, k_steps, n_rows, norm_eps, x_dtype, dtype):
    """Program (i, j, s): the j-th column tile of the weights' tiles laid end to end (`tiles`: (first tile, block_n)
    of each weight), rows i, K range s. refs: [the norm's weight], the weights, then their outputs."""
    if norm_eps is not None:
        g_ref, *refs = refs
    else:
        g_ref = None
    w_refs, o_refs = refs[: len(tiles)], refs[len(tiles) :]
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    one_row = n_rows == 1
    rows = pl.ds(0 if one_row else i * block_m, 1 if one_row else block_m)
    scale = None
    if g_ref is not None:  # up to NORM_ROWS rows, read as they are
        scale = _row_scale(x_ref, x_ref.shape[-1], norm_eps, n_rows, 1 if one_row else block_m, x_dtype)

    def product(w_ref, o_ref, cols, block_n):
        def chunk(t, acc):
            k = pl.ds((s * k_steps + t) * block_k, block_k)
            x = _load_rows(x_ref, n_rows, block_m, rows, k, x_dtype)
            if g_ref is not None:  # rms_norm's arithmetic on this chunk
                g = plt.load(g_ref.at[k] if len(g_ref.shape) == 1 else g_ref.at[layer, k])
                y = (x.astype(_F32) * scale).astype(x.dtype)
                x = (g.astype(_F32)[None, :] * y.astype(_F32)).astype(jnp.result_type(g.dtype, x.dtype))
            x = x.astype(dtype)
            if one_row:  # the row repeated over the dot's 16 rows (each row of the product is the same)
                x = jnp.broadcast_to(x, (block_m, block_k))
            return acc + plt.dot(x, plt.load(w_ref.at[layer, k, cols]))

        acc = lax.fori_loop(0, k_steps, chunk, jnp.zeros((block_m, block_n), _F32))
        if one_row:
            acc = jnp.max(acc, axis=0, keepdims=True)  # the rows are equal: any one of them
        plt.store(o_ref.at[s, rows, cols], acc)

    if len(tiles) == 1:
        product(w_refs[0], o_refs[0], pl.ds(j * tiles[0][1], tiles[0][1]), tiles[0][1])
        return
    ends = [first for first, _ in tiles[1:]] + [None]
    for w_ref, o_ref, (first, block_n), end in zip(w_refs, o_refs, tiles, ends):
        mine = j >= first if end is None else (j >= first) & (j < end)
        pl.when(mine)(functools.partial(product, w_ref, o_ref, pl.ds((j - first) * block_n, block_n), block_n))


def _stacked_matmul_kernel(x_MK, ws, layer, *, config, interpret, norm, dtype, keep_splits):
    """The weights `ws` (stacks [L, K, N_i] of one K) in one launch -> a result a weight (`keep_splits`: a bool
    a weight)."""
    M, K = x_MK.shape
    bm = _block_m(M)
    blocks = [_blocks(K, w.shape[2], config) for w in ws]
    bk = blocks[0][0]
    n_tiles = [w.shape[2] // bn for w, (_, bn) in zip(ws, blocks)]
    split = _split(K // bk, pl.cdiv(M, bm) * sum(n_tiles), config)
    few = M < FEW_ROWS  # read as they are (`_load_rows`); `Partials` only then (more rows are summed by XLA)
    if isinstance(x_MK, Partials) and not few:
        x_MK = x_MK.total()
    if norm is not None and M > NORM_ROWS:  # more rows' norms by XLA (`_row_scale` loads each row whole)
        g = norm.weight if norm.weight.ndim == 1 else lax.dynamic_index_in_dim(norm.weight, layer, 0, False)
        x_MK, norm = rms_norm(x_MK.total() if isinstance(x_MK, Partials) else x_MK, g, norm.eps), None
    Mp = 1 if M == 1 else pl.cdiv(M, bm) * bm  # the partials' rows
    if isinstance(x_MK, Partials):
        x = x_MK.parts
    else:
        x = x_MK if few else jnp.pad(x_MK.astype(dtype), ((0, Mp - M), (0, 0)))
    norm_args = () if norm is None else (norm.weight,)
    firsts = [sum(n_tiles[:i]) for i in range(len(ws))]
    partials = pl.pallas_call(
        functools.partial(
            _kernel,
            tiles=tuple((first, bn) for first, (_, bn) in zip(firsts, blocks)),
            block_m=bm,
            block_k=bk,
            k_steps=K // bk // split,
            n_rows=M if few else bm,
            norm_eps=None if norm is None else float(norm.eps),
            x_dtype=x_MK.dtype,
            dtype=dtype,
        ),
        out_shape=tuple(jax.ShapeDtypeStruct((split, Mp, w.shape[2]), _F32) for w in ws),
        grid=(1 if M == 1 else Mp // bm, sum(n_tiles), split),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="stacked_matmul",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), x, *norm_args, *(w.astype(dtype) for w in ws))
    return tuple(
        _rows_out(p, M, dtype, keep, (M, w.shape[2])) for p, w, keep in zip(partials, ws, keep_splits, strict=True)
    )


def stacked_matmul(
    x_MK,
    w_LKN,
    layer,
    *,
    norm: RowNorm | None = None,
    dtype=None,
    config: StackedMatmulConfig | None = None,
    impl: str | None = "auto",
    keep_splits: bool | tuple[bool, ...] = False,
):
    """[norm](x) [M, K] · w_LKN[layer] [K, N] -> [M, N] in `dtype` (fp32 accumulation).

    Args:
      x_MK: [M, K] rows, bf16 (or f32), M <= `MAX_ROWS`; or `Partials` of [M, K] (another call's unsummed result).
      w_LKN: [L, K, N] a scanned stack of one projection's weights (cast to `dtype`); read in place. Or a tuple of
        such stacks of one L and K (projections of the same rows, e.g. MLA's `wq` and `wkv_a`): their products in
        one launch, whose column tiles follow one another (one split over K for all), -> a tuple of results.
      layer: int scalar (may be traced), the layer of the stack to use; 0 <= layer < L (not checked
        when traced).
      norm: a `RowNorm` (weight [K]) to apply to the rows first, inside the kernel (`rms_norm`); None: none.
      dtype: the products' operand and result dtype (None: x's); the rows (after the norm) are cast to it.
      config: `StackedMatmulConfig`; K and N must be multiples of its blocks (`stacked_matmul_problems`).
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU, else the reference).
      keep_splits: return the kernel's split-K partials as `Partials` (fewer than `FEW_ROWS` rows; else the sum), or
        `ANY_ROWS` at any number of rows (a consumer that sums each row's as it loads it, `latent_write`); with a tuple
        of stacks, one for all or a tuple of one a stack.
    """
    config = StackedMatmulConfig() if config is None else config
    many = isinstance(w_LKN, (tuple, list))
    ws = tuple(w_LKN) if many else (w_LKN,)
    if not ws:
        raise ValueError("stacked_matmul: no weights")
    for w in ws:
        _validate(x_MK, w, config)
    if len({(w.shape[0], w.shape[1]) for w in ws}) > 1:
        raise ValueError(f"stacked_matmul: the stacks must share L and K, got shapes {[w.shape for w in ws]}")
    keeps = tuple(keep_splits) if isinstance(keep_splits, (tuple, list)) else (keep_splits,) * len(ws)
    if len(keeps) != len(ws):
        raise ValueError(f"stacked_matmul: keep_splits has {len(keeps)} entries for {len(ws)} stacks")
    if norm is not None and (norm.weight.ndim not in (1, 2) or norm.weight.shape[-1] != x_MK.shape[1]):
        raise ValueError(
            f"stacked_matmul: the norm's weight must be [K={x_MK.shape[1]}] or [L, K], got {norm.weight.shape}"
        )
    dtype = x_MK.dtype if dtype is None else jnp.dtype(dtype)
    impl = backend.resolve(impl)
    if impl == "reference":
        x = x_MK.total() if isinstance(x_MK, Partials) else x_MK
        out = tuple(stacked_matmul_reference(x, w, layer, norm=norm, dtype=dtype) for w in ws)
    else:
        out = _stacked_matmul_kernel(
            x_MK, ws, layer, config=config, interpret=impl == "interpret", norm=norm, dtype=dtype, keep_splits=keeps
        )
    return out if many else out[0]
