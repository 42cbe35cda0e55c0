"""`pallas_kernels.fp8_gemm` (block-scaled FP8, DeepSeek-V3's recipe) against the bf16 GEMM (XLA / cuBLAS,
fp32 accumulation) on DeepSeek-V3's projection shapes, one Hopper GPU.

Per shape (N, K) and rows M (4096 prefill; 32 decode): CUPTI time of the whole call (activation quantization
+ the kernel) and of the kernel alone, the bf16 einsum's time, TFLOP/s (2·M·N·K / time) and the ratio
bf16 / fp8; the kernel's error against the same-recipe reference (relative Frobenius; bf16 rounding only)
and against the exact dequantized product (fp8 activation error). Then a sweep of tile configs at M=4096 on
three shapes. Writes JSON to --out. Cells past --budget-s seconds are skipped (listed in the JSON).

    PYTHONPATH=. python scripts/lab/probe_fp8_gemm.py --out $OUT/fp8_gemm.json
    PYTHONPATH=. python scripts/lab/probe_fp8_gemm.py --out $OUT/fp8_gemm.json --rows 4096 --no-sweep
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

import benchmarks as bm
from pallas_kernels.fp8_gemm import Fp8MatmulConfig, default_config, fp8_matmul, fp8_matmul_reference
from tests.test_fp8_gemm import V3_SHAPES  # (N, K) of DeepSeek-V3's projections: the tests' table

SWEEP_SHAPES = ("gate_up", "wo", "q_b")
SWEEP_CONFIGS = {  # the default (128x128, 5 stages) is in the rows already
    "128x128 4 stages, snake M-fastest width 16": Fp8MatmulConfig(
        block_m=64, block_n=128, max_concurrent_steps=4, grid_minor_dim=0, grid_tile_width=16
    ),
    "256x64": Fp8MatmulConfig(block_m=128, block_n=64, max_concurrent_steps=4),
    "64x256 (wgs side by side)": Fp8MatmulConfig(block_m=64, block_n=128, wg_split="n", max_concurrent_steps=4),
}


def make(M, N, K, seed=0):
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    w = (jax.random.normal(kw, (N, K), jnp.float32) * 32).astype(jnp.float8_e4m3fn)
    s = jnp.exp2(jax.random.uniform(ks, (-(-N // 128), -(-K // 128)), jnp.float32, -10.0, -4.0))
    return x, w, s


def rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def cell(name, M, N, K, config, iters, bf16=True):
    x, w, s = make(M, N, K)
    fp8 = jax.jit(lambda x, w, s: fp8_matmul(x, w, s, impl="kernel", config=config))
    t0 = time.perf_counter()
    y = jax.block_until_ready(fp8(x, w, s))
    compile_s = time.perf_counter() - t0
    row = dict(shape=name, M=M, N=N, K=K, config=repr(config or default_config(M, N, K)), compile_s=compile_s)
    row["err_same_recipe"] = rel_err(y, jax.jit(fp8_matmul_reference)(x, w, s))
    row["err_exact"] = rel_err(y, jax.jit(lambda *a: fp8_matmul_reference(*a, quantize_x=False))(x, w, s))
    total, parts = bm.cupti_median_us(fp8, x, w, s, iterations=iters, per_kernel=True)
    kernel_us = max(parts.values())  # the GEMM; the rest is quantization and scale layout
    flop = 2.0 * M * N * K
    row.update(
        fp8_us=total,
        fp8_kernel_us=kernel_us,
        fp8_parts_us=parts,
        fp8_tflops=flop / total / 1e6,
        fp8_kernel_tflops=flop / kernel_us / 1e6,
        weight_gbps=N * K / kernel_us / 1e3,
    )
    if bf16:
        wb = w.astype(jnp.bfloat16)  # the same weight values, bf16 (unscaled: the time does not depend on them)
        dot = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32).astype(x.dtype))
        bf16_us = bm.cupti_median_us(dot, x, wb, iterations=iters)
        row.update(bf16_us=bf16_us, bf16_tflops=flop / bf16_us / 1e6, speedup_vs_bf16=bf16_us / total)
        row["speedup_kernel_vs_bf16"] = bf16_us / kernel_us
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--rows", default="4096,32", help="comma-separated M values")
    p.add_argument("--shapes", default=",".join(V3_SHAPES), help="comma-separated names of V3_SHAPES")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--budget-s", type=float, default=160.0, help="skip the cells that would start after this")
    args = p.parse_args()
    bm.require_gpu("probe_fp8_gemm")
    header = bm.run_header()
    command = " ".join(["python", "scripts/lab/probe_fp8_gemm.py", *sys.argv[1:]])
    header["command"] = command.replace(os.environ["OUT"], "$OUT") if os.environ.get("OUT") else command
    out = dict(header=header, rows=[], sweep=[], errors=[], skipped=[])
    start = time.perf_counter()

    def record(kind, name, M, config, bf16=True):
        N, K = V3_SHAPES[name]
        if time.perf_counter() - start > args.budget_s:
            out["skipped"].append(dict(kind=kind, shape=name, M=M, config=repr(config)))
            return
        try:
            row = cell(name, M, N, K, config, args.iters, bf16=bf16)
        except Exception as e:  # a failing cell is recorded, the others still run
            out["errors"].append(
                dict(kind=kind, shape=name, M=M, config=repr(config), error=f"{type(e).__name__}: {e}"[:2000])
            )
            print(f"{kind} {name} M={M}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return
        out[kind].append(row)
        print(
            f"{kind:5s} {name:12s} M={M:5d} N={N:6d} K={K:6d} fp8 {row['fp8_us']:9.1f} us "
            f"(kernel {row['fp8_kernel_us']:9.1f} us, {row['fp8_kernel_tflops']:6.0f} TFLOP/s, "
            f"{row['weight_gbps']:5.0f} GB/s weights)"
            + (
                f"  bf16 {row['bf16_us']:9.1f} us ({row['bf16_tflops']:6.0f})  x{row['speedup_vs_bf16']:.2f}"
                if bf16
                else ""
            )
            + f"  err same {row['err_same_recipe']:.1e} exact {row['err_exact']:.1e}  compile {row['compile_s']:.1f}s",
            flush=True,
        )

    for M in (int(m) for m in args.rows.split(",")):
        for name in args.shapes.split(","):
            record("rows", name, M, None)
    if not args.no_sweep:
        for config in SWEEP_CONFIGS.values():
            for name in SWEEP_SHAPES:
                record("sweep", name, 4096, config, bf16=False)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
