"""`mla_decode`'s checks of its arguments and its plain-jnp references: `mla_decode_reference` (fp32 math over the
pages as the kernel's tensor cores see them) and `mla_decode_fp8_math_reference` (the FP8 math decided for fp8
pages), each with `mla_decode`'s contract; `QueryRows`, a query already in the kernel's row layout."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._page_table import check_page_table
from pallas_kernels.mla_decode.config import KEY_DIM, LATENT_DIM, ROWS
from pallas_kernels.mla_decode.fp8_math import fp8_math_decode
from pallas_kernels.page_format import PageFormat, check_pages


@dataclasses.dataclass(frozen=True)
class QueryRows:
    """A decode call's query already in the kernel's row layout (`pallas_kernels.head_matmul.absorbed_query` makes
    it, so that no launch pads it): rows [B, Rp, 576] in bf16, row t·H + h query token t's head h, the Rp - s_q·H
    rows past them zero, Rp = `padded(s_q, heads)` (whole 64-row blocks). `shape` and `dtype` are the query's
    [B, s_q, H, 576] that `mla_decode` takes; `unpadded()` is that array."""

    rows: jax.Array
    s_q: int
    heads: int

    @staticmethod
    def padded(s_q: int, heads: int) -> int:
        """The rows a sequence's s_q·heads query rows take in the kernel: whole 64-row (`ROWS`) blocks."""
        return -(-s_q * heads // ROWS) * ROWS

    @classmethod
    def of(cls, q) -> "QueryRows":
        """`QueryRows` of a query [B, s_q, H, 576] (its rows padded with zeros)."""
        B, s_q, H, C = q.shape
        rows = q.reshape(B, s_q * H, C)
        return cls(jnp.pad(rows, ((0, 0), (0, cls.padded(s_q, H) - s_q * H), (0, 0))), s_q, H)

    @property
    def shape(self) -> tuple:
        return (self.rows.shape[0], self.s_q, self.heads, self.rows.shape[-1])

    @property
    def dtype(self):
        return self.rows.dtype

    @property
    def ndim(self) -> int:
        return 4

    def unpadded(self) -> jax.Array:
        return self.rows[:, : self.s_q * self.heads].reshape(self.shape)


jax.tree_util.register_dataclass(QueryRows, data_fields=["rows"], meta_fields=["s_q", "heads"])


def _validate(
    q, kv_pages, block_table, seq_lens, softmax_scale, page_format, *, checked=False, page_offset=0
) -> PageFormat:
    """Checks what both the kernel and the reference need; -> the pages' `PageFormat`."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, s_q, H, {KEY_DIM}], got shape {q.shape}")
    B, s_q, H, D = q.shape
    if D != KEY_DIM:
        raise ValueError(f"q's last dim must be {KEY_DIM} (512 latent + 64 rope), got {D}")
    if q.dtype != jnp.bfloat16:
        raise ValueError(f"q must be bfloat16, got {q.dtype}")
    if min(B, s_q, H) < 1:
        raise ValueError(f"q must have B, s_q and H >= 1, got shape {q.shape}")
    if kv_pages.ndim != 3:
        raise ValueError(f"kv_pages must be [num_pages, page_size, W], got shape {kv_pages.shape}")
    fmt = check_pages(kv_pages, page_format, page_size=kv_pages.shape[1])
    if fmt.value_dim != KEY_DIM:
        raise ValueError(
            f"kv_pages hold {fmt.latent_dim} latent + {fmt.rope_dim} rope values a token ({fmt.name} pages of "
            f"width {fmt.width}); q's {KEY_DIM} columns need {LATENT_DIM} + {KEY_DIM - LATENT_DIM}"
        )
    if block_table.ndim != 2 or block_table.shape[0] != B or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be [B={B}, max_pages >= 1], got {block_table.shape}")
    if block_table.dtype != jnp.int32:
        raise ValueError(f"block_table must be int32, got {block_table.dtype}")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be [B={B}], got {seq_lens.shape}")
    if seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be int32, got {seq_lens.dtype}")
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise ValueError(f"softmax_scale must be a Python float (it is baked into the kernel), got {softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if jnp.shape(page_offset) != () or not jnp.issubdtype(jnp.result_type(page_offset), jnp.integer):
        raise ValueError(f"page_offset must be an integer scalar, got {page_offset!r}")
    pages = block_table if isinstance(page_offset, int) and page_offset == 0 else block_table + page_offset
    check_page_table(pages, seq_lens, num_pages=kv_pages.shape[0], page_size=kv_pages.shape[1], checked=checked)
    return fmt


def _key_limits(seq_lens, s_q: int, causal: bool):
    """Exclusive key bound per (sequence, query token): int32 [B, T]."""
    j = jnp.arange(s_q, dtype=jnp.int32)[None, :]
    lens = seq_lens.astype(jnp.int32)[:, None]
    if causal:
        return lens - s_q + 1 + j  # query j sits at position seq_len - s_q + j
    return jnp.broadcast_to(lens, (lens.shape[0], s_q))


def mla_decode_reference(
    q,
    kv_pages,
    block_table,
    seq_lens,
    *,
    softmax_scale,
    causal=False,
    page_format=None,
    config=None,
    impl=None,
    checked=False,
    schedule=None,
    split_partials=False,
    page_offset=0,
):
    """Plain-jnp absorbed MLA decode with fp32 math; same contract (and checks) as `mla_decode`, for any
    head count, query length, page size and page format (quantized pages are dequantised to bf16 first,
    what the kernel's tensor cores see).

    ``config``, ``impl``, ``schedule`` and ``split_partials`` are accepted (and ignored: the reference's output is
    merged) so the two functions are interchangeable.
    A query with no visible key (only possible when causal and seq_len < s_q) gets out = 0 and
    lse = -inf, as in the kernel.
    """
    del config, impl, schedule, split_partials
    q = q.unpadded() if isinstance(q, QueryRows) else q
    fmt = _validate(
        q, kv_pages, block_table, seq_lens, softmax_scale, page_format, checked=checked, page_offset=page_offset
    )
    B, s_q, H, _ = q.shape
    pages = kv_pages[block_table + page_offset]
    if fmt.quantized:
        pages = fmt.dequantize_reference(pages)
    kv_BSK = pages.reshape(B, -1, KEY_DIM).astype(jnp.float32)  # (B, S, K)
    keys = jnp.arange(kv_BSK.shape[1], dtype=jnp.int32)
    valid_BS = keys[None, :] < seq_lens.astype(jnp.int32)[:, None]
    # Zero rows past the sequence: unused slots may hold anything (NaN), and 0 * NaN = NaN.
    kv_BSK = jnp.where(valid_BS[..., None], kv_BSK, 0.0)
    scores_BTHS = (
        jnp.einsum("bthk,bsk->bths", q.astype(jnp.float32), kv_BSK, precision=lax.Precision.HIGHEST) * softmax_scale
    )
    visible_BTS = keys[None, None, :] < _key_limits(seq_lens, s_q, causal)[..., None]
    scores_BTHS = jnp.where(visible_BTS[:, :, None, :], scores_BTHS, -jnp.inf)
    m_BTH = scores_BTHS.max(axis=-1)
    m_BTH = jnp.where(jnp.isfinite(m_BTH), m_BTH, 0.0)
    p_BTHS = jnp.exp(scores_BTHS - m_BTH[..., None])
    l_BTH = p_BTHS.sum(axis=-1)
    out_BTHL = jnp.einsum("bths,bsl->bthl", p_BTHS, kv_BSK[..., :LATENT_DIM], precision=lax.Precision.HIGHEST)
    out_BTHL = out_BTHL / jnp.where(l_BTH == 0, 1.0, l_BTH)[..., None]
    lse_BTH = jnp.where(l_BTH == 0, -jnp.inf, m_BTH + jnp.log(l_BTH))
    return out_BTHL.astype(q.dtype), lse_BTH


def mla_decode_fp8_math_reference(
    q, kv_pages, block_table, seq_lens, *, softmax_scale, causal=False, page_format=None, checked=False, page_offset=0
):
    """Plain-jnp absorbed MLA decode over fp8 pages with the FP8 math decided for the fp8 bodies: the query
    quantized to e4m3 per row, e4m3 products with the pages' block scales applied per 128 columns, P quantized
    to e4m3 with the scales folded in (`pallas_kernels.mla_decode.fp8_math`). No kernel body computes it yet:
    it is the oracle such a body will be checked against, and what measures that math's error
    (docs/PERFORMANCE.md, "Limits and open gaps"). Same arguments and checks as `mla_decode_reference`, for fp8
    pages only (a ValueError names any other format).
    """
    q = q.unpadded() if isinstance(q, QueryRows) else q
    fmt = _validate(
        q, kv_pages, block_table, seq_lens, softmax_scale, page_format, checked=checked, page_offset=page_offset
    )
    if fmt.name != "fp8":
        raise ValueError(f"mla_decode_fp8_math_reference reads fp8 pages, got {fmt.name} pages")
    B, s_q = q.shape[:2]
    keys = jnp.arange(block_table.shape[1] * kv_pages.shape[1], dtype=jnp.int32)
    visible_BTS = keys[None, None, :] < _key_limits(seq_lens, s_q, causal)[..., None]
    out, lse = fp8_math_decode(
        q, kv_pages[block_table + page_offset], seq_lens, visible_BTS, softmax_scale=float(softmax_scale)
    )
    return out.astype(q.dtype), lse
