"""A decode step's latents into their pages in one kernel: the latent's RMSNorm, the key's RoPE and the page write
(Pallas, Triton backend).

Dimension letters: B sequences, T tokens a sequence, C the cached width (K + R), K the latent (kv_lora_rank), R the
rotary key, L layers of a scanned stack, N pages a pool, G tokens a page, P pages a sequence's table, S split-K
partials.

What MLA caches a token is [kv_norm(c) ; rope(k_pe)] of wkv_a's row [c ; k_pe]. XLA made that three kernels a layer
of a decode step: the sum of wkv_a's split-K partials, the norm's sum of squares (a reduction cannot fuse into the
in-place update that consumes it) and the update of the page row that normalises, rotates and writes.
`latent_write` is one launch of B·T programs, a token each: it loads the token's row (its `Partials` summed as they
are loaded), takes the sum of squares of its K latent columns, normalises them, rotates its R key columns by the
token's position and stores the row into its page, in place in the (aliased) pool. A token whose position is
negative (padding) or past its table is not written. The norm's weight may be a scanned stack's [L, K], read at its
layer in place, and the pools a stack's [L, N, G, C], written at theirs.

The arithmetic is the model's (`latent_rows_reference`): the row in its dtype (partials summed in fp32 first); c in
fp32, normalised and cast back to the row's dtype, times the weight in their promoted dtype (`rms_norm`), cast to
the row's dtype; the key rotated in fp32 (`rotate`, interleaved pairs or halves) by the angles `rotation` makes of
the position, and cast back; the row cast to the pages' dtype. The kernel computes cos and sin itself (from the
position and the frequencies): they are the same fp32 operations as `rotation`'s.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend
from pallas_kernels.stacked_matmul import Partials, rms_norm

_F32 = jnp.float32


def rotation(positions, inv_freq, scale: float = 1.0):
    """cos, sin float32 [..., R/2] of integer `positions` [...]: the angles position · inv_freq (fp32 [R/2]), their
    cosine and sine times `scale` (YaRN's attention factor). The one formula of `mla_jax.rope.rope_cos_sin` and of
    `latent_write`."""
    angles = positions.astype(_F32)[..., None] * jnp.asarray(inv_freq, _F32)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def rotate(x, cos, sin, *, interleave: bool = True):
    """RoPE: rotate the last axis of `x` [B, T, ..., R] by cos / sin [B, T, R/2] (broadcast over the middle axes), in
    fp32, cast back to x's dtype. ``interleave``: the pairs are (x[2i], x[2i+1]) (DeepSeek's checkpoints), else
    (x[i], x[i + R/2]). The one formula of `mla_jax.rope.apply_rope` and of `latent_write`."""
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    xf = x.astype(_F32)
    half = x.shape[-1] // 2
    if interleave:
        pairs = xf.reshape(x.shape[:-1] + (half, 2))
        re, im = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(x.shape)
    else:
        re, im = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return out.astype(x.dtype)


def _rows(kv, shape):
    """wkv_a's rows [B, T, C] from an array or `Partials` (summed)."""
    return (kv.total() if isinstance(kv, Partials) else kv).reshape(shape)


def latent_rows_reference(
    kv, norm_weight, positions_BT, inv_freq, *, eps, interleave, rope_scale=1.0, norm_layer=None, weight_apart=False
):
    """The cached rows [B, T, C] in kv's dtype: [rms_norm(c, weight) ; rotate(k_pe)] of wkv_a's rows [c ; k_pe]
    (an array [B, T, C] or its `Partials`), the key rotated by `rotation`(positions, inv_freq, rope_scale);
    ``weight_apart``: `rms_norm`'s (the same values)."""
    B, T = positions_BT.shape
    kv_BTC = _rows(kv, (B, T, kv.shape[-1]))
    K = kv_BTC.shape[-1] - 2 * len(inv_freq)
    weight = norm_weight if norm_layer is None else norm_weight[norm_layer]
    c = rms_norm(kv_BTC[..., :K], weight, eps, weight_apart=weight_apart)
    cos, sin = rotation(positions_BT, inv_freq, rope_scale)
    k_pe = rotate(kv_BTC[..., K:], cos, sin, interleave=interleave)
    return jnp.concatenate([c.astype(kv_BTC.dtype), k_pe], axis=-1)


