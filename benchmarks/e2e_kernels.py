"""``mla-bench e2e --kernels``: a census of the kernels a warm engine's decode step launches (CUPTI), from the
difference of two generations that share their prompts, prefill and first token."""

from __future__ import annotations

import json
import os

import benchmarks as bm
from benchmarks.e2e_cells import stat
from benchmarks.e2e_models import sync_engine

# --kernels: two generations of the warm cell, of KERNEL_TOKENS[0] and KERNEL_TOKENS[1] new tokens, recorded with
# CUPTI; their difference is decode steps alone (the same prompts, prefill and first token in both).
KERNEL_TOKENS = (17, 81)
TOP_KERNELS = 8


def kernel_profile(engine, prompts, kw, out_dir: str, label: str) -> dict:
    """Per decode step of a warm engine: kernels launched, their device time (CUPTI sum), the host gap (wall
    time less device time) and the kernels that take the most device time, from the difference of two
    generations (`KERNEL_TOKENS`); the whole table goes to `<out_dir>/kernels_<label>.json`."""
    runs = []
    for n in KERNEL_TOKENS:
        box = {}

        def call(n=n, box=box):
            box["res"] = engine.generate(prompts, **{**kw, "max_new_tokens": n})

        timings = bm.cupti_kernels(call, sync=lambda: sync_engine(engine))
        st = box["res"].stats
        runs.append((timings, stat(st, "decode_steps"), stat(st, "decode_s"), stat(st, "decode_calls")))
    (k1, s1, w1, c1), (k2, s2, w2, c2) = runs
    steps = s2 - s1
    if steps <= 0:
        return dict(note="--kernels: no decode steps between the two generations")
    per = {}
    for sign, timings in ((-1, k1), (1, k2)):
        for name, ms in timings:
            n_ms = per.setdefault(name, [0, 0.0])
            n_ms[0] += sign
            n_ms[1] += sign * ms
    device_ms = (sum(ms for _, ms in k2) - sum(ms for _, ms in k1)) / steps
    table = sorted(
        ({"kernel": k, "count_step": c / steps, "us_step": 1e3 * ms / steps} for k, (c, ms) in per.items()),
        key=lambda r: -r["us_step"],
    )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"kernels_{label}.json"), "w") as f:
        json.dump(dict(steps=steps, calls=c2 - c1, device_ms_step=device_ms, kernels=table), f, indent=1)
    top = "; ".join(f"{r['kernel'][:48]} {r['us_step']:.1f}us x{r['count_step']:.1f}" for r in table[:TOP_KERNELS])
    return dict(
        kernels_step=(len(k2) - len(k1)) / steps,
        device_ms_step=device_ms,
        host_gap_ms_step=1e3 * (w2 - w1) / steps - device_ms,
        top_kernels=top,
    )
