"""Pallas kernels for Hopper (Mosaic GPU, sm_90; `moe_decode`, `moe_route`, `moe_gate`, `stacked_matmul`,
`head_matmul`, `fp8_matvec` on Pallas' Triton backend) with their plain-jnp references; `backend`, the one "which
implementation" vocabulary (auto / kernel / interpret / reference) with the one Hopper check; `page_format`, the one
page-format type.

Each kernel takes its pages' format explicitly (a `PageFormat`, or read from the pages) and says what it
serves (`mla_decode_problems`, `paged_gather_problems`, `moe_decode_problems`, `moe_route_problems`,
`moe_gate_problems`, `fp8_matmul_problems`, `fp8_matvec_problems`). Imports nothing from the rest of the project.
"""

from pallas_kernels import backend
from pallas_kernels.flash_attention import (
    FlashAttentionConfig,
    flash_attention,
    flash_attention_prefill,
    flash_attention_prefill_reference,
    flash_attention_reference,
)
from pallas_kernels.fp8_gemm import Fp8MatmulConfig, fp8_matmul, fp8_matmul_problems, fp8_matmul_reference
from pallas_kernels.fp8_matvec import Fp8MatvecConfig, fp8_matvec, fp8_matvec_problems, fp8_matvec_reference
from pallas_kernels.mla_decode import MlaDecodeConfig, mla_decode, mla_decode_problems, mla_decode_reference
from pallas_kernels.moe_decode import (
    MoeDecodeConfig,
    moe_decode,
    moe_decode_fp8,
    moe_decode_fp8_problems,
    moe_decode_fp8_reference,
    moe_decode_problems,
    moe_decode_reference,
)
from pallas_kernels.moe_route import (
    DecodeRoute,
    RouteSpec,
    moe_route,
    moe_route_problems,
    moe_route_reference,
    route_reference,
    route_scores,
)
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
    resolve_page_format,
)
from pallas_kernels.paged_gather import PagedGatherConfig, paged_gather, paged_gather_problems, paged_gather_reference

__all__ = [
    "BF16_PAGES",
    "DecodeRoute",
    "FP4_PAGES",
    "FP8_PAGES",
    "FlashAttentionConfig",
    "Fp8MatmulConfig",
    "Fp8MatvecConfig",
    "MlaDecodeConfig",
    "MoeDecodeConfig",
    "PageFormat",
    "PagedGatherConfig",
    "RouteSpec",
    "backend",
    "dequantize_latent_fp4",
    "dequantize_latent_fp8",
    "flash_attention",
    "flash_attention_prefill",
    "flash_attention_prefill_reference",
    "flash_attention_reference",
    "fp8_matmul",
    "fp8_matmul_problems",
    "fp8_matmul_reference",
    "fp8_matvec",
    "fp8_matvec_problems",
    "fp8_matvec_reference",
    "mla_decode",
    "mla_decode_problems",
    "mla_decode_reference",
    "moe_decode",
    "moe_decode_fp8",
    "moe_decode_fp8_problems",
    "moe_decode_fp8_reference",
    "moe_decode_problems",
    "moe_decode_reference",
    "moe_route",
    "moe_route_problems",
    "moe_route_reference",
    "page_format_of",
    "paged_gather",
    "paged_gather_problems",
    "paged_gather_reference",
    "quantize_latent_fp4",
    "quantize_latent_fp8",
    "resolve_page_format",
    "route_reference",
    "route_scores",
]
