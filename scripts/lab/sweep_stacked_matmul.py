"""Probe: `stacked_matmul` / `stacked_head_matmul` at V2-Lite's decode projections over their config space (GPU).

    PYTHONPATH=. python3 scripts/lab/sweep_stacked_matmul.py --out OUT [--rows 1,32] [--iters 20]

Each projection of a V2-Lite layer (q and kv_a with the input norm inside, wo, W_UK, W_UV), its weights a
27-layer stack as the model holds them; every timed call reads the next layer of the stack (the stack is
larger than L2, so no call finds its weights cached). A config is checked against the reference (relative
L2 < 1e-2) before it is timed; the time is the CUPTI median of the call's kernels, the kernel alone beside
the call (the split-K sum included). GB/s = one layer's weight bytes / the kernel's time, beside the copy
rate measured in the same run. Writes OUT/sweep.csv (a row a config), prints the best few a projection.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import benchmarks as bm  # noqa: E402
from pallas_kernels.stacked_matmul import (  # noqa: E402
    HEAD_CONFIG,
    RowNorm,
    StackedMatmulConfig,
    stacked_head_matmul,
    stacked_head_matmul_problems,
    stacked_matmul,
    stacked_matmul_problems,
)

L = 27
D, H, NOPE, ROPE, V, R = 2048, 16, 128, 64, 128, 512


def projections(M: int, key):
    """name -> (fn(x, w, layer, config, impl), x, w, weight bytes a layer, problems(config))."""
    ks = jax.random.split(key, 8)
    bf = jnp.bfloat16

    def rnd(k, shape, scale=0.02):
        return (jax.random.normal(k, shape, jnp.float32) * scale).astype(bf)

    g = (1.0 + rnd(ks[0], (L, D), 0.1).astype(jnp.float32)).astype(bf)
    wkv_b = rnd(ks[1], (L, R, H * (NOPE + V)))
    out = {}
    for name, N, k in (("q", H * (NOPE + ROPE), ks[2]), ("kv_a", R + ROPE, ks[3])):
        w = rnd(k, (L, D, N))

        def f(x, w, layer, config, impl, g=g):
            return stacked_matmul(x, w, layer, norm=RowNorm(g, 1e-6), config=config, impl=impl)

        out[name] = (f, rnd(ks[4], (M, D), 1.0), w, D * N * 2, lambda c, N=N: stacked_matmul_problems(M, D, N, c))
    w_o = rnd(ks[5], (L, H * V, D))
    out["wo"] = (
        lambda x, w, layer, config, impl: stacked_matmul(x, w, layer, config=config, impl=impl),
        rnd(ks[6], (M, H * V), 1.0),
        w_o,
        H * V * D * 2,
        lambda c: stacked_matmul_problems(M, H * V, D, c),
    )
    out["w_uk"] = (
        lambda x, w, layer, config, impl: stacked_head_matmul(
            x, w, layer, col_offset=0, contract_rows=False, k_cols=NOPE, config=config, impl=impl
        ),
        rnd(ks[7], (M, H, NOPE + ROPE), 1.0),
        wkv_b,
        R * H * NOPE * 2,
        lambda c: stacked_head_matmul_problems(M, H, NOPE, R, c),
    )
    out["w_uv"] = (
        lambda x, w, layer, config, impl: stacked_head_matmul(
            x, w, layer, col_offset=NOPE, contract_rows=True, width=V, config=config, impl=impl
        ),
        rnd(ks[4], (M, H, R), 1.0),
        wkv_b,
        R * H * V * 2,
        lambda c: stacked_head_matmul_problems(M, H, R, V, c),
    )
    return out


def configs(name: str):
    default = HEAD_CONFIG if name in ("w_uk", "w_uv") else StackedMatmulConfig()
    yield "default", default
    for bn, bk, split in itertools.product((32, 64, 128, 256), (64, 128, 256), (None, 1, 2, 4, 8, 16, 32)):
        yield "grid", StackedMatmulConfig(block_n=bn, block_k=bk, split_k=split)


def time_call(fn, x, w, layers, iters):
    """CUPTI median µs of a call (all its kernels) and of its first kernel, the call i reading layer i mod L."""
    outs, it = [], iter(range(10**9))

    def call():
        outs.append(fn(x, w, layers[next(it) % L]))

    def sync():
        jax.block_until_ready(outs)
        outs.clear()

    us, parts = bm._cupti_record(call, sync, iters, warmup=2)
    if parts is None:
        return us, None, None
    mine = [v for k, v in parts.items() if "stacked" in k or "pallas" in k or "triton" in k.lower()]
    return us, (mine[0] if len(mine) == 1 else None), ";".join(f"{k}={v:.2f}" for k, v in parts.items())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="1,32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--only", default="", help="projections to sweep (comma-separated; default all)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    header, ceil = bm.begin_run("stacked_matmul sweep (V2-Lite projections)", args.out, args.iters)
    gbps_copy = ceil["bandwidth_gbps"]
    layers = [jnp.asarray(i, jnp.int32) for i in range(L)]
    rows, csv = [], os.path.join(args.out, "sweep.csv")
    for M in (int(m) for m in args.rows.split(",")):
        for name, (f, x, w, wbytes, problems) in projections(M, jax.random.key(M)).items():
            if args.only and name not in args.only.split(","):
                continue
            ref = jax.jit(lambda x, w, layer, f=f: f(x, w, layer, None, "reference"))(x, w, layers[3])
            ref = jnp.asarray(ref, jnp.float32)
            seen = set()
            for kind, c in bm.progress(list(configs(name)), desc=f"M={M} {name}"):
                if problems(c) or c in seen:
                    continue
                seen.add(c)
                row = dict(M=M, proj=name, kind=kind, block_n=c.block_n, block_k=c.block_k, split_k=c.split_k)
                row |= dict(num_warps=c.num_warps, num_stages=c.num_stages, weight_mb=wbytes / 1e6)
                try:
                    fn = jax.jit(lambda x, w, layer, f=f, c=c: f(x, w, layer, c, "kernel"))
                    got = jnp.asarray(fn(x, w, layers[3]), jnp.float32)
                    err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                    if not err < 1e-2:
                        raise RuntimeError(f"relative error {err:.3g}")
                    us, k_us, n_k = time_call(fn, x, w, layers, args.iters)
                    row |= dict(us=us, kernel_us=k_us, kernels=n_k, rel_err=err)
                    row |= dict(gbps=wbytes / (k_us or us) / 1e3, pct_copy=wbytes / (k_us or us) / 1e3 / gbps_copy)
                except Exception as e:  # noqa: BLE001 - a config that fails to compile or run is a row
                    row["error"] = bm.one_line(e)[:200]
                rows.append(row)
                bm.write_csv(csv, rows)
            done = sorted((r for r in rows if r["M"] == M and r["proj"] == name and "us" in r), key=lambda r: r["us"])
            dflt = next((r for r in done if r["kind"] == "default"), None)
            print(
                f"# M={M} {name}: {wbytes / 1e6:.2f} MB a layer; default {dflt and round(dflt['us'], 2)} µs; best:",
                flush=True,
            )
            for r in done[:5]:
                print(
                    f"   bn={r['block_n']} bk={r['block_k']} split={r['split_k']}: {r['us']:.2f} µs "
                    f"(kernel {r['kernel_us'] or float('nan'):.2f}, {r['pct_copy']:.0%} of copy)",
                    flush=True,
                )
    # warps / stages around each projection's best
    for M in (int(m) for m in args.rows.split(",")):
        for name, (f, x, w, wbytes, problems) in projections(M, jax.random.key(M)).items():
            if args.only and name not in args.only.split(","):
                continue
            done = sorted((r for r in rows if r["M"] == M and r["proj"] == name and "us" in r), key=lambda r: r["us"])
            for best in done[:1]:
                for nw, ns in itertools.product((2, 4, 8), (2, 3, 4, 6)):
                    c = StackedMatmulConfig(best["block_n"], best["block_k"], best["split_k"], nw, ns)
                    row = dict(M=M, proj=name, kind="warps", block_n=c.block_n, block_k=c.block_k, split_k=c.split_k)
                    row |= dict(num_warps=nw, num_stages=ns, weight_mb=wbytes / 1e6)
                    try:
                        fn = jax.jit(lambda x, w, layer, f=f, c=c: f(x, w, layer, c, "kernel"))
                        us, k_us, n_k = time_call(fn, x, w, layers, args.iters)
                        row |= dict(us=us, kernel_us=k_us, kernels=n_k)
                        row |= dict(gbps=wbytes / (k_us or us) / 1e3, pct_copy=wbytes / (k_us or us) / 1e3 / gbps_copy)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = bm.one_line(e)[:200]
                    rows.append(row)
                    bm.write_csv(csv, rows)
            done = sorted((r for r in rows if r["M"] == M and r["proj"] == name and "us" in r), key=lambda r: r["us"])
            print(
                f"# M={M} {name} after warps/stages: "
                + "; ".join(
                    f"{r['block_n']}/{r['block_k']}/{r['split_k']}/w{r['num_warps']}s{r['num_stages']} {r['us']:.2f}"
                    for r in done[:4]
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
