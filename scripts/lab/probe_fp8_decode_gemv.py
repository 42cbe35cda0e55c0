"""FP8 weights at decode: `pallas_kernels.fp8_matvec` (e4m3 + 128x128 block scales, a stack's layer read in place)
against the bf16 `stacked_matmul` (the same in-place read of twice the bytes) and XLA's dequantize + dot, on
DeepSeek-V3's decode projections; then the routed experts, `moe_decode_fp8` against the bf16 `moe_decode`. One GPU.

Per projection (N, K) of `tests.test_fp8_matvec.V3_PROJECTIONS` and rows M (default 1, 8, 32), over a stack of
--layers layers and a traced layer index: CUPTI median of the whole call and of its largest kernel (the split-K
partial sum is a second, small kernel), GB/s of the layer's weight bytes (fp8: N·K + the scales; bf16: 2·N·K;
XLA's dequantize + dot reads the fp8 bytes too) and that as a fraction of --hbm-tbs (H200: 4.8 TB/s); the fp8
kernel's error against the reference. `--sweep`: a few `Fp8MatvecConfig`s at M = 1 (columns a program, K chunk,
pipeline depth, the integer conversion). Experts: 256 of D = 7168, I = 2048, top-8, at --tokens tokens, the weight
bytes of the touched experts. JSON to --out.

    PYTHONPATH=. python scripts/lab/probe_fp8_decode_gemv.py --out $OUT/fp8_decode_gemv.json
    PYTHONPATH=. python scripts/lab/probe_fp8_decode_gemv.py --out $OUT/fp8_decode_gemv.json --sweep --no-experts
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import benchmarks as bm
from pallas_kernels.fp8_matvec import Fp8MatvecConfig, default_config, fp8_matvec, fp8_matvec_reference
from pallas_kernels.moe_decode import MoeDecodeConfig, moe_decode, moe_decode_fp8
from pallas_kernels.stacked_matmul import stacked_matmul
from tests.test_fp8_matvec import V3_PROJECTIONS  # (N, K) of V3's decode projections: the tests' table

SWEEP = {
    # operands "x" (the bf16 product, the default until the fourteenth session) with other launch knobs
    "x": Fp8MatvecConfig(operands="x"),
    "block_n=32": Fp8MatvecConfig(block_n=32, operands="x"),
    "block_n=128": Fp8MatvecConfig(block_n=128, operands="x"),
    "block_k=64": Fp8MatvecConfig(block_k=64, operands="x"),
    "stages=2": Fp8MatvecConfig(num_stages=2, operands="x"),
    "stages=6": Fp8MatvecConfig(num_stages=6, operands="x"),
    "warps=8": Fp8MatvecConfig(num_warps=8, operands="x"),
    "bits": Fp8MatvecConfig(convert="bits", operands="x"),
    # bytes in flight: the default's tile is 8 KB of e4m3 where bf16 stacked_matmul's is 16 KB (the same 64x128)
    "block_n=128 stages=6": Fp8MatvecConfig(block_n=128, num_stages=6, operands="x"),
    "block_n=128 warps=8": Fp8MatvecConfig(block_n=128, num_warps=8, operands="x"),
    "block_n=128 warps=8 stages=6": Fp8MatvecConfig(block_n=128, num_warps=8, num_stages=6, operands="x"),
    # the fourteenth session's sweep: block_n 128 and more stages / warps moved nothing, "bits" was 2.5x slower,
    # so the conversion is the cost: e4m3 -> f16 (one instruction for two values), or none (fp8 x fp8)
    "f16": Fp8MatvecConfig(operands="f16"),
    "e4m3": Fp8MatvecConfig(operands="e4m3"),
    "f16 block_n=128": Fp8MatvecConfig(operands="f16", block_n=128),
    "e4m3 block_n=128": Fp8MatvecConfig(operands="e4m3", block_n=128),
    # the f16 default's launch knobs at M = 32 (0.78-0.81x bf16's time there, 0.59-0.71x at M = 1)
    "f16 warps=8": Fp8MatvecConfig(operands="f16", num_warps=8),
    "f16 block_n=128 warps=8": Fp8MatvecConfig(operands="f16", block_n=128, num_warps=8),
    "f16 stages=6": Fp8MatvecConfig(operands="f16", num_stages=6),
    "f16 block_n=32": Fp8MatvecConfig(operands="f16", block_n=32),
    "f16 block_k=64": Fp8MatvecConfig(operands="f16", block_k=64),
}
SCALE_BYTES = 4 / 128**2  # an fp32 scale per 128x128 block, per weight


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def timed(fn, *args, iters):
    """(whole call µs, largest kernel µs, kernels a call)."""
    total, parts = bm.cupti_median_us(fn, *args, iterations=iters, per_kernel=True)
    return total, max(parts.values()), len(parts)


def projection_rows(name, M, layers, iters, hbm, configs):
    N, K = V3_PROJECTIONS[name]
    keys = jax.random.split(jax.random.key(M * 7 + N), 3)
    x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (layers, N, K), jnp.float32) * 16).astype(jnp.float8_e4m3fn)
    s = jnp.exp2(jax.random.uniform(keys[2], (layers, -(-N // 128), -(-K // 128)), jnp.float32, -12.0, -6.0))
    layer = jnp.int32(layers // 2)
    fp8_bytes = N * K * (1 + SCALE_BYTES)
    rows = []

    def row(impl, fn, args, nbytes, **extra):
        t0 = time.perf_counter()
        y = jax.block_until_ready(fn(*args))
        compile_s = time.perf_counter() - t0
        us, kernel_us, kernels = timed(fn, *args, iters=iters)
        r = dict(
            shape=name,
            M=M,
            N=N,
            K=K,
            impl=impl,
            us=us,
            kernel_us=kernel_us,
            kernels=kernels,
            weight_bytes=nbytes,
            gbps=nbytes / us / 1e3,
            frac_hbm=nbytes / us / 1e6 / hbm,
            compile_s=compile_s,
            **extra,
        )
        rows.append(r)
        print(
            f"{name:11s} M={M:3d} {impl:24s} {us:8.1f} us (kernel {kernel_us:8.1f}, {kernels} kernels) "
            f"{r['gbps']:6.0f} GB/s = {r['frac_hbm']:5.1%} of HBM"
            + (f"  err {extra['rel_err']:.1e}" if "rel_err" in extra else ""),
            flush=True,
        )
        return y

    ref = jax.jit(fp8_matvec_reference)
    want = row("xla_dequant_dot", ref, (x, w, s, layer), fp8_bytes)
    for label, config in configs.items():
        f = jax.jit(lambda x, w, s, i, c=config: fp8_matvec(x, w, s, i, config=c, impl="kernel"))
        try:
            y = f(x, w, s, layer)
            row(f"fp8_matvec[{label}]", f, (x, w, s, layer), fp8_bytes, rel_err=rel_err(y, want))
        except Exception as e:  # a config that does not compile is recorded, the others still run
            rows.append(dict(shape=name, M=M, impl=f"fp8_matvec[{label}]", error=f"{type(e).__name__}: {e}"[:2000]))
            print(f"{name} M={M} fp8_matvec[{label}]: {type(e).__name__}: {str(e)[:300]}", flush=True)
    wb = jnp.swapaxes(w.astype(jnp.bfloat16), 1, 2)  # [L, K, N] bf16: stacked_matmul's layout (unscaled values)
    row(
        "bf16_stacked_matmul",
        jax.jit(lambda x, w, i: stacked_matmul(x, w, i, impl="kernel")),
        (x, wb, layer),
        2 * N * K,
    )
    return rows


MOE_SWEEP = {
    # the fp8 tiles at their default sizes are half of bf16's bytes (gate/up 64 x 128, down 64 x 64 e4m3 = 4 KB)
    "k128 o128": MoeDecodeConfig(block_k=128, block_o=128),
    "i128 k128 o128": MoeDecodeConfig(block_i=128, block_k=128, block_o=128),
    "k128 o128 s5": MoeDecodeConfig(block_k=128, block_o=128, num_stages=5),
    "i128 k128 o128 s4 w8": MoeDecodeConfig(block_i=128, block_k=128, block_o=128, num_stages=4, num_warps=8),
    "k128 o128 s4 f16": MoeDecodeConfig(block_k=128, block_o=128, num_stages=4, fp8_f16=True),
}


def expert_rows(tokens, iters, hbm, E=256, K=8, D=7168, I=2048, sweep=False):
    """V3's routed experts (E of width I over D, top-K) at `tokens` tokens, fp8 and bf16 (E = 256 exceeds the
    Triton lowering's 2**31-element arrays: `--experts 64` keeps V3's widths and top-8)."""
    rng = np.random.default_rng(tokens)
    sizes = np.bincount(np.concatenate([rng.choice(E, K, replace=False) for _ in range(tokens)]), minlength=E)
    touched = int((sizes > 0).sum())
    keys = jax.random.split(jax.random.key(tokens), 7)
    x = jax.random.normal(keys[0], (int(sizes.sum()), D), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    shapes = ((E, I, D), (E, I, D), (E, D, I))
    ws = [(jax.random.normal(k, sh, jnp.float32) * 16).astype(jnp.float8_e4m3fn) for k, sh in zip(keys[1:4], shapes)]
    ss = [
        jnp.exp2(jax.random.uniform(k, (sh[0], sh[1] // 128, sh[2] // 128), jnp.float32, -12.0, -6.0))
        for k, sh in zip(keys[4:], shapes)
    ]
    out = []
    f16 = MoeDecodeConfig(fp8_f16=True)
    extra = [
        (
            f"moe_decode_fp8[{n}]",
            jax.jit(lambda *a, c=c: moe_decode_fp8(*a, config=c, impl="kernel")),
            (x, gs, *ws, *ss),
            1 + SCALE_BYTES,
        )
        for n, c in (MOE_SWEEP.items() if sweep else ())
    ]
    for impl, fn, args, per_weight in (
        *extra,
        ("moe_decode_fp8", jax.jit(lambda *a: moe_decode_fp8(*a, impl="kernel")), (x, gs, *ws, *ss), 1 + SCALE_BYTES),
        (
            "moe_decode_fp8[f16]",
            jax.jit(lambda *a: moe_decode_fp8(*a, config=f16, impl="kernel")),
            (x, gs, *ws, *ss),
            1 + SCALE_BYTES,
        ),
        (
            "moe_decode_bf16",
            jax.jit(lambda *a: moe_decode(*a, impl="kernel")),
            (x, gs, *(jnp.swapaxes(w.astype(jnp.bfloat16), 1, 2) for w in ws)),
            2,
        ),
    ):
        jax.block_until_ready(fn(*args))
        us, kernel_us, kernels = timed(fn, *args, iters=iters)
        nbytes = touched * 3 * D * I * per_weight
        r = dict(
            impl=impl,
            tokens=tokens,
            experts_touched=touched,
            us=us,
            kernel_us=kernel_us,
            kernels=kernels,
            weight_bytes=nbytes,
            gbps=nbytes / us / 1e3,
            frac_hbm=nbytes / us / 1e6 / hbm,
        )
        out.append(r)
        print(
            f"experts tokens={tokens:3d} ({touched} touched) {impl:16s} {us:8.1f} us {r['gbps']:6.0f} GB/s "
            f"= {r['frac_hbm']:5.1%} of HBM",
            flush=True,
        )
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--rows", default="1,8,32", help="comma-separated M values")
    p.add_argument("--shapes", default=",".join(V3_PROJECTIONS), help="comma-separated names of V3_PROJECTIONS")
    p.add_argument("--layers", type=int, default=4, help="layers of each projection's stack")
    p.add_argument("--tokens", default="1,8,32", help="comma-separated token counts of the experts' cells")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--hbm-tbs", type=float, default=4.8, help="the HBM's bandwidth in TB/s (H200: 4.8)")
    p.add_argument("--sweep", action="store_true", help="also a few Fp8MatvecConfigs at M = 1")
    p.add_argument("--configs", default="", help="comma-separated SWEEP names to time at every M (beside default)")
    p.add_argument("--no-experts", action="store_true")
    p.add_argument("--experts", type=int, default=256, help="routed experts of the experts' cells (top-8 of them)")
    p.add_argument("--moe-sweep", action="store_true", help="also MOE_SWEEP's MoeDecodeConfigs")
    p.add_argument("--budget-s", type=float, default=480.0, help="skip the cells that would start after this")
    args = p.parse_args()
    bm.require_gpu("probe_fp8_decode_gemv")
    header = bm.run_header()
    command = " ".join(["python", "scripts/lab/probe_fp8_decode_gemv.py", *sys.argv[1:]])
    header["command"] = command.replace(os.environ["OUT"], "$OUT") if os.environ.get("OUT") else command
    out = dict(header=header, projections=[], experts=[], errors=[], skipped=[])
    start = time.perf_counter()

    def run(kind, label, fn, *a):
        if time.perf_counter() - start > args.budget_s:
            out["skipped"].append(dict(kind=kind, cell=label))
            return
        try:
            out[kind].extend(fn(*a))
        except Exception as e:  # a failing cell is recorded, the others still run
            out["errors"].append(dict(kind=kind, cell=label, error=f"{type(e).__name__}: {e}"[:2000]))
            print(f"{kind} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)

    for M in (int(m) for m in args.rows.split(",")):
        for name in args.shapes.split(","):
            configs = {"default": default_config(*V3_PROJECTIONS[name])}
            if args.sweep and M == 1:
                configs.update(SWEEP)
            configs.update({c: SWEEP[c] for c in args.configs.split(",") if c})
            run(
                "projections", f"{name} M={M}", projection_rows, name, M, args.layers, args.iters, args.hbm_tbs, configs
            )
    if not args.no_experts:
        for tokens in (int(t) for t in args.tokens.split(",")):
            run(
                "experts",
                f"tokens={tokens}",
                expert_rows,
                tokens,
                args.iters,
                args.hbm_tbs,
                args.experts,
                8,
                7168,
                2048,
                args.moe_sweep,
            )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
