"""The flash attention forward kernel: O and the log-sum-exp, two compute warpgroups ping-ponging beside a TMA
warpgroup."""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.flash_attention.config import (
    _BF16_TRANSFORMS,
    _LOG2E,
    _M_INIT,
    COMPUTE_WGS,
    CTA_ROWS,
    ROWS,
    FlashAttentionConfig,
)
from pallas_kernels.flash_attention.steps import _heavy_first, _iota, _mm_acc, _rows, _zeros

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
