"""What `flash_attention_prefill` (the package's public face) runs: the flash attention forward with per-row
query offsets and key lengths, for a prefill chunk that attends over a cached prefix plus itself (forward
only); its jnp reference, its validation and the kernel call that pads T and S.

Dimension letters: B rows, T queries (the chunk), S keys (the row's prefix and the chunk, then padding),
H heads, D = q·k width, V = v width.

Row b's query t sits at position ``q_offsets[b] + t`` and sees key s iff ``s < kv_lens[b]`` and (causal)
``s <= q_offsets[b] + t``: the chunk's queries at positions p0..p0+T-1 over keys 0..p0+T-1 when the keys
are the gathered prefix followed by the chunk. The kernel is the forward of `flash_attention` (same CTA,
warpgroups, pipeline and SMEM) with the two int32 [B] arrays read from GMEM per CTA: its key loop stops at
the CTA's last visible key (min(kv_len, p0 + 128 (qb + 1)); the producer never fetches a block past it), and
the mask runs only on blocks that straddle the offset diagonal or kv_len.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.flash_attention.config import CTA_ROWS, check_widths_and_scalars
from pallas_kernels.flash_attention.forward import _forward

# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------


def flash_attention_prefill_reference(
    q_BTHD, k_BSHD, v_BSHV, q_offsets_B, kv_lens_B, *, softmax_scale, causal=True, impl=None, config=None
):
    """Plain-jnp `flash_attention_prefill` (fp32 scores and softmax): the same contract without the kernel's
    width limits. ``impl`` and ``config`` are accepted and ignored."""
    del impl, config
    _validate(q_BTHD, k_BSHD, v_BSHV, q_offsets_B, kv_lens_B, softmax_scale, causal, kernel=False)
    T, S = q_BTHD.shape[1], k_BSHD.shape[1]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    s_BHTS = jnp.einsum("bthd,bshd->bhts", f32(q_BTHD), f32(k_BSHD), precision=lax.Precision.HIGHEST) * softmax_scale
    key_S = jnp.arange(S, dtype=jnp.int32)
    visible_BTS = jnp.broadcast_to(key_S[None, None, :] < kv_lens_B[:, None, None], (q_BTHD.shape[0], T, S))
    if causal:
        pos_BT = q_offsets_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        visible_BTS = visible_BTS & (key_S[None, None, :] <= pos_BT[:, :, None])
    mask = visible_BTS[:, None]
    s_BHTS = jnp.where(mask, s_BHTS, -jnp.inf)
    m = jnp.max(s_BHTS, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s_BHTS - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)  # a query that sees no key: p = 0, o = 0
    o = jnp.einsum("bhts,bshv->bthv", p, f32(v_BSHV), precision=lax.Precision.HIGHEST)
    return o.astype(q_BTHD.dtype)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def _validate(q, k, v, q_offsets, kv_lens, softmax_scale, causal, *, kernel=True):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, tokens, H, width], got shape {x.shape}")
        if x.dtype != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {x.dtype}")
    B, T, H, D = q.shape
    S = k.shape[1]
    if B < 1 or T < 1 or S < 1 or H < 1:
        raise ValueError(f"B, T, S and H must be >= 1, got B={B}, T={T}, S={S}, H={H}")
    if k.shape != (B, S, H, D):
        raise ValueError(f"k must be [B={B}, S, H={H}, D={D}] (one K head per Q head), got {k.shape}")
    if v.shape[:3] != (B, S, H):
        raise ValueError(f"v must be [B={B}, S={S}, H={H}, V], got {v.shape}")
    for name, x in (("q_offsets", q_offsets), ("kv_lens", kv_lens)):
        if x.shape != (B,) or x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [B={B}], got {x.dtype} {x.shape}")
    check_widths_and_scalars(D, v.shape[3], softmax_scale, causal, kernel=kernel)


# ------------------------------------------------------------------------------------------------
# The kernel call
# ------------------------------------------------------------------------------------------------


def _prefill_forward(q_BTHD, k_BSHD, v_BSHV, q_offsets_B, kv_lens_B, *, scale, causal, config, interpret):
    """The forward kernel with offsets on inputs of any T and S: T is padded to a multiple of 128 and S to
    one of ``config.block_kv`` with zero rows (the padded keys lie past kv_len, the padded queries are
    dropped); kv_lens are clipped to [0, S]. -> o [B, T, H, V] bf16."""
    T, S = q_BTHD.shape[1], k_BSHD.shape[1]
    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n), (0, 0), (0, 0))) if n else x  # noqa: E731
    q = pad(q_BTHD, -T % CTA_ROWS)
    k, v = pad(k_BSHD, -S % config.block_kv), pad(v_BSHV, -S % config.block_kv)
    offsets = (q_offsets_B, jnp.clip(kv_lens_B, 0, S))
    o, _ = _forward(q, k, v, scale=scale, causal=causal, config=config, interpret=interpret, offsets=offsets)
    return o[:, :T]
