"""The flash attention backward kernels: dK/dV (keys resident, queries streamed from the diagonal) and dQ
(queries resident, keys streamed up to the diagonal)."""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.flash_attention.config import _BF16_TRANSFORMS, _LOG2E, COMPUTE_WGS, CTA_ROWS, ROWS
from pallas_kernels.flash_attention.steps import _heavy_first, _iota, _mm, _mm_acc, _zeros

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
