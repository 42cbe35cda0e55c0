"""Lab probe (GPU): the decode kernel's two schedules side by side, one run.

For each cell, `MlaDecodeConfig(schedule=...)` "per_sequence" (the default: each CTA one split of
one sequence) against "balanced" (the batch's pages cut into equal runs per CTA across sequence
boundaries, then the piece combine): the output checked against `mla_decode_reference` (unused
pages and page tails NaN, block table permuted), then CUPTI whole-call time, its Mosaic GPU
kernels' share (main kernel + combine) and the rest (the schedule's jnp metadata, pad/slice),
and the schedule metadata alone. Issue 13's cells: ragged lengths (B=128, uniform in [256,
16384], H=64), B=128 at 8192, B=1 and B=8 at 4096 with H=128.

    PYTHONPATH=. python3 scripts/lab/probe_balanced.py --out runs/bal

Writes ``probe_balanced.csv`` under --out (after every cell) and prints one JSON line a row.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import benchmarks as bm
from benchmarks.bench_mla_decode import FLASHMLA_US
from pallas_kernels import MlaDecodeConfig, mla_decode, mla_decode_reference
from pallas_kernels.mla_decode import balanced_schedule, plan

SCALE = 192**-0.5
PAGE = 64
# Issue 13's side-by-side run: FlashMLA on the ragged cell (B=128, uniform [256, 16384], H=64).
FLASHMLA_RAGGED_GBPS = 3656

CELLS = [  # name, B, s_q, H, lengths: ("uniform", lo, hi) or ("fixed", seq)
    ("ragged", 128, 1, 64, ("uniform", 256, 16384)),
    ("fixed8k", 128, 1, 64, ("fixed", 8192)),
    ("b1", 1, 1, 128, ("fixed", 4096)),
    ("b8", 8, 1, 128, ("fixed", 4096)),
]

CONFIGS = {
    "per_sequence": MlaDecodeConfig(),
    "balanced": MlaDecodeConfig(schedule="balanced"),
    # optional (--configs): the other body, and runs without the 4-page floor
    "balanced_plain": MlaDecodeConfig(schedule="balanced", scorer=False, split_qk=False),
    "balanced_min1": MlaDecodeConfig(schedule="balanced", min_pages_per_split=1),
    "balanced_whole": MlaDecodeConfig(schedule="balanced", whole_requests=True),
}


def make(B, s_q, H, lengths, seed=0):
    """(q, kv_pages, block_table, seq_lens): permuted table; pages and page tails no sequence owns
    are NaN."""
    rng = np.random.default_rng(seed)
    if lengths[0] == "uniform":
        lens = rng.integers(lengths[1], lengths[2] + 1, B).astype(np.int32)
    else:
        lens = np.full(B, lengths[1], np.int32)
    max_pages = -(-int(lens.max()) // PAGE)
    n = B * max_pages + 1
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    table = jax.random.permutation(k1, n)[: B * max_pages].astype(jnp.int32).reshape(B, max_pages)
    tok = jnp.arange(max_pages * PAGE).reshape(max_pages, PAGE)
    owned = jnp.zeros((n, PAGE), bool).at[table].set(tok[None] < jnp.asarray(lens)[:, None, None])
    kv = jax.random.normal(k2, (n, PAGE, 576), jnp.bfloat16)
    kv = jnp.where(owned[..., None], kv, jnp.nan).astype(jnp.bfloat16)
    q = jax.random.normal(k3, (B, s_q, H, 576), jnp.bfloat16)
    return q, kv, table, jnp.asarray(lens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--configs", default="per_sequence,balanced", help=f"comma-separated, from {sorted(CONFIGS)}")
    ap.add_argument("--cells", default=",".join(c[0] for c in CELLS))
    args = ap.parse_args()
    bm.require_gpu("probe_balanced")
    os.makedirs(args.out, exist_ok=True)
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    cells = [c for c in CELLS if c[0] in args.cells.split(",")]
    rows, t_start = [], time.time()
    for name, B, s_q, H, lengths in cells:
        q, kv, table, lens = make(B, s_q, H, lengths)
        causal = s_q > 1
        total = int(lens.sum())
        nbytes = total * 576 * 2 + (B * s_q * H * 576 + B * s_q * H * 512) * 2
        ref_out, ref_lse = jax.jit(lambda *a: mla_decode_reference(*a, softmax_scale=SCALE, causal=causal))(
            q, kv, table, lens
        )
        ref_out = np.asarray(ref_out, np.float32)
        ref_lse = np.asarray(ref_lse)
        outs = {}
        for cname, cfg in configs.items():
            t0 = time.time()
            p = plan(B, s_q, H, table.shape[1], cfg)
            row = dict(
                cell=name,
                B=B,
                s_q=s_q,
                H=H,
                seq_max=int(lens.max()),
                seq_mean=float(lens.mean()),
                config=cname,
                row_blocks=p.row_blocks,
                split_qk=p.split_qk,
                splits=p.num_splits if cfg.schedule == "per_sequence" else "",
                num_ctas=p.num_ctas or "",
            )
            try:
                fn = jax.jit(
                    lambda *a, cfg=cfg: mla_decode(*a, softmax_scale=SCALE, causal=causal, config=cfg, impl="kernel")
                )
                out, lse = fn(q, kv, table, lens)
                o = np.asarray(out, np.float32)
                outs[cname] = o
                row["finite"] = bool(np.isfinite(o).all())
                row["rel_err"] = float(np.linalg.norm(o - ref_out) / np.linalg.norm(ref_out))
                row["lse_err"] = float(np.abs(np.asarray(lse) - ref_lse).max())
                row["ok"] = row["finite"] and row["rel_err"] < 1e-2 and row["lse_err"] < 2e-2
                if cfg.schedule == "balanced":
                    sched_fn = jax.jit(
                        lambda l, c=p.num_ctas, cfg=cfg: balanced_schedule(
                            l,
                            num_ctas=c,
                            min_pages_per_cta=cfg.min_pages_per_split,
                            whole_requests=cfg.whole_requests,
                            request_cost=cfg.request_cost_pages,
                        )
                    )
                    sched = sched_fn(lens)
                    row["pages_per_cta"] = int((sched.ctas[:, 1] - sched.ctas[:, 0]).max())
                    row["max_pieces"] = int(sched.num_pieces.max())
                    row["pieces"] = int(sched.num_pieces.sum())
                    row["sched_us"] = bm.cupti_median_us(sched_fn, lens, iterations=args.iters)
                whole, parts = bm.cupti_median_us(fn, q, kv, table, lens, iterations=args.iters, per_kernel=True)
                mosaic = {k: v for k, v in parts.items() if "mla_decode" in k or "mosaic" in k.lower()}
                row.update(
                    us=whole,
                    kernels_us=sum(mosaic.values()) if mosaic else float("nan"),
                    other_us=whole - sum(mosaic.values()) if mosaic else float("nan"),
                    gbps=nbytes / whole / 1e3,
                    parts=json.dumps({k: round(v, 2) for k, v in parts.items()}),
                )
                fm = FLASHMLA_US.get((B, s_q, lengths[1], H)) if lengths[0] == "fixed" else None
                if fm:
                    row["x_flashmla"] = whole / fm
                elif name == "ragged":
                    row["x_flashmla"] = FLASHMLA_RAGGED_GBPS / row["gbps"]
            except Exception as e:  # noqa: BLE001 - one config's failure must not end the probe
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["wall_s"] = round(time.time() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            bm.write_csv(os.path.join(args.out, "probe_balanced.csv"), rows)
        if "per_sequence" in outs and "balanced" in outs:
            diff = float(np.abs(outs["per_sequence"] - outs["balanced"]).max())
            print(json.dumps(dict(cell=name, balanced_vs_per_sequence_max_abs=diff)), flush=True)
        del q, kv, table, lens, ref_out, ref_lse, outs
    print("\n  cell          config            us   kernels  other   GB/s  x FlashMLA  ok")
    for r in rows:
        print(
            f"  {r['cell']:<12}  {r['config']:<15} {r.get('us', float('nan')):8.1f} "
            f"{r.get('kernels_us', float('nan')):8.1f} {r.get('other_us', float('nan')):6.1f} "
            f"{r.get('gbps', float('nan')):6.0f} {r.get('x_flashmla', float('nan')):10.2f}  "
            f"{r.get('ok', r.get('error', '?'))}"
        )
    print(f"total {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
