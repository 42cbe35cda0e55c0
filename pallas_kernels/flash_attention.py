"""Causal flash attention for MLA's decompressed path, forward and backward (Mosaic GPU, sm_90).

Dimension letters: B batch, T tokens (queries = keys: self-attention), H heads (one K/V head per
query head, no GQA), D = q·k width (192 for DeepSeek-V2/V3: 128 nope + 64 rope), V = v width (128).

Training attends with per-head K/V (the latent up-projected by ``wkv_b``) over right-padded rows
whose positions are 0..T-1 (the padding tail is masked by the loss), so the kernel is plain causal
attention by token index, q·k width D != v width V. cuDNN does the same (`mla_jax.attention`'s
"cudnn" impl) but has no CPU interpreter; this kernel runs in the Pallas Mosaic GPU interpreter.

Kernels (each a `plgpu.kernel` with 2 compute warpgroups x 64 rows and a TMA producer warpgroup,
`plgpu.emit_pipeline_warp_specialized`; bf16 tiles in SMEM with 8x64 tiling and a 128-byte swizzle,
as wgmma wants them; fp32 softmax in the exp2 domain; running max starts at -1e30, not -inf):

* forward: CTA = (128 query rows, head, batch). Warpgroup w owns rows [128 q + 64 w, +64): its Q
  tile stays in SMEM; K and V blocks (``block_kv`` keys) stream through ``max_concurrent_steps``
  stages, only up to the diagonal (causal loop bound: cdiv(128 (q + 1), block_kv) blocks). Per
  block: S = Q·Kᵀ (wgmma, fp32), mask key > query to -inf, online softmax, O += P·V (P bf16 from
  registers). Writes O (bf16) and the log-sum-exp (log2 domain, [B, H, T] fp32) for the backward.
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
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _platform

ROWS = 64  # rows per compute warpgroup (the wgmma M tile)
COMPUTE_WGS = 2
CTA_ROWS = ROWS * COMPUTE_WGS  # query rows (forward, dQ) / keys (dK/dV) per CTA
MAX_WIDTH = 256  # wgmma N limit: the widest D or V one accumulator can hold
SMEM_BYTES = 232448  # sm_90's SMEM per CTA (checked again by the lowering)
_LOG2E = math.log2(math.e)
# Running max starts finite: a row whose keys are all masked in a block then gives
# exp2(-inf - m) = 0 instead of exp2(-inf + inf) = NaN.
_M_INIT = -1e30
_BF16_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# What impl="interpret" runs the kernels with (tests swap in ``detect_races=True``).
INTERPRET_PARAMS = plgpu.InterpretGPUParams()


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """Static tuning knobs of `flash_attention`.

    Attributes:
      block_kv: keys per pipeline step of the forward (64 or 128; T must be a multiple).
      max_concurrent_steps: K/V stages in flight in the forward (2 to 4; SMEM-bound, see the module
        docstring: with D=192 and block_kv=128 only 2 fit).
      block_kv_dq: keys per pipeline step of the dQ kernel (64 or 128).
      bwd_max_concurrent_steps: stages in flight in the dK/dV and dQ kernels (2 to 4).
      memory_registers: registers per thread left to the TMA warpgroup (setmaxnreg).
      schedule_barrier: forward only: FA3's ping-pong of the two compute warpgroups (they meet at
        a CTA barrier after issuing Q·Kᵀ and before P·V, one meeting apart), so one warpgroup's
        softmax overlaps the other's matmuls.
      interpretable: stage P and dS through SMEM and accumulate with ``run_scoped`` (what the Pallas
        interpreter can run); slower, for interpret mode only (set automatically there).
    """

    block_kv: int = 128
    max_concurrent_steps: int = 2
    block_kv_dq: int = 64
    bwd_max_concurrent_steps: int = 2
    memory_registers: int = 40
    schedule_barrier: bool = True
    interpretable: bool = False

    def __post_init__(self):
        for name in ("block_kv", "block_kv_dq"):
            value = getattr(self, name)
            if value not in (64, 128):
                raise ValueError(f"{name} must be 64 or 128, got {value!r}")
        for name in ("max_concurrent_steps", "bwd_max_concurrent_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 2 <= value <= 4:
                raise ValueError(f"{name} must be an int in [2, 4], got {value!r}")
        if not 24 <= self.memory_registers <= 256 or self.memory_registers % 8:
            raise ValueError(f"memory_registers must be a multiple of 8 in [24, 256], got {self.memory_registers}")


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
    for name, width in (("q/k width D", D), ("v width V", V)) if kernel else ():
        if width % 64 or not 64 <= width <= MAX_WIDTH:
            raise ValueError(f"{name} must be a multiple of 64 in [64, {MAX_WIDTH}], got {width}")
    block = max(CTA_ROWS, config.block_kv, config.block_kv_dq) if config is not None else CTA_ROWS
    if T < 1 or (kernel and T % block):
        raise ValueError(f"T (tokens) must be a positive multiple of {block} (the kernel's blocks), got {T}")
    if B < 1 or H < 1:
        raise ValueError(f"batch and heads must be >= 1, got B={B}, H={H}")
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise ValueError(f"softmax_scale must be a Python float (it is baked into the kernel), got {softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")


def smem_bytes(D: int, V: int, config: FlashAttentionConfig) -> dict[str, int]:
    """Static SMEM of each kernel (tiles only; barriers add a few hundred bytes)."""
    bf = 2
    stage_p = ROWS * ROWS * bf * COMPUTE_WGS * 2 if config.interpretable else 0
    fwd = (
        COMPUTE_WGS * ROWS * D * bf
        + config.max_concurrent_steps * config.block_kv * (D + V) * bf
        + (COMPUTE_WGS * ROWS * config.block_kv * bf if config.interpretable else 0)
    )
    dkv = COMPUTE_WGS * ROWS * (D + V) * bf + config.bwd_max_concurrent_steps * ROWS * ((D + V) * bf + 8) + stage_p
    dq = (
        COMPUTE_WGS * ROWS * ((D + V) * bf + 8)
        + config.bwd_max_concurrent_steps * config.block_kv_dq * (D + V) * bf
        + (COMPUTE_WGS * ROWS * config.block_kv_dq * bf if config.interpretable else 0)
    )
    return dict(forward=fwd, dkv=dkv, dq=dq)


# ------------------------------------------------------------------------------------------------
# Kernel helpers
# ------------------------------------------------------------------------------------------------


def _mm(a_ref, b_ref, shape):
    """a_ref · b_ref (both SMEM, possibly transposed views) into a fresh fp32 accumulator."""

    def f(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref)
        return acc_ref[...]

    return pl.run_scoped(f, plgpu.ACC(shape, jnp.float32))


def _mm_acc(acc, a16, b_ref, stage_ref=None):
    """acc + a16 · b_ref: a16 bf16 in registers (WGMMA layout), b_ref SMEM, acc fp32 registers.

    With ``stage_ref`` (an SMEM tile of a16's shape: `FlashAttentionConfig.interpretable`), a16 is
    staged through SMEM and the product added with ``run_scoped``, which the interpreter can run."""
    if stage_ref is not None:
        stage_ref[...] = a16
        plgpu.commit_smem()
        return acc + _mm(stage_ref, b_ref, acc.shape)

    def f(acc_ref):
        plgpu.wgmma(acc_ref, a16, b_ref)

    return pl.run_state(f)(plgpu.ACC.init(acc))


def _zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _rows(x):
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def _heavy_first(index, n, causal):
    """The query block of a forward / dQ CTA: causal CTAs of late blocks loop over more keys, so the
    grid's launch order (the "qb" axis) hands them out first (longest job first: a shorter tail)."""
    return n - 1 - index if causal else index


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------


def _forward(q, k, v, *, scale, causal, config: FlashAttentionConfig, interpret):
    """-> (o [B, T, H, V] bf16, lse [B, H, T] fp32 in the log2 domain of scale·log2(e)·q·k)."""
    B, T, H, D = q.shape
    V = v.shape[3]
    bkv = config.block_kv
    scale_log2 = scale * _LOG2E
    n_kv_total = T // bkv
    steps = min(config.max_concurrent_steps, n_kv_total)
    scratch = dict(
        q_smem=plgpu.SMEM((COMPUTE_WGS, ROWS, D), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        q_bar=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        sched_bar=plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    )
    if config.interpretable:
        scratch["p_smem"] = plgpu.SMEM((COMPUTE_WGS, ROWS, bkv), jnp.bfloat16, transforms=_BF16_TRANSFORMS)

    @functools.partial(
        plgpu.kernel,
        out_type=(jax.ShapeDtypeStruct((B, T, H, V), q.dtype), jax.ShapeDtypeStruct((B, H, T), jnp.float32)),
        grid=(H, T // CTA_ROWS, B),
        grid_names=("h", "qb", "b"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    def flash_attention_fwd(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, q_bar, sched_bar, p_smem=None):
        h, b = lax.axis_index("h"), lax.axis_index("b")
        qb = _heavy_first(lax.axis_index("qb"), T // CTA_ROWS, causal)
        wg = lax.axis_index("wg")
        row0 = qb * CTA_ROWS + wg * ROWS
        n_kv = pl.cdiv((qb + 1) * CTA_ROWS, bkv) if causal else n_kv_total

        def schedule_barrier():
            # FA3's ping-pong: the two warpgroups meet here twice a step, warpgroup 1 one meeting behind,
            # so one's softmax runs while the other's matmuls hold the tensor cores.
            if config.schedule_barrier:
                plgpu.barrier_arrive(sched_bar)
                plgpu.barrier_wait(sched_bar)

        def compute_context(pipeline):
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, ROWS), h], q_smem.at[wg], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            pl.when(wg == 1)(schedule_barrier)
            acc, m, l = pipeline(
                (
                    _zeros((ROWS, V)),
                    _rows(jnp.full((ROWS,), _M_INIT, jnp.float32)),
                    _rows(jnp.zeros((ROWS,), jnp.float32)),
                )
            )
            pl.when(wg == 0)(schedule_barrier)
            # l >= 1: every row sees its own key (the row max contributes exp2(0) = 1).
            o_ref[b, pl.ds(row0, ROWS), h] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_ref.dtype)
            lse_ref[b, h, pl.ds(row0, ROWS)] = m + jnp.log2(l)

        def body(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
            (i,) = idx
            acc, m, l = carry

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.transpose((1, 0)))
                schedule_barrier()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, bkv), jnp.float32)) * scale_log2
            plgpu.barrier_arrive(k_consumed)  # K's stage may refill while P·V runs
            if causal:  # only blocks on the diagonal have keys after some of the rows

                def mask(s):
                    visible = i * bkv + _iota((ROWS, bkv), 1) <= row0 + _iota((ROWS, bkv), 0)
                    return jnp.where(visible, s, -jnp.inf)

                s = lax.cond((i + 1) * bkv - 1 > row0, mask, lambda s: s, s)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(jnp.bfloat16)
            schedule_barrier()
            acc = _mm_acc(acc, p16, v_smem, p_smem.at[wg] if p_smem is not None else None)
            plgpu.barrier_arrive(v_consumed)
            return acc, m_new, l

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(n_kv,),
            memory_registers=config.memory_registers,
            num_compute_wgs=COMPUTE_WGS,
            wg_axis="wg",
            max_concurrent_steps=steps,
            compute_context=compute_context,
            manual_consumed_barriers=True,
            in_specs=[
                plgpu.BlockSpec((bkv, D), lambda i: (i, 0), transforms=_BF16_TRANSFORMS),
                plgpu.BlockSpec((bkv, V), lambda i: (i, 0), transforms=_BF16_TRANSFORMS),
            ],
        )(k_ref.at[b, :, h], v_ref.at[b, :, h])

    return flash_attention_fwd(q, k, v)


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------


