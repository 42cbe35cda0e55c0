"""Block-scaled FP8 GEMM for Hopper (Mosaic GPU, sm_90): DeepSeek-V3's recipe for its linear layers.

Dimension letters: M rows (tokens), K contraction (input width), N output width; Kb = K / 128,
Nb = ceil(N / 128).

    y[m, n] = sum over K blocks kb of (xq[m, kb] · wq[n, kb]) * x_scale[m, kb] * w_scale[n // 128, kb]

* Weights: float8_e4m3fn [N, K] with an fp32 scale per 128x128 block (the checkpoint's format).
* Activations: quantized per 1x128 tile to e4m3 with an fp32 scale per (row, K block), by
  `quantize_activations`, a small XLA op run before the kernel (one read of x, one write of xq).
* Products: e4m3 WGMMA with an fp32 accumulator over one 128-wide K block; each block's partial sum
  is then promoted, acc += part * x_scale[row] * w_scale (DeepSeek-V3's promotion at every block:
  the tensor core's fp8 accumulation is not trusted beyond 128 products).

This package: this file is the public face (`fp8_matmul`, validation, `fp8_matmul_problems`), `config`
the limits and knobs, `reference` the quantizer and the jnp oracle, `gemm` the kernel.

Kernel (`gemm._fp8_gemm`): a persistent grid (one CTA per SM, output tiles in planar-snake order); a
CTA tile is two compute warpgroups' (block_m, block_n) tiles stacked along M (prefill) or N (decode);
the TMA warpgroup streams x and w tiles of (rows, 128) e4m3 (128-byte swizzle) with the step's scales,
``max_concurrent_steps`` deep. The epilogue stages bf16 through SMEM and stores by TMA, overlapping
the next tile's loads. M is padded to the CTA tile by the wrapper; N and K must be multiples of the
tile and of 128 (`fp8_matmul_problems`).

The interpreter runs the kernel as is (``impl="interpret"``); SMEM, TMA and WGMMA limits are checked
only by cross-lowering for sm_90 and on the GPU.
"""

from __future__ import annotations

import math

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import backend
from pallas_kernels.fp8_gemm.config import (
    QUANT_BLOCK,
    SCALE_COLUMNS,
    SMEM_BYTES,
    Fp8MatmulConfig,
    default_config,
    scale_slot,
    smem_bytes,
)
from pallas_kernels.fp8_gemm.gemm import _fp8_gemm
from pallas_kernels.fp8_gemm.reference import dequantize_blocks, fp8_matmul_reference, quantize_activations

__all__ = [
    "QUANT_BLOCK",
    "SMEM_BYTES",
    "Fp8MatmulConfig",
    "default_config",
    "dequantize_blocks",
    "fp8_matmul",
    "fp8_matmul_problems",
    "fp8_matmul_reference",
    "quantize_activations",
    "smem_bytes",
]

# What impl="interpret" runs the kernel with (tests may swap in ``detect_races=True``).
INTERPRET_PARAMS = plgpu.InterpretGPUParams()
H100_SMS = 132  # the persistent grid's size off a GPU (cross-lowering, the interpreter): H100 / H200


def fp8_matmul_problems(M: int, N: int, K: int, config: Fp8MatmulConfig | None = None) -> list[str]:
    """Why the kernel cannot serve x [M, K] @ w [N, K].T with this config (None: `default_config`);
    empty when it can. Any M >= 1 is served (rows are padded to the CTA tile)."""
    config = default_config(M, N, K) if config is None else config
    out = []
    if K < QUANT_BLOCK or K % QUANT_BLOCK:
        out.append(f"K = {K} is not a positive multiple of {QUANT_BLOCK} (the scaling block)")
    if N < config.cta_n or N % config.cta_n:
        out.append(f"N = {N} is not a positive multiple of the CTA tile's {config.cta_n} columns")
    if M < 1:
        out.append(f"M = {M} rows: nothing to compute")
    if (size := smem_bytes(config)) > SMEM_BYTES:
        out.append(f"config {config} needs {size} bytes of SMEM, over the {SMEM_BYTES} of sm_90")
    return out


