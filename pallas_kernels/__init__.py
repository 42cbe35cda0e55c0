"""Pallas Mosaic GPU kernels (sm_90) with their plain-jnp references.

Imports nothing from the rest of the project.
"""

from pallas_kernels.mla_decode import (MlaDecodeConfig, mla_decode, mla_decode_problems,
                                       mla_decode_reference)
from pallas_kernels.paged_gather import (BF16_PAGES, PagedGatherConfig, PageFormat, paged_gather,
                                         paged_gather_reference)

__all__ = [
    "BF16_PAGES",
    "MlaDecodeConfig",
    "PageFormat",
    "PagedGatherConfig",
    "mla_decode",
    "mla_decode_problems",
    "mla_decode_reference",
    "paged_gather",
    "paged_gather_reference",
]
