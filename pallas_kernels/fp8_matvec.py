"""Decode-shaped projections with FP8 block-scaled weights: `x @ dequant(w)ᵀ`, each weight byte read once (Pallas,
Triton backend).

Dimension letters: M rows (B·T of a decode step, at most `MAX_ROWS`), K the projection's input width, N its
output width, L layers of a scanned stack; nb = ceil(N / 128), kb = ceil(K / 128).

The weights are DeepSeek-V3's release format: e4m3 values w [N, K] (torch's [out, in], K contiguous) with one
fp32 scale per 128x128 block, scale [nb, kb], W[n, k] = w[n, k] · scale[n // 128, k // 128] (edge blocks
partial). A decode step reads its weights and little else, so the e4m3 bytes are what it must move: half of
bf16's. This kernel reads them as they are stored, converts each tile to the activations' dtype in registers
(e4m3 -> bf16 is exact), and applies the block's scale to the tile's fp32 partial product:

  grid (1, ceil(N / block_n), split_k): program (0, j, s) loops over its K range in `block_k` chunks (a chunk
  lies in one 128-wide scale block, the program's columns in one 128-row one), acc += (x_chunk · w_tileᵀ) ·
  scale[j-th block, chunk's block] in fp32, and writes that partial; XLA sums the split_k partials.

Split over K as `pallas_kernels.stacked_matmul` does, so a skinny call still runs about `TARGET_PROGRAMS`
programs; the split is any divisor of the chunks (V3's K = 7168 is 56 chunks: a power of two would stop at 8).
Rows are padded to a power of two >= 16 (the smallest tensor-core M). N and K need not be multiples of the
blocks: the edge tiles are masked (never read out of bounds).

A stack: w [L, N, K] with scales [L, nb, kb] and a layer index (an int scalar, may be traced): layer `layer`
is read in place, so a scanned model passes its whole stack and no per-layer slice is copied.

The product's operands (`Fp8MatvecConfig.operands`): by default, for bf16 rows, float16: each row of x scaled
by a power of two into f16's range and each weight tile converted e4m3 -> f16, one instruction for two values
on Hopper (the conversion, not the bytes, sets the time of the bf16 form: docs/PERFORMANCE.md, "FP8 weights");
float32 rows stay exact. "x" converts the tiles to x's dtype (bf16 / f32), "e4m3" quantizes x and multiplies fp8 by fp8.

Conversion with operands "x" (`Fp8MatvecConfig.convert`): "cast" is the e4m3 -> bf16/f32 conversion Triton
lowers for sm_89+; "bits" loads the same bytes and decodes the e4m3fn bit fields with integer arithmetic
(`e4m3_to_f32`), for a Triton that does not convert (it costs ~10 integer operations a weight).

The result differs from `fp8_matvec_reference` (the weight dequantized to x's dtype, then one dot) by where
the scale multiplies: per block after the dot here, per weight before it there (bf16 rounding of the scaled
weights); with f16 operands also by x's rounding to f16 (finer than bf16's); with e4m3 operands by x's
rounding to e4m3 (about 2.5e-2 relative, DeepSeek-V3's recipe).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend
from pallas_kernels.fp8_gemm.config import QUANT_BLOCK
from pallas_kernels.fp8_gemm.reference import dequantize_blocks
from pallas_kernels.stacked_matmul import TARGET_PROGRAMS

MAX_ROWS = 32  # rows a call serves (padded to 16 or 32); more is a GEMM's business (`pallas_kernels.fp8_gemm`)
CONVERTS = ("cast", "bits")
OPERANDS = ("x", "f16", "e4m3")  # what the tensor-core product takes (`Fp8MatvecConfig.operands`)
E4M3_MAX = 448.0
FP8_DTYPE = jnp.float8_e4m3fn
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Fp8MatvecConfig:
    """Static tuning knobs of `fp8_matvec`.

    Attributes:
      block_n: output columns a program computes (a power of two in [16, 128]: it divides 128, so a
        program's columns share one row of scale blocks).
      block_k: contraction chunk of a program's loop (a power of two in [16, 128]: a chunk lies in one
        scale block).
      split_k: programs along K (divides ceil(K / block_k)); None: enough for about `TARGET_PROGRAMS`.
      convert: "cast" (Triton's e4m3 conversion) or "bits" (integer decoding, `e4m3_to_f32`); with
        ``operands="x"`` only.
      operands: the dtype of the tensor-core product; None: "f16" for bf16 rows (the fastest with exact weights,
        docs/PERFORMANCE.md, "FP8 weights", and finer than bf16), "x" for float32 rows (kept exact) and with
        ``convert="bits"``. "x": x as given (bf16 or f32), each weight tile converted to
        it by ``convert``. "f16": each row of x scaled by a power of two into float16's range (exact; undone on
        the output) and the weights converted e4m3 -> f16, which Hopper does in one instruction for two values
        (e4m3 -> bf16 goes through f32); e4m3 values are exact in f16 and f16 keeps 3 more bits of x than bf16.
        "e4m3": no weight conversion at all: x quantized per (row, 128-column block) to e4m3 with an fp32 scale
        (amax / 448, DeepSeek-V3's `act_quant`, what its release's own linear layers do when the weights are
        FP8) and an fp8 x fp8 product with fp32 accumulation; x's rounding to e4m3 (3 mantissa bits) is the
        error it adds.
      num_warps, num_stages: Triton's launch knobs (warps a program; software-pipeline depth).
    """

    block_n: int = 64
    block_k: int = 128
    split_k: int | None = None
    convert: str = "cast"
    num_warps: int = 4
    num_stages: int = 4
    operands: str | None = None

    def __post_init__(self):
        for f in ("block_n", "block_k"):
            v = getattr(self, f)
            if not 16 <= v <= QUANT_BLOCK or v & (v - 1):
                raise ValueError(f"Fp8MatvecConfig.{f} must be a power of two in [16, {QUANT_BLOCK}], got {v}")
        if self.split_k is not None and self.split_k < 1:
            raise ValueError(f"Fp8MatvecConfig.split_k must be >= 1 or None, got {self.split_k}")
        if self.convert not in CONVERTS:
            raise ValueError(f"Fp8MatvecConfig.convert must be one of {CONVERTS}, got {self.convert!r}")
        if self.operands is not None and self.operands not in OPERANDS:
            raise ValueError(f"Fp8MatvecConfig.operands must be one of {OPERANDS}, got {self.operands!r}")
        if self.convert != "cast" and self.operands not in (None, "x"):
            raise ValueError(f"Fp8MatvecConfig.convert={self.convert!r} converts to x's dtype: it needs operands='x'")
        if self.operands == "e4m3" and self.block_k < 32:
            raise ValueError(
                f"Fp8MatvecConfig.operands='e4m3' needs block_k >= 32 (an fp8 product's K), got {self.block_k}"
            )


def default_config(N: int, K: int) -> Fp8MatvecConfig:
    """`fp8_matvec`'s config when none is given: 128 output columns a program for a wide output of twice its width's
    inputs (N >= 4096, K >= 2·N: the projections back to the hidden width, V3's wo and down), 64 elsewhere
    (128 columns are faster on wo and down, slower on gate_up, q_a, kv_a and q_b: docs/PERFORMANCE.md, "FP8
    weights")."""
    return Fp8MatvecConfig(block_n=128 if N >= 4096 and K >= 2 * N else 64)


def fp8_matvec_problems(M: int, N: int, K: int, config: Fp8MatvecConfig = Fp8MatvecConfig()) -> list[str]:
    """Why `fp8_matvec` cannot take an [M, K] · [N, K]ᵀ product (empty when it can). Any N, K >= 1 is served
    (partial blocks included), so the limits are on M and the config alone."""
    out = []
    if not 1 <= M <= MAX_ROWS:
        out.append(f"M = {M} rows is outside the 1..{MAX_ROWS} a decode-shaped call takes")
    if N < 1 or K < 1:
        out.append(f"N = {N}, K = {K}: nothing to compute")
    chunks = -(-K // config.block_k)
    if config.split_k is not None and K >= 1 and chunks % config.split_k:
        out.append(f"split_k = {config.split_k} does not divide ceil(K / block_k) = {chunks}")
    return out


def e4m3_to_f32(codes):
    """float8_e4m3fn bit patterns (uint8 or int32, any shape) -> float32 values, by integer arithmetic: 1 sign
    bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m · 2^-9); 0x7F / 0xFF are NaN;
    no infinities. Equal to jnp's conversion for all 256 codes (a test checks)."""
    b = codes.astype(jnp.int32)
    mag = b & 0x7F
    e, m = mag >> 3, mag & 0x7
    normal = lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), _F32)  # 2^(e-7) · (1 + m/8)
    v = jnp.where(e == 0, m.astype(_F32) * (2.0**-9), normal)
    v = jnp.where(mag == 0x7F, jnp.nan, v)
    return jnp.where(b >= 0x80, -v, v)


def to_compute(w_fp8, dtype, convert: str):
    """A tile of e4m3 weights (as loaded) -> `dtype` (bf16 or f32; exact either way), by `convert`
    (`CONVERTS`)."""
    if convert == "bits":
        return e4m3_to_f32(lax.bitcast_convert_type(w_fp8, jnp.uint8)).astype(dtype)
    return w_fp8.astype(dtype)


def _as_stack(w, scale, layer):
    if layer is None:
        return w[None], scale[None], 0
    return w, scale, layer


def fp8_matvec_reference(x_MK, w_NK, scale, layer=None):
    """x [M, K] · dequant(w)ᵀ -> [M, N] in x's dtype: the weight (w [N, K] with scale [nb, kb], or layer `layer`
    of a stack [L, N, K] / [L, nb, kb]) dequantized to x's dtype (fp32 products, rounded once), then one dot
    with fp32 accumulation."""
    w, s, layer = _as_stack(w_NK, scale, layer)
    w = lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
    s = lax.dynamic_index_in_dim(s, layer, axis=0, keepdims=False)
    w_NK = dequantize_blocks(w, s).astype(x_MK.dtype)
    return lax.dot_general(x_MK, w_NK, (((1,), (1,)), ((), ())), preferred_element_type=_F32).astype(x_MK.dtype)


def _validate(x_MK, w, scale, layer, config):
    if x_MK.ndim != 2 or x_MK.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bfloat16 or float32 [M, K], got {x_MK.dtype} {x_MK.shape}")
    want_ndim = 2 if layer is None else 3
    if w.dtype != FP8_DTYPE or w.ndim != want_ndim:
        form = "[N, K]" if layer is None else "a stack [L, N, K] (a layer index was given)"
        raise ValueError(f"w must be float8_e4m3fn {form}, got {w.dtype} {w.shape}")
    if w.shape[-1] != x_MK.shape[1]:
        raise ValueError(f"w must be [..., N, K={x_MK.shape[1]}] (x's K), got {w.shape}")
    N, K = w.shape[-2:]
    want = w.shape[:-2] + (-(-N // QUANT_BLOCK), -(-K // QUANT_BLOCK))
    if tuple(scale.shape) != want or scale.dtype != _F32:
        raise ValueError(
            f"scale must be float32 {want} (one per 128x128 block of w), got {scale.dtype} {tuple(scale.shape)}"
        )
    problems = fp8_matvec_problems(x_MK.shape[0], N, K, config)
    if problems:
        raise ValueError("fp8_matvec: " + "; ".join(problems))


def _block_m(M: int) -> int:
    return max(16, 1 << (M - 1).bit_length())


def _split_k(N: int, K: int, config: Fp8MatvecConfig) -> int:
    """The largest divisor of the K chunks that keeps the grid within `TARGET_PROGRAMS` (at least 1)."""
    if config.split_k is not None:
        return config.split_k
    chunks = -(-K // config.block_k)
    columns = -(-N // config.block_n)
    return max(d for d in range(1, chunks + 1) if chunks % d == 0 and (d == 1 or columns * d <= TARGET_PROGRAMS))


def _kernel(layer_ref, x_ref, w_ref, s_ref, *refs, block_m, block_n, block_k, k_steps, N, K, convert, operands):
    """Program (0, j, s): columns [j·block_n, +block_n) over its K range; x_ref holds x in the product's dtype
    (`prepare_rows`), and with e4m3 operands `xs_ref` its per-(row, 128-block) scales."""
    xs_ref, o_ref = refs if operands == "e4m3" else (None, refs[0])
    j, s = pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    c0 = j * block_n
    rows, cols = pl.ds(0, block_m), pl.ds(c0, block_n)
    # masks of the edge tiles, [block_n, block_k] like the weight tile (None where the blocks divide N, K)
    col_ok = jnp.broadcast_to((c0 + jnp.arange(block_n) < N)[:, None], (block_n, block_k)) if N % block_n else None
    per_scale = QUANT_BLOCK // block_k  # chunks a 128-wide scale block holds

    def chunk(t, acc):
        c = s * k_steps + t
        k0 = c * block_k
        k = pl.ds(k0, block_k)
        k_ok = (k0 + jnp.arange(block_k) < K)[None, :] if K % block_k else None
        if k_ok is None:
            x = plt.load(x_ref.at[rows, k])
        else:
            x = plt.load(x_ref.at[rows, k], mask=jnp.broadcast_to(k_ok, (block_m, block_k)), other=0.0)
            k_ok = jnp.broadcast_to(k_ok, (block_n, block_k))
        mask = k_ok if col_ok is None else (col_ok if k_ok is None else col_ok & k_ok)
        if operands == "e4m3":  # masked lanes read as 0 (an e4m3 NaN there would poison the dot)
            w = plt.load(w_ref.at[layer, cols, k], mask=mask, other=0.0 if mask is not None else None)
        else:
            w = plt.load(w_ref.at[layer, cols, k], mask=mask)
            w = w.astype(jnp.float16) if operands == "f16" else to_compute(w, x.dtype, convert)  # [block_n, block_k]
            if mask is not None:
                w = jnp.where(mask, w, 0.0)  # masked lanes hold anything (an e4m3 NaN would poison the dot)
        part = plt.dot(x, w, trans_b=True)  # [block_m, block_n], fp32
        scale = s_ref[layer, c0 // QUANT_BLOCK, c // per_scale]
        if operands == "e4m3":
            part = part * plt.load(xs_ref.at[rows, pl.ds(c // per_scale, 1)])  # [block_m, 1]: x's block scales
        return acc + part * scale

    acc = lax.fori_loop(0, k_steps, chunk, jnp.zeros((block_m, block_n), _F32))
    out_ok = None if col_ok is None else jnp.broadcast_to((c0 + jnp.arange(block_n) < N)[None, :], acc.shape)
    plt.store(o_ref.at[s, rows, cols], acc, mask=out_ok)


def prepare_rows(x_MK, operands: str):
    """x in the product's dtype -> (x [M, K], its per-(row, 128-block) scales [M, kb] for e4m3 or None, the
    per-row factor [M, 1] the output is multiplied by, or None)."""
    x = x_MK.astype(_F32)
    if operands == "f16":
        # 2^e with amax · 2^-e <= 2^15 < 65504: the row in f16's range, the scaling exact both ways
        amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
        e = jnp.where(amax > 0, jnp.ceil(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - 15, 0.0)
        return (x * jnp.exp2(-e)).astype(jnp.float16), None, jnp.exp2(e)
    if operands == "e4m3":
        M, K = x.shape
        kb = -(-K // QUANT_BLOCK)
        blocks = jnp.pad(x, ((0, 0), (0, kb * QUANT_BLOCK - K))).reshape(M, kb, QUANT_BLOCK)
        amax = jnp.max(jnp.abs(blocks), axis=2)
        xs = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)  # [M, kb]
        xq = (blocks / xs[..., None]).astype(FP8_DTYPE).reshape(M, kb * QUANT_BLOCK)[:, :K]
        return xq, xs, None
    return x_MK, None, None


def resolve_operands(config: Fp8MatvecConfig, x_dtype) -> str:
    """The product's operands `fp8_matvec` uses for rows of `x_dtype` (`Fp8MatvecConfig.operands`)."""
    if config.operands is not None:
        return config.operands
    return "x" if jnp.dtype(x_dtype) == _F32 or config.convert != "cast" else "f16"


def _fp8_matvec_kernel(x_MK, w_LNK, s_L, layer, *, config, interpret):
    M, K = x_MK.shape
    operands = resolve_operands(config, x_MK.dtype)
    N = w_LNK.shape[1]
    bm = _block_m(M)
    split = _split_k(N, K, config)
    k_steps = -(-K // config.block_k) // split
    x, xs, row_factor = prepare_rows(x_MK, operands)
    x = jnp.pad(x, ((0, bm - M), (0, 0)))
    extra = () if xs is None else (jnp.pad(xs, ((0, bm - M), (0, 0)), constant_values=1.0),)
    kernel = functools.partial(
        _kernel,
        block_m=bm,
        block_n=config.block_n,
        block_k=config.block_k,
        k_steps=k_steps,
        N=N,
        K=K,
        convert=config.convert,
        operands=operands,
    )
    partials = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split, bm, N), _F32),
        grid=(1, pl.cdiv(N, config.block_n), split),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="fp8_matvec",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), x, w_LNK, s_L, *extra)
    out = jnp.sum(partials, axis=0)[:M]
    if row_factor is not None:
        out = out * row_factor
    return out.astype(x_MK.dtype)


def fp8_matvec(
    x_MK, w_NK, scale, layer=None, *, config: Fp8MatvecConfig | None = None, impl: str | None = "auto"
) -> jax.Array:
    """x [M, K] · dequant(w)ᵀ -> [M, N] in x's dtype (fp32 accumulation), each weight byte read once.

    Args:
      x_MK: [M, K] bf16 (or f32) rows, 1 <= M <= `MAX_ROWS`.
      w_NK: float8_e4m3fn [N, K] (the release's layout), or with `layer` a stack [L, N, K] read in place.
      scale: fp32 [ceil(N/128), ceil(K/128)] (a stack: [L, ...]); W[n, k] = w[n, k] · scale[n // 128, k // 128].
      layer: None, or an int scalar (may be traced): the layer of the stack to use, 0 <= layer < L (not
        checked when traced).
      config: `Fp8MatvecConfig` (static; None: `default_config`); the limits are `fp8_matvec_problems`.
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU, else
        `fp8_matvec_reference`).
    Raises ValueError (one line) for dtypes, shapes and limits; "auto" takes the reference for a weight array
    the Triton lowering cannot index (`backend.triton_offset_problems`), "kernel" refuses it.
    """
    config = default_config(*w_NK.shape[-2:]) if config is None else config
    _validate(x_MK, w_NK, scale, layer, config)
    impl = backend.choose(impl, backend.triton_offset_problems("w", w_NK.shape, w_NK.dtype), name="fp8_matvec impl")
    if impl == "reference":
        return fp8_matvec_reference(x_MK, w_NK, scale, layer)
    w, s, layer = _as_stack(w_NK, scale, layer)
    return _fp8_matvec_kernel(x_MK, w, s, layer, config=config, interpret=impl == "interpret")
