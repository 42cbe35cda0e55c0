"""How the Mosaic GPU kernels read an fp8 page (`pallas_kernels.page_format`, "fp8" with L = 512, R = 64) out of
SMEM: where a token's parts sit in its 656 bytes, and the register layouts the dequantisation uses. Shared by
`paged_gather`'s fp8 body and `mla_decode`'s fp8 bodies."""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu.fragmented_array import Tiling

LATENT = 512  # e4m3 bytes, then
SCALE_WORD = 128  # fp32 word offset of the 4 scales (byte 512) in a 164-word row
ROPE_HALF = 264  # bf16 offset of the 64 rope values (byte 528) in a 328-half row
BLOCK = 128  # latent values a scale covers

# Register layouts of the dequantisation: a warp covers 2 rows x 16 lanes, a lane 8 consecutive values
# (rope: 4), so one warp access reads or writes whole rows' runs of 128 (bytes) or 256 (16-bit) bytes and
# no two lanes of it meet in a bank, in an untiled buffer and in a 128-byte-swizzled (8, 64) tile alike
# (Mosaic GPU's transfer planner finds conflict-free patterns for both, so the loads can be `optimized`).
# (The WGMMA layout puts 8 rows in a warp at the same offset: on these 256- and 1152-byte rows, an 8-way
# bank conflict on every load and store, which the planner refuses.)
BLOCK_LAYOUT = plgpu.Layout.TILED(
    Tiling(((64, BLOCK), (16, BLOCK), (2, BLOCK), (8,))),
    warp_dims=(-7,),
    lane_dims=(-3, -2),
    vector_dim=-1,
)
ROPE_LAYOUT = plgpu.Layout.TILED(
    Tiling(((64, 64), (16, 64), (2, 64), (4,))), warp_dims=(-7,), lane_dims=(-3, -2), vector_dim=-1
)