def _validate(x_MK, w_NK, w_scale):
    if x_MK.ndim != 2 or x_MK.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bfloat16 [M, K], got {x_MK.dtype} {x_MK.shape}")
    if w_NK.ndim != 2 or w_NK.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"w must be float8_e4m3fn [N, K], got {w_NK.dtype} {w_NK.shape}")
    if w_NK.shape[1] != x_MK.shape[1]:
        raise ValueError(f"w must be [N, K={x_MK.shape[1]}] (x's K), got {w_NK.shape}")
    N, K = w_NK.shape
    want = (math.ceil(N / QUANT_BLOCK), math.ceil(K / QUANT_BLOCK))
    if w_scale.shape != want or w_scale.dtype != jnp.float32:
        raise ValueError(
            f"w_scale must be float32 {want} (one per 128x128 block of w), got {w_scale.dtype} {w_scale.shape}"
        )


def _num_sms() -> int:
    if backend.on_hopper():
        return jax.devices()[0].core_count
    return H100_SMS


def fp8_matmul(x_MK, w_NK, w_scale, *, impl="auto", config: Fp8MatmulConfig | None = None):
    """y = x @ dequant(w).T with DeepSeek-V3's block-scaled FP8 recipe (module docstring).

    Args:
      x_MK: bf16 [M, K] activations (quantized here per 1x128 tile).
      w_NK: float8_e4m3fn [N, K] weights (a torch ``nn.Linear`` layout: output rows).
      w_scale: fp32 [ceil(N / 128), ceil(K / 128)]; dequant(w)[n, k] = w[n, k] * w_scale[n // 128, k // 128].
      impl: one of `pallas_kernels.backend.IMPLS`. "auto": the kernel on a Hopper GPU when
        `fp8_matmul_problems` is empty, else `fp8_matmul_reference` (same recipe, fp32, plain XLA).
      config: `Fp8MatmulConfig` (static); None = `default_config(M, N, K)`.

    Returns:
      bf16 [M, N], fp32 accumulation.

    Raises:
      ValueError naming the bad value and the limit (dtypes, shapes; for "kernel" and "interpret" also
      every `fp8_matmul_problems` line).
    """
    _validate(x_MK, w_NK, w_scale)
    if config is not None and not isinstance(config, Fp8MatmulConfig):
        raise ValueError(f"config must be an Fp8MatmulConfig or None, got {type(config).__name__}")
    (M, K), N = x_MK.shape, w_NK.shape[0]
    config = default_config(M, N, K) if config is None else config
    impl = backend.choose(impl, fp8_matmul_problems(M, N, K, config))
    if impl == "reference":
        return fp8_matmul_reference(x_MK, w_NK, w_scale)
    xq, xs = quantize_activations(x_MK)
    M_pad = -(-M // config.cta_m) * config.cta_m
    xq = jnp.pad(xq, ((0, M_pad - M), (0, 0)))
    xs_KbM = jnp.pad(xs.T, ((0, 0), (0, M_pad - M)))
    ws_KbC = jnp.repeat(w_scale.T, QUANT_BLOCK // SCALE_COLUMNS, axis=1)[:, : N // SCALE_COLUMNS]
    per_cta = config.cta_n // SCALE_COLUMNS  # a CTA column tile's scales, padded to an aligned TMA row
    ws_KbC = ws_KbC.reshape(ws_KbC.shape[0], N // config.cta_n, per_cta)
    ws_KbC = jnp.pad(ws_KbC, ((0, 0), (0, 0), (0, scale_slot(config.cta_n) - per_cta))).reshape(ws_KbC.shape[0], -1)
    y = _fp8_gemm(
        xq,
        xs_KbM,
        w_NK,
        ws_KbC,
        config=config,
        num_sms=_num_sms(),
        interpret=INTERPRET_PARAMS if impl == "interpret" else None,
    )
    return y[:M] if M_pad != M else y