def _backward_dkv(q, k, v, do, lse, delta, *, scale, causal, config, interpret):
    """-> (dk [B, T, H, D], dv [B, T, H, V]) bf16."""
    B, T, H, D = q.shape
    V = v.shape[3]
    scale_log2 = scale * _LOG2E
    n_q_total = T // ROWS
    steps = min(config.bwd_max_concurrent_steps, n_q_total)
    scratch = dict(
        k_smem=plgpu.SMEM((COMPUTE_WGS, ROWS, D), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        v_smem=plgpu.SMEM((COMPUTE_WGS, ROWS, V), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        kv_bar=plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),
    )
    if config.interpretable:
        scratch["stage_smem"] = plgpu.SMEM((COMPUTE_WGS, 2, ROWS, ROWS), jnp.bfloat16, transforms=_BF16_TRANSFORMS)

    @functools.partial(
        plgpu.kernel,
        out_type=(jax.ShapeDtypeStruct((B, T, H, D), q.dtype), jax.ShapeDtypeStruct((B, T, H, V), q.dtype)),
        grid=(H, T // CTA_ROWS, B),
        grid_names=("h", "kb", "b"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    def flash_attention_dkv(
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem, v_smem, kv_bar, stage_smem=None
    ):
        h, kb, b = lax.axis_index("h"), lax.axis_index("kb"), lax.axis_index("b")
        wg = lax.axis_index("wg")
        key0 = kb * CTA_ROWS + wg * ROWS
        # Query blocks (of 64) from the CTA's diagonal on: the first block that sees any of its keys.
        first_q = kb * COMPUTE_WGS if causal else 0
        stage = stage_smem.at[wg] if stage_smem is not None else None

        def compute_context(pipeline):
            keys = pl.ds(key0, ROWS)
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[wg], kv_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[wg], kv_bar.at[wg])
            plgpu.barrier_wait(kv_bar.at[wg])
            dk, dv = pipeline((_zeros((ROWS, D)), _zeros((ROWS, V))))
            dk_ref[b, keys, h] = (dk * scale).astype(dk_ref.dtype)
            dv_ref[b, keys, h] = dv.astype(dv_ref.dtype)

        def body(idx, q_s, do_s, lse_s, delta_s, carry):
            (i,) = idx
            dk, dv = carry
            shape = (ROWS, ROWS)  # (keys, queries)
            s_t = _mm(k_smem.at[wg], q_s.transpose((1, 0)), shape) * scale_log2
            lse = plgpu.load(lse_s, layout=plgpu.Layout.WGMMA.reduce(0))
            if causal:  # only blocks on the diagonal have keys after some of their queries

                def mask(s_t):
                    visible = key0 + _iota(shape, 0) <= (first_q + i) * ROWS + _iota(shape, 1)
                    return jnp.where(visible, s_t, -jnp.inf)

                s_t = lax.cond(key0 + ROWS - 1 > (first_q + i) * ROWS, mask, lambda s_t: s_t, s_t)
            # Pᵀ is kept in bf16 only (what dV's wgmma takes anyway): with dK (96) and dV (64) fp32
            # accumulators live, an fp32 Pᵀ (32 registers a thread) next to dPᵀ would pass the 232.
            p_t16 = jnp.exp2(s_t - lax.broadcast_in_dim(lse, shape, [1])).astype(jnp.bfloat16)
            if stage is None:
                # dV += Pᵀ·dO and dPᵀ = V·dOᵀ issued together, one wait for both (as attention_mgpu).
                def dv_and_dp(refs):
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dv_ref, p_t16, do_s)
                    plgpu.wgmma(dp_ref, v_smem.at[wg], do_s.transpose((1, 0)))

                dv, dp_t = pl.run_state(dv_and_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(_zeros(shape))))
            else:
                dv = _mm_acc(dv, p_t16, do_s, stage.at[0])
                dp_t = _mm(v_smem.at[wg], do_s.transpose((1, 0)), shape)
            delta = plgpu.load(delta_s, layout=plgpu.Layout.WGMMA.reduce(0))
            ds_t = p_t16.astype(jnp.float32) * (dp_t - lax.broadcast_in_dim(delta, shape, [1]))
            dk = _mm_acc(dk, ds_t.astype(jnp.bfloat16), q_s, stage.at[1] if stage is not None else None)
            return dk, dv

        qmap = lambda i: (first_q + i, 0)  # noqa: E731
        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(n_q_total - first_q,),
            memory_registers=config.memory_registers,
            num_compute_wgs=COMPUTE_WGS,
            wg_axis="wg",
            max_concurrent_steps=steps,
            compute_context=compute_context,
            in_specs=[
                plgpu.BlockSpec((ROWS, D), qmap, transforms=_BF16_TRANSFORMS),
                plgpu.BlockSpec((ROWS, V), qmap, transforms=_BF16_TRANSFORMS),
                plgpu.BlockSpec((ROWS,), lambda i: (first_q + i,)),
                plgpu.BlockSpec((ROWS,), lambda i: (first_q + i,)),
            ],
        )(q_ref.at[b, :, h], do_ref.at[b, :, h], lse_ref.at[b, h], delta_ref.at[b, h])

    return flash_attention_dkv(q, k, v, do, lse, delta)


