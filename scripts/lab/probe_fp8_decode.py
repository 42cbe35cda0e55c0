"""Lab probe (GPU): the decode kernel on fp8 pages against bf16 pages of the same latents, one run.

For each cell: the fp8 kernel's error against its reference (dequantise, then the bf16 reference),
then CUPTI whole-call times of the bf16 and the fp8 kernel, side by side, and their ratio; where
the transposed fp8 body serves the cell (s_q * H <= 32), also the padded shared-buffer body's time
(``fp8_shared_us``, config fp8_transposed=False).

    python scripts/lab/probe_fp8_decode.py --out results/x
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import benchmarks as bm  # noqa: E402
from pallas_kernels import MlaDecodeConfig, mla_decode, mla_decode_reference, quantize_latent_fp8  # noqa: E402

CELLS = [  # B, s_q, seq, H, ragged
    (128, 1, 8192, 16, False),
    (128, 1, 8192, 32, False),
    (128, 1, 32768, 16, False),
    (128, 1, 32768, 32, False),
    (128, 1, 8192, 64, False),
    (128, 1, 8192, 128, False),
    (128, 2, 8192, 16, False),
    (1, 1, 32768, 16, False),
    (8, 1, 4096, 32, True),
    (128, 1, 32768, 64, False),
    (128, 2, 8192, 128, True),
    (8, 4, 4096, 32, True),
]


def make(B, s_q, seq, H, ragged, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(seq // 8, seq + 1, B) if ragged else np.full(B, seq)
    P = -(-seq // 64)
    N = B * P + 1
    key = jax.random.split(jax.random.key(seed), 2)
    lat = jax.random.normal(key[0], (N, 64, 576), jnp.float32)
    kv16 = lat.astype(jnp.bfloat16)
    kv8 = quantize_latent_fp8(lat)
    table = jnp.asarray(rng.permutation(N - 1)[: B * P].reshape(B, P) + 1, jnp.int32)
    q = (jax.random.normal(key[1], (B, s_q, H, 576), jnp.float32) * 0.3).astype(jnp.bfloat16)
    return q, kv16, kv8, table, jnp.asarray(lens, jnp.int32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cells", type=int, default=len(CELLS))
    ap.add_argument("--only", type=str, default="", help="comma-separated CELLS indices")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    cells = [CELLS[int(i)] for i in args.only.split(",")] if args.only else CELLS[: args.cells]
    for cell in cells:
        B, s_q, seq, H, ragged = cell
        t0 = time.time()
        q, kv16, kv8, table, lens = make(*cell)
        causal = s_q > 1
        f = jax.jit(lambda q, kv, t, l: mla_decode(q, kv, t, l, softmax_scale=0.07, causal=causal, impl="kernel"))
        shared = jax.jit(
            lambda q, kv, t, l: mla_decode(
                q,
                kv,
                t,
                l,
                softmax_scale=0.07,
                causal=causal,
                impl="kernel",
                config=MlaDecodeConfig(fp8_transposed=False),
            )
        )
        row = dict(B=B, s_q=s_q, seq=seq, H=H, ragged=ragged)
        try:
            o8, l8 = f(q, kv8, table, lens)
            r8, rl8 = jax.jit(lambda q, kv, t, l: mla_decode_reference(q, kv, t, l, softmax_scale=0.07, causal=causal))(
                q, kv8, table, lens
            )
            row["fp8_out_err"] = float(jnp.max(jnp.abs(o8.astype(jnp.float32) - r8.astype(jnp.float32))))
            row["fp8_lse_err"] = float(jnp.max(jnp.abs(l8 - rl8)))
            row["fp8_nan"] = int(jnp.isnan(o8.astype(jnp.float32)).sum())
            row["bf16_us"] = bm.cupti_median_us(f, q, kv16, table, lens, iterations=args.iters)
            row["fp8_us"] = bm.cupti_median_us(f, q, kv8, table, lens, iterations=args.iters)
            row["ratio"] = row["fp8_us"] / row["bf16_us"]
            if s_q * H <= 32:
                row["fp8_shared_us"] = bm.cupti_median_us(shared, q, kv8, table, lens, iterations=args.iters)
            tot = int(lens.sum())
            row["fp8_TBps"] = tot * 656 / row["fp8_us"] / 1e6
            row["bf16_TBps"] = tot * 1152 / row["bf16_us"] / 1e6
        except Exception as e:  # noqa: BLE001 - one cell's failure must not end the probe
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["wall_s"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(args.out, "fp8_decode.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, keys)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
