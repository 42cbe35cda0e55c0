"""One `mla_decode` call for Nsight Compute: compiled and run twice first, then once more between the driver's
`cuProfilerStart` / `Stop` (ncu's `--profile-from-start off`), so the report holds the measured call's kernels
only. Filter ncu to the main kernel (``--kernel-name regex:mla_decode_partials``): profiling the XLA fusions
around it can hang ncu.

    ncu --profile-from-start off --kernel-name regex:mla_decode_partials --launch-count 1 --set full \\
        --import-source yes -o $OUT/mla_decode_h128 python scripts/ncu_mla_decode.py --cell 128,1,4096,128
"""

import argparse
import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_mla_decode import variants
from pallas_kernels import MlaDecodeConfig, mla_decode


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cell", default="128,1,4096,128", help="B,s_q,seq,H (seq 'lo-hi': lengths uniform in [lo, hi])")
    p.add_argument("--variant", default="", help="a name of `mla-bench mla_decode --variants` (default: the default)")
    a = p.parse_args()
    B, s_q, seq, H = a.cell.split(",")
    B, s_q, H = int(B), int(s_q), int(H)
    rng = np.random.default_rng(0)
    if "-" in seq:
        lo, hi = map(int, seq.split("-"))
        lens = rng.integers(lo, hi + 1, B).astype(np.int32)
    else:
        lens = np.full(B, int(seq), np.int32)
    max_pages = -(-int(lens.max()) // 64)
    k = jax.random.split(jax.random.key(0), 2)
    q = jax.random.normal(k[0], (B, s_q, H, 576), jnp.bfloat16)
    pages = jax.random.normal(k[1], (B * max_pages, 64, 576), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(B * max_pages).reshape(B, max_pages).astype(np.int32))
    config = variants()[a.variant] if a.variant else MlaDecodeConfig()
    fn = jax.jit(lambda *x: mla_decode(*x, softmax_scale=0.1, causal=s_q > 1, config=config, impl="kernel"))
    args = (q, pages, table, jnp.asarray(lens))
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    cuda = ctypes.CDLL("libcuda.so.1")  # the driver API: present wherever a GPU runs
    cuda.cuProfilerStart()
    jax.block_until_ready(fn(*args))
    cuda.cuProfilerStop()
    print(f"profiled mla_decode {a.cell} config {a.variant or 'default'}: {config}")


if __name__ == "__main__":
    main()
