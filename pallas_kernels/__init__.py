"""Pallas kernels for Hopper (Mosaic GPU, sm_90; `moe_decode` on Pallas' Triton backend) with their
plain-jnp references, and the one "which implementation" vocabulary (`_platform.IMPLS`: kernel /
interpret / reference, with the one Hopper check).

Imports nothing from the rest of the project.
"""

from pallas_kernels.flash_attention import FlashAttentionConfig, flash_attention, flash_attention_reference
from pallas_kernels.mla_decode import MlaDecodeConfig, mla_decode, mla_decode_problems, mla_decode_reference
from pallas_kernels.moe_decode import MoeDecodeConfig, moe_decode, moe_decode_problems, moe_decode_reference
from pallas_kernels.page_format import (
    BF16_PAGES,
    FP4_PAGES,
    FP8_PAGES,
    PageFormat,
    dequantize_latent_fp4,
    dequantize_latent_fp8,
    page_format_of,
    quantize_latent_fp4,
    quantize_latent_fp8,
)
from pallas_kernels.paged_gather import PagedGatherConfig, paged_gather, paged_gather_reference

__all__ = [
    "BF16_PAGES",
    "FP4_PAGES",
    "FP8_PAGES",
    "FlashAttentionConfig",
    "MlaDecodeConfig",
    "MoeDecodeConfig",
    "PageFormat",
    "dequantize_latent_fp4",
    "dequantize_latent_fp8",
    "flash_attention",
    "flash_attention_reference",
    "page_format_of",
    "quantize_latent_fp4",
    "quantize_latent_fp8",
    "PagedGatherConfig",
    "mla_decode",
    "mla_decode_problems",
    "mla_decode_reference",
    "moe_decode",
    "moe_decode_problems",
    "moe_decode_reference",
    "paged_gather",
    "paged_gather_reference",
]
