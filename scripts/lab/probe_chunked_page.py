"""Probe (issue 29's "what would unblock"): a page slot stored chunk-major, [9, 64, 64] bf16 (FlashMLA's nine
64-column chunks of a [64, 576] page, each its own (8, 64)-tiled, 128-byte-swizzled tile), filled by nine TMA copies
with a barrier each, Q·Kᵀ as nine wgmma calls (one a chunk, Q chunk-major too, each chunk waited for on its own),
and P·V over the 512 latent columns as eight N = 64 wgmma calls, one a chunk. Checks that it lowers for sm_90 (Mosaic
GPU's layouts and descriptors; registers need a GPU) and that the interpreter's result equals plain jnp.

What it answered on a CPU (twentieth session): the chunk-major slot, its nine copies and barriers, the nine Q·Kᵀ
calls and the eight N = 64 P·V calls lower for sm_90 and interpret correctly. One P·V call of N = 256 over four
chunks does not: a [64, 256] view of `kv_s.at[0:4]` (reshape, or transpose then reshape) is refused by the transform
commuting ("Unfolding dimensions is not supported when commuting an UntilingTransform with a ReshapeTransform"), so
a chunked body's P·V issues one wgmma a chunk.

    PYTHONPATH=. python scripts/lab/probe_chunked_page.py            # interpret + cross-lowering (CPU)
    PYTHONPATH=. python scripts/lab/probe_chunked_page.py --gpu      # on a Hopper GPU, against jnp
"""

import argparse
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

CHUNK, NCHUNK, TOKENS, LATENT_CHUNKS = 64, 9, 64, 8
TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def chunked_page_attention(q, page, *, interpret):
    """softmax(Q·Kᵀ)·V for one [64, 576] page (V its first 512 columns), Q [64, 576]; out fp32 [64, 512]."""

    @functools.partial(
        plgpu.kernel,
        out_type=jax.ShapeDtypeStruct((TOKENS, CHUNK * LATENT_CHUNKS), jnp.float32),
        scratch_types=dict(
            q_s=plgpu.SMEM((NCHUNK, 64, CHUNK), jnp.bfloat16, transforms=TRANSFORMS),
            kv_s=plgpu.SMEM((NCHUNK, TOKENS, CHUNK), jnp.bfloat16, transforms=TRANSFORMS),
            p_s=plgpu.SMEM((64, TOKENS), jnp.bfloat16, transforms=TRANSFORMS),
            q_bar=plgpu.Barrier(num_barriers=NCHUNK),
            kv_bar=plgpu.Barrier(num_barriers=NCHUNK),
        ),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    def kernel(q_ref, page_ref, o_ref, *, q_s, kv_s, p_s, q_bar, kv_bar):
        for j in range(NCHUNK):  # one TMA copy and one barrier a 64-column chunk, into a contiguous 8 KB tile
            cols = pl.ds(j * CHUNK, CHUNK)
            plgpu.copy_gmem_to_smem(q_ref.at[:, cols], q_s.at[j], q_bar.at[j])
            plgpu.copy_gmem_to_smem(page_ref.at[:, cols], kv_s.at[j], kv_bar.at[j])

        def qk(acc_ref):
            for j in range(NCHUNK):  # Q·Kᵀ starts on the first chunk that lands
                plgpu.barrier_wait(q_bar.at[j])
                plgpu.barrier_wait(kv_bar.at[j])
                plgpu.wgmma(acc_ref, q_s.at[j], kv_s.at[j].transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((64, TOKENS), jnp.float32))
        m = s.max(axis=1)
        p = jnp.exp(s - jax.lax.broadcast_in_dim(m, s.shape, [0]))
        l = p.sum(axis=1)
        p_s[...] = p.astype(jnp.bfloat16)
        plgpu.commit_smem()

        def pv(*accs):
            for c, acc_ref in enumerate(accs):  # V's 512 columns: eight N = 64 products, one a chunk
                plgpu.wgmma(acc_ref, p_s, kv_s.at[c])
            return tuple(a[...] for a in accs)

        outs = pl.run_scoped(pv, *(plgpu.ACC((64, CHUNK), jnp.float32) for _ in range(LATENT_CHUNKS)))
        for c, o in enumerate(outs):
            o_ref[:, pl.ds(c * CHUNK, CHUNK)] = o / jax.lax.broadcast_in_dim(l, o.shape, [0])

    return kernel(q, page)


def reference(q, page):
    """The kernel's arithmetic in plain jnp: unnormalised P rounded to bf16, then divided by its fp32 row sums."""
    s = q.astype(jnp.float32) @ page.astype(jnp.float32).T
    p = jnp.exp(s - s.max(axis=1, keepdims=True))
    v = page[:, : CHUNK * LATENT_CHUNKS].astype(jnp.float32)
    return (p.astype(jnp.bfloat16).astype(jnp.float32) @ v) / p.sum(axis=1, keepdims=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true", help="run the kernel on the GPU (default: interpret + cross-lower)")
    a = ap.parse_args()
    k1, k2 = jax.random.split(jax.random.key(0))
    q = (jax.random.normal(k1, (64, CHUNK * NCHUNK)) * 0.05).astype(jnp.bfloat16)
    page = jax.random.normal(k2, (TOKENS, CHUNK * NCHUNK), jnp.bfloat16)
    ref = np.asarray(reference(q, page))
    if a.gpu:
        out = np.asarray(jax.jit(lambda *x: chunked_page_attention(*x, interpret=False))(q, page))
        print("gpu: max abs err", float(np.abs(out - ref).max()))
        return
    out = np.asarray(chunked_page_attention(q, page, interpret=True))
    print("interpret: max abs err", float(np.abs(out - ref).max()))
    f = jax.jit(lambda *x: chunked_page_attention(*x, interpret=False))
    text = f.trace(q, page).lower(lowering_platforms=("cuda",)).as_text()
    print("cross-lowered for sm_90:", "mosaic_gpu" in text, f"({len(text)} chars of StableHLO)")


if __name__ == "__main__":
    main()