def latent_write_reference(pages, kv, positions_BT, block_table_BP, norm_weight, inv_freq, *, layer=None, **kw):
    """`latent_write` in plain jnp: the rows (`latent_rows_reference`, ``kw`` its options) scattered into their pages,
    padding dropped."""
    rows = latent_rows_reference(kv, norm_weight, jnp.maximum(positions_BT, 0), inv_freq, **kw)
    N, G = pages.shape[-3:-1]
    P = block_table_BP.shape[1]
    valid = (positions_BT >= 0) & (positions_BT < P * G)
    pos = jnp.where(valid, positions_BT, 0)
    page = jnp.where(valid, jnp.take_along_axis(block_table_BP, pos // G, axis=1), N)  # N: out of bounds, dropped
    index = (page, pos % G) if layer is None else (layer, page, pos % G)
    return pages.at[index].set(rows.astype(pages.dtype), mode="drop")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def latent_write_problems(pages_dtype, K: int, R: int) -> list[str]:
    """Why `latent_write`'s kernel cannot write rows of K latent and R rotary columns into pages of `pages_dtype`
    (empty when it can)."""
    out = []
    if not jnp.issubdtype(pages_dtype, jnp.floating):
        out.append(f"pages of {jnp.dtype(pages_dtype)}: the kernel writes values, not encoded (fp8 / fp4) rows")
    if not _pow2(K):
        out.append(f"K = {K} latent columns is not a power of two (a load of its own)")
    if not (R % 2 == 0 and _pow2(R // 2)):
        out.append(f"R = {R} rotary columns is not twice a power of two (a load a half)")
    return out


def _piece(R: int, interleave: bool) -> int:
    """The width w of the pieces the kernel views a row as [C / w, w], so that each half of the rotary pairs is a
    load of its own (a strided slice is not): 2 (interleaved pairs: the halves are columns 0 and 1) or R/2 (halves:
    two rows)."""
    return 2 if interleave else R // 2


def _kernel(
    layer_ref,
    norm_layer_ref,
    pos_ref,
    table_ref,
    kv_ref,
    w_ref,
    f_ref,
    _,
    pages_ref,
    *,
    T,
    K,
    R,
    S,
    dtype,
    eps,
    scale,
    interleave,
):
    """Refs: the pools' layer [1], the norm's layer [1]; positions [B·T]; the table [B, P]; the rows [B·T', C/w, w]
    (S = 0) or partials [S, B·T', C/w, w], T' >= T; the norm's weight [K/w, w] or [L, K/w, w]; the frequencies [R/2];
    the pages [N, G, C/w, w] or [L, N, G, C/w, w] (aliased: the input is not read). `dtype`: the rows'."""
    i = pl.program_id(0)
    G, P = pages_ref.shape[-3], table_ref.shape[1]
    pos = pos_ref[i]
    w_ = pages_ref.shape[-1]

    def load(at):  # the row's pieces at `at`, partials summed in fp32 and cast to the rows' dtype, as fp32
        if not S:
            return plt.load(kv_ref.at[(i, *at)]).astype(_F32)
        x = plt.load(kv_ref.at[(jnp.int32(0), i, *at)])
        for s in range(1, S):
            x = x + plt.load(kv_ref.at[(jnp.int32(s), i, *at)])
        return x.astype(dtype).astype(_F32)

    @pl.when((pos >= 0) & (pos < P * G))
    def _():
        page = table_ref[i // T, pos // G]
        row = (page, pos % G) if len(pages_ref.shape) == 4 else (layer_ref[0], page, pos % G)
        lat = (pl.ds(0, K // w_), slice(None))
        c = load(lat)
        w = plt.load(w_ref.at[lat] if len(w_ref.shape) == 2 else w_ref.at[(norm_layer_ref[0], *lat)])
        y = (c * lax.rsqrt(jnp.sum(jnp.sum(c * c, axis=1)) / K + eps)).astype(dtype)  # `rms_norm`
        y = (w.astype(_F32) * y.astype(_F32)).astype(jnp.result_type(w.dtype, dtype)).astype(dtype)
        plt.store(pages_ref.at[(*row, *lat)], y.astype(pages_ref.dtype))
        if interleave:
            re_at, im_at = (pl.ds(K // 2, R // 2), jnp.int32(0)), (pl.ds(K // 2, R // 2), jnp.int32(1))
        else:
            re_at, im_at = (jnp.int32(K // w_), slice(None)), (jnp.int32(K // w_ + 1), slice(None))
        re, im = load(re_at), load(im_at)
        angles = pos.astype(_F32) * plt.load(f_ref.at[pl.ds(0, R // 2)])  # `rotation`
        cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
        plt.store(pages_ref.at[(*row, *re_at)], (re * cos - im * sin).astype(dtype).astype(pages_ref.dtype))
        plt.store(pages_ref.at[(*row, *im_at)], (re * sin + im * cos).astype(dtype).astype(pages_ref.dtype))


def latent_write(
    pages,
    kv,
    positions_BT,
    block_table_BP,
    norm_weight,
    inv_freq,
    *,
    eps: float,
    interleave: bool = True,
    rope_scale: float = 1.0,
    layer=None,
    norm_layer=None,
    impl: str | None = "auto",
):
    """Normalise, rotate and write B·T tokens' latents into their pages, in one kernel -> the pages.

    Args:
      pages: a pool [N, G, C] of values (bf16 / f32), or a stack of pools [L, N, G, C] (then `layer` picks the one
        written, in place); the kernel updates the buffer in place (donate it, as a decode step does its cache).
      kv: wkv_a's rows [B, T, C], the K latent columns c then the R rotary key columns k_pe, or their split-K
        `Partials` (of rows [B, T, C] or [B·T, C]), summed as the kernel loads them.
      positions_BT: int32 [B, T]: each token's position in its sequence; negative (padding) or at or past P·G: not
        written.
      block_table_BP: int32 [B, P]: each sequence's page ids in token order (entries read must be in [0, N)).
      norm_weight: [K] kv_norm's weight, or a stack's [L, K] (then `norm_layer` picks the row, in place).
      inv_freq: float32 [R/2] the rotary frequencies (`mla_jax.rope.inv_frequencies`); rope_scale: the factor on cos
        and sin (`rotation`).
      eps: the norm's epsilon. interleave: the rotary pairs' layout (`rotate`).
      layer, norm_layer: int scalars (may be traced), with stacks.
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU where
        `latent_write_problems` is empty, else `latent_write_reference`).
    Returns the pages (the same shape and dtype) with each valid token's row [rms_norm(c) ; rotate(k_pe)] written.
    """
    B, T = positions_BT.shape
    C, R = pages.shape[-1], 2 * len(inv_freq)
    K = C - R
    parts = isinstance(kv, Partials)
    rows = kv.parts if parts else kv
    if rows.shape[-1] != C or (rows.ndim != 3 or rows.shape[1] < B * T if parts else rows.shape != (B, T, C)):
        want = f"Partials [S, >= B·T={B * T}, C={C}]" if parts else f"[B={B}, T={T}, C={C}]"
        raise ValueError(f"latent_write: kv must be {want} (C the pages' width), got {tuple(rows.shape)}")
    if pages.ndim not in (3, 4) or (pages.ndim == 4) != (layer is not None):
        raise ValueError(
            f"latent_write: pages [N, G, C] (or [L, N, G, C] with a layer) expected, got {tuple(pages.shape)} with "
            f"layer {'given' if layer is not None else 'None'}"
        )
    if block_table_BP.ndim != 2 or block_table_BP.shape[0] != B:
        raise ValueError(f"latent_write: block table [B={B}, P] expected, got {tuple(block_table_BP.shape)}")
    if (
        norm_weight.shape[-1] != K
        or norm_weight.ndim not in (1, 2)
        or (norm_weight.ndim == 2) != (norm_layer is not None)
    ):
        raise ValueError(
            f"latent_write: norm weight [K={K}] (or [L, K] with a norm_layer) expected, got {tuple(norm_weight.shape)}"
        )
    impl = backend.choose(impl, latent_write_problems(pages.dtype, K, R), name="latent_write impl")
    kw = dict(eps=eps, interleave=interleave)
    if impl == "reference":
        args = (pages, kv, positions_BT, block_table_BP, norm_weight, inv_freq)
        return latent_write_reference(*args, layer=layer, norm_layer=norm_layer, rope_scale=rope_scale, **kw)
    w_ = _piece(R, interleave)
    S = rows.shape[0] if parts else 0
    kv_in = rows.reshape(rows.shape[:-1] + (C // w_, w_)) if parts else rows.reshape(B * T, C // w_, w_)
    scalar = lambda a: jnp.asarray(0 if a is None else a, jnp.int32).reshape(1)  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, T=T, K=K, R=R, S=S, dtype=jnp.dtype(kv.dtype), scale=float(rope_scale), **kw),
        out_shape=jax.ShapeDtypeStruct(pages.shape[:-1] + (C // w_, w_), pages.dtype),
        grid=(B * T,),
        input_output_aliases={7: 0},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=impl == "interpret",
        name="latent_write",
    )(
        scalar(layer),
        scalar(norm_layer),
        positions_BT.reshape(B * T).astype(jnp.int32),
        block_table_BP.astype(jnp.int32),
        kv_in,
        norm_weight.reshape(norm_weight.shape[:-1] + (K // w_, w_)),
        jnp.asarray(inv_freq, _F32),
        pages.reshape(pages.shape[:-1] + (C // w_, w_)),
    )
    return out.reshape(pages.shape)
