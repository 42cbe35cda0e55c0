"""Causal flash attention for MLA's decompressed path, forward and backward (Mosaic GPU, sm_90).

Dimension letters: B batch, T tokens (queries = keys: self-attention), H heads (one K/V head per
query head, no GQA), D = q·k width (192 for DeepSeek-V2/V3: 128 nope + 64 rope), V = v width (128).

Training attends with per-head K/V (the latent up-projected by ``wkv_b``) over right-padded rows
whose positions are 0..T-1 (the padding tail is masked by the loss), so the kernel is plain causal
attention by token index, q·k width D != v width V. cuDNN does the same (`mla_jax.attention`'s
"cudnn" impl) but has no CPU interpreter; this kernel runs in the Pallas Mosaic GPU interpreter.

This package: this file is the public face (`flash_attention`, its validation, the reference, the custom
VJP; `flash_attention_prefill`), `config` the limits and knobs, `steps` what the kernels share, `forward` and
`backward` the kernels, `prefill` the forward with per-row query offsets and key lengths (a prefill chunk
over a cached prefix: its reference, validation and padding).

Kernels (each a `plgpu.kernel` with 2 compute warpgroups x 64 rows and a TMA producer warpgroup,
`plgpu.emit_pipeline_warp_specialized`; bf16 tiles in SMEM with 8x64 tiling and a 128-byte swizzle,
as wgmma wants them; fp32 softmax in the exp2 domain; running max starts at -1e30, not -inf):

* forward: CTA = (128 query rows, head, batch). Warpgroup w owns rows [128 q + 64 w, +64): its Q
  tile stays in SMEM; K and V blocks (``block_kv`` keys) stream through ``max_concurrent_steps``
  stages, only up to the diagonal (causal loop bound: cdiv(128 (q + 1), block_kv) blocks). Per
  block: S = Q·Kᵀ (wgmma, fp32), mask key > query to -inf, online softmax, O += P·V (P bf16 from
  registers). Writes O (bf16) and the log-sum-exp (log2 domain, [B, H, T] fp32) for the backward.
* forward with offsets (`flash_attention_prefill`, inference): the same kernel with per-row query
  offsets and key lengths (int32 [B] each, read from GMEM per CTA): queries at positions p0..p0+T-1 over
  S keys, the key loop stopping at the CTA's last visible key, the mask on blocks straddling the offset
  diagonal or the key length (`forward._forward`'s ``offsets``; the training kernel is unchanged).
* delta = rowsum(dO ∘ O) in jnp (fp32, [B, H, T]).
* dK/dV: CTA = (128 keys, head, batch); warpgroup w owns keys [128 k + 64 w, +64), K and V tiles
  resident. Q, dO, lse and delta blocks of 64 queries stream from the diagonal (query block 2 k) to
  the end. Per block: Sᵀ = K·Qᵀ, Pᵀ = exp2(Sᵀ·c - lse) masked, dV += Pᵀ·dO, dPᵀ = V·dOᵀ,
  dSᵀ = Pᵀ ∘ (dPᵀ - delta), dK += dSᵀ·Q; dK is scaled by softmax_scale at the end.
* dQ: CTA = (128 query rows, head, batch); warpgroup w owns rows as in the forward, Q, dO, lse and
  delta resident; K and V blocks of ``block_kv_dq`` keys stream up to the diagonal. Per block:
  S = Q·Kᵀ, P = exp2(S·c - lse) masked, dP = dO·Vᵀ, dS = P ∘ (dP - delta), dQ += dS·K.

The interpreter cannot take a wgmma A operand from registers nor run ``run_state`` accumulators,
so `FlashAttentionConfig.interpretable` (set automatically for ``impl="interpret"``) stages P / dS
through SMEM and accumulates with ``run_scoped``; the production form is checked by
cross-lowering for sm_90 and on the GPU.

SMEM (bytes, defaults): forward Q 2x64x192x2 = 48 Ki + 2 stages x (K 128x192x2 + V 128x128x2 =
80 Ki) = 208 Ki; dK/dV: K, V 80 Ki resident + 2 stages x (Q 24 Ki + dO 16 Ki + lse, delta 0.5 Ki)
= 161 Ki; dQ: Q, dO, lse, delta 81 Ki + 2 stages x (K 24 Ki + V 16 Ki) = 161 Ki. The limit is 227 Ki.
Registers (32-bit registers per compute thread, 128 threads a warpgroup; a 64 x n fp32 tile is n/2):
forward O 64 + S 64 + P (bf16) 32 = 160 at the peak; dK/dV: dK 96 + dV 64 + Pᵀ (kept in bf16 only)
16 + dPᵀ 32 = 208 at the peak (dSᵀ replaces dPᵀ); dQ: dQ 96 + P 32 + dP 32 = 160. The compute
warpgroups get setmaxnreg 232 (memory_registers=40 for the TMA warpgroup), so dK/dV is the tight
one: check ``MOSAIC_GPU_DUMP_PTXAS=1`` for spills on the GPU.

Schedule: forward and dQ CTAs of late query blocks (more keys under the causal mask) launch first;
the forward's two warpgroups ping-pong on a CTA barrier (FA3: one's softmax under the other's
wgmmas) and release each K stage right after Q·Kᵀ. The causal mask (iota compare + select) runs
only on blocks that straddle the diagonal (``lax.cond``), and no block wholly after it is fetched.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backend
from pallas_kernels.flash_attention.backward import _backward_dkv, _backward_dq
from pallas_kernels.flash_attention.config import (
    CTA_ROWS,
    MAX_WIDTH,
    SMEM_BYTES,
    FlashAttentionConfig,
    check_widths_and_scalars,
    smem_bytes,
)
from pallas_kernels.flash_attention.forward import _forward
from pallas_kernels.flash_attention.prefill import _prefill_forward, flash_attention_prefill_reference
from pallas_kernels.flash_attention.prefill import _validate as _validate_prefill

__all__ = [
    "CTA_ROWS",
    "MAX_WIDTH",
    "SMEM_BYTES",
    "FlashAttentionConfig",
    "flash_attention",
    "flash_attention_prefill",
    "flash_attention_prefill_reference",
    "flash_attention_reference",
    "smem_bytes",
]

# What impl="interpret" runs the kernels with (tests swap in ``detect_races=True``).
INTERPRET_PARAMS = plgpu.InterpretGPUParams()


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------


def _reference_with_lse(q, k, v, *, softmax_scale, causal=True):
    """(o in q's dtype, lse [B, H, T] fp32 natural log) with fp32 scores and softmax."""
    s = (
        jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        * softmax_scale
    )
    if causal:
        T, S = q.shape[1], k.shape[1]
        visible = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]
        s = jnp.where(visible, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bhts,bshv->bthv", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return o.astype(q.dtype), lse


def flash_attention_reference(q_BTHD, k_BTHD, v_BTHV, *, softmax_scale, causal=True, impl=None, config=None):
    """Plain-jnp attention with fp32 scores and softmax (the oracle of `flash_attention`); same
    contract, without the kernel's block and width limits (any T, D, V). ``impl`` and ``config``
    are accepted and ignored. Differentiable by jax (autodiff of the fp32 math)."""
    del impl, config
    _validate(q_BTHD, k_BTHD, v_BTHV, softmax_scale, causal, kernel=False)
    return _reference_with_lse(q_BTHD, k_BTHD, v_BTHV, softmax_scale=softmax_scale, causal=causal)[0]


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def _validate(q, k, v, softmax_scale, causal, config=None, *, kernel=True):
    """The contract's checks; ``kernel=False`` (the reference) skips the kernel's block and width limits."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, T, H, width], got shape {x.shape}")
        if x.dtype != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {x.dtype}")
    B, T, H, D = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {q.shape} (self-attention, one K head per Q head), got {k.shape}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B={B}, T={T}, H={H}, V], got {v.shape}")
    V = v.shape[3]
    check_widths_and_scalars(D, V, softmax_scale, causal, kernel=kernel)
    block = max(CTA_ROWS, config.block_kv, config.block_kv_dq) if config is not None else CTA_ROWS
    if T < 1 or (kernel and T % block):
        raise ValueError(f"T (tokens) must be a positive multiple of {block} (the kernel's blocks), got {T}")
    if B < 1 or H < 1:
        raise ValueError(f"batch and heads must be >= 1, got B={B}, H={H}")


# ------------------------------------------------------------------------------------------------
# custom_vjp and the entry point
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _flash(q, k, v, scale, causal, config, interpret):
    return _forward(q, k, v, scale=scale, causal=causal, config=config, interpret=interpret)[0]


def _flash_fwd(q, k, v, scale, causal, config, interpret):
    o, lse = _forward(q, k, v, scale=scale, causal=causal, config=config, interpret=interpret)
    return o, (q, k, v, o, lse)


def _flash_bwd(scale, causal, config, interpret, res, do):
    q, k, v, o, lse = res
    do = do.astype(q.dtype)
    delta = jnp.einsum("bthv,bthv->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    kw = dict(scale=scale, causal=causal, config=config, interpret=interpret)
    dk, dv = _backward_dkv(q, k, v, do, lse, delta, **kw)
    dq = _backward_dq(q, k, v, do, lse, delta, **kw)
    return dq, dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_BTHD, k_BTHD, v_BTHV, *, softmax_scale, causal=True, impl="auto", config=None):
    """Flash attention (self-attention, one K/V head per query head), differentiable.

    Args:
      q_BTHD, k_BTHD: bf16 [B, T, H, D]; D a multiple of 64 in [64, 256] (192 for MLA).
      v_BTHV: bf16 [B, T, H, V]; V a multiple of 64 in [64, 256] (128 for MLA).
      softmax_scale: Python float multiplying q·k.
      causal: query t sees keys 0..t (by index); False: every key.
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU, else the reference).
      config: `FlashAttentionConfig` (static); None = defaults. T must be a multiple of 128 and of
        its block sizes.

    Returns:
      o [B, T, H, V] bf16; softmax in fp32. ``jax.grad`` runs the dK/dV and dQ kernels.

    Raises:
      ValueError naming the bad value and the limit (dtype, widths, T, softmax_scale, config).
    """
    if config is None:
        config = FlashAttentionConfig()
    if not isinstance(config, FlashAttentionConfig):
        raise ValueError(f"config must be a FlashAttentionConfig or None, got {type(config).__name__}")
    _validate(q_BTHD, k_BTHD, v_BTHV, softmax_scale, causal, config)
    impl = backend.resolve(impl)
    if impl == "reference":
        return flash_attention_reference(q_BTHD, k_BTHD, v_BTHV, softmax_scale=softmax_scale, causal=causal)
    config, params = _kernel_setup(impl, q_BTHD.shape[3], v_BTHV.shape[3], config, ("forward", "dkv", "dq"))
    return _flash(q_BTHD, k_BTHD, v_BTHV, float(softmax_scale), causal, config, params)


def _kernel_setup(impl, D, V, config, kernels):
    """(config, interpreter params or None) for a resolved kernel ``impl``: the SMEM of ``kernels`` checked
    against sm_90 (the compiled kernels only: the interpreter has no SMEM limit, and its staging tiles add to
    it), the interpretable variant for the interpreter."""
    if impl != "interpret":
        for kernel, size in smem_bytes(D, V, config).items():
            if kernel in kernels and size > SMEM_BYTES:
                raise ValueError(
                    f"config {config} needs {size} bytes of SMEM in the {kernel} kernel "
                    f"(D={D}, V={V}), over the {SMEM_BYTES} of sm_90"
                )
        return config, None
    if not config.interpretable:
        config = dataclasses.replace(config, interpretable=True)
    return config, INTERPRET_PARAMS


def flash_attention_prefill(
    q_BTHD, k_BSHD, v_BSHV, q_offsets_B, kv_lens_B, *, softmax_scale, causal=True, impl="auto", config=None
):
    """Flash attention forward of a chunk of queries over keys that start before it (a cached prefix plus
    the chunk): `flash_attention`'s forward kernel with per-row query offsets and key lengths.

    Args:
      q_BTHD: bf16 [B, T, H, D], any T >= 1; D a multiple of 64 in [64, 256] (192 for MLA).
      k_BSHD: bf16 [B, S, H, D], any S >= 1 (one K/V head per query head).
      v_BSHV: bf16 [B, S, H, V]; V a multiple of 64 in [64, 256] (128 for MLA).
      q_offsets_B: int32 [B]: row b's query t sits at position q_offsets[b] + t (a query at a negative
        position sees no key).
      kv_lens_B: int32 [B]: row b's keys 0..kv_lens[b]-1 are valid (clipped to [0, S]).
      softmax_scale: Python float multiplying q·k.
      causal: a query at position p sees the valid keys s <= p; False: every valid key.
      impl: one of `pallas_kernels.backend.IMPLS` ("auto": the kernel on a Hopper GPU, else the reference).
      config: `FlashAttentionConfig` (static; its forward knobs: block_kv, max_concurrent_steps,
        memory_registers, schedule_barrier); None = defaults.

    Returns:
      o [B, T, H, V] bf16 (scores and softmax in fp32); a query that sees no key gives 0. Forward only
      (no VJP). T and S need no block multiple: the kernel call pads both with zero rows.

    Raises:
      ValueError naming the bad value and the limit (dtype, shapes, widths, softmax_scale, config, SMEM).
    """
    if config is None:
        config = FlashAttentionConfig()
    if not isinstance(config, FlashAttentionConfig):
        raise ValueError(f"config must be a FlashAttentionConfig or None, got {type(config).__name__}")
    _validate_prefill(q_BTHD, k_BSHD, v_BSHV, q_offsets_B, kv_lens_B, softmax_scale, causal)
    impl = backend.resolve(impl)
    if impl == "reference":
        return flash_attention_prefill_reference(
            q_BTHD, k_BSHD, v_BSHV, q_offsets_B, kv_lens_B, softmax_scale=softmax_scale, causal=causal
        )
    config, params = _kernel_setup(impl, q_BTHD.shape[3], v_BSHV.shape[3], config, ("forward",))
    return _prefill_forward(
        q_BTHD,
        k_BSHD,
        v_BSHV,
        q_offsets_B,
        kv_lens_B,
        scale=float(softmax_scale),
        causal=causal,
        config=config,
        interpret=params,
    )
