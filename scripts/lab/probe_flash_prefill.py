"""Lab probe (GPU): `pallas_kernels.flash_attention_prefill` (the flash forward with a query offset: a prefill
chunk of T queries after a cached prefix of P tokens) against the jnp attention the cached path ran before it,
at V2-Lite's attention shape (16 heads, q·k 192 / v 128).

Per cell (T chunk, P prefix; B rows, all with the same prefix):
* ``attn``: the attention alone on decompressed q [B,T,H,192], k [B,P+T,H,192], v [B,P+T,H,128] bf16:
  the kernel (``impl="kernel"``) against the jnp form of `mla_decompressed_attention` (bf16 einsums into
  fp32 scores, fp32 masked softmax by positions, bf16 P·V);
* ``layer`` (cells with the largest prefix only): `mla_decompressed_attention` on the latent [B,P+T,576] and
  wkv_b as the cached path calls it (decompression included), ``impl="mgpu"`` with ``cache_impl="kernel"``
  against ``impl="xla"``.
Times: CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`, median of --iters) of the jitted call, wall
clock if CUPTI is unavailable. TFLOP/s at the causal attention FLOPs 2·B·H·(192+128)·(T·P + T(T+1)/2)
(the decompression's FLOPs are not counted in the layer rows). Equality: the relative Frobenius error and
the max abs error of each output against `flash_attention_prefill_reference` (fp32 scores and softmax) on
row 0, and ``equal`` = rel < 1e-2 and finite. Writes ``flash_prefill.json`` (and a table on stdout) to --out;
``--time-budget`` seconds (default 170) stops starting new cells.

    PYTHONPATH=. python scripts/lab/probe_flash_prefill.py --out results/flash_prefill
    PYTHONPATH=. python scripts/lab/probe_flash_prefill.py --out runs/fp --lower-only   # CPU: lowering only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mla_jax.attention import _masked_softmax, attention_mask, einsum_f32, mla_decompressed_attention  # noqa: E402
from pallas_kernels import flash_attention_prefill, flash_attention_prefill_reference  # noqa: E402

H, N, R, D, V, L = 16, 128, 64, 192, 128, 512  # V2-Lite: heads, nope, rope, q·k, v, latent
SCALE = D**-0.5


def cells(chunks, prefixes, extra):
    out = [(t, p) for t in chunks for p in prefixes]
    return out + [c for c in extra if c not in out]


def flops(B, T, P):
    return 2 * B * H * (D + V) * (T * P + T * (T + 1) // 2)


def positions(B, T, P):
    q_pos = jnp.broadcast_to(P + jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    kv_pos = jnp.broadcast_to(jnp.arange(P + T, dtype=jnp.int32)[None], (B, P + T))
    return q_pos, kv_pos


def jnp_attention(q, k, v, q_pos, kv_pos):
    """`mla_decompressed_attention`'s "xla" attention on decompressed q, k, v (its `attend`)."""
    scores = einsum_f32("bthd,bshd->bhts", q, k)
    p, _ = _masked_softmax(scores * SCALE, attention_mask(q_pos, kv_pos))
    return einsum_f32("bhts,bshv->bthv", p.astype(v.dtype), v).astype(q.dtype)


def kernel_attention(q, k, v, q_pos, kv_pos):
    B, T = q_pos.shape
    off = q_pos[:, 0]
    lens = jnp.sum(kv_pos >= 0, axis=1).astype(jnp.int32)
    return flash_attention_prefill(q, k, v, off, lens, softmax_scale=SCALE, impl="kernel")


def layer(impl):
    def f(q_nope, q_pe, latent, w, q_pos, kv_pos):
        return mla_decompressed_attention(
            q_nope,
            q_pe,
            latent,
            w,
            q_pos,
            kv_pos,
            softmax_scale=SCALE,
            impl=impl,
            cache_impl="kernel" if impl == "mgpu" else None,
        )

    return f


def timed_ms(f, args, iters):
    """(median ms, how): CUPTI kernel time of the jitted call, or wall clock."""
    jax.block_until_ready(f(*args))
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, times = profiler.measure(f, iterations=iters)(*args)
        return statistics.median(times), "cupti"
    except Exception:  # no CUPTI (another profiler attached, or none installed)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), "wall"


def errors(got, want):
    g, w = (np.asarray(x, np.float32) for x in (got, want))
    rel = float(np.linalg.norm(g - w) / np.linalg.norm(w))
    finite = bool(np.isfinite(g).all())
    return dict(rel_err=rel, max_abs_err=float(np.abs(g - w).max()), equal=finite and rel < 1e-2)


