"""Held-out evaluation and a run's record of it: `metrics.jsonl` (one row per step or evaluation) and the
loss curve (`loss.png`)."""

from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np


def evaluate(eval_step, graphdef, state, windows: np.ndarray, batch_size: int, place=None) -> dict[str, float]:
    """Token-weighted mean CE and MTP loss over the held-out windows (every window has T tokens);
    `place(ids)` puts each chunk where the step wants it (default: `jnp.asarray`)."""

    place = jnp.asarray if place is None else place
    ce = mtp = 0.0
    n = 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        m = eval_step(graphdef, state, place(chunk))
        ce += float(m["ce"]) * len(chunk)
        mtp += float(m["mtp_loss"]) * len(chunk)
        n += len(chunk)
    return {"eval_ce": ce / n, "eval_mtp_loss": mtp / n}


def load_balance(expert_load_NE) -> float:
    """max/mean expert load of the worst MoE layer (1.0 = perfectly balanced)."""
    load = np.asarray(expert_load_NE, np.float64)
    if load.size == 0:
        return 1.0
    return float(np.max(load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-9)))


class MetricsLog:
    """`metrics.jsonl`: one JSON row per training step ({"step", "loss", "ce", ...}) or evaluation
    ({"step", "eval_ce", ...}); `rows` holds what the file holds. A value that was not measured (the first step's
    tokens_per_s, which includes compiling; an MTP CE without MTP loss) is NaN in `rows` and null in the file:
    strict JSON, which every parser reads."""

    def __init__(self, path: str, upto_step: int | None = None, write: bool = True):
        """Keep the rows of an existing file up to `upto_step` (what a resumed run continues; None = none).
        `write=False`: rows in memory only (the processes of a run other than the first)."""
        self.path, self.write = path, write
        self.rows: list[dict] = []
        if upto_step is not None and os.path.isfile(path):
            with open(path) as f:
                rows = (_from_json(json.loads(line)) for line in f if line.strip())
                self.rows = [r for r in rows if r["step"] <= upto_step]
        if write:
            with open(path, "w") as f:
                f.writelines(_to_json(r) + "\n" for r in self.rows)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if not self.write:
            return
        with open(self.path, "a") as f:
            f.write(_to_json(row) + "\n")


def _to_json(row: dict) -> str:
    """A row as one line of strict JSON: NaN and infinities (no JSON number) as null."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()})


def _from_json(row: dict) -> dict:
    """A row read back: null as NaN, as it was before it was written (also the bare NaN earlier files hold)."""
    return {k: float("nan") if v is None else v for k, v in row.items()}


def plot_losses(rows: list[dict], path: str) -> None:
    """The loss curve (train and held-out CE, main and MTP head, log scale) as a PNG."""
    # here, not at import: 0.8 s of every tool's start-up (`mla-generate` never plots)
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    train = [r for r in rows if "ce" in r]
    ev = [r for r in rows if "eval_ce" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot([r["step"] for r in train], [r["ce"] for r in train], lw=0.8, alpha=0.8, label="train CE")
        ax.plot(
            [r["step"] for r in train],
            [r["mtp_ce"] for r in train],
            lw=0.8,
            alpha=0.6,
            label="train MTP CE (token i+2)",
        )
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_ce"] for r in ev], "o-", label="held-out CE")
        ax.plot([r["step"] for r in ev], [r["eval_mtp_ce"] for r in ev], "s--", label="held-out MTP CE")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("mla-train")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
