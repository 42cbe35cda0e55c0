"""Lab probe (GPU): `pallas_kernels.flash_attention` (Mosaic GPU, causal, q·k 192 / v 128) against
cuDNN's flash attention (`mla_jax.attention._cudnn_causal_attention`) and the jnp form.

Per cell (B x T x H): the kernel's max abs error against `flash_attention_reference` (forward and
dq, dk, dv of sum(o * do), on two batch rows: attention does not mix rows), then wall-clock times
(`jax.block_until_ready`, median of --iters after --warmup) of the forward and of forward+backward
(`jax.vjp` then the cotangent) for each implementation, and TFLOP/s at the nominal causal FLOPs
(forward 2·B·H·T²/2·(D+V); backward 2·B·H·T²/2·(3D+2V)). Prints a table, writes
``flash_attention.csv`` and ``flash_attention.json`` to --out.

    PYTHONPATH=. python scripts/lab/probe_flash_attention.py --out results/flash
    PYTHONPATH=. python scripts/lab/probe_flash_attention.py --out runs/fl --lower-only   # CPU too

``--sweep``: also time the kernel under each `SWEEP` config that fits in SMEM (block sizes, stages,
the schedule barrier), at the first cell only, rows ``mgpu[field=value,...]``.

``--lower-only``: trace and lower (for ``cuda``, sm_90) the kernel's forward and ``jax.grad`` at every
cell, with the SMEM estimate of each kernel; runs nothing, so it works on a CPU host.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.flash_attention import (
    FlashAttentionConfig,
    flash_attention,  # noqa: E402
    flash_attention_reference,
    smem_bytes,
)

D, V = 192, 128
SCALE = D**-0.5
DEFAULT_CELLS = "16x4096x16,4x2048x16"
# Tuning candidates for --sweep (FlashAttentionConfig fields; those over the SMEM limit are skipped).
SWEEP = [
    dict(block_kv=64),
    dict(block_kv=64, max_concurrent_steps=3),
    dict(block_kv=64, max_concurrent_steps=4),
    dict(schedule_barrier=False),
    dict(bwd_max_concurrent_steps=3),
    dict(memory_registers=24),
    dict(memory_registers=56),
]
COLUMNS = [
    "cell",
    "impl",
    "fwd_ms",
    "fwd_bwd_ms",
    "fwd_tflops",
    "fwd_bwd_tflops",
    "err_o",
    "err_dq",
    "err_dk",
    "err_dv",
    "note",
]


def parse_cells(text):
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",") if c]


def make(B, T, H, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, H, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, H, V), jnp.bfloat16)
    do = jax.random.normal(ks[3], (B, T, H, V), jnp.bfloat16)
    return q, k, v, do


def jnp_attention(q, k, v):
    """mla_decompressed_attention's "xla" form: bf16 einsums with fp32 accumulation, fp32 masked softmax."""
    T = q.shape[1]
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * SCALE
    s = jnp.where(jnp.arange(T)[None, :] <= jnp.arange(T)[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshv->bthv", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)


def cudnn_attention(q, k, v):
    from mla_jax.attention import _cudnn_causal_attention

    B, T = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    return _cudnn_causal_attention(q, k, v, pos, pos, SCALE)


def impls(config):
    return {
        "mgpu": lambda q, k, v: flash_attention(q, k, v, softmax_scale=SCALE, impl="kernel", config=config),
        "cudnn": cudnn_attention,
        "jnp": jnp_attention,
    }


def timed(fn, args, warmup, iters):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def fwd_bwd(f):
    def run(q, k, v, do):
        o, vjp = jax.vjp(f, q, k, v)
        return o, vjp(do)

    return run


def errors(f, q, k, v, do, rows):
    """max |kernel - reference| of o, dq, dk, dv on batch rows ``rows`` (the kernel runs the whole
    batch; the reference, fp32 [B,H,T,T], only those rows)."""
    o, (dq, dk, dv) = jax.jit(fwd_bwd(f))(q, k, v, do)
    ref = jax.jit(fwd_bwd(lambda q, k, v: flash_attention_reference(q, k, v, softmax_scale=SCALE)))
    errs = np.zeros(4)
    for r in rows:
        sl = slice(r, r + 1)
        got = (o[sl], dq[sl], dk[sl], dv[sl])
        ro, rg = ref(q[sl], k[sl], v[sl], do[sl])
        for i, (a, b) in enumerate(zip(got, (ro, *rg))):
            errs[i] = max(errs[i], float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))))
            if not bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))):
                errs[i] = float("nan")
    return errs