def _backward_dq(q, k, v, do, lse, delta, *, scale, causal, config, interpret):
    """-> dq [B, T, H, D] bf16."""
    B, T, H, D = q.shape
    V = v.shape[3]
    bkv = config.block_kv_dq
    scale_log2 = scale * _LOG2E
    n_kv_total = T // bkv
    steps = min(config.bwd_max_concurrent_steps, n_kv_total)
    scratch = dict(
        q_smem=plgpu.SMEM((COMPUTE_WGS, ROWS, D), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        do_smem=plgpu.SMEM((COMPUTE_WGS, ROWS, V), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        lse_smem=plgpu.SMEM((COMPUTE_WGS, ROWS), jnp.float32),
        delta_smem=plgpu.SMEM((COMPUTE_WGS, ROWS), jnp.float32),
        q_bar=plgpu.Barrier(num_arrivals=4, num_barriers=COMPUTE_WGS),
    )
    if config.interpretable:
        scratch["stage_smem"] = plgpu.SMEM((COMPUTE_WGS, ROWS, bkv), jnp.bfloat16, transforms=_BF16_TRANSFORMS)

    @functools.partial(
        plgpu.kernel,
        out_type=jax.ShapeDtypeStruct((B, T, H, D), q.dtype),
        grid=(H, T // CTA_ROWS, B),
        grid_names=("h", "qb", "b"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    def flash_attention_dq(
        q_ref,
        k_ref,
        v_ref,
        do_ref,
        lse_ref,
        delta_ref,
        dq_ref,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        q_bar,
        stage_smem=None,
    ):
        h, b = lax.axis_index("h"), lax.axis_index("b")
        qb = _heavy_first(lax.axis_index("qb"), T // CTA_ROWS, causal)
        wg = lax.axis_index("wg")
        row0 = qb * CTA_ROWS + wg * ROWS
        n_kv = pl.cdiv((qb + 1) * CTA_ROWS, bkv) if causal else n_kv_total
        stage = stage_smem.at[wg] if stage_smem is not None else None

        def compute_context(pipeline):
            rows = pl.ds(row0, ROWS)
            bar = q_bar.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[wg], bar)
            plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[wg], bar)
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[wg], bar)
            plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[wg], bar)
            plgpu.barrier_wait(bar)
            lse = plgpu.load(lse_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
            delta = plgpu.load(delta_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
            dq, _, _ = pipeline((_zeros((ROWS, D)), lse, delta))
            dq_ref[b, rows, h] = (dq * scale).astype(dq_ref.dtype)

        def body(idx, k_s, v_s, carry):
            (j,) = idx
            dq, lse, delta = carry
            shape = (ROWS, bkv)

            def s_and_dp(s_ref, dp_ref):  # S = Q·Kᵀ and dP = dO·Vᵀ issued together, one wait
                plgpu.wgmma(s_ref, q_smem.at[wg], k_s.transpose((1, 0)))
                plgpu.wgmma(dp_ref, do_smem.at[wg], v_s.transpose((1, 0)))
                return s_ref[...], dp_ref[...]

            s, dp = pl.run_scoped(s_and_dp, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))
            s = s * scale_log2
            if causal:  # only blocks on the diagonal have keys after some of the rows

                def mask(s):
                    visible = j * bkv + _iota(shape, 1) <= row0 + _iota(shape, 0)
                    return jnp.where(visible, s, -jnp.inf)

                s = lax.cond((j + 1) * bkv - 1 > row0, mask, lambda s: s, s)
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, shape, [0]))
            ds = p * (dp - lax.broadcast_in_dim(delta, shape, [0]))
            dq = _mm_acc(dq, ds.astype(jnp.bfloat16), k_s, stage)
            return dq, lse, delta

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(n_kv,),
            memory_registers=config.memory_registers,
            num_compute_wgs=COMPUTE_WGS,
            wg_axis="wg",
            max_concurrent_steps=steps,
            compute_context=compute_context,
            in_specs=[
                plgpu.BlockSpec((bkv, D), lambda j: (j, 0), transforms=_BF16_TRANSFORMS),
                plgpu.BlockSpec((bkv, V), lambda j: (j, 0), transforms=_BF16_TRANSFORMS),
            ],
        )(k_ref.at[b, :, h], v_ref.at[b, :, h])

    return flash_attention_dq(q, k, v, do, lse, delta)


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