def run_cell(B, T, P, args, with_layer):
    ks = jax.random.split(jax.random.key(T + P), 6)
    S = P + T
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, S, H, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, S, H, V), jnp.bfloat16)
    q_pos, kv_pos = positions(B, T, P)
    fl = flops(B, T, P)
    ref = jax.jit(lambda q, k, v, off, lens: flash_attention_prefill_reference(q, k, v, off, lens, softmax_scale=SCALE))
    row0 = (q[:1], k[:1], v[:1], jnp.full((1,), P, jnp.int32), jnp.full((1,), S, jnp.int32))
    want = ref(*row0)
    rows = []
    forms = [("attn", {"kernel": kernel_attention, "jnp": jnp_attention}, (q, k, v, q_pos, kv_pos))]
    if with_layer:
        q_nope, q_pe = q[..., :N], q[..., N:]
        latent = jax.random.normal(ks[3], (B, S, L + R), jnp.bfloat16)
        w = (jax.random.normal(ks[4], (L, H, N + V), jnp.float32) * L**-0.5).astype(jnp.bfloat16)
        layer_inputs = (q_nope, q_pe, latent, w, q_pos, kv_pos)
        forms.append(("layer", {"kernel": layer("mgpu"), "jnp": layer("xla")}, layer_inputs))
    for form, fns, inputs in forms:
        outs = {}
        for name, fn in fns.items():
            row = dict(form=form, impl=name, B=B, T=T, prefix=P, keys=S, gflop=fl / 1e9)
            f = jax.jit(fn)
            try:
                outs[name] = f(*inputs)
                ms, how = timed_ms(f, inputs, args.iters)
                row.update(ms=ms, timer=how, tflops=fl / ms / 1e9)
                if form == "attn":
                    row.update(errors(outs[name][:1], want))
            except Exception as e:  # an out-of-memory jnp cell is a row, not the end of the run
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
        if form == "layer" and len(outs) == 2:
            rows[-2].update(errors(outs["kernel"], outs["jnp"]), against="jnp layer")
        del outs
    return rows


def lower_cell(B, T, P):
    S = P + T
    sds = jax.ShapeDtypeStruct
    shapes = (sds((B, T, H, D), jnp.bfloat16), sds((B, S, H, D), jnp.bfloat16), sds((B, S, H, V), jnp.bfloat16))
    pos = (sds((B, T), jnp.int32), sds((B, S), jnp.int32))
    t0 = time.perf_counter()
    text = jax.jit(kernel_attention).trace(*shapes, *pos).lower(lowering_platforms=("cuda",)).as_text()
    return dict(
        form="attn",
        impl="kernel",
        B=B,
        T=T,
        prefix=P,
        keys=S,
        lowered=text.count("flash_attention_fwd_offset") > 0,
        lower_s=time.perf_counter() - t0,
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for flash_prefill.json")
    p.add_argument("--batch", type=int, default=1, help="rows B (every row has the cell's prefix)")
    p.add_argument("--chunks", default="2048,4096,8192", help="chunk lengths T (queries)")
    p.add_argument("--prefixes", default="0,2048,6144", help="prefix lengths P (cached tokens before the chunk)")
    p.add_argument("--extra", default="2048x6100", help="more TxP cells (6100: a prefix off the page and block grid)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations a measurement (median)")
    p.add_argument("--time-budget", type=float, default=170, help="seconds after which no new cell starts")
    p.add_argument("--lower-only", action="store_true", help="lower the kernel at every cell for sm_90; run nothing")
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    extra = [tuple(int(x) for x in c.split("x")) for c in args.extra.split(",") if c]
    grid = cells(ints(args.chunks), ints(args.prefixes), extra)
    largest = max(P for _, P in grid)
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    rows, skipped = [], []
    for T, P in grid:
        if time.perf_counter() - start > args.time_budget:
            skipped.append(f"{T}x{P}")
            continue
        new = [lower_cell(args.batch, T, P)] if args.lower_only else run_cell(args.batch, T, P, args, P == largest)
        rows += new
        for r in new:
            print(
                f"{r['form']:5s} {r['impl']:6s} B={r['B']} T={r['T']:5d} P={r['prefix']:5d} "
                + (f"lowered={r['lowered']} {r['lower_s']:.1f}s" if args.lower_only else "")
                + (f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s" if "ms" in r else "")
                + (f" rel={r['rel_err']:.2e} equal={r['equal']}" if "rel_err" in r else "")
                + (f" ERROR {r['error']}" if "error" in r else ""),
                flush=True,
            )
    meta = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        heads=H,
        qk=D,
        v=V,
        batch=args.batch,
        seconds=time.perf_counter() - start,
        skipped_for_time=skipped,
    )
    with open(os.path.join(args.out, "flash_prefill.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {os.path.join(args.out, 'flash_prefill.json')} ({len(rows)} rows, {meta['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
