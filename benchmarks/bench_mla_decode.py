"""Benchmark of the absorbed MLA decode kernel against XLA and the decompressing path.

Usage: ``python -m benchmarks mla_decode [--quick] [--out DIR] [--iters N] [--sweep] [--kv-dtype fp8]
[--cell-list CELLS] [--schedule pieces] [--peers DIR]``

For every cell (B, s_q, seq, H, fixed or ragged lengths):
* kernel: `pallas_kernels.mla_decode` (whole call: main kernel + split combine + any pad/slice),
  also the main kernel alone;
* xla: the absorbed math in plain XLA, bf16 operands with fp32 accumulation (gather, einsum,
  masked softmax, einsum);
* decompressed: what a non-absorbed implementation does every step: up-project the whole latent cache
  to per-head K_nope/V through W_UK/W_UV [H, 128, 512], then attend (may not fit: marked OOM).
The kernel is checked against the XLA path before it is timed. Bytes and FLOPs follow FlashMLA's
formulas (shared/BENCHMARKING.md); ceilings are measured in the same run. mla_decode.csv is rewritten after each
row (mla_decode_meta.json, the header and ceilings, first); a cell whose inputs or kernel fail (out of memory, a
result unlike XLA's) is a row with the error's first line (``error``), and the run ends with exit status 1.

``--kv-dtype fp8``: the pages are fp8 (random latents quantised, `pallas_kernels.quantize_latent_fp8`:
656 bytes a token, so the cache bytes are sum(seq_lens) * 656); the XLA and decompressing paths read the
same pages and dequantise them first.

``--peers DIR`` (a peer bundle outside the repository, `benchmarks.peers`): in the same process, on
each cell's own arrays, also FlashMLA and vLLM's Triton MLA decode, each checked against the XLA
path before it is timed; columns ``fmla_*``, ``triton_*`` and ``ours_over_fmla`` /
``ours_over_triton`` = our µs / theirs, CUPTI kernel sum to CUPTI kernel sum. ``--cell-list`` picks
exact cells (uniform ragged lengths ``lo-hi``), ``--schedule`` the default config's schedule.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import benchmarks as bm
from benchmarks import peers
from benchmarks.mla_decode_report import cell_name, peer_summary, report
from pallas_kernels import BF16_PAGES, FP8_PAGES, MlaDecodeConfig, mla_decode, page_format_of, quantize_latent_fp8
from pallas_kernels.mla_decode import SCHEDULES, mla_decode_schedule, plan

SCALE = 192**-0.5
PAGE = 64

# FlashMLA on an H200 (shared/BENCHMARKING.md; whole call, fixed lengths): (B, s_q, seq, H) -> µs.
FLASHMLA_US = {
    (128, 1, 4096, 64): 171,
    (128, 1, 8192, 64): 319,
    (128, 1, 8192, 16): 316,
    (128, 1, 32768, 16): 1178,
    (128, 1, 32768, 64): 1221,
    (128, 1, 4096, 128): 232,
    (128, 1, 32768, 128): 1968,
    (128, 2, 8192, 128): 920,
    (128, 2, 32768, 128): 3615,
    (1, 1, 4096, 128): 24.4,
    (8, 1, 4096, 128): 38.1,
}


# What continuous batching feeds the kernel: lengths drawn uniformly, s_q 1 and 2, H 64 and 128.
RAGGED_CELLS = [
    (128, 1, 16384, 64, (256, 16384)),
    (128, 1, 16384, 128, (256, 16384)),
    (64, 2, 8192, 128, (256, 8192)),
    (32, 1, 32768, 64, (1, 32768)),
]
# The cells FlashMLA was measured at, plus H=32, ragged lengths and more small batches.
QUICK_CELLS = [
    (128, 1, 4096, 64, False),
    (128, 1, 8192, 64, False),
    (128, 1, 8192, 16, False),
    (128, 1, 32768, 16, False),
    (128, 1, 32768, 64, False),
    (128, 1, 4096, 128, False),
    (128, 1, 32768, 128, False),
    (128, 2, 8192, 128, False),
    (128, 2, 32768, 128, False),
    (1, 1, 4096, 128, False),
    (8, 1, 4096, 128, False),
    (128, 1, 8192, 32, False),
    (128, 1, 8192, 64, True),
    (32, 1, 4096, 64, False),
    (8, 1, 32768, 64, False),
    (1, 1, 32768, 64, False),
    *RAGGED_CELLS,
]


def decode_config(name: str):
    """``--decode-config NAME`` of `mla-bench e2e` / `serve`: None for "" (the kernel's defaults), else the named
    variant; an unknown name is one line naming the known ones."""
    if not name:
        return None
    known = variants()
    if name not in known:
        raise SystemExit(f"unknown --decode-config {name!r}; known: {', '.join(known)}")
    return known[name]


def variants():
    """Named kernel configurations that ``--variants`` can time beside the default (and that `mla-bench e2e` /
    `serve --decode-config NAME` run the engine's decode kernel with)."""
    return {
        # The bodies other than the scorer body (MlaDecodeConfig.scorer, the default on bf16 pages).
        "plain": MlaDecodeConfig(scorer=False, split_qk=False),
        "split_qk": MlaDecodeConfig(scorer=False, split_qk=True),
        "splits2": MlaDecodeConfig(num_splits=2),
        "splits4": MlaDecodeConfig(num_splits=4),
        # each sequence cut into pieces of at most a CTA's share / pieces_per_share pages, launched longest first
        "pieces": MlaDecodeConfig(schedule="pieces"),
        "pieces1": MlaDecodeConfig(schedule="pieces", pieces_per_share=1),
        "pieces4": MlaDecodeConfig(schedule="pieces", pieces_per_share=4),
        # per call, on the device: pieces for ragged lengths, the default for the others
        "auto": MlaDecodeConfig(schedule="auto"),
        # fp8 pages (--kv-dtype fp8) only: the padded shared-buffer body where the transposed one
        # would serve (s_q * H <= 32); the same as the default on bf16 pages.
        "fp8_padded": MlaDecodeConfig(fp8_transposed=False),
    }


def grid(quick: bool):
    """Cells (B, s_q, seq, H, ragged): fixed lengths at B=128, then small batches, then ragged (normal around
    seq, then `RAGGED_CELLS`' uniform draws)."""
    if quick:
        return list(QUICK_CELLS)
    cells = [
        (128, s_q, seq, H, False) for s_q in (1, 2) for seq in (4096, 8192, 16384, 32768) for H in (16, 32, 64, 128)
    ]
    cells += [(B, 1, seq, H, False) for B in (1, 8, 32) for seq in (4096, 32768) for H in (16, 64, 128)]
    cells += [
        (128, s_q, seq, H, True) for s_q in (1, 2) for seq in (4096, 8192, 16384, 32768) for H in (16, 32, 64, 128)
    ]
    return cells + RAGGED_CELLS


def parse_cell_list(spec: str):
    """Cells from ``"B,s_q,seq,H;..."``; seq ``lo-hi`` = lengths uniform in [lo, hi], ``seq~`` = the
    grid's normal ragged lengths around seq. Raises ValueError naming the bad part."""
    cells = []
    for part in spec.split(";"):
        if not part.strip():
            continue
        try:
            B, s_q, seq, H = (x.strip() for x in part.split(","))
            if "-" in seq:
                lo, hi = (int(v) for v in seq.split("-"))
                if not 1 <= lo <= hi:
                    raise ValueError
                cells.append((int(B), int(s_q), hi, int(H), (lo, hi)))
            else:
                cells.append((int(B), int(s_q), int(seq.rstrip("~")), int(H), seq.endswith("~")))
        except ValueError:
            raise ValueError(f"bad cell {part.strip()!r}: want B,s_q,seq,H with seq N, N~ or lo-hi") from None
    if not cells:
        raise ValueError("no cells")
    return cells


def lengths_name(ragged) -> str:
    return f"uniform {ragged[0]}-{ragged[1]}" if isinstance(ragged, tuple) else ("ragged" if ragged else "fixed")


def token_bytes(kv_dtype: str) -> int:
    """Bytes of one cached token in one layer (`pallas_kernels.PageFormat`: 1152 bf16, 656 fp8)."""
    return (FP8_PAGES if kv_dtype == "fp8" else BF16_PAGES).token_bytes


def dense_pages(kv_pages):
    """The pages as bf16 values [N, 64, 576] (fp8 pages dequantised, as the kernel's tensor cores see them)."""
    return page_format_of(kv_pages).dequantize_reference(kv_pages)


def make_cell(B, s_q, seq, H, ragged, seed=0, kv_dtype="bf16", group_pages=False):
    """Random device inputs: lengths, a permuted block table over B*max_pages pages, q, kv (bf16 pages,
    or with kv_dtype "fp8" the same random latents quantised to fp8 pages).

    ``ragged``: False (every length ``seq``), True (normal around ``seq``, sd seq/2, clipped) or
    (lo, hi) (uniform in [lo, hi]). ``group_pages`` (``--peers``): the permutation stays within
    batch groups whose pages span < 2^31 cache elements (`peers.page_groups`; vLLM's Triton kernel
    computes offsets in int32); the same table as without it unless the cache exceeds 4 GiB.
    """
    rng = np.random.default_rng(seed)
    if isinstance(ragged, tuple):
        lens = rng.integers(ragged[0], ragged[1] + 1, B).astype(np.int32)
    elif ragged:
        lens = np.clip(rng.normal(seq, seq / 2, B), max(1, s_q), 2 * seq).astype(np.int32)
    else:
        lens = np.full(B, seq, np.int32)
    max_pages = -(-int(lens.max()) // PAGE)
    num_pages = B * max_pages
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    groups = [(0, B, 0, num_pages)]
    if group_pages:
        groups = peers.page_groups(B, max_pages)
    if len(groups) == 1:
        table = jax.random.permutation(k1, num_pages).astype(jnp.int32).reshape(B, max_pages)
    else:
        table = (
            jnp.concatenate(
                [
                    p0 + jax.random.permutation(jax.random.fold_in(k1, g), p1 - p0)
                    for g, (_, _, p0, p1) in enumerate(groups)
                ]
            )
            .astype(jnp.int32)
            .reshape(B, max_pages)
        )
    kv = jax.random.normal(k2, (num_pages, PAGE, 576), jnp.bfloat16)
    if kv_dtype == "fp8":
        kv = jax.jit(quantize_latent_fp8)(kv)
    q = jax.random.normal(k3, (B, s_q, H, 576), jnp.bfloat16)
    return q, kv, table, jnp.asarray(lens), int(lens.sum())


def xla_absorbed(q, kv_pages, block_table, seq_lens, *, causal):
    """Absorbed decode in plain XLA: bf16 operands, fp32 accumulation and softmax (fp8 pages: the
    gathered pages dequantised first)."""
    B, s_q, H, _ = q.shape
    kv_BSK = dense_pages(kv_pages[block_table]).reshape(B, -1, 576)
    S = kv_BSK.shape[1]
    s_BTHS = jnp.einsum("bthk,bsk->bths", q, kv_BSK, preferred_element_type=jnp.float32) * SCALE
    key = jnp.arange(S)
    lim_BT = seq_lens[:, None] - (s_q - 1 - jnp.arange(s_q))[None] if causal else seq_lens[:, None]
    s_BTHS = jnp.where((key[None, None] < jnp.broadcast_to(lim_BT, (B, s_q))[..., None])[:, :, None], s_BTHS, -jnp.inf)
    m = s_BTHS.max(-1, keepdims=True)
    p = jnp.exp(s_BTHS - m)
    l = p.sum(-1)
    o = (
        jnp.einsum("bths,bsl->bthl", p.astype(jnp.bfloat16), kv_BSK[..., :512], preferred_element_type=jnp.float32)
        / l[..., None]
    )
    return o.astype(q.dtype), m[..., 0] + jnp.log(l)


def decompressed_reference(q_nope, q_pe, kv_pages, block_table, seq_lens, w_uk, w_uv):
    """Non-absorbed decode: per-head K/V up-projected from the whole latent cache every step.

    q_nope [B,T,H,128], q_pe [B,T,H,64], w_uk/w_uv [H,128,512] -> out [B,T,H,128] (pre-o_proj).
    Non-causal (timing baseline only).
    """
    B = q_nope.shape[0]
    kv_BSK = dense_pages(kv_pages[block_table]).reshape(B, -1, 576)
    c_BSL, k_pe_BSR = kv_BSK[..., :512], kv_BSK[..., 512:]
    k_BSHD = jnp.einsum("bsl,hdl->bshd", c_BSL, w_uk)
    v_BSHD = jnp.einsum("bsl,hdl->bshd", c_BSL, w_uv)
    s = (
        jnp.einsum("bthd,bshd->bths", q_nope, k_BSHD, preferred_element_type=jnp.float32)
        + jnp.einsum("bthr,bsr->bths", q_pe, k_pe_BSR, preferred_element_type=jnp.float32)
    ) * SCALE
    key = jnp.arange(s.shape[-1])
    s = jnp.where((key[None] < seq_lens[:, None])[:, None, None], s, -jnp.inf)
    p = jax_softmax(s)
    return jnp.einsum("bths,bshd->bthd", p.astype(jnp.bfloat16), v_BSHD)


def jax_softmax(s):
    return jax.nn.softmax(s, axis=-1)


def run(args):
    bundle = getattr(args, "bundle", None)
    header, ceil = bm.begin_run("mla_decode", args.out, args.iters)
    if bundle is not None:
        header["peers"] = dict(
            bundle.describe(), timing=PEER_TIMING, xla_mem=dict((k, os.environ.get(k)) for k in PEER_XLA_ENV)
        )
    csv_path = os.path.join(args.out, "mla_decode.csv")
    bm.write_json(os.path.join(args.out, "mla_decode_meta.json"), dict(header, ceilings=ceil))
    configs = {"default": MlaDecodeConfig(schedule=args.schedule)}
    if args.sweep:
        configs["split_qk"] = MlaDecodeConfig(scorer=False, split_qk=True)
        for n in (4, 16, 64):
            for split_qk in (False, True):
                configs[f"splits{n}{'_sqk' if split_qk else ''}"] = MlaDecodeConfig(
                    num_splits=n, scorer=False if split_qk else None, split_qk=split_qk
                )
    if args.variants:
        known = variants()
        for name in args.variants.split(","):
            if name not in known:
                raise SystemExit(f"unknown variant {name!r}; known: {', '.join(known)}")
            configs[name] = known[name]
    rows = []
    cells = list(args.cell_specs) if args.cell_specs else grid(args.quick)
    if args.skip_quick:
        cells = [c for c in cells if c not in QUICK_CELLS]
    if args.only_flashmla:
        cells = [c for c in cells if c[:4] in FLASHMLA_US and not c[4]]
        cells += [(128, 1, 8192, 64, True), (128, 2, 8192, 128, True), *RAGGED_CELLS]
    if args.cells:
        cells = cells[: args.cells]
    xla_jit = jax.jit(xla_absorbed, static_argnames="causal")
    decompressed_jit = jax.jit(decompressed_reference)
    baselines = {}
    peer_cols = {}  # cell -> the peers' columns (measured once, attached to every row of the cell)
    rows_of = {}  # cell -> its rows
    pending = []  # cells whose FlashMLA waited for its build: measured once it is over
    # Pass 1 times the default config (and the baselines) over every cell; pass 2 the sweep
    # variants. A variant that fails or hangs then cannot cost the default's results.
    passes = [{"default": configs["default"]}]
    if len(configs) > 1:
        passes.append({k: v for k, v in configs.items() if k != "default"})
    work = [(i, cfgs, cell) for i, cfgs in enumerate(passes) for cell in cells]
    if args.then_grid:
        # Then the rest of the full grid with the default config (no decompressed path: time).
        work += [(len(passes), passes[0], cell) for cell in grid(False) if cell not in cells]
    for pass_idx, cfgs, (B, s_q, seq, H, ragged) in bm.progress(work, desc="mla_decode cells"):
        causal = s_q > 1
        key = (B, s_q, seq, H, ragged)
        try:
            q, kv, table, lens, total = make_cell(
                B, s_q, seq, H, ragged, kv_dtype=args.kv_dtype, group_pages=bundle is not None
            )
        except Exception as e:  # noqa: BLE001 - one cell's inputs out of memory must not end the run
            row = dict(B=B, s_q=s_q, seq=seq, H=H, lengths=lengths_name(ragged), config=",".join(cfgs))
            rows.append(bm.record_failure(row, f"the inputs of B={B} s_q={s_q} seq={seq} H={H}", e))
            bm.write_csv(csv_path, rows)
            continue
        nbytes = total * token_bytes(args.kv_dtype) + (B * s_q * H * 576 + B * s_q * H * 512) * 2
        flops = s_q * total * H * (576 + 512) * 2
        ref_out = ref_lse = None
        base = dict(
            B=B,
            s_q=s_q,
            seq=seq,
            H=H,
            lengths=lengths_name(ragged),
            causal=causal,
            gbytes=nbytes / 1e9,
            gflop=flops / 1e9,
        )
        if args.kv_dtype != "bf16":
            base["kv_dtype"] = args.kv_dtype
        try:
            ref_out, ref_lse = xla_jit(q, kv, table, lens, causal=causal)
        except Exception as e:  # noqa: BLE001 - an XLA OOM must not end the run
            bm.log(f"  xla failed at {base}: {type(e).__name__}: {str(e)[:120]}")
        if key not in baselines:
            xla_us = None
            if ref_out is not None:
                xla_us = bm.cupti_median_us(
                    lambda *a: xla_jit(*a, causal=causal), q, kv, table, lens, iterations=args.iters
                )
            decompressed_us, decompressed_note = None, ""
            decompressed_gb = B * table.shape[1] * PAGE * H * 256 * 2 / 1e9
            if args.decompressed and decompressed_gb < 60 and pass_idx < len(passes):
                k = jax.random.split(jax.random.key(7), 4)
                q_nope = jax.random.normal(k[0], (B, s_q, H, 128), jnp.bfloat16)
                q_pe = jax.random.normal(k[1], (B, s_q, H, 64), jnp.bfloat16)
                w_uk = jax.random.normal(k[2], (H, 128, 512), jnp.bfloat16) * 0.05
                w_uv = jax.random.normal(k[3], (H, 128, 512), jnp.bfloat16) * 0.05
                try:
                    decompressed_us = bm.cupti_median_us(
                        decompressed_jit, q_nope, q_pe, kv, table, lens, w_uk, w_uv, iterations=args.iters
                    )
                except Exception as e:  # noqa: BLE001
                    decompressed_note = f"failed: {type(e).__name__}"
                del q_nope, q_pe, w_uk, w_uv
            elif args.decompressed and pass_idx < len(passes):
                decompressed_note = f"OOM (K/V {decompressed_gb:.0f} GB)"
            baselines[key] = dict(xla_us=xla_us, decompressed_us=decompressed_us, decompressed_note=decompressed_note)
        bl = baselines[key]
        cell_rows = []
        for cname, cfg in cfgs.items():
            p = plan(B, s_q, H, table.shape[1], cfg)
            if (
                cname.startswith("splits")
                and args.sweep
                and (B * p.row_blocks >= 100 or cfg.num_splits > table.shape[1])
            ):
                continue  # the sweep's split counts only matter where the default leaves SMs idle
            # A device plan (pieces, auto) is built once a step and read by every layer's call, as
            # FlashMLA's metadata is: built here outside the timed call, its own time in plan_us.
            plan_fn = jax.jit(functools.partial(mla_decode_schedule, heads=H, query_len=s_q, config=cfg))
            fn = jax.jit(
                lambda *a, sched, cfg=cfg: mla_decode(
                    *a, softmax_scale=SCALE, causal=causal, config=cfg, impl="kernel", schedule=sched
                )
            )
            row = dict(base, config=cname, schedule=cfg.schedule, splits=p.num_splits, row_blocks=p.row_blocks)
            try:
                sched = plan_fn(lens)
                fn = functools.partial(fn, sched=sched)
                if sched is not None:
                    row["plan_us"] = bm.cupti_median_us(plan_fn, lens, iterations=args.iters)
                out, lse = fn(q, kv, table, lens)
                # A cell is timed only after its output was checked against the XLA path.
                if ref_out is None:
                    raise RuntimeError("not timed: the XLA reference failed, nothing to check against")
                o, r = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
                row["rel_err"] = float(np.linalg.norm(o - r) / np.linalg.norm(r))
                row["lse_err"] = float(np.abs(np.asarray(lse) - np.asarray(ref_lse)).max())
                if not row["rel_err"] < 1e-2:
                    raise RuntimeError(f"not timed: WRONG (rel_err {row['rel_err']:.3g})")
                whole, parts = bm.cupti_median_us(fn, q, kv, table, lens, iterations=args.iters, per_kernel=True)
                main = max(parts.values()) if parts else None  # None: a conditional's kernels (auto)
                row.update(us=whole, main_us=main, gbps=nbytes / whole / 1e3, tflops=flops / whole / 1e6)
                row["bw_frac"] = row["gbps"] / ceil["bandwidth_gbps"]
                row["flop_frac"] = row["tflops"] / ceil["matmul_tflops"]
            except Exception as e:  # noqa: BLE001
                bm.record_failure(row, f"the kernel at B={B} s_q={s_q} seq={seq} H={H} {cname}", e)
            row.update(bl)
            if bl["xla_us"] and row.get("us"):
                row["x_vs_xla"] = bl["xla_us"] / row["us"]
            if bl["decompressed_us"] and row.get("us"):
                row["x_vs_decompressed"] = bl["decompressed_us"] / row["us"]
            fm = FLASHMLA_US.get((B, s_q, seq, H)) if not ragged else None
            if fm and row.get("us"):
                row["flashmla_us"] = fm
                row["vs_flashmla"] = fm / row["us"]  # > 1: faster than FlashMLA
            rows.append(row)
            cell_rows.append(row)
            bm.log(
                "  "
                + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items()
                    if k not in ("gbytes", "gflop", "causal")
                )
            )
            bm.write_csv(csv_path, rows)  # partial results survive a kill
        if bundle is not None and cell_rows:
            # After our own timing (a peer's CUDA error cannot cost our row), on the same arrays.
            rows_of.setdefault(key, []).extend(cell_rows)
            if key not in peer_cols:
                ref_np = None if ref_out is None else np.asarray(ref_out, np.float32)
                peer_cols[key] = bundle.measure(q, kv, table, lens, causal=causal, scale=SCALE, ref=ref_np, wait=False)
                del ref_np
                if any(v == "pending" for k, v in peer_cols[key].items() if k.endswith("_status")):
                    pending.append(key)
            for row in cell_rows:
                attach_peers(row, peer_cols[key], bundle)
            bm.log("  peers: " + peer_summary(cell_rows[0], bundle))
            bm.write_csv(csv_path, rows)
        del q, kv, table, lens, ref_out, ref_lse
        if pending and bundle.ready():
            late_peers(pending, peer_cols, rows_of, bundle, xla_jit)
            bm.write_csv(csv_path, rows)
    if pending:
        bm.log(f"# peers: {len(pending)} cell(s) waited for the FlashMLA build; measuring them now")
        late_peers(pending, peer_cols, rows_of, bundle, xla_jit)
    report(rows, ceil, header, args.out)
    bm.exit_if_failed("mla_decode", rows, csv_path, name=cell_name)
    return rows


# What each timing column is (``--peers``): written into the meta JSON and under the table.
PEER_TIMING = {
    "us": "ours: CUPTI kernel-time sum of one jitted call, median of --iters calls (benchmarks.cupti_median_us); a "
    "device plan (pieces, auto schedules) built before, outside timing, as FlashMLA's metadata",
    "plan_us": "ours: the device plan's own CUPTI time (mla_decode_schedule; once a step for every layer)",
    "<peer>_us": "the peer: the same CUPTI kernel-time sum of one call, median of --iters calls, same "
    "arguments every call, L2 not flushed (benchmarks.cupti_call_us); <peer>_method says so, "
    "or names the fallback (CUDA events) where CUPTI failed",
    "<peer>_event_us": "the peer: CUDA events around back-to-back calls, per call, median of 5 loops "
    "(host launch gaps included)",
    "ours_over_<peer>": "us / <peer>_us (< 1: ours faster)",
    "fmla": "FlashMLA, scheduler metadata built by the (checked) first call, outside timing",
    "triton": "vLLM Triton decode_attention_fwd, the num_kv_splits of --triton-splits with the least kernel "
    "time among the correct ones (<peer>_variant; all of them in <peer>_note)",
}
PEER_XLA_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def attach_peers(row, cols, bundle):
    """Copies one cell's peer columns into ``row`` (replacing any earlier ones) and adds
    ``ours_over_<key>`` = row["us"] / <key>_us."""
    for k in [k for k in row if any(k.startswith(f"{p.key}_") or k == f"ours_over_{p.key}" for p in bundle.peers)]:
        del row[k]
    row["us_method"] = f"cupti_kernel_sum (median of {bundle.iterations} calls)"
    row.update(cols)
    for p in bundle.peers:
        theirs = cols.get(f"{p.key}_us")
        if theirs and row.get("us"):
            row[f"ours_over_{p.key}"] = row["us"] / theirs


def late_peers(pending, peer_cols, rows_of, bundle, xla_jit):
    """Measures the peers left "pending" (a build still running) of the cells in ``pending``, on the same
    inputs regenerated (`make_cell` is deterministic), and attaches them to those cells' rows."""
    while pending:
        key = pending.pop(0)
        B, s_q, seq, H, ragged = key
        late = [p.key for p in bundle.peers if peer_cols[key].get(f"{p.key}_status") == "pending"]
        for k in [k for k in peer_cols[key] if any(k.startswith(f"{p}_") for p in late)]:
            del peer_cols[key][k]
        q, kv, table, lens, _ = make_cell(B, s_q, seq, H, ragged, group_pages=True)
        try:
            ref = np.asarray(xla_jit(q, kv, table, lens, causal=s_q > 1)[0], np.float32)
        except Exception as e:  # noqa: BLE001
            bm.log(f"  xla failed at {key}: {type(e).__name__}")
            ref = None
        peer_cols[key].update(bundle.measure(q, kv, table, lens, causal=s_q > 1, scale=SCALE, ref=ref, only=late))
        for row in rows_of.get(key, []):
            attach_peers(row, peer_cols[key], bundle)
        bm.log(
            f"  peers (late) at B={B} s_q={s_q} seq={seq} H={H} {lengths_name(ragged)}: "
            + peer_summary(rows_of[key][0], bundle)
        )
        del q, kv, table, lens, ref


def main(argv=None):
    p = bm.OneLineParser(
        prog="python -m benchmarks mla_decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a reduced grid")
    p.add_argument("--out", default="runs/bench_mla_decode", help="directory for CSV/PNG/JSON")
    p.add_argument("--iters", type=int, default=30, help="CUPTI iterations per timing (median)")
    p.add_argument(
        "--sweep", action="store_true", help="also time the split_qk variant everywhere and split counts at small batch"
    )
    p.add_argument(
        "--variants",
        default="",
        help="comma-separated named configs to time beside the default: " + ", ".join(variants()),
    )
    p.add_argument(
        "--only-flashmla", action="store_true", help="only the cells FlashMLA was measured at (plus two ragged ones)"
    )
    p.add_argument(
        "--no-decompressed", "--no-naive", dest="decompressed", action="store_false", help="skip the decompressed path"
    )
    p.add_argument("--cells", type=int, default=0, help="only the first N cells (0 = all)")
    p.add_argument("--skip-quick", action="store_true", help="leave out the --quick cells")
    p.add_argument(
        "--then-grid",
        action="store_true",
        help="after the chosen cells, the rest of the full grid (default config only)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=("bf16", "fp8"),
        default="bf16",
        help="page format of the cache: bf16 pages or fp8 ones (656 bytes a token) (default: bf16)",
    )
    p.add_argument(
        "--cell-list",
        default="",
        help="exactly these cells: 'B,s_q,seq,H;...' (seq 'lo-hi': lengths uniform in [lo, hi]; "
        "'N~': normal around N, the grid's ragged lengths); replaces --quick and the grid",
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="per_sequence",
        help="MlaDecodeConfig.schedule of the default config (default: per_sequence)",
    )
    p.add_argument(
        "--peers",
        metavar="DIR",
        help="also time FlashMLA (DIR/flashmla, built in place if needed) and vLLM's Triton MLA decode "
        "(DIR/vllm_triton_mla.py) on every cell's arrays, in this process (needs torch): "
        "columns fmla_*, triton_*, ours_over_* (see benchmarks/peers.py)",
    )
    p.add_argument(
        "--triton-splits",
        default="4,8,16,32",
        help="with --peers: num_kv_splits tried for vLLM's Triton kernel (the correct one with the least "
        "kernel time is kept)",
    )
    p.add_argument(
        "--peer-build-timeout",
        type=float,
        default=480.0,
        help="with --peers: seconds to wait for FlashMLA's in-place build (default 480)",
    )
    p.add_argument("--from-csv", help="no GPU: re-report a CSV from an earlier run (table + plot)")
    p.add_argument("--bandwidth-gbps", type=float, help="with --from-csv: the measured copy ceiling")
    p.add_argument("--matmul-tflops", type=float, help="with --from-csv: the measured matmul ceiling")
    p.add_argument("--device", default="NVIDIA H200", help="with --from-csv: the GPU it ran on")
    args = p.parse_args(argv)
    args.cell_specs = None
    if args.cell_list:
        try:
            args.cell_specs = parse_cell_list(args.cell_list)
        except ValueError as e:
            p.error(f"--cell-list: {e}")
    if args.peers:
        if args.from_csv:
            p.error("--peers times the peers now, on a GPU: not with --from-csv")
        if args.kv_dtype != "bf16":
            p.error("--peers: the peers read bf16 pages only (leave --kv-dtype at bf16)")
        try:
            args.triton_split_list = tuple(int(x) for x in args.triton_splits.split(",") if x.strip())
        except ValueError:
            args.triton_split_list = ()
        if not args.triton_split_list or min(args.triton_split_list) < 1:
            p.error(f"--triton-splits {args.triton_splits!r}: want positive integers, comma-separated")
        why = peers.check_bundle_dir(args.peers)
        if why:
            p.error(why)
        # JAX and torch share the GPU in this process: JAX allocates as it goes (no 75 % block at start),
        # up to the fraction, and torch takes what it needs from the rest. Set before JAX starts its
        # backend; a value already in the environment wins.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    if args.from_csv:
        if not (args.bandwidth_gbps and args.matmul_tflops):
            p.error("--from-csv needs --bandwidth-gbps and --matmul-tflops")
        rows = bm.read_csv(args.from_csv)
        ceil = dict(bandwidth_gbps=args.bandwidth_gbps, matmul_tflops=args.matmul_tflops)
        for r in rows:
            if isinstance(r.get("us"), float):
                r["bw_frac"] = r["gbps"] / ceil["bandwidth_gbps"]
                r["flop_frac"] = r["tflops"] / ceil["matmul_tflops"]
        os.makedirs(args.out, exist_ok=True)
        report(rows, ceil, dict(device=args.device, jax=jax.__version__, source=args.from_csv), args.out)
        return rows
    bm.require_gpu("mla_decode")
    if args.iters < 30:
        print(f"# note: --iters {args.iters} < 30")
    args.bundle = None
    if args.peers:
        # torch is imported only now, after JAX's backend is up: JAX loads its own CUDA libraries first,
        # and a peer whose stack does not load on top of them is reported, not the other way round.
        print("# peers: " + ", ".join(f"{k}={os.environ.get(k)}" for k in PEER_XLA_ENV), flush=True)
        args.bundle = peers.open_bundle(
            args.peers,
            args.out,
            splits=args.triton_split_list,
            build_timeout_s=args.peer_build_timeout,
            iterations=args.iters,
        )
    try:
        return run(args)
    finally:
        if args.bundle is not None:
            args.bundle.close()


if __name__ == "__main__":
    main()