def flash_attention(q_BTHD, k_BTHD, v_BTHV, *, softmax_scale, causal=True, impl=None, config=None):
    """Flash attention (self-attention, one K/V head per query head), differentiable.

    Args:
      q_BTHD, k_BTHD: bf16 [B, T, H, D]; D a multiple of 64 in [64, 256] (192 for MLA).
      v_BTHV: bf16 [B, T, H, V]; V a multiple of 64 in [64, 256] (128 for MLA).
      softmax_scale: Python float multiplying q·k.
      causal: query t sees keys 0..t (by index); False: every key.
      impl: None (kernel on a Hopper GPU, else the reference), "kernel", "interpret", "reference"
        (`pallas_kernels._platform`).
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
    impl = _platform.resolve_impl(impl)
    if impl == "reference":
        return flash_attention_reference(q_BTHD, k_BTHD, v_BTHV, softmax_scale=softmax_scale, causal=causal)
    interpret = impl == "interpret"
    if not interpret:  # (the interpreter has no SMEM limit, and its staging tiles add to it)
        for kernel, size in smem_bytes(q_BTHD.shape[3], v_BTHV.shape[3], config).items():
            if size > SMEM_BYTES:
                raise ValueError(
                    f"config {config} needs {size} bytes of SMEM in the {kernel} kernel "
                    f"(D={q_BTHD.shape[3]}, V={v_BTHV.shape[3]}), over the {SMEM_BYTES} of sm_90"
                )
    if interpret and not config.interpretable:
        config = dataclasses.replace(config, interpretable=True)
    params = INTERPRET_PARAMS if interpret else None
    return _flash(q_BTHD, k_BTHD, v_BTHV, float(softmax_scale), causal, config, params)
