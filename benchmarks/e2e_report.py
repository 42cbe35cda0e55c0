"""`mla-bench e2e`'s report: the one-line summary of a row as it finishes, the table of e2e.csv under the run's
header (device, command, ceilings; from e2e_meta.json) and e2e.png (decode step against its floor, prefill
throughput)."""

from __future__ import annotations

import os

import matplotlib

import benchmarks as bm
from benchmarks.e2e_cells import read_meta

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def summary(row: dict) -> str:
    keys = (
        "model",
        "impl",
        "B",
        "prompt",
        "mtp",
        "cold_compile_s",
        "ttft_s",
        "prefill_tok_s",
        "prefill_mfu",
        "decode_ms_step",
        "decode_tok_s",
        "floor_ms",
        "x_floor",
        "agree_one_device",
        "note",
        "error",
    )
    return ", ".join(
        f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row[k]}"
        for k in keys
        if row.get(k) not in (None, "")
    )


TABLE = [
    ("model", "model", "{}"),
    ("impl", "impl", "{}"),
    ("B", "B", "{}"),
    ("prompt", "prompt", "{}"),
    ("lengths", "lengths", "{}"),
    ("mtp", "mtp", "{}"),
    ("cold_compile_s", "cold compile s", "{:.1f}"),
    ("ttft_s", "warm TTFT s", "{:.3f}"),
    ("prefill_tok_s", "prefill tok/s", "{:.0f}"),
    ("prefill_mfu", "prefill MFU", "{:.1%}"),
    ("decode_ms_step", "decode ms/step", "{:.2f}"),
    ("decode_tok_s", "decode tok/s", "{:.0f}"),
    ("floor_ms", "floor ms", "{:.2f}"),
    ("x_floor", "x floor", "{:.2f}"),
    ("agree_one_device", "agree 1 dev", "{:.0%}"),
    ("note", "note", "{}"),
    ("error", "error", "{}"),
]


def report(csv_path: str, out_dir: str) -> list[dict]:
    """Prints the header (from the e2e_meta.json beside the CSV) and the table of the CSV; draws out_dir/e2e.png."""
    rows = bm.read_csv(csv_path) if os.path.exists(csv_path) else []
    meta = read_meta(os.path.dirname(os.path.abspath(csv_path)))
    ceil = meta.get("ceilings") or {}
    print()
    print(f"# e2e on {meta.get('device', '?')}, jax {meta.get('jax', '?')}, {meta.get('date', '?')}")
    print(f"# command: {meta.get('command', '?')}")
    if meta.get("compile_cache"):
        print(f"# persistent compilation cache on ({meta['compile_cache']}): cold compiles may be cache loads")
    if ceil:
        print(
            f"# ceilings: copy {ceil.get('bandwidth_gbps', float('nan')):.0f} GB/s, bf16 matmul "
            f"{bm.figure(ceil.get('matmul_tflops', float('nan')))} TFLOP/s"
            + (f" ({ceil['method']})" if "method" in ceil else "")
        )
    clip = lambda v: v if not isinstance(v, str) or len(v) <= 70 else v[:67] + "..."  # noqa: E731
    bm.print_table([{k: clip(v) for k, v in r.items()} for r in rows], TABLE)
    if rows:
        os.makedirs(out_dir, exist_ok=True)
        plot(rows, os.path.join(out_dir, "e2e.png"), meta)
    return rows


def plot(rows, path, meta):
    fig, (ax_d, ax_p) = plt.subplots(1, 2, figsize=(13, 5))
    num = lambda r, k: isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)  # noqa: E731
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"ours": ("-", "o"), "hf": ("--", "s")}
    for i, (model, prompt) in enumerate(sorted({(r["model"], r["prompt"]) for r in rows})):
        c = colors[i % len(colors)]
        series = {(r["impl"], r.get("mtp") or "off") for r in rows if (r["model"], r["prompt"]) == (model, prompt)}
        for impl, mtp in sorted(series):
            pts = sorted(
                (
                    r
                    for r in rows
                    if (r["model"], r["prompt"], r["impl"], r.get("mtp") or "off") == (model, prompt, impl, mtp)
                ),
                key=lambda r: r["B"],
            )
            style, marker = styles.get(impl, ("-.", "^"))
            label = f"{model} T={prompt} {impl}" + (" MTP" if mtp == "on" else "")
            if mtp == "on":
                style, marker = "-.", "^"
            for ax, key in ((ax_d, "decode_ms_step"), (ax_p, "prefill_tok_s")):
                xy = [(r["B"], r[key]) for r in pts if num(r, key)]
                if xy:
                    ax.plot(*zip(*xy), style, marker=marker, color=c, label=label)
            if impl == "ours" and mtp == "off":
                xy = [(r["B"], r["floor_ms"]) for r in pts if num(r, "floor_ms")]
                if xy:
                    ax_d.plot(*zip(*xy), ":", color=c, label=f"{model} T={prompt} floor")
    for ax, ylabel, title in (
        (ax_d, "decode ms / step", "Decode step vs its weight+KV read floor"),
        (ax_p, "prefill tokens / s", "Prefill throughput"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"End to end, random weights, greedy, {meta.get('device', '?')}, jax {meta.get('jax', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# wrote {path}")
