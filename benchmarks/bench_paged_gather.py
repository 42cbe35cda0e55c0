"""Benchmark of the paged gather kernel against XLA's ``kv_pages[block_table]``.

Usage: ``python -m benchmarks paged_gather [--quick] [--out DIR] [--iters N] [--sweep] [--kv-dtype fp8|fp4]``

Bytes = read + written = 2 * B * T * 576 * 2 (bf16 pages); with ``--kv-dtype fp8`` (``fp4``) the pages
are fp8 (fp4): random latents quantised, 656 (416) bytes a token, and the kernel dequantises them:
B * T * (656 + 1152) (B * T * (416 + 1152)), against XLA's ``dequantize(kv[bt])``. The ceiling is a
device-to-device copy measured in the same run.
Every kernel result is compared bit-exactly with XLA's before it is timed.

Rows go to ``paged_gather.csv`` as they come (the ceilings to ``paged_gather_meta.json`` first); a cell that
fails (out of memory, a result unlike XLA's) is a row with the error's first line (``error``), and the run ends
with exit status 1.
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np

import benchmarks as bm
from pallas_kernels import BF16_PAGES, FP4_PAGES, FP8_PAGES, PagedGatherConfig, paged_gather
from pallas_kernels.paged_gather import plan_chunks


def grid(quick: bool):
    """Cells (B, num_tokens)."""
    if quick:
        return [(32, 4096), (128, 4096), (8, 32768)]
    return [(1, 32768), (8, 32768), (32, 4096), (32, 8192), (128, 4096), (128, 8192), (128, 16384), (64, 2500)]


def run(args):
    fmt = {"fp8": FP8_PAGES, "fp4": FP4_PAGES}.get(args.kv_dtype, BF16_PAGES)

    header, ceil = bm.begin_run("paged_gather", args.out, args.iters)
    configs = {"default": PagedGatherConfig()}
    if fmt.quantized:  # the dequantised page stored from two staging buffers in turn (default) or one
        configs["staging1"] = PagedGatherConfig(staging_buffers=1, max_concurrent_steps=3)
        configs["ctas132"] = PagedGatherConfig(target_ctas=132)
    if args.sweep:
        for chunks in (2, 4, 8, 16):
            for steps in (2, 3):
                configs[f"c{chunks}s{steps}"] = PagedGatherConfig(chunks=chunks, max_concurrent_steps=steps)
        configs["ctas132"] = PagedGatherConfig(target_ctas=132)
        configs["ctas528"] = PagedGatherConfig(target_ctas=528)
    csv_path = os.path.join(args.out, "paged_gather.csv")
    bm.write_json(os.path.join(args.out, "paged_gather_meta.json"), dict(header, ceilings=ceil))
    rows = []
    for B, T in bm.progress(grid(args.quick), desc="paged_gather cells"):
        n_pages = -(-T // 64)
        nbytes = B * T * (fmt.token_bytes + 576 * 2)
        try:
            k1, k2 = jax.random.split(jax.random.key(B * T))
            table = jax.random.permutation(k1, B * n_pages).astype(np.int32).reshape(B, n_pages)
            kv = jax.random.normal(k2, (B * n_pages, 64, 576), jax.numpy.bfloat16)
            if fmt.quantized:
                kv = jax.jit(fmt.encode)(kv)
            xla_fn = jax.jit(lambda kv, bt: fmt.dequantize_reference(kv[bt]).reshape(B, -1, 576)[:, :T])
            want = xla_fn(kv, table)
            xla_us = bm.cupti_median_us(xla_fn, kv, table, iterations=args.iters)
        except Exception as e:  # noqa: BLE001 - one cell's failure (out of memory) must not cost the others
            for name in configs:
                row = dict(B=B, T=T, kv_dtype=fmt.name, config=name, gbytes=nbytes / 1e9)
                rows.append(bm.record_failure(row, f"B={B} T={T} XLA's gather", e))
            bm.write_csv(csv_path, rows)
            continue
        for name, cfg in configs.items():
            fn = jax.jit(
                lambda kv, bt, cfg=cfg: paged_gather(kv, bt, num_tokens=T, config=cfg, page_format=fmt, impl="kernel")
            )
            row = dict(
                B=B,
                T=T,
                kv_dtype=fmt.name,
                config=name,
                chunks=plan_chunks(B, n_pages, cfg)[0],
                steps=cfg.for_format(fmt).max_concurrent_steps,
                gbytes=nbytes / 1e9,
                xla_us=xla_us,
                xla_gbps=nbytes / xla_us / 1e3,
            )
            try:
                got = fn(kv, table)
                row["exact"] = bool((got == want).all())
                if not row["exact"]:  # timed only once checked bit-exact against XLA
                    raise RuntimeError("not timed: output differs from XLA's kv[bt]")
                us = bm.cupti_median_us(fn, kv, table, iterations=args.iters)
                row.update(us=us, gbps=nbytes / us / 1e3, x_vs_xla=xla_us / us)
                row["bw_frac"] = row["gbps"] / ceil["bandwidth_gbps"]
            except Exception as e:  # noqa: BLE001
                bm.record_failure(row, f"B={B} T={T} {name}", e)
            rows.append(row)
            bm.write_csv(csv_path, rows)
        del kv, table, want
    bm.print_table(
        rows,
        [
            ("B", "B", "{}"),
            ("T", "T", "{}"),
            ("config", "cfg", "{}"),
            ("chunks", "chunks", "{}"),
            ("steps", "steps", "{}"),
            ("us", "kernel µs", "{:.1f}"),
            ("gbps", "GB/s", "{:.0f}"),
            ("bw_frac", "%copy", "{:.0%}"),
            ("xla_us", "XLA µs", "{:.1f}"),
            ("xla_gbps", "XLA GB/s", "{:.0f}"),
            ("x_vs_xla", "xXLA", "{:.2f}"),
            ("exact", "exact", "{}"),
            ("error", "error", "{}"),
        ],
    )
    bm.exit_if_failed("paged_gather", rows, csv_path, name=lambda r: f"B={r['B']} T={r['T']} {r['config']}")
    return rows


def main(argv=None):
    p = bm.OneLineParser(
        prog="python -m benchmarks paged_gather",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a reduced grid")
    p.add_argument("--out", default="runs/bench_paged_gather", help="directory for CSV/JSON")
    p.add_argument("--iters", type=int, default=30, help="CUPTI iterations per timing (median)")
    p.add_argument("--sweep", action="store_true", help="also time chunk/step configs")
    p.add_argument(
        "--kv-dtype",
        choices=("bf16", "fp8", "fp4"),
        default="bf16",
        help="page format: bf16 (a copy), fp8 or fp4 (dequantised to bf16) (default: bf16)",
    )
    args = p.parse_args(argv)
    bm.require_gpu("paged_gather")
    return run(args)


if __name__ == "__main__":
    main()
