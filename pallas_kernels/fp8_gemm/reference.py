"""DeepSeek-V3's FP8 recipe in plain jnp: the activation quantizer the kernel's wrapper runs, weight
dequantization, and `fp8_matmul_reference`, the kernel's oracle."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8_gemm.config import FP8_MAX, QUANT_BLOCK

AMAX_FLOOR = 1e-4  # an all-zero block gets a finite scale (DeepGEMM's clamp), not 0/0


def quantize_activations(x_MK):
    """Per-(row, 128-column block) e4m3 quantization (DeepSeek-V3's ``act_quant``).

    Args:
      x_MK: [M, K] bf16 or fp32, any K (a last partial block is scaled by its own amax).

    Returns:
      (xq [M, K] float8_e4m3fn, scale [M, ceil(K / 128)] fp32) with x ~= xq * scale per block and
      scale = max(amax of the block, 1e-4) / 448.
    """
    M, K = x_MK.shape
    Kb = -(-K // QUANT_BLOCK)
    x = jnp.pad(x_MK.astype(jnp.float32), ((0, 0), (0, Kb * QUANT_BLOCK - K))).reshape(M, Kb, QUANT_BLOCK)
    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=2), AMAX_FLOOR) / FP8_MAX  # [M, Kb]
    xq = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return xq.reshape(M, Kb * QUANT_BLOCK)[:, :K], scale


def dequantize_blocks(q_RC, scale):
    """fp32 [..., R, C] = q * scale[..., r // 128, c // 128] (weights: 128x128 blocks, the last ones partial) or,
    with a scale of R rows, q * scale[..., r, c // 128] (activations: 1x128 tiles). Leading axes (a stack of
    experts) are carried through."""
    R, C = q_RC.shape[-2:]
    s = jnp.repeat(scale.astype(jnp.float32), QUANT_BLOCK, axis=-1)[..., :C]
    if scale.shape[-2] != R:
        s = jnp.repeat(s, QUANT_BLOCK, axis=-2)[..., :R, :]
    return q_RC.astype(jnp.float32) * s


def fp8_matmul_reference(x_MK, w_NK, w_scale, *, quantize_x=True, impl=None, config=None):
    """x @ dequant(w).T in fp32, returned as bf16 [M, N] (the oracle of `fp8_matmul`; same contract,
    without the kernel's shape limits).

    ``quantize_x=True`` (the kernel's recipe): x goes through `quantize_activations` first, so the only
    difference from the kernel is fp32 summation order. ``quantize_x=False``: the exact product of the
    unquantized x with the dequantized weights (what the recipe approximates). ``impl`` and ``config``
    are accepted and ignored.
    """
    del impl, config
    if quantize_x:
        xq, xs = quantize_activations(x_MK)
        # The barrier keeps the e4m3 rounding: XLA:GPU (excess precision allowed, its default) folds a
        # convert to fp8 and straight back into nothing, which made this reference the unquantized product.
        x = dequantize_blocks(lax.optimization_barrier(xq), xs)
    else:
        x = x_MK.astype(jnp.float32)
    w = dequantize_blocks(w_NK, w_scale)
    y = jnp.einsum("mk,nk->mn", x, w, precision=lax.Precision.HIGHEST)
    return y.astype(jnp.bfloat16)
