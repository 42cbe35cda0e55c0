"""The FP8 math of `mla_decode` over fp8 pages (`MlaDecodeConfig.fp8_math="fp8"`), in plain jnp: the query's
quantization (`quantize_query_rows`, which a kernel's wrapper can run as it is) and the decode the e4m3
tensor-core bodies compute (`fp8_math_decode`; `mla_decode_fp8_math_reference` is its checked face).

Per sequence, query row (t, h), key token s (of page j = s // 64) and latent block k (128 columns, one fp32
scale a token, `pallas_kernels.page_format`):

* Q·Kᵀ: the row's 512 latent values quantized to e4m3 with one scale, q_scale = amax / 448 (1 for an
  all-zero row): q8 = e4m3(q_lat / q_scale). The score is

      softmax_scale · (Σ_k q_scale · k_scale[s, k] · (q8_k · k8_k[s]) + q_rope · k_rope[s])

  with each block's e4m3 product accumulated in f32 (an e4m3 WGMMA) and the rope in bf16 as stored.
* Softmax: P = exp(score - m) in f32, m the row's largest score, so P is in [0, 1]; l = Σ P in f32, summed
  before any rounding of P.
* P·V (V is the latent itself, the 512 e4m3 columns): the page's block scales are folded into P, per block
  of the output: out_k = Σ_j c[j, k] · (p8_jk · V8_k) / l with p8_jk = e4m3(P · k_scale[s, k] / c[j, k]) over
  page j's tokens, c[j, k] the largest block-k scale of page j's valid tokens (1 when that is 0). Dividing by
  c keeps the folded P in [0, 1]: k_scale itself is amax / 448, about 2e-3 for a block whose largest value
  is 1, so P · k_scale would fall under e4m3's smallest subnormal (2^-9) and round to 0. A kernel applies c
  through its running accumulator: acc_k · alpha · c_old / c_new before page j's product, acc_k · c / l at
  the end.

A kernel's online softmax quantizes P relative to the running maximum, not the row's final one, so its P
rounds differently from this one's; both stay within the same bound of the exact product.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.mla_decode.config import LATENT_DIM
from pallas_kernels.page_format import FP8_BLOCK, FP8_MAX

E4M3 = jnp.float8_e4m3fn
NUM_BLOCKS = LATENT_DIM // FP8_BLOCK  # 4 scales a token


def _e4m3(x):
    """f32 x (|x| <= 448 or clipped there) rounded to e4m3, back in f32. The barrier keeps the rounding:
    XLA:GPU folds a convert to fp8 and straight back into nothing (as in `fp8_gemm.reference`)."""
    return lax.optimization_barrier(jnp.clip(x, -FP8_MAX, FP8_MAX).astype(E4M3)).astype(jnp.float32)


def quantize_query_rows(q_lat):
    """Latent query rows [..., 512] (bf16 / f32) -> (q8 float8_e4m3fn [..., 512], q_scale f32 [...]) with
    q_lat ~= q8 · q_scale, q_scale = amax(|row|) / 448, or 1 for an all-zero row (whose q8 is 0)."""
    x = q_lat.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / FP8_MAX
    scale = jnp.where(scale > 0, scale, 1.0)
    q8 = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(E4M3)
    return lax.optimization_barrier(q8), scale


def split_fp8_pages(pages):
    """uint8 fp8 pages [..., 656] -> (latent e4m3 values as f32 [..., 512], block scales f32 [..., 4],
    rope f32 [..., 64]), no scale applied."""
    k8 = lax.bitcast_convert_type(pages[..., :LATENT_DIM], E4M3).astype(jnp.float32)
    end = LATENT_DIM + 4 * NUM_BLOCKS
    scales = lax.bitcast_convert_type(pages[..., LATENT_DIM:end].reshape(*pages.shape[:-1], NUM_BLOCKS, 4), jnp.float32)
    rope = pages[..., end:]
    rope = lax.bitcast_convert_type(rope.reshape(*rope.shape[:-1], rope.shape[-1] // 2, 2), jnp.bfloat16)
    return k8, scales, rope.astype(jnp.float32)


def fp8_math_decode(q, pages, seq_lens, visible, *, softmax_scale: float):
    """The module docstring's decode, unchecked.

    Args:
      q: bf16 [B, T, H, 576] (latent 512 ; rope 64).
      pages: uint8 [B, P, G, 656]: each sequence's fp8 pages in token order (the block table applied).
      seq_lens: int32 [B]: tokens s < seq_len are the sequence's; the rest (maybe NaN bytes) are ignored.
      visible: bool [B, T, P·G]: the keys each query token sees (a subset of the valid ones).
      softmax_scale: multiplies Q·Kᵀ.

    Returns:
      (out f32 [B, T, H, 512], lse f32 [B, T, H] natural log); a row that sees no key: out 0, lse -inf.
    """
    B, P, G, _ = pages.shape
    T, H = q.shape[1:3]
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    k8, ks, rope = split_fp8_pages(pages)
    valid = (jnp.arange(P * G, dtype=jnp.int32)[None, :] < seq_lens.astype(jnp.int32)[:, None]).reshape(B, P, G)
    # Bytes outside a sequence may be NaN, and 0 x NaN = NaN: zero them before any product.
    k8 = jnp.where(valid[..., None], k8, 0.0).reshape(B, P, G, NUM_BLOCKS, FP8_BLOCK)
    ks = jnp.where(valid[..., None], ks, 0.0)  # [B, P, G, 4]
    rope = jnp.where(valid[..., None], rope, 0.0)

    q8, q_scale = quantize_query_rows(q[..., :LATENT_DIM])
    q8 = q8.astype(f32).reshape(B, T, H, NUM_BLOCKS, FP8_BLOCK)
    blocks = jnp.einsum("bthkc,bpgkc->bthpgk", q8, k8, precision=hi)  # exact e4m3 products, f32 sums
    lat = (blocks * (q_scale[..., None, None, None] * ks[:, None, None])).sum(axis=-1)
    rope_sc = jnp.einsum("bthr,bpgr->bthpg", q[..., LATENT_DIM:].astype(f32), rope, precision=hi)
    scores = ((lat + rope_sc) * softmax_scale).reshape(B, T, H, P * G)
    scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf)
    m = scores.max(axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m[..., None])
    l = p.sum(axis=-1)

    c = ks.max(axis=2)  # [B, P, 4]: each page's largest scale per block (invalid tokens are 0)
    c = jnp.where(c > 0, c, 1.0)
    folded = ks / c[:, :, None, :]  # [B, P, G, 4], in [0, 1]
    p8 = _e4m3(p.reshape(B, T, H, P, G)[..., None] * folded[:, None, None])  # [B, T, H, P, G, 4]
    pv = jnp.einsum("bthpgk,bpgkc->bthpkc", p8, k8, precision=hi)  # [B, T, H, P, 4, 128]
    out = (pv * c[:, None, None, :, :, None]).sum(axis=3).reshape(B, T, H, LATENT_DIM)
    out = out / jnp.where(l == 0, 1.0, l)[..., None]
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(l))
    return out, lse
