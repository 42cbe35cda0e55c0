"""`fp8_matmul`'s limits, SMEM budget and tuning knobs (`Fp8MatmulConfig`, a static argument)."""

from __future__ import annotations

import dataclasses

import jax.experimental.pallas.mosaic_gpu as plgpu

QUANT_BLOCK = 128  # DeepSeek-V3's scaling block: 1x128 activation tiles, 128x128 weight blocks (and tile K)
COMPUTE_WGS = 2
SMEM_BYTES = 232448  # sm_90's SMEM per CTA (checked again by the lowering)
BARRIER_BYTES = 1024  # the pipeline's barriers and allocation alignment (measured: under 1 KB)
SCALE_COLUMNS = 16  # the weight scales reach the kernel repeated once per 16 output columns
# A TMA copy's SMEM destination must be 128-byte aligned, and a pipeline stage's slot of a buffer sits at
# stage x slot size: a CTA's weight scales travel as a row of a multiple of 32 fp32 (padded), so that every
# stage's slot is aligned (8 floats a slot was a misaligned-address fault on the H200).
SCALE_SLOT_FLOATS = 32


def scale_slot(cta_n: int) -> int:
    """fp32 entries a CTA's weight scales take a K block: cta_n / SCALE_COLUMNS, padded to SCALE_SLOT_FLOATS."""
    return -(-(cta_n // SCALE_COLUMNS) // SCALE_SLOT_FLOATS) * SCALE_SLOT_FLOATS


FP8_MAX = 448.0  # largest finite float8_e4m3fn
# 8-bit WGMMA operands: K-major, 128-byte swizzle = 128 elements a row (one scaling block of K).
FP8_TRANSFORMS = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
BF16_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class Fp8MatmulConfig:
    """Static tuning knobs of `fp8_matmul`.

    A CTA computes a (cta_m, cta_n) tile of the output with two compute warpgroups and one TMA warpgroup;
    each compute warpgroup owns a (block_m, block_n) part of it, split along ``wg_split``. K advances one
    128-wide scaling block per pipeline step.

    Attributes:
      block_m: rows a compute warpgroup owns (64 or 128: the wgmma M tile is 64).
      block_n: output columns a compute warpgroup owns (64 or 128: it divides 128, so the columns of one
        warpgroup share one weight-scale block). block_m * block_n <= 8192: the warpgroup holds two fp32
        accumulators (the step's product and the promoted total), block_m * block_n / 64 registers a thread.
      wg_split: "m" (the warpgroups stack along rows: CTA 2 block_m x block_n) or "n" (side by side:
        CTA block_m x 2 block_n; for few rows).
      max_concurrent_steps: K blocks in flight (2 to 8; SMEM-bound, see `smem_bytes`).
      grid_minor_dim: the output-tile order of the persistent loop (`plgpu.planar_snake`): 0 walks M
        fastest, 1 walks N fastest.
      grid_tile_width: planar_snake's band width (tiles), for L2 reuse.
      memory_registers: registers a thread left to the TMA warpgroup (setmaxnreg).
    """

    block_m: int = 64
    block_n: int = 128
    wg_split: str = "m"
    max_concurrent_steps: int = 5
    grid_minor_dim: int = 1
    grid_tile_width: int = 8
    memory_registers: int = 40

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m must be 64 or 128, got {self.block_m!r}")
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n must be 64 or 128, got {self.block_n!r}")
        if self.block_m * self.block_n > 8192:
            raise ValueError(
                f"block_m * block_n must be <= 8192 (two fp32 accumulators), got {self.block_m}x{self.block_n}"
            )
        if self.wg_split not in ("m", "n"):
            raise ValueError(f"wg_split must be 'm' or 'n', got {self.wg_split!r}")
        if not isinstance(self.max_concurrent_steps, int) or not 2 <= self.max_concurrent_steps <= 8:
            raise ValueError(f"max_concurrent_steps must be an int in [2, 8], got {self.max_concurrent_steps!r}")
        if self.grid_minor_dim not in (0, 1):
            raise ValueError(f"grid_minor_dim must be 0 (M) or 1 (N), got {self.grid_minor_dim!r}")
        if not isinstance(self.grid_tile_width, int) or self.grid_tile_width < 1:
            raise ValueError(f"grid_tile_width must be an int >= 1, got {self.grid_tile_width!r}")
        if not 24 <= self.memory_registers <= 256 or self.memory_registers % 8:
            raise ValueError(f"memory_registers must be a multiple of 8 in [24, 256], got {self.memory_registers}")

    @property
    def cta_m(self) -> int:
        return self.block_m * (COMPUTE_WGS if self.wg_split == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.block_n * (COMPUTE_WGS if self.wg_split == "n" else 1)


def default_config(M: int, N: int, K: int) -> Fp8MatmulConfig:
    """The config `fp8_matmul` uses when given none: 128x128 CTA tiles (DeepGEMM's shape for these
    widths) for prefill-sized M; for decode-sized M (<= 64) 64x128 CTAs (the warpgroups side by side) with
    8 K blocks in flight; 128x64 CTAs where N is not a multiple of 128 (kv_a's 576)."""
    del K
    if M <= 64 and N % 128 == 0:
        return Fp8MatmulConfig(block_m=64, block_n=64, wg_split="n", max_concurrent_steps=8)
    return Fp8MatmulConfig(block_m=64, block_n=128 if N % 128 == 0 else 64, wg_split="m", max_concurrent_steps=5)


def smem_bytes(config: Fp8MatmulConfig) -> int:
    """Static SMEM of the kernel, with `BARRIER_BYTES` of slack for barriers and alignment."""
    stage = (
        config.cta_m * QUANT_BLOCK  # x tile, e4m3
        + config.cta_n * QUANT_BLOCK  # w tile, e4m3
        + config.cta_m * 4  # x scales, fp32
        + scale_slot(config.cta_n) * 4  # w scales, fp32
    )
    epilogue = COMPUTE_WGS * config.block_m * config.block_n * 2  # bf16 output staging
    return config.max_concurrent_steps * stage + epilogue + BARRIER_BYTES
