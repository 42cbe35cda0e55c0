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
a multiple of `block_m` (at least 16, the smallest tensor-core M).

`stacked_matmul_reference` is the same function in plain XLA.
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

MAX_ROWS = 128  # a decode step's rows (B·T) this kernel is for; larger calls are a GEMM's business
TARGET_PROGRAMS = 264  # about two programs a streaming multiprocessor of an H100/H200 (132)


@dataclasses.dataclass(frozen=True)
class StackedMatmulConfig:
    """Static tuning knobs of `stacked_matmul`.

    Attributes:
      block_n: output columns a program computes (divides N).
      block_k: contraction chunk of a program's loop (divides K).
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
    out = []
    if M > MAX_ROWS:
        out.append(f"M = {M} rows is more than the {MAX_ROWS} a decode-shaped call takes")
    if K % config.block_k:
        out.append(f"K = {K} is not a multiple of the block {config.block_k}")
    if N % config.block_n:
        out.append(f"N = {N} is not a multiple of the block {config.block_n}")
    if config.split_k is not None and K % config.block_k == 0 and (K // config.block_k) % config.split_k:
        out.append(f"split_k = {config.split_k} does not divide K / block_k = {K // config.block_k}")
    return out


def _block_m(M: int) -> int:
    return max(16, 1 << (M - 1).bit_length())


def _split_k(M: int, K: int, N: int, config: StackedMatmulConfig) -> int:
    if config.split_k is not None:
        return config.split_k
    steps = K // config.block_k
    programs = pl.cdiv(M, _block_m(M)) * (N // config.block_n)
    s = 1
    while s * 2 <= steps and steps % (s * 2) == 0 and programs * s * 2 <= TARGET_PROGRAMS:
        s *= 2
    return s


def stacked_matmul_reference(x_MK, w_LKN, layer):
    """x [M, K] · w_LKN[layer] [K, N] (fp32 accumulation) -> [M, N] in x's dtype."""
    w_KN = lax.dynamic_index_in_dim(w_LKN, layer, axis=0, keepdims=False)
    return jnp.dot(x_MK, w_KN.astype(x_MK.dtype), preferred_element_type=jnp.float32).astype(x_MK.dtype)


def _validate(x_MK, w_LKN, config):
    if x_MK.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x_MK.shape}")
    if w_LKN.ndim != 3 or w_LKN.shape[1] != x_MK.shape[1]:
        raise ValueError(f"w must be a stack [L, K={x_MK.shape[1]}, N], got shape {w_LKN.shape}")
    problems = stacked_matmul_problems(x_MK.shape[0], w_LKN.shape[1], w_LKN.shape[2], config)
    if problems:
        raise ValueError("stacked_matmul: " + "; ".join(problems))


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, block_m, block_n, block_k, k_steps):
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    rows, cols = pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)

    def chunk(t, acc):
        k = pl.ds((s * k_steps + t) * block_k, block_k)
        return acc + plt.dot(plt.load(x_ref.at[rows, k]), plt.load(w_ref.at[layer, k, cols]))

    acc = lax.fori_loop(0, k_steps, chunk, jnp.zeros((block_m, block_n), jnp.float32))
    plt.store(o_ref.at[s, rows, cols], acc)


def _stacked_matmul_kernel(x_MK, w_LKN, layer, *, config, interpret):
    M, K = x_MK.shape
    N = w_LKN.shape[2]
    bm = _block_m(M)
    split = _split_k(M, K, N, config)
    Mp = pl.cdiv(M, bm) * bm
    x = jnp.pad(x_MK, ((0, Mp - M), (0, 0)))
    partials = pl.pallas_call(
        functools.partial(
            _kernel, block_m=bm, block_n=config.block_n, block_k=config.block_k, k_steps=K // config.block_k // split
        ),
        out_shape=jax.ShapeDtypeStruct((split, Mp, N), jnp.float32),
        grid=(Mp // bm, N // config.block_n, split),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="stacked_matmul",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), x, w_LKN.astype(x_MK.dtype))
    return jnp.sum(partials, axis=0)[:M].astype(x_MK.dtype)


def stacked_matmul(x_MK, w_LKN, layer, *, config: StackedMatmulConfig | None = None, impl: str | None = "auto"):
    """x [M, K] · w_LKN[layer] [K, N] -> [M, N] in x's dtype (fp32 accumulation).

    Args:
      x_MK: [M, K] rows, bf16 (or f32), M <= `MAX_ROWS`.
      w_LKN: [L, K, N] a scanned stack of one projection's weights (cast to x's dtype); read in place.
      layer: int scalar (may be traced), the layer of the stack to use; 0 <= layer < L (not checked
        when traced).
      config: `StackedMatmulConfig`; K and N must be multiples of its blocks (`stacked_matmul_problems`).
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU, else the reference).
    """
    config = StackedMatmulConfig() if config is None else config
    _validate(x_MK, w_LKN, config)
    impl = backend.resolve(impl)
    if impl == "reference":
        return stacked_matmul_reference(x_MK, w_LKN, layer)
    return _stacked_matmul_kernel(x_MK, w_LKN, layer, config=config, interpret=impl == "interpret")
