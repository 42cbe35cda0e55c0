"""Lab probe (GPU): where the fp8 decode kernel's time goes, from Mosaic GPU's profiler.

Runs `mla_decode` on fp8 pages with every `plgpu.CompilerParams` given a profile buffer (the
kernel bodies mark their phases with `jax.named_scope`), then reads the trace Mosaic GPU writes and
prints, per warpgroup and phase, the mean time per page and its share of the warpgroup's time in
the main kernel. Also the bf16 kernel's whole-call time for the same cell, unprofiled.

    python scripts/lab/profile_fp8_decode.py --out results/x [--cells 128,1,2048,16 ...]

The profiler keeps its events in SMEM (about 13 bytes per range a warpgroup, next to the kernel's own
buffers), so the cells are short: 16 pages a CTA and room for 16 ranges a page.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import jax  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import benchmarks as bm  # noqa: E402
from pallas_kernels import MlaDecodeConfig, mla_decode, quantize_latent_fp8  # noqa: E402


def summarise(path, pages_per_cta):
    """{(wg, phase): (mean µs per page, share of the wg's span)} over the CTAs of one trace."""
    events = json.load(open(path))["traceEvents"]
    per = collections.defaultdict(float)
    span = collections.defaultdict(lambda: [float("inf"), float("-inf")])
    open_ = {}
    for e in events:
        key = (e["tid"], e["name"])
        span[e["tid"]][0] = min(span[e["tid"]][0], e["ts"])
        span[e["tid"]][1] = max(span[e["tid"]][1], e["ts"])
        if e["ph"] == "B":
            open_[key] = e["ts"]
        else:
            per[key] += e["ts"] - open_.pop(key)
    tids = sorted(span)
    wgs = 3  # two compute warpgroups and the memory one, per CTA
    out = collections.defaultdict(lambda: [0.0, 0.0])
    ctas = max(1, len(tids) // wgs)
    for (tid, name), t in per.items():
        wg = (tid - 1) % wgs
        s0, s1 = span[tid]
        out[(wg, name)][0] += t / pages_per_cta / ctas
        out[(wg, name)][1] += t / max(s1 - s0, 1e-9) / ctas
    spans = [span[t][1] - span[t][0] for t in tids]
    return dict(out), float(np.mean(spans)) if spans else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cells", nargs="*", default=["128,1,1024,16", "128,1,1024,32"])
    ap.add_argument(
        "--configs",
        nargs="*",
        default=["default"],
        help="MlaDecodeConfig keyword sets, e.g. fp8_transposed=False (default: none)",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    orig = plgpu.CompilerParams
    for cell in args.cells:
        B, s_q, seq, H = map(int, cell.split(","))
        P = seq // 64
        key = jax.random.split(jax.random.key(0), 2)
        lat = jax.random.normal(key[0], (B * P, 64, 576), jnp.float32)
        kv8, kv16 = quantize_latent_fp8(lat), lat.astype(jnp.bfloat16)
        table = jnp.asarray(np.random.default_rng(0).permutation(B * P).reshape(B, P), jnp.int32)
        lens = jnp.full((B,), seq, jnp.int32)
        q = (jax.random.normal(key[1], (B, s_q, H, 576)) * 0.3).astype(jnp.bfloat16)
        for cfg_s in args.configs:
            kw = {} if cfg_s == "default" else {k: eval(v) for k, v in (x.split("=") for x in cfg_s.split(";"))}
            jax.clear_caches()
            cfg = MlaDecodeConfig(num_splits=1, **kw)
            try:
                f = jax.jit(
                    lambda q, kv, t, l: mla_decode(
                        q, kv, t, l, softmax_scale=0.07, causal=s_q > 1, impl="kernel", config=cfg
                    )
                )
                row = dict(
                    cell=cell,
                    config=cfg_s,
                    bf16_us=bm.cupti_median_us(f, q, kv16, table, lens, iterations=10),
                    fp8_us=bm.cupti_median_us(f, q, kv8, table, lens, iterations=10),
                )
                d = os.path.join(args.out, f"trace_{cell.replace(',', '_')}_{len(os.listdir(args.out))}")
                os.makedirs(d, exist_ok=True)
                prof = dict(profile_space=16 * P + 16, profile_dir=d, profile_bounds_check=True)
                plgpu.CompilerParams = lambda **k: orig(**{**k, **prof})
                jax.clear_caches()  # the profiled call must trace (and compile) again
                try:
                    g = jax.jit(
                        lambda q, kv, t, l: mla_decode(
                            q, kv, t, l, softmax_scale=0.07, causal=s_q > 1, impl="kernel", config=cfg
                        )
                    )
                    jax.block_until_ready(g(q, kv8, table, lens))
                    jax.effects_barrier()
                finally:
                    plgpu.CompilerParams = orig
                traces = sorted(glob.glob(os.path.join(d, "*.json")), key=os.path.getmtime)
                row["traces"] = [os.path.basename(t) for t in traces]
                if traces:
                    phases, mean_span = summarise(traces[-1], P)
                    row["cta_span_us"] = round(mean_span, 2)
                    row["us_per_page"] = {f"wg{wg}:{name}": round(v[0], 3) for (wg, name), v in sorted(phases.items())}
                    row["share"] = {f"wg{wg}:{name}": round(v[1], 3) for (wg, name), v in sorted(phases.items())}
            except Exception as e:  # noqa: BLE001 - one config failing must not end the probe
                row = dict(cell=cell, config=cfg_s, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
