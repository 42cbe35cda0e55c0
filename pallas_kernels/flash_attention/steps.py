"""The steps the flash attention kernels share: wgmma products (from SMEM or registers), fp32 zero tiles, row
broadcasts, iotas in the WGMMA layout, and the heaviest-first order of causal CTAs."""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

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
