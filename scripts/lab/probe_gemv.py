"""What a decode step's projections cost on the GPU, and why (issue 28: XLA turns batch-1 projections into a
multiply fusion that writes a weight-sized product, then a reduce).

1. Projections of one token (and of 2, 8, 32 rows) through a scan over 26 stacked layers' weights, as the model
   runs them: x @ W[l] in bf16 (nnx.Linear), the same with fp32 accumulation (einsum_f32), and with the rows
   padded to 2 or 8; CUPTI time, GB/s of weights read, kernels and their names.
2. The optimized HLO of V2-Lite's multi-step decode program (B=1 and B=32), written to --out for reading.

    PYTHONPATH=. python scripts/lab/probe_gemv.py --out $OUT/gemv
(run it again under XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true to compare)
"""

import argparse
import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import benchmarks as bm

L, K, N = 26, 2048, 3072  # V2-Lite's wq: 2048 -> 16 heads x 192


def scan_proj(kind: str, rows: int):
    def layer(x, w):
        if kind == "pad2":
            xp = jnp.pad(x, ((0, 2 - rows), (0, 0))) if rows < 2 else x
            return x, jnp.dot(xp, w)[:rows]
        if kind == "pad8":
            xp = jnp.pad(x, ((0, 8 - rows), (0, 0))) if rows < 8 else x
            return x, jnp.dot(xp, w)[:rows]
        if kind == "f32acc":
            return x, jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        return x, jnp.dot(x, w)

    def f(x, ws):
        return jax.lax.scan(layer, x, ws)[1]

    return jax.jit(f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/gemv")
    p.add_argument("--no-hlo", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    flags = os.environ.get("XLA_FLAGS", "")
    ws = jax.random.normal(jax.random.key(0), (L, K, N), jnp.bfloat16)
    rows_out = []
    for rows in (1, 2, 8, 32):
        x = jax.random.normal(jax.random.key(rows), (rows, K), jnp.bfloat16)
        ref = None
        for kind in ("plain", "f32acc", "pad2", "pad8"):
            if (kind == "pad2" and rows >= 2) or (kind == "pad8" and rows >= 8):
                continue
            fn = scan_proj(kind, rows)
            out = np.asarray(fn(x, ws), np.float32)
            ref = out if ref is None else ref
            err = float(np.abs(out - ref).max() / (np.abs(ref).max() + 1e-9))
            us, parts = bm.cupti_median_us(fn, x, ws, iterations=20, per_kernel=True)
            names = {}
            for name, t in parts.items():
                base = name.split(":", 1)[1]
                names[base] = names.get(base, 0.0) + t
            row = dict(
                flags=flags,
                rows=rows,
                kind=kind,
                us=us,
                gbps=L * K * N * 2 / us / 1e3,
                kernels=len(parts),
                rel_err=err,
                top=sorted(names.items(), key=lambda kv: -kv[1])[:5],
            )
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, f"gemv{'_dsf' if 'dynamic_slice' in flags else ''}.jsonl"), "w") as f:
        for r in rows_out:
            f.write(json.dumps(r) + "\n")
    if args.no_hlo:
        return
    from benchmarks.bench_e2e import build_model, kv_pages, model_config  # noqa: PLC0415 (lab)
    from mla_jax.kv_cache import KVCache  # noqa: PLC0415 (lab)
    from models import Engine  # noqa: PLC0415 (lab)
    from models.sampling import SamplingArrays, SamplingParams  # noqa: PLC0415 (lab)
    from models.steps import StepInputs  # noqa: PLC0415 (lab)

    cfg = model_config("v2-lite")
    model, _ = build_model(cfg, jnp.bfloat16)
    for B in (1, 32):
        e = Engine(model, page_size=64, num_pages=kv_pages(cfg, B, 1024, 128), max_batch=B)
        P = 32
        inp = StepInputs(
            np.zeros((B, 1), np.int32),
            np.full((B, 1), 1024, np.int32),
            np.zeros((B, P), np.int32),
            np.full((B,), 1025, np.int32),
            np.zeros((B,), np.int32),
            np.zeros((B, 2), np.uint32),
            SamplingArrays.from_params([SamplingParams(temperature=0.0)] * B),
        )
        cache = KVCache.create(
            e.cache.pages, inp.block_table, inp.lengths, impl=e.backend, page_format=e.cache.page_format
        )
        lowered = e.steps.decode_loop.lower(
            e.state,
            cache,
            inp,
            np.full((B,), 8, np.int32),
            np.full((B, 1), -1, np.int32),
            sampler="greedy",
            num_steps=8,
        )
        text = lowered.compile().as_text()
        with gzip.open(os.path.join(args.out, f"decode_loop_B{B}.hlo.txt.gz"), "wt") as f:
            f.write(text)
        print(f"B={B}: HLO {len(text)} chars written", flush=True)
        del e


if __name__ == "__main__":
    main()
