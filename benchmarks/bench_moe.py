"""Benchmark of one MoE layer's routed experts: the decode kernel, the Mosaic GPU grouped GEMM and
`lax.ragged_dot`, per token count, against the weight-read floor and the matmul rate.

Usage: ``python -m benchmarks moe [--model v2-lite|v3] [--tokens 1,8,32,128,4096] [--row-tiles 16,32] [--out DIR]``

``--row-tiles``: the decode kernel once per row tile (`MoeDecodeConfig.row_tile`, the rest its default config): a
program reads its expert's weights once per tile of the expert's rows, so where experts get more rows than 16
(V2-Lite at 128 tokens: 768 rows over 64 experts) the tiles decide how often the weights are read.

A call routes T tokens to K of E experts (uniformly at random, K distinct per token), so the
weights it must read are the touched experts' 3·D·I values: floor = touched · 3·D·I · 2 B / the
copy bandwidth measured in the same run. FLOPs = 2 · T · K · 3 · D · I (what a prefill-sized call
is judged by, against the bf16 matmul rate measured in the same run). Each implementation is
checked against `lax.ragged_dot`'s result (relative L2 < 1e-2) before it is timed; times are the
CUPTI median of the whole `moe_grouped` call (sort, gather, expert GEMMs, weighting, un-sort).

Rows go to ``moe_<model>.csv`` as they come (the ceilings to ``moe_<model>_meta.json`` first); a cell that fails
(out of memory, a result unlike ragged_dot's) is a row with the error's first line (``error``), and the run ends
with exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

import benchmarks as bm
from mla_jax import ModelConfig
from models.experts import moe_grouped
from pallas_kernels.moe_decode import MoeDecodeConfig, default_config

IMPLS = ("decode", "mgpu", "ragged_dot")


def run(args):
    cfg = ModelConfig.deepseek_v2_lite() if args.model == "v2-lite" else ModelConfig.deepseek_v3()
    E, K, D, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    header, ceil = bm.begin_run(f"moe ({args.model}: E={E} K={K} D={D} I={I})", args.out, args.iters)
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    scale = 0.02
    gate = (jax.random.normal(k0, (E, D, I), jnp.bfloat16) * scale).astype(jnp.bfloat16)
    up = (jax.random.normal(k1, (E, D, I), jnp.bfloat16) * scale).astype(jnp.bfloat16)
    down = (jax.random.normal(k2, (E, I, D), jnp.bfloat16) * scale).astype(jnp.bfloat16)
    csv_path = os.path.join(args.out, f"moe_{args.model}.csv")
    bm.write_json(os.path.join(args.out, f"moe_{args.model}_meta.json"), dict(header, ceilings=ceil))
    tiles = args.row_tiles
    configs = [dataclasses.replace(default_config(D, I), row_tile=t) for t in tiles]
    variants = [("decode", c) for c in configs] + [(impl, None) for impl in IMPLS if impl != "decode"]
    label = lambda impl, c: impl if c is None or len(tiles) == 1 else f"{impl} row_tile {c.row_tile}"  # noqa: E731
    rows = []
    for T in bm.progress([int(t) for t in args.tokens.split(",")], desc="moe cells"):
        try:
            rng = np.random.default_rng(T)
            idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
            touched = len(np.unique(idx))
            x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
            w = jnp.asarray(rng.random((T, K)), jnp.float32)
            idx = jnp.asarray(idx)
            ref = jax.jit(lambda *a: moe_grouped(*a, impl="ragged_dot"))(x, w, idx, gate, up, down).astype(jnp.float32)
        except Exception as e:  # noqa: BLE001 - one cell's failure (out of memory) must not cost the others
            for impl, c in variants:
                row = dict(model=args.model, T=T, impl=impl, row_tile=c.row_tile if c else "")
                rows.append(bm.record_failure(row, f"T={T} inputs", e))
            bm.write_csv(csv_path, rows)
            continue
        wbytes = touched * 3 * D * I * 2
        floor_us = wbytes / (ceil["bandwidth_gbps"] * 1e3)
        flops = 2 * T * K * 3 * D * I
        for impl, c in variants:
            row = dict(model=args.model, T=T, impl=impl, row_tile=c.row_tile if c else "", touched=touched)
            row.update(weight_mb=wbytes / 1e6, floor_us=floor_us)
            kw = dict(impl=impl) if c is None else dict(impl=impl, decode_config=c)
            fn = jax.jit(lambda *a, kw=kw: moe_grouped(*a, **kw))
            try:
                got = fn(x, w, idx, gate, up, down).astype(jnp.float32)
                row["rel_err"] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                if not row["rel_err"] < 1e-2:
                    raise RuntimeError(f"not timed: relative error {row['rel_err']:.3g} against ragged_dot")
                us = bm.cupti_median_us(fn, x, w, idx, gate, up, down, iterations=args.iters)
                row.update(
                    us=us,
                    x_floor=us / floor_us,
                    gbps=wbytes / us / 1e3,
                    tflops=flops / us / 1e6,
                    mfu=flops / us / 1e6 / ceil["matmul_tflops"],
                )
            except Exception as e:  # noqa: BLE001
                bm.record_failure(row, f"T={T} {label(impl, c)}", e)
            rows.append(row)
            bm.write_csv(csv_path, rows)
    bm.print_table(
        rows,
        [
            ("T", "T", "{}"),
            ("impl", "impl", "{}"),
            ("row_tile", "row tile", "{}"),
            ("touched", "experts", "{}"),
            ("weight_mb", "weights MB", "{:.1f}"),
            ("floor_us", "floor µs", "{:.1f}"),
            ("us", "µs", "{:.1f}"),
            ("x_floor", "x floor", "{:.2f}"),
            ("gbps", "GB/s", "{:.0f}"),
            ("tflops", "TFLOP/s", "{:.0f}"),
            ("mfu", "%matmul", "{:.0%}"),
            ("rel_err", "rel err", "{:.1e}"),
            ("error", "error", "{}"),
        ],
    )
    multi = len(tiles) > 1
    name = lambda r: f"T={r['T']} {r['impl']}" + (f" row_tile {r['row_tile']}" if multi and r["row_tile"] else "")  # noqa: E731
    bm.exit_if_failed("moe", rows, csv_path, name=name)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks moe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=("v2-lite", "v3"), default="v2-lite", help="the layer's shape")
    p.add_argument("--tokens", default="1,8,32,128,512,4096", help="tokens a call (comma-separated)")
    p.add_argument(
        "--row-tiles", default="16", help="the decode kernel's row tiles to time (comma-separated: 16, 32 or 64)"
    )
    p.add_argument("--out", default="runs/bench_moe", help="directory for CSV/JSON")
    p.add_argument("--iters", type=int, default=30, help="CUPTI iterations per timing (median)")
    args = p.parse_args(argv)
    raw = args.row_tiles
    try:
        args.row_tiles = [int(t) for t in raw.split(",")]
        for t in args.row_tiles:
            MoeDecodeConfig(row_tile=t)
    except ValueError as e:
        p.error(f"--row-tiles {raw}: {e}")
    bm.require_gpu("moe")
    return run(args)


if __name__ == "__main__":
    main()
