"""One `fp8_matvec` call and one bf16 `stacked_matmul` call of a V3 decode projection, for Nsight Compute: each is
compiled and run twice first, then run once more between the driver's `cuProfilerStart` / `Stop` (ncu's
`--profile-from-start off`), so the report holds exactly the measured calls' kernels.

    ncu --profile-from-start off --set full -o $OUT/fp8_matvec python scripts/lab/ncu_fp8_matvec.py --shape wo
"""

import argparse
import ctypes

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_matvec import Fp8MatvecConfig, fp8_matvec
from pallas_kernels.stacked_matmul import stacked_matmul
from tests.test_fp8_matvec import V3_PROJECTIONS


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="wo", help="a name of V3_PROJECTIONS")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=4)
    a = p.parse_args()
    N, K = V3_PROJECTIONS[a.shape]
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (a.rows, K), jnp.bfloat16)
    w8 = (jax.random.normal(k[1], (a.layers, N, K), jnp.float32) * 16).astype(jnp.float8_e4m3fn)
    s8 = jnp.full((a.layers, -(-N // 128), -(-K // 128)), 2.0**-6, jnp.float32)
    w16 = jax.random.normal(k[2], (a.layers, K, N), jnp.bfloat16)
    cfg = Fp8MatvecConfig(block_n=a.block_n, num_warps=a.warps, num_stages=a.stages)
    f8 = jax.jit(lambda x, w, s, layer: fp8_matvec(x, w, s, layer, config=cfg, impl="kernel"))
    f16 = jax.jit(lambda x, w, layer: stacked_matmul(x, w, layer, impl="kernel"))
    layer = jnp.int32(1)
    for _ in range(2):
        jax.block_until_ready((f8(x, w8, s8, layer), f16(x, w16, layer)))
    cuda = ctypes.CDLL("libcuda.so.1")  # the driver API: present wherever a GPU runs
    cuda.cuProfilerStart()
    jax.block_until_ready(f8(x, w8, s8, layer))
    jax.block_until_ready(f16(x, w16, layer))
    cuda.cuProfilerStop()
    print(f"profiled {a.shape} (N={N}, K={K}) M={a.rows}: fp8_matvec {cfg} and bf16 stacked_matmul")


if __name__ == "__main__":
    main()
