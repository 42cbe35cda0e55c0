"""`mla-bench mla_decode`'s report: a cell's name and its peers' summary in the run's log lines, the table of the
run's rows (a peer that was not timed shows its status), the CSV and meta JSON rewritten whole, and the roofline
plot (measured ceilings, our kernel, XLA, the decompressing path, FlashMLA's published and measured figures,
vLLM's Triton kernel)."""

from __future__ import annotations

import os

import matplotlib

import benchmarks as bm

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def cell_name(row: dict) -> str:
    return f"B={row['B']} s_q={row['s_q']} seq={row['seq']} H={row['H']} {row['lengths']} {row.get('config', '')}"


def peer_summary(row, bundle) -> str:
    parts = []
    for p in bundle.peers:
        k = p.key
        if row.get(f"{k}_us"):
            parts.append(
                f"{p.label} {row[f'{k}_us']:.1f} µs ({row.get(f'{k}_variant', '')}, events "
                f"{row.get(f'{k}_event_us', float('nan')):.1f} µs)"
            )
        else:
            parts.append(f"{p.label} {row.get(f'{k}_status', '?')}: {row.get(f'{k}_note', '')}")
    return "; ".join(parts)


def peer_display(rows):
    """Rows for printing: a peer that was not timed shows its status in its µs column."""
    out = []
    for r in rows:
        d = dict(r)
        for k in ("fmla", "triton"):
            if d.get(f"{k}_us") in (None, "") and d.get(f"{k}_status") not in (None, ""):
                d[f"{k}_us"] = {"disagrees": "WRONG", "unavailable": "n/a"}.get(d[f"{k}_status"], d[f"{k}_status"])
        out.append(d)
    return out


def report(rows, ceil, header, out_dir):
    """Prints the table and writes CSV, JSON metadata and the roofline plot under ``out_dir``."""
    columns = [
        ("B", "B", "{}"),
        ("s_q", "s_q", "{}"),
        ("seq", "seq", "{}"),
        ("H", "H", "{}"),
        ("lengths", "len", "{}"),
        ("config", "cfg", "{}"),
        ("splits", "spl", "{}"),
        ("us", "kernel µs", "{:.1f}"),
        ("main_us", "main µs", "{:.1f}"),
        ("plan_us", "plan µs", "{:.1f}"),
        ("gbps", "GB/s", "{:.0f}"),
        ("tflops", "TFLOP/s", "{:.0f}"),
        ("bw_frac", "%BW", "{:.0%}"),
        ("flop_frac", "%MMA", "{:.0%}"),
        ("xla_us", "XLA µs", "{:.0f}"),
        ("x_vs_xla", "xXLA", "{:.1f}"),
        ("decompressed_us", "decompressed µs", "{:.0f}"),
        ("flashmla_us", "FlashMLA µs", "{}"),
        ("vs_flashmla", "FM/ours", "{:.2f}"),
        ("rel_err", "rel err", "{:.1e}"),
        ("note", "note", "{}"),
        ("error", "error", "{}"),
    ]
    with_peers = any(r.get("fmla_status") or r.get("triton_status") for r in rows)
    if with_peers:
        at = [k for k, _, _ in columns].index("note")
        columns[at:at] = [
            ("schedule", "schedule", "{}"),
            ("fmla_us", "FlashMLA µs", "{:.1f}"),
            ("ours_over_fmla", "ours/FM", "{:.2f}"),
            ("triton_us", "Triton µs", "{:.1f}"),
            ("ours_over_triton", "ours/Tr", "{:.2f}"),
        ]
        columns = [(k, {"flashmla_us": "FM pub. µs", "vs_flashmla": "FMpub/ours"}.get(k, h), f) for k, h, f in columns]
    print()
    bm.print_table(peer_display(rows) if with_peers else rows, columns)
    if with_peers:
        print(
            "# FlashMLA µs, Triton µs: measured now, in this process, on the same arrays; ours/FM and ours/Tr ="
            " our µs / theirs (< 1: ours faster), CUPTI kernel sum to CUPTI kernel sum (the CSV's *_method"
            " says where not); FM pub. µs: the published figure (FLASHMLA_US). WRONG = disagrees with the"
            " reference, not timed; n/a = the peer did not load:"
        )
        for k in ("fmla", "triton"):
            notes = sorted({str(r.get(f"{k}_note")) for r in rows if r.get(f"{k}_status") not in (None, "", "ok")})
            for n in notes[:4]:
                print(f"#   {k}: {n}")
    bm.write_csv(os.path.join(out_dir, "mla_decode.csv"), rows)
    bm.write_json(os.path.join(out_dir, "mla_decode_meta.json"), dict(header, ceilings=ceil))
    plot_roofline(rows, ceil, os.path.join(out_dir, "mla_decode_roofline.png"), header)


def plot_roofline(rows, ceil, path, header):
    bw, peak = ceil["bandwidth_gbps"], ceil["matmul_tflops"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [10 ** (i / 20) for i in range(0, 81)]
    ax.plot(
        xs,
        [min(bw * x / 1e3, peak) for x in xs],
        "k-",
        lw=1,
        label=f"roof: {bw:.0f} GB/s, {peak:.0f} TFLOP/s (measured)",
    )
    for key, label, marker in (
        ("us", "Mosaic GPU kernel", "o"),
        ("xla_us", "XLA absorbed", "s"),
        ("decompressed_us", "decompressed", "x"),
    ):
        pts = [
            (r["gflop"] / r["gbytes"], r["gflop"] / r[key] * 1e3)
            for r in rows
            if r.get(key) and r.get("config") == "default"
        ]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=label, alpha=0.7)
    fm = [
        (r["gflop"] / r["gbytes"], r["gflop"] / r["flashmla_us"] * 1e3)
        for r in rows
        if r.get("flashmla_us") and r.get("config") == "default"
    ]
    if fm:
        ax.scatter(*zip(*fm), marker="*", s=90, label="FlashMLA (H200, published run)")
    for key, label, marker in (
        ("fmla_us", "FlashMLA (measured in this run)", "P"),
        ("triton_us", "vLLM Triton (measured in this run)", "v"),
    ):
        pts = [
            (r["gflop"] / r["gbytes"], r["gflop"] / r[key] * 1e3)
            for r in rows
            if isinstance(r.get(key), (int, float)) and r.get(key) and r.get("config") == "default"
        ]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, s=60, label=label, alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Absorbed MLA decode, {header['device']}, jax {header['jax']}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"# wrote {path}")