def lower_only(cells, configs):
    rows = []
    for (label, config), (B, T, H) in [(c, cell) for c in configs for cell in cells]:
        f = impls(config)["mgpu"]
        g = jax.grad(lambda q, k, v, f=f: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        shapes = (
            jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, T, H, V), jnp.bfloat16),
        )
        note = []
        for name, fn in (("fwd", f), ("grad", g)):
            t0 = time.time()
            try:
                jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
                note.append(f"{name} lowered ({time.time() - t0:.1f} s)")
            except Exception as e:  # noqa: BLE001  (reported, the probe goes on)
                note.append(f"{name} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        smem = smem_bytes(D, V, config)
        note.append("smem " + " ".join(f"{k}={v}" for k, v in smem.items()))
        rows.append(dict(cell=f"{B}x{T}x{H}", impl=label, note="; ".join(note)))
        print(f"{B}x{T}x{H} {label}: " + "; ".join(note), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cells", default=DEFAULT_CELLS, help="BxTxH,... (default %(default)s)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--impls", default="mgpu,cudnn,jnp")
    ap.add_argument(
        "--lower-only", action="store_true", help="lower the kernels for sm_90 (works on a CPU); run nothing"
    )
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP configs at the first cell")
    ap.add_argument("--config", default="", help="FlashAttentionConfig fields, e.g. block_kv=64,max_concurrent_steps=3")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    kw = {}
    for item in filter(None, args.config.split(",")):
        key, value = item.split("=")
        kw[key] = int(value)
    config = FlashAttentionConfig(**kw)
    cells = parse_cells(args.cells)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, config {config}", flush=True)
    if args.lower_only:
        configs = [("mgpu", config)]
        if args.sweep:
            configs += [
                ("mgpu[" + ",".join(f"{k}={v}" for k, v in e.items()) + "]", FlashAttentionConfig(**{**kw, **e}))
                for e in SWEEP
            ]
        rows = lower_only(cells, configs)
    else:
        rows = []
        for B, T, H in cells:
            q, k, v, do = make(B, T, H)
            flops_f = 2 * B * H * T * T / 2 * (D + V)
            flops_b = 2 * B * H * T * T / 2 * (3 * D + 2 * V)
            todo = [(name, impls(config)[name]) for name in args.impls.split(",")]
            if args.sweep and (B, T, H) == cells[0]:
                for extra in SWEEP:
                    cfg = FlashAttentionConfig(**{**kw, **extra})
                    if max(smem_bytes(D, V, cfg).values()) <= 232448:
                        todo.append(
                            ("mgpu[" + ",".join(f"{k}={v}" for k, v in extra.items()) + "]", impls(cfg)["mgpu"])
                        )
            for name, f in todo:
                row = dict(cell=f"{B}x{T}x{H}", impl=name, note="")
                try:
                    if name.startswith("mgpu"):
                        row.update(
                            zip(("err_o", "err_dq", "err_dk", "err_dv"), errors(f, q, k, v, do, sorted({0, B - 1})))
                        )
                    row["fwd_ms"] = timed(jax.jit(f), (q, k, v), args.warmup, args.iters)
                    row["fwd_bwd_ms"] = timed(jax.jit(fwd_bwd(f)), (q, k, v, do), args.warmup, args.iters)
                    row["fwd_tflops"] = flops_f / row["fwd_ms"] / 1e9
                    row["fwd_bwd_tflops"] = (flops_f + flops_b) / row["fwd_bwd_ms"] / 1e9
                except Exception as e:  # noqa: BLE001  (e.g. the jnp form out of memory at 16x4096)
                    row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                print(
                    "  ".join(
                        f"{c}={row[c]:.4g}" if isinstance(row.get(c), float) else f"{c}={row.get(c, '')}"
                        for c in COLUMNS
                        if c in row
                    ),
                    flush=True,
                )
    with open(os.path.join(args.out, "flash_attention.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out, "flash_attention.json"), "w") as fh:
        json.dump(
            dict(jax=jax.__version__, device=jax.devices()[0].device_kind, config=str(config), rows=rows),
            fh,
            indent=1,
            default=float,
        )
    print(
        f"\n{'cell':>12} {'impl':>6} {'fwd ms':>8} {'f+b ms':>8} {'fwd TF/s':>9} {'f+b TF/s':>9} "
        f"{'err o':>8} {'err dq':>8} {'err dk':>8} {'err dv':>8}  note"
    )
    for r in rows:
        num = lambda c, fmt: format(r[c], fmt) if isinstance(r.get(c), float) else "-"  # noqa: E731
        print(
            f"{r['cell']:>12} {r['impl']:>6} {num('fwd_ms', '8.3f')} {num('fwd_bwd_ms', '8.3f')} "
            f"{num('fwd_tflops', '9.1f')} {num('fwd_bwd_tflops', '9.1f')} {num('err_o', '8.2g')} "
            f"{num('err_dq', '8.2g')} {num('err_dk', '8.2g')} {num('err_dv', '8.2g')}  {r.get('note', '')}"
        )
    return 0 if all("FAILED" not in r.get("note", "") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
