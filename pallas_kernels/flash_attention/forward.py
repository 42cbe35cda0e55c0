"""The flash attention forward kernel: O and the log-sum-exp, two compute warpgroups ping-ponging beside a TMA
warpgroup."""

from __future__ import annotations

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


def _forward(q, k, v, *, scale, causal, config: FlashAttentionConfig, interpret, offsets=None):
    """-> (o [B, T, H, V] bf16, lse [B, H, T] fp32 in the log2 domain of scale·log2(e)·q·k).

    q [B, T, H, D], k [B, S, H, D], v [B, S, H, V]; T a multiple of 128, S of ``config.block_kv``.
    ``offsets`` None: self-attention by index (S = T; query t sees keys 0..t when causal).
    ``offsets`` = (q_offsets, kv_lens), int32 [B] each: row b's query t sits at position
    q_offsets[b] + t and sees key s iff s < kv_lens[b] (and, when causal, s <= q_offsets[b] + t);
    requires 0 <= kv_lens[b] <= S. Key blocks past both bounds are never fetched; a query that sees
    no key gives o = 0 (its lse is then meaningless).
    """
    B, T, H, D = q.shape
    S = k.shape[1]
    V = v.shape[3]
    bkv = config.block_kv
    scale_log2 = scale * _LOG2E
    n_kv_total = S // bkv
    steps = min(config.max_concurrent_steps, n_kv_total)
    scratch = dict(
        q_smem=plgpu.SMEM((COMPUTE_WGS, ROWS, D), jnp.bfloat16, transforms=_BF16_TRANSFORMS),
        q_bar=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        sched_bar=plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    )
    if config.interpretable:
        scratch["p_smem"] = plgpu.SMEM((COMPUTE_WGS, ROWS, bkv), jnp.bfloat16, transforms=_BF16_TRANSFORMS)

    def flash_attention_fwd(q_ref, k_ref, v_ref, *refs, q_smem, q_bar, sched_bar, p_smem=None):
        if offsets is None:
            o_ref, lse_ref = refs
        else:
            q_off_ref, kv_len_ref, o_ref, lse_ref = refs
        h, b = lax.axis_index("h"), lax.axis_index("b")
        qb = _heavy_first(lax.axis_index("qb"), T // CTA_ROWS, causal)
        wg = lax.axis_index("wg")
        row0 = qb * CTA_ROWS + wg * ROWS
        if offsets is None:
            n_kv = pl.cdiv((qb + 1) * CTA_ROWS, bkv) if causal else n_kv_total
        else:
            # Query row r sits at position pos0 + r. The CTA's last query sees keys up to
            # q_off + 128 (qb + 1) - 1 and no row sees a key at or past kv_len: blocks past both
            # are skipped (the producer never fetches them). One bound for both warpgroups, so
            # their barrier meetings stay balanced.
            q_off, kv_len = q_off_ref[b], kv_len_ref[b]
            pos0 = q_off + row0
            kv_end = jnp.minimum(kv_len, q_off + (qb + 1) * CTA_ROWS) if causal else kv_len
            n_kv = jnp.clip((kv_end + bkv - 1) // bkv, 0, n_kv_total)

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
            if offsets is not None:  # a row may see no key (kv_len 0, or before its offset): o = 0
                l = jnp.where(l > 0, l, 1.0)
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
            if offsets is not None:  # only blocks on the offset diagonal or across kv_len are masked

                def mask(s):
                    key = i * bkv + _iota((ROWS, bkv), 1)
                    visible = key < kv_len
                    if causal:
                        visible = visible & (key <= pos0 + _iota((ROWS, bkv), 0))
                    return jnp.where(visible, s, -jnp.inf)

                straddles = (i + 1) * bkv > kv_len
                if causal:
                    straddles = straddles | ((i + 1) * bkv - 1 > pos0)
                s = lax.cond(straddles, mask, lambda s: s, s)
            elif causal:  # only blocks on the diagonal have keys after some of the rows

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

    kernel = plgpu.kernel(
        flash_attention_fwd,
        out_type=(jax.ShapeDtypeStruct((B, T, H, V), q.dtype), jax.ShapeDtypeStruct((B, H, T), jnp.float32)),
        grid=(H, T // CTA_ROWS, B),
        grid_names=("h", "qb", "b"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
        **({} if offsets is None else dict(kernel_name="flash_attention_fwd_offset")),
    )
    return kernel(q, k, v) if offsets is None else kernel(q, k, v, *offsets)
