"""Where the time of a training step goes, kernel by kernel (CUPTI), for the V2-Lite cut
`mla-bench train` measures, and the decompressed attention alone in its two implementations.

For each cell (`--cells B x T : remat : CE chunk : attention q block : attention impl`, e.g.
``16x4096:full:2048:512:xla,16x4096:full:2048:0:cudnn``): the step `mla-train` uses, built without donation
(so the profiler may call it again on the same arrays), compiled, run once, then `profiler.measure` over
`--iterations` steps with every kernel's CUPTI time. Reported per cell: the step's kernel time, MFU by
`mla-bench train`'s arithmetic, the time per kernel category (matmuls through cuBLAS, the Mosaic GPU grouped
GEMMs, cuDNN attention, XLA fusions, copies) and the top kernels. Then, with `--attention`, the
decompressed attention alone (forward + backward of `mla_decompressed_attention` at V2-Lite's widths, one layer)
for each implementation: CUPTI time and TFLOP/s.

    PYTHONPATH=. python3 scripts/profile_train_step.py --out $OUT/prof [--cells ...] [--attention]

Writes under --out: profile.json (every cell: categories, top kernels, totals), log.txt.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
T0 = time.perf_counter()
LOG = []

CATEGORIES = [  # first match wins
    ("attention (cuDNN)", re.compile(r"cudnn|fmha|flash|sdpa|fprop|bprop", re.I)),
    ("grouped GEMM (Mosaic GPU)", re.compile(r"ragged|mosaic|mgpu|grouped", re.I)),
    ("matmul (cuBLAS)", re.compile(r"gemm|xmma|cutlass|nvjet|wgmma|sm90_|cublas", re.I)),
    ("sort / scatter / gather", re.compile(r"sort|scatter|gather|cub::|radix", re.I)),
    ("copy / transpose", re.compile(r"copy|memcpy|memset|transpose|concatenate|dynamic.update", re.I)),
    ("XLA fusion", re.compile(r"fusion|reduce|loop_|input_|wrapped_|convert|select|add|multiply", re.I)),
]


def log(msg: str) -> None:
    line = f"[{time.perf_counter() - T0:6.1f}s] {msg}"
    print(line, flush=True)
    LOG.append(line)


def category(name: str) -> str:
    for cat, rx in CATEGORIES:
        if rx.search(name):
            return cat
    return "other"


def parse_cell(spec: str):
    try:
        bt, remat, chunk, qb, impl = spec.split(":")
        b, t = bt.lower().split("x")
        return int(b), int(t), remat, int(chunk), int(qb), impl
    except ValueError:
        raise SystemExit(f"--cells: {spec!r} is not BxT:remat:chunk:q_block:impl (e.g. 16x4096:full:2048:512:xla)")


def measure_kernels(fn, args, iterations: int):
    """(median total ms, {kernel name: median ms a step}) over `iterations` calls, CUPTI."""
    from jax.experimental.mosaic.gpu import profiler

    _, runs = profiler.measure(fn, iterations=iterations, aggregate=False)(*args)
    totals = [sum(t for _, t in run) for run in runs]
    per = {}
    for run in runs:
        acc = {}
        for name, t in run:
            acc[name] = acc.get(name, 0.0) + t
        for name, t in acc.items():
            per.setdefault(name, []).append(t)
    return statistics.median(totals), {n: statistics.median(ts) for n, ts in per.items()}, len(runs[0])


def profile_cell(spec: str, args) -> dict:
    import functools

    import jax

    sys.path.insert(0, ".")
    import benchmarks.bench_train as bt
    from models.training.loop import TrainSettings, make_optimizer
    from models.training.step import TrainConfig, make_train_step

    B, T, remat, chunk, qb, impl = parse_cell(spec)
    cfg = bt.model_config(args.model, args.layers)
    tx, _ = make_optimizer(TrainSettings(steps=1000, warmup=10, lr=3e-4))
    tc = TrainConfig(remat=remat, ce_chunk=chunk, attn_q_block=qb, attn_impl=impl)
    step = make_train_step(tx, tc, donate=False)
    graphdef, state, opt_state = bt.build_state(cfg, tx, dtype="bf16", param_dtype="bf16", moe_impl="auto")
    batch = bt.random_batch(cfg, B, T)
    fn = functools.partial(step, graphdef)
    t0 = time.perf_counter()
    out = fn(state, opt_state, batch)
    jax.block_until_ready(out)
    compile_s = time.perf_counter() - t0
    loss = float(out[2]["loss"])
    del out
    total_ms, per, n_kernels = measure_kernels(fn, (state, opt_state, batch), args.iterations)
    flops = bt.train_flops(cfg, B, T)
    cats = {}
    for name, ms in per.items():
        c = category(name)
        cats[c] = cats.get(c, 0.0) + ms
    top = sorted(per.items(), key=lambda kv: -kv[1])[: args.top]
    row = dict(
        cell=spec,
        B=B,
        T=T,
        remat=remat,
        ce_chunk=chunk,
        attn_q_block=qb,
        attn_impl=impl,
        layers=cfg.num_hidden_layers,
        compile_and_first_step_s=compile_s,
        loss=loss,
        kernels_a_step=n_kernels,
        kernel_ms=total_ms,
        train_tflop=flops / 1e12,
        mfu=flops / (total_ms / 1e3) / (bt.H200_BF16_TFLOPS * 1e12),
        categories_ms=dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        top_kernels=[dict(name=n[:160], ms=ms, category=category(n)) for n, ms in top],
    )
    log(
        f"{spec}: {total_ms:.1f} ms of kernels a step ({n_kernels} kernels), MFU {row['mfu']:.1%}, loss {loss:.3f}, "
        f"first call {compile_s:.0f} s"
    )
    for c, ms in row["categories_ms"].items():
        log(f"    {c:28s} {ms:8.1f} ms  {ms / total_ms:6.1%}")
    for k in row["top_kernels"][: args.top]:
        log(f"      {k['ms']:8.2f} ms  [{k['category']}] {k['name'][:110]}")
    del state, opt_state, batch, step, fn
    gc.collect()
    jax.clear_caches()
    return row


def attention_alone(args) -> list[dict]:
    """Forward + backward of one layer's decompressed attention at V2-Lite's widths, each implementation."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, ".")
    import benchmarks as bm
    from mla_jax.attention import mla_decompressed_attention

    rows = []
    H, N, R, V, L = 16, 128, 64, 128, 512
    for B, T in ((1, 4096), (16, 4096)):
        rng = np.random.default_rng(0)
        bf = lambda s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.bfloat16)  # noqa: E731
        qn, qp, lat, w = bf((B, T, H, N)), bf((B, T, H, R)), bf((B, T, L + R)), bf((L, H, N + V), 0.05)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        flops = 3 * 2 * H * (N + R + V) * B * T * (T + 1) / 2
        ref = None
        for impl, qb in (("xla", 512), ("cudnn", None)):

            def loss(qn, qp, lat, w, impl=impl, qb=qb):
                o = mla_decompressed_attention(qn, qp, lat, w, pos, pos, softmax_scale=0.1, q_block=qb, impl=impl)
                return jnp.sum(o.astype(jnp.float32) ** 2)

            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
            try:
                us = bm.cupti_median_us(g, qn, qp, lat, w, iterations=10)
                grads = g(qn, qp, lat, w)
                if ref is None:
                    ref, err = grads, 0.0
                else:
                    err = max(
                        float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
                        for a, b in zip(grads, ref)
                    )
                row = dict(B=B, T=T, impl=impl, q_block=qb, us=us, tflops=flops / us / 1e6, grad_rel_err_vs_xla=err)
            except Exception as e:  # noqa: BLE001
                row = dict(B=B, T=T, impl=impl, q_block=qb, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            log(f"attention fwd+bwd B={B} T={T} {impl} q_block={qb}: {row}")
            rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cells", default="16x4096:full:2048:512:xla,16x4096:full:2048:0:cudnn")
    p.add_argument("--model", default="v2-lite", help="mla-bench train's models (tiny: a CPU smoke run)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--attention", action="store_true", help="also time the attention alone, each implementation")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    result = dict(cells=[], attention=[])
    if a.attention:
        result["attention"] = attention_alone(a)
    for spec in a.cells.split(","):
        try:
            result["cells"].append(profile_cell(spec, a))
        except Exception as e:  # noqa: BLE001 - the next cell still runs
            log(f"{spec}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            log(traceback.format_exc()[-1500:])
            result["cells"].append(dict(cell=spec, error=f"{type(e).__name__}: {str(e)[:300]}"))
        with open(os.path.join(a.out, "profile.json"), "w") as f:
            json.dump(result, f, indent=1)
    with open(os.path.join(a.out, "log.txt"), "w") as f:
        f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
