"""The FP8 GEMM kernel: a persistent grid of CTAs, each with two compute warpgroups and a TMA warpgroup,
e4m3 WGMMA over one 128-wide K block per pipeline step, promoted to fp32 with the block's scales."""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8_gemm.config import (
    BF16_TRANSFORMS,
    COMPUTE_WGS,
    FP8_TRANSFORMS,
    QUANT_BLOCK,
    SCALE_COLUMNS,
    Fp8MatmulConfig,
    scale_slot,
)


def _fp8_gemm(xq_MK, xs_KbM, w_NK, ws_KbC, *, config: Fp8MatmulConfig, num_sms: int, interpret):
    """-> bf16 [M, N] = sum over K blocks kb of (xq[:, kb] @ w[:, kb].T) * xs[kb, :, None] * ws[kb, n // 16].

    Args:
      xq_MK: e4m3 [M, K], M a multiple of ``config.cta_m``, K of 128.
      xs_KbM: fp32 [K / 128, M], the activation scales (transposed: a K block's scales are one TMA row).
      w_NK: e4m3 [N, K], N a multiple of ``config.cta_n``.
      ws_KbC: fp32 [K / 128, N / cta_n · scale_slot(cta_n)], per CTA column tile its weight scales repeated per
        16 output columns, padded to `scale_slot`.
    """
    M, K = xq_MK.shape
    N = w_NK.shape[0]
    bm, bn, cta_m, cta_n = config.block_m, config.block_n, config.cta_m, config.cta_n
    m_iters, n_iters, k_iters = M // cta_m, N // cta_n, K // QUANT_BLOCK
    split_m = config.wg_split == "m"
    slot = scale_slot(cta_n)

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=config.memory_registers,
            in_specs=[
                plgpu.BlockSpec((cta_m, QUANT_BLOCK), lambda k: (0, k), transforms=FP8_TRANSFORMS),
                plgpu.BlockSpec((cta_n, QUANT_BLOCK), lambda k: (0, k), transforms=FP8_TRANSFORMS),
                plgpu.BlockSpec((None, cta_m), lambda k: (k, 0)),
                plgpu.BlockSpec((None, slot), lambda k: (k, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=min(config.max_concurrent_steps, k_iters),
            compute_context=compute_context,
        )

    def kernel(x_gmem, xs_gmem, w_gmem, ws_gmem, out_gmem):
        ignore = lambda *_, **__: None  # the allocations depend on the specs only

        @functools.partial(
            pl.run_scoped,
            allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem, xs_gmem, ws_gmem),
            out_smem=plgpu.SMEM((COMPUTE_WGS, bm, bn), jnp.bfloat16, transforms=BF16_TRANSFORMS),
            collective_axes="wg",
        )
        def scope(allocs, out_smem):
            wg = lax.axis_index("wg")
            wg_rows = pl.ds(wg * bm, bm) if split_m else pl.ds(0, bm)
            wg_cols = pl.ds(0, bn) if split_m else pl.ds(wg * bn, bn)
            # The warpgroup's weight-scale column in a CTA's block of scales (bn divides 128: one scale block).
            wg_scale = 0 if split_m else wg * (bn // SCALE_COLUMNS)

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def tile_loop(loop_info: plgpu.NDLoopInfo):
                (lin,) = loop_info.index
                mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), config.grid_minor_dim, config.grid_tile_width)
                cta_rows, cta_cols = pl.ds(mi * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)

                def compute_context(pipeline):
                    acc = pipeline(plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read out_smem
                    out_smem[wg] = acc.astype(jnp.bfloat16)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[cta_rows, cta_cols].at[wg_rows, wg_cols])

                def body(_, x_smem, w_smem, xs_smem, ws_smem, acc):
                    x_scale = plgpu.load(xs_smem.at[wg_rows], layout=plgpu.Layout.WGMMA.reduce(1))
                    scale = x_scale * ws_smem[wg_scale]
                    # Generic-proxy reads of a stage the TMA (async proxy) refills once this step is released:
                    # fence them (the interpreter's race detector flags the refill otherwise).
                    plgpu.commit_smem()

                    def block_product(acc_ref):
                        plgpu.wgmma(acc_ref, x_smem.at[wg_rows], w_smem.at[wg_cols].transpose((1, 0)))
                        return acc_ref[...]

                    part = pl.run_scoped(block_product, plgpu.ACC((bm, bn), jnp.float32))
                    return acc + part * lax.broadcast_in_dim(scale, part.shape, [0])

                get_pipeline(body, compute_context)(
                    x_gmem.at[cta_rows],
                    w_gmem.at[cta_cols],
                    xs_gmem.at[:, cta_rows],
                    ws_gmem.at[:, pl.ds(ni * slot, slot)],
                    allocations=allocs,
                )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    f = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((M, N), jnp.bfloat16),
        grid=(min(num_sms, m_iters * n_iters),),
        grid_names=("sm",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        interpret=interpret,
    )
    return f(xq_MK, xs_KbM, w_NK, ws_KbC)
