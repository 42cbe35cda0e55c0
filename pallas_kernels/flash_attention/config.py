"""`flash_attention`'s limits, SMEM budget and tuning knobs (`FlashAttentionConfig`, a static argument)."""

from __future__ import annotations

import dataclasses
import math

import jax.experimental.pallas.mosaic_gpu as plgpu

ROWS = 64  # rows per compute warpgroup (the wgmma M tile)
COMPUTE_WGS = 2
CTA_ROWS = ROWS * COMPUTE_WGS  # query rows (forward, dQ) / keys (dK/dV) per CTA
MAX_WIDTH = 256  # wgmma N limit: the widest D or V one accumulator can hold
SMEM_BYTES = 232448  # sm_90's SMEM per CTA (checked again by the lowering)
_LOG2E = math.log2(math.e)
# Running max starts finite: a row whose keys are all masked in a block then gives
# exp2(-inf - m) = 0 instead of exp2(-inf + inf) = NaN.
_M_INIT = -1e30
_BF16_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """Static tuning knobs of `flash_attention`.

    Attributes:
      block_kv: keys per pipeline step of the forward (64 or 128; T must be a multiple).
      max_concurrent_steps: K/V stages in flight in the forward (2 to 4; SMEM-bound, see the module
        docstring: with D=192 and block_kv=128 only 2 fit).
      block_kv_dq: keys per pipeline step of the dQ kernel (64 or 128).
      bwd_max_concurrent_steps: stages in flight in the dK/dV and dQ kernels (2 to 4).
      memory_registers: registers per thread left to the TMA warpgroup (setmaxnreg).
      schedule_barrier: forward only: FA3's ping-pong of the two compute warpgroups (they meet at
        a CTA barrier after issuing Q·Kᵀ and before P·V, one meeting apart), so one warpgroup's
        softmax overlaps the other's matmuls.
      interpretable: stage P and dS through SMEM and accumulate with ``run_scoped`` (what the Pallas
        interpreter can run); slower, for interpret mode only (set automatically there).
    """

    block_kv: int = 128
    max_concurrent_steps: int = 2
    block_kv_dq: int = 64
    bwd_max_concurrent_steps: int = 2
    memory_registers: int = 40
    schedule_barrier: bool = True
    interpretable: bool = False

    def __post_init__(self):
        for name in ("block_kv", "block_kv_dq"):
            value = getattr(self, name)
            if value not in (64, 128):
                raise ValueError(f"{name} must be 64 or 128, got {value!r}")
        for name in ("max_concurrent_steps", "bwd_max_concurrent_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 2 <= value <= 4:
                raise ValueError(f"{name} must be an int in [2, 4], got {value!r}")
        if not 24 <= self.memory_registers <= 256 or self.memory_registers % 8:
            raise ValueError(f"memory_registers must be a multiple of 8 in [24, 256], got {self.memory_registers}")


def smem_bytes(D: int, V: int, config: FlashAttentionConfig) -> dict[str, int]:
    """Static SMEM of each kernel (tiles only; barriers add a few hundred bytes)."""
    bf = 2
    stage_p = ROWS * ROWS * bf * COMPUTE_WGS * 2 if config.interpretable else 0
    fwd = (
        COMPUTE_WGS * ROWS * D * bf
        + config.max_concurrent_steps * config.block_kv * (D + V) * bf
        + (COMPUTE_WGS * ROWS * config.block_kv * bf if config.interpretable else 0)
    )
    dkv = COMPUTE_WGS * ROWS * (D + V) * bf + config.bwd_max_concurrent_steps * ROWS * ((D + V) * bf + 8) + stage_p
    dq = (
        COMPUTE_WGS * ROWS * ((D + V) * bf + 8)
        + config.bwd_max_concurrent_steps * config.block_kv_dq * (D + V) * bf
        + (COMPUTE_WGS * ROWS * config.block_kv_dq * bf if config.interpretable else 0)
    )
    return dict(forward=fwd, dkv=dkv, dq=dq)


def check_widths_and_scalars(D: int, V: int, softmax_scale, causal, *, kernel: bool) -> None:
    """The checks every flash attention entry point makes (ValueError, one line): the q/k and v widths the kernel
    holds (only when it runs: `kernel`), a finite positive Python-float `softmax_scale`, a bool `causal`."""
    for name, width in (("q/k width D", D), ("v width V", V)) if kernel else ():
        if width % 64 or not 64 <= width <= MAX_WIDTH:
            raise ValueError(f"{name} must be a multiple of 64 in [64, {MAX_WIDTH}], got {width}")
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise ValueError(f"softmax_scale must be a Python float (it is baked into the kernel), got {softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
