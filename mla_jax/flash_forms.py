"""The decompressed attention through a flash kernel: cuDNN's, or this project's Mosaic GPU ones
(`pallas_kernels.flash_attention`), each over the rows it can attend by index (right-padded self-attention, or a
prefill chunk over its row's gathered cache); rows of other positions give NaN, not a wrong attention.
`mla_jax.attention.mla_decompressed_attention` picks one (`resolve_decompressed_impl`).

Dimension letters: B batch, T query tokens, S key tokens, H heads, D the qk width, V the v width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# jax.nn.dot_product_attention wants equal qk and v widths; its cuDNN backend takes MLA's 192 / 128 (jax 0.11)
from jax._src.cudnn.fused_attention_stablehlo import MaskType
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

from pallas_kernels import backend, flash_attention, flash_attention_prefill
from pallas_kernels.flash_attention import CTA_ROWS


def _right_padded(q_positions, kv_positions, impl):
    """(ok: scalar bool, n [B] int32, valid [B, T] bool): whether both position rows are 0..n-1 then -1
    (right-padded self-attention, what a by-index causal kernel computes), each row's n, and which queries
    are real."""
    B, T = q_positions.shape
    if kv_positions.shape != (B, T):
        raise ValueError(f"impl={impl!r} is self-attention: kv positions {kv_positions.shape} != queries' {(B, T)}")
    n_B = jnp.sum(q_positions >= 0, axis=1).astype(jnp.int32)
    idx = jnp.arange(T, dtype=jnp.int32)[None]
    expected = jnp.where(idx < n_B[:, None], idx, -1)
    ok = jnp.all(q_positions == expected) & jnp.all(kv_positions == expected)
    return ok, n_B, idx < n_B[:, None]


def _mgpu_causal_attention(q_BTHD, k_BSHD, v_BSHV, q_positions, kv_positions, softmax_scale, *, kernel_impl=None):
    """`pallas_kernels.flash_attention` (causal by index, forward and backward kernels) over right-padded
    self-attention, with `_cudnn_causal_attention`'s contract: other positions give NaN. Padding queries
    give 0 (as the jnp form). The kernel computes in bf16 (inputs are cast) and wants T a multiple of 128
    and widths multiples of 64: T is padded with zero rows at the end (no real query sees them: causal),
    the widths with zero columns. ``kernel_impl``: None = the kernel (a Hopper GPU), or "interpret" (the
    Pallas interpreter on a CPU; tests)."""
    if kernel_impl is None:
        if not backend.on_hopper():
            where = jax.default_backend()
            if where == "gpu":
                where += f" ({jax.devices()[0].device_kind})"
            raise ValueError(
                f"impl='mgpu' needs a Hopper GPU (the Mosaic GPU flash attention kernel); the backend "
                f"is {where}: use impl='xla'"
            )
        kernel_impl = "kernel"
    ok, _, valid_BT = _right_padded(q_positions, kv_positions, "mgpu")
    T, D, V = q_BTHD.shape[1], q_BTHD.shape[3], v_BSHV.shape[3]
    dtype = q_BTHD.dtype
    # Zero rows at the end (T), zero q/k columns (D: no change to any score) and zero v columns (V: sliced
    # off) bring the shapes to the kernel's multiples; a no-op at V2/V3's 4096 x 192 / 128.
    pad = lambda x, t, c: jnp.pad(x, ((0, 0), (0, t), (0, 0), (0, c))) if t or c else x  # noqa: E731
    t_pad, d_pad, v_pad = -T % CTA_ROWS, -D % 64, -V % 64
    q, k = (pad(x, t_pad, d_pad).astype(jnp.bfloat16) for x in (q_BTHD, k_BSHD))
    v = pad(v_BSHV, t_pad, v_pad).astype(jnp.bfloat16)
    o = flash_attention(q, k, v, softmax_scale=float(softmax_scale), causal=True, impl=kernel_impl)[:, :T, :, :V]
    o = jnp.where(valid_BT[:, :, None, None], o, 0)
    return jnp.where(ok, o, jnp.nan).astype(dtype)


def _pad_widths(q_BTHD, k_BSHD, v_BSHV):
    """q, k zero-padded to a multiple of 64 columns (no score changes) and v likewise (sliced off after), bf16."""
    pad = lambda x, c: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, c))) if c else x  # noqa: E731
    d_pad, v_pad = -q_BTHD.shape[3] % 64, -v_BSHV.shape[3] % 64
    return tuple(pad(x, c).astype(jnp.bfloat16) for x, c in ((q_BTHD, d_pad), (k_BSHD, d_pad), (v_BSHV, v_pad)))


def _mgpu_prefill_attention(q_BTHD, k_BSHD, v_BSHV, q_positions, kv_positions, softmax_scale, kernel_impl):
    """`pallas_kernels.flash_attention_prefill` over a row's gathered cache: queries at positions p0..p0+m-1
    then -1, keys at 0..n-1 then -1 (what `KVCache.gather` and a prefill chunk give), so row b's query
    offset is its first position and its key length its valid keys. Rows of other positions give NaN;
    padding queries give 0 (as the jnp form). Inputs are cast to bf16, widths padded to multiples of 64.
    ``kernel_impl``: the `pallas_kernels.backend` name the kernel runs with."""
    B, T = q_positions.shape
    S = kv_positions.shape[1]
    n_q_B = jnp.sum(q_positions >= 0, axis=1).astype(jnp.int32)
    off_B = jnp.where(n_q_B > 0, q_positions[:, 0], 0).astype(jnp.int32)
    kv_len_B = jnp.sum(kv_positions >= 0, axis=1).astype(jnp.int32)
    t, s = jnp.arange(T, dtype=jnp.int32)[None], jnp.arange(S, dtype=jnp.int32)[None]
    valid_BT = t < n_q_B[:, None]
    ok = jnp.all(q_positions == jnp.where(valid_BT, off_B[:, None] + t, -1))
    ok &= jnp.all(kv_positions == jnp.where(s < kv_len_B[:, None], s, -1))
    q, k, v = _pad_widths(q_BTHD, k_BSHD, v_BSHV)
    o = flash_attention_prefill(
        q, k, v, off_B, kv_len_B, softmax_scale=float(softmax_scale), causal=True, impl=kernel_impl
    )[..., : v_BSHV.shape[3]]
    o = jnp.where(valid_BT[:, :, None, None], o, 0)
    return jnp.where(ok, o, jnp.nan).astype(q_BTHD.dtype)


def _cudnn_causal_attention(q_BTHD, k_BSHD, v_BSHV, q_positions, kv_positions, softmax_scale):
    """cuDNN's flash attention (qk width D, v width V; jax's MLA form of it) over right-padded self-attention.

    Rows must be positions 0..n-1 then -1 on both sides (n = the row's valid tokens): cuDNN masks by index
    (causal, and the padding past n), which equals `attention_mask` on exactly those rows. Other positions
    (left padding, a cached prefix, packed documents) give NaN outputs instead of a wrong attention. The
    padding queries' outputs are cuDNN's (the jnp form gives 0 there; the loss masks them either way).
    """
    if jax.default_backend() != "gpu":
        raise ValueError(
            f"impl='cudnn' needs a CUDA GPU (cuDNN's flash attention); the backend is "
            f"{jax.default_backend()}: use impl='xla'"
        )
    ok, n_B, _ = _right_padded(q_positions, kv_positions, "cudnn")
    o = cudnn_attention(
        q_BTHD,
        k_BSHD,
        v_BSHV,
        None,
        None,
        n_B,
        n_B,
        scale=float(softmax_scale),
        mask_type=MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH",
    )
    return jnp.where(ok, o, jnp.nan).astype(q_BTHD.dtype)
