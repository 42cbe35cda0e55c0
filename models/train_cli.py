"""`mla-train`: train a small DeepSeek-style model (MLA + MoE + MTP) on a text corpus, on CPU or GPU.

    mla-train --out runs/tiny                        # the built-in model's recipe: shipped corpus, tiny config
    mla-train --out runs/tiny --resume               # continue an interrupted run, bit for bit
    mla-train --out runs/small --steps 200 --seq-len 128 --dtype bf16 --export runs/small-hf

What one step is: `models.training.make_train_step` (CE + λ·MTP + α·sequence-wise balance loss,
AdamW on the Params, then the aux-loss-free router-bias update outside the gradient). This file
adds the data, the schedule, evaluation, logging, checkpoints and export around it.

Data: the corpus is split into paragraphs (blank-line separated); the last `HELDOUT_FRACTION`
of them are held out. Each paragraph becomes [bos] + UTF-8 bytes + [eos] (`ByteTokenizer`), and
the paragraphs of each split are concatenated into one token stream. A training batch is B
windows of T tokens at offsets drawn from `numpy.random.default_rng([seed, step])`: the data
order is a pure function of (seed, step), so the step number *is* the data-order RNG state and
resuming at step s draws exactly the batches an uninterrupted run would have drawn.
Evaluation: consecutive non-overlapping T-token windows of the held-out stream (fixed).

Checkpoints (orbax `CheckpointManager`, `<out>/checkpoints/<step>`): every variable of the
model (Params and router biases), the optax state (moments and the schedule's step count) and
a JSON record of the step, the data-order seed and the arguments that shape the trajectory.
`--resume` refuses to continue with different arguments or a different corpus.

Errors in arguments or inputs: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

from models.data import CORPUS_PATH

HELDOUT_FRACTION = 0.05
PRESETS = ("tiny", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3")
_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CORPUS = CORPUS_PATH  # shipped inside the package (models/data), so an installed wheel finds it
# Arguments that change the training trajectory: a resumed run must use the same ones.
_TRAJECTORY_ARGS = ("config", "steps", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup", "weight_decay",
                    "clip", "seed", "dtype", "mtp_weight", "balance_alpha", "bias_update_rate", "moe_impl")


class UsageError(Exception):
    """A bad argument or input: reported as one line on stderr, exit status 2."""


# ------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------
class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # show real defaults only, not None / False
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mla-train", description="Train a small DeepSeek-style model (MLA + MoE + MTP) on a corpus. "
                "The defaults are the recipe of the built-in model (models/builtin).",
                formatter_class=_Formatter)
    a = p.add_argument
    a("--out", default=os.path.join("runs", "mla-train"), help="run directory: checkpoints, metrics.jsonl, loss.png")
    a("--corpus", default=None, help="UTF-8 text file, paragraphs separated by blank lines "
      "(default: the shipped models/data/corpus.txt)")
    a("--config", default="tiny", help=f"preset ({', '.join(PRESETS)}) or a config.json path")
    a("--steps", type=int, default=800, help="total optimizer steps")
    a("--batch-size", type=int, default=8, help="sequences per step")
    a("--seq-len", type=int, default=256, help="tokens per training window")
    a("--lr", type=float, default=4e-3, help="peak learning rate")
    a("--min-lr-ratio", type=float, default=0.1, help="final lr of the cosine decay, relative to --lr")
    a("--warmup", type=int, default=60, help="linear warmup steps")
    a("--weight-decay", type=float, default=0.1, help="AdamW decay on matrices (not norms, biases)")
    a("--clip", type=float, default=1.0, help="global gradient-norm clip (0 = off)")
    a("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype; parameters stay fp32")
    a("--mtp-weight", type=float, default=0.3, help="λ of the MTP loss")
    a("--balance-alpha", type=float, default=1e-4, help="α of the sequence-wise balance loss")
    a("--bias-update-rate", type=float, default=1e-2,
      help="γ of the aux-loss-free router-bias update (V3 uses 1e-3 over ~10^5 steps; a run of a few hundred "
      "steps needs a larger one to balance the experts in time)")
    a("--moe-impl", default="auto", choices=("auto", "ragged_dot", "mgpu", "dense"),
      help="expert computation; auto = dense on CPU (faster for a few small experts), else models.moe's auto")
    a("--eval-every", type=int, default=100, help="held-out evaluation period in steps (0 = only at the end)")
    a("--eval-windows", type=int, default=64, help="held-out windows per evaluation (at most what the split holds)")
    a("--save-every", type=int, default=200, help="checkpoint period in steps (0 = only at the end)")
    a("--stop-at", type=int, default=None, help="stop (with a checkpoint) after this step, as if interrupted")
    a("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    a("--seed", type=int, default=0, help="initialisation and data-order seed")
    a("--export", default=None, help="write an HF-layout checkpoint (config.json, model.safetensors, tokenizer "
      "marker) here at the end (by default <out>/export)")
    a("--no-progress", action="store_true", help="no progress bar (log lines at each evaluation instead)")
    return p


def _validate(args) -> None:
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len < 3:
        raise UsageError(f"--seq-len must be >= 3 (the MTP loss predicts two tokens ahead), got {args.seq_len}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    for name in ("warmup", "eval_every", "save_every", "eval_windows"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.warmup >= args.steps:
        raise UsageError(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    if not 0 <= args.min_lr_ratio <= 1:
        raise UsageError(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    for name in ("weight_decay", "clip", "mtp_weight", "balance_alpha", "bias_update_rate"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.stop_at is not None and args.stop_at < 1:
        raise UsageError(f"--stop-at must be >= 1, got {args.stop_at}")
    if args.corpus is None:
        args.corpus = DEFAULT_CORPUS
    if not os.path.isfile(args.corpus):
        raise UsageError(f"--corpus {args.corpus!r}: no such file")


def load_config(spec: str):
    """A ModelConfig from a preset name or a config.json path (UsageError otherwise)."""
    from mla_jax.config import ModelConfig

    key = spec.replace("-", "_")
    if key in PRESETS:
        cfg = getattr(ModelConfig, key)()
    elif os.path.exists(spec):
        try:
            cfg = ModelConfig.from_hf(spec)
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            raise UsageError(f"--config {spec!r}: {e}") from e
    else:
        raise UsageError(f"--config {spec!r}: not a preset ({', '.join(PRESETS)}) nor an existing config.json")
    if cfg.vocab_size < 259:
        raise UsageError(f"--config {spec!r}: vocab_size={cfg.vocab_size} cannot hold the byte tokenizer "
                         "(256 bytes + bos/eos/pad)")
    # The byte tokenizer's specials, so an exported config.json tells generation where to stop.
    return cfg.replace(bos_token_id=256, eos_token_id=257)


# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------
def split_corpus(text: str, heldout_fraction: float = HELDOUT_FRACTION) -> tuple[list[str], list[str]]:
    """(train paragraphs, held-out paragraphs): the last `heldout_fraction` of the blank-line separated
    paragraphs (at least one) are held out. Deterministic; raises UsageError on fewer than 2 paragraphs."""
    paras = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
    paras = [p for p in paras if p]
    if len(paras) < 2:
        raise UsageError(f"the corpus needs at least 2 paragraphs (blank-line separated), found {len(paras)}")
    n_held = max(1, int(round(len(paras) * heldout_fraction)))
    return paras[:-n_held], paras[-n_held:]


def token_stream(paragraphs: list[str], tok) -> np.ndarray:
    """int32 [N]: [bos] + bytes + [eos] per paragraph, concatenated."""
    ids: list[int] = []
    for p in paragraphs:
        ids += tok.encode(p, add_bos=True)
        ids.append(tok.eos_id)
    return np.asarray(ids, np.int32)


def train_batch(stream: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int) -> np.ndarray:
    """int32 [B, T]: random windows; the offsets depend only on (seed, step) (see the module docstring)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len + 1, size=batch_size)
    return np.stack([stream[s:s + seq_len] for s in starts])


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """int32 [W, T]: the first `max_windows` consecutive non-overlapping windows of the held-out stream."""
    n = min(len(stream) // seq_len, max_windows)
    return stream[:n * seq_len].reshape(n, seq_len)


def corpus_fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# Model, optimizer, steps
# ------------------------------------------------------------------------------------------
def make_optimizer(args):
    """(optax AdamW with warmup + cosine schedule and global-norm clipping, the schedule)."""
    return _optimizer(args.lr, args.min_lr_ratio, args.warmup, args.steps, args.weight_decay, args.clip)


@functools.lru_cache(maxsize=8)
def _optimizer(lr, min_lr_ratio, warmup, steps, weight_decay, clip):
    import jax
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=steps, end_value=lr * min_lr_ratio)
    # Decay matrices only: norms' scales and 1-D tensors are not weights to shrink toward 0.
    adamw = optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    tx = optax.chain(optax.clip_by_global_norm(clip), adamw) if clip > 0 else adamw
    return tx, schedule


@functools.lru_cache(maxsize=8)
def _steps(tx, tc):
    """The jitted (train_step, eval_step), one pair per (optimizer, loss weights): a second run in the
    same process (a resumed run, a test) reuses the compiled steps instead of compiling again."""
    from models.training import make_train_step

    return make_train_step(tx, tc), make_eval_step(tc)


def resolve_moe_impl(name: str) -> str:
    import jax

    if name == "auto" and jax.default_backend() == "cpu":
        return "dense"
    return name


def build_model(cfg, args):
    import jax.numpy as jnp
    from flax import nnx

    from models.deepseek import DeepSeekModel

    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    return DeepSeekModel(cfg, rngs=nnx.Rngs(args.seed), dtype=dtype, param_dtype=jnp.float32,
                         moe_impl=resolve_moe_impl(args.moe_impl))


def initial_state(args, cfg=None):
    """(graphdef, state, opt_state) of a fresh run: the model initialised from --seed, AdamW's zero state.
    Also the template a checkpoint is restored into."""
    from models.training import init_train_state

    cfg = load_config(args.config) if cfg is None else cfg
    tx, _ = make_optimizer(args)
    return init_train_state(build_model(cfg, args), tx)


def train_config(args):
    from models.training import TrainConfig

    return TrainConfig(mtp_weight=args.mtp_weight, balance_alpha=args.balance_alpha,
                       bias_update_rate=args.bias_update_rate)


def make_eval_step(tc):
    """A jitted `eval_step(graphdef, state, ids [W,T]) -> metrics` (loss_fn without the update)."""
    import jax
    from flax import nnx

    from models.training import loss_fn

    def eval_step(graphdef, state, ids):
        _, metrics = loss_fn(nnx.merge(graphdef, state), {"input_ids": ids}, tc)
        return metrics

    return jax.jit(eval_step, static_argnums=(0,))


def evaluate(eval_step, graphdef, state, windows: np.ndarray, batch_size: int) -> dict[str, float]:
    """Token-weighted mean CE and MTP loss over the held-out windows (every window has T tokens)."""
    import jax.numpy as jnp

    ce = mtp = 0.0
    n = 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        m = eval_step(graphdef, state, jnp.asarray(chunk))
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


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------
def checkpoint_manager(out: str):
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(out, "checkpoints")), options=opts)


def save_checkpoint(mgr, step: int, state, opt_state, meta: dict) -> None:
    import orbax.checkpoint as ocp

    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta)), force=True)
    mgr.wait_until_finished()


def restore_checkpoint(mgr, state_template, opt_template, step: int | None = None):
    """(state, opt_state, meta) of `step` (default the latest), restored into the templates' structure."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    step = mgr.latest_step() if step is None else step
    if step is None:
        raise UsageError(f"--resume: no checkpoint in {mgr.directory}")
    abstract = lambda t: jax.tree.map(ocp.utils.to_shape_dtype_struct, t)  # noqa: E731
    r = mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract(state_template)),
        opt_state=ocp.args.StandardRestore(abstract(opt_template)), meta=ocp.args.JsonRestore()))
    # orbax hands back arrays committed to a device; fresh ones are uncommitted, and jit keys its cache
    # on that, so a resumed run would compile the step again. A host round-trip is exact.
    fresh = lambda t: jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), t)  # noqa: E731
    return fresh(r["state"]), fresh(r["opt_state"]), r["meta"]


def _portable_args(args) -> dict[str, Any]:
    """The run's arguments for training.json, with paths inside the repository made relative to it
    (an exported model must not carry this machine's absolute paths)."""
    root = os.path.dirname(_HERE)
    out = {}
    for k, v in vars(args).items():
        if k == "no_progress":
            continue
        if isinstance(v, str) and os.path.isabs(v) and os.path.commonpath([root, v]) == root:
            v = os.path.relpath(v, root)
        out[k] = v
    return out


def _trajectory(args) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _TRAJECTORY_ARGS}


# ------------------------------------------------------------------------------------------
# Logging and the loss curve
# ------------------------------------------------------------------------------------------
def _read_metrics(path: str, upto_step: int | None = None) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if upto_step is None or r["step"] <= upto_step]


def _write_metrics(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def plot_losses(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "ce" in r]
    ev = [r for r in rows if "eval_ce" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot([r["step"] for r in train], [r["ce"] for r in train], lw=0.8, alpha=0.8, label="train CE")
        ax.plot([r["step"] for r in train], [r["mtp_ce"] for r in train], lw=0.8, alpha=0.6,
                label="train MTP CE (token i+2)")
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


# ------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------
def export(graphdef, state, directory: str, summary: dict | None = None) -> None:
    """HF layout (config.json + model.safetensors) plus the byte-tokenizer marker, loadable by
    `load_hf_checkpoint` / `load_tokenizer` / `mla-generate --checkpoint`."""
    from flax import nnx

    from models.checkpoint import save_hf_checkpoint
    from models.tokenizer import save_byte_tokenizer

    save_hf_checkpoint(nnx.merge(graphdef, state), directory)
    save_byte_tokenizer(directory)
    if summary is not None:
        with open(os.path.join(directory, "training.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunResult:
    step: int
    train_ce: float | None
    eval: dict[str, float]
    out: str
    export_dir: str | None


def train(args) -> RunResult:
    """Train per `args` (see `build_parser`); raises UsageError on bad input."""
    from models.tokenizer import ByteTokenizer

    _validate(args)
    cfg = load_config(args.config)
    with open(args.corpus, encoding="utf-8", errors="strict") as f:
        try:
            text = f.read()
        except UnicodeDecodeError as e:
            raise UsageError(f"--corpus {args.corpus!r} is not UTF-8 text: {e}") from e
    tok = ByteTokenizer()
    train_paras, held_paras = split_corpus(text)
    train_ids, held_ids = token_stream(train_paras, tok), token_stream(held_paras, tok)
    if len(train_ids) < args.seq_len + 1:
        raise UsageError(f"the training split has {len(train_ids)} tokens, fewer than --seq-len {args.seq_len} + 1")
    windows = eval_windows(held_ids, args.seq_len, args.eval_windows)
    if len(windows) == 0:
        raise UsageError(f"the held-out split has {len(held_ids)} tokens, fewer than one --seq-len window "
                         f"({args.seq_len})")
    fingerprint = corpus_fingerprint(text)

    os.makedirs(args.out, exist_ok=True)
    mgr = checkpoint_manager(args.out)
    try:
        return _train_loop(args, cfg, train_ids, held_ids, windows, fingerprint, mgr)
    finally:
        mgr.close()


def _train_loop(args, cfg, train_ids, held_ids, windows, fingerprint, mgr) -> RunResult:
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    tx, schedule = make_optimizer(args)
    tc = train_config(args)
    graphdef, state, opt_state = initial_state(args, cfg)
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    start = 0
    if args.resume:
        state, opt_state, saved = restore_checkpoint(mgr, state, opt_state)
        if saved["corpus_sha256"] != fingerprint:
            raise UsageError("--resume: the corpus differs from the one the checkpoint was trained on")
        diff = {k: (v, getattr(args, k)) for k, v in saved["trajectory"].items() if getattr(args, k) != v}
        if diff:
            raise UsageError("--resume with different arguments than the checkpoint (saved, given): "
                             + ", ".join(f"{k}={a!r}/{b!r}" for k, (a, b) in diff.items()))
        start = int(saved["step"])
        rows = _read_metrics(metrics_path, upto_step=start)  # drop what the interrupted run logged after it
    else:
        if mgr.latest_step() is not None:
            raise UsageError(f"--out {args.out!r} already holds checkpoints: pass --resume, or choose another --out")
        rows = []
    _write_metrics(metrics_path, rows)

    train_step, eval_step = _steps(tx, tc)
    stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))

    def meta(step: int) -> dict:
        return {"step": step, "data_seed": args.seed, "corpus_sha256": fingerprint, "trajectory": _trajectory(args)}

    def log(row: dict) -> None:
        rows.append(row)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def run_eval(step: int) -> dict[str, float]:
        ev = evaluate(eval_step, graphdef, state, windows, args.batch_size)
        # the step's "mtp_loss" carries λ; the curve shows the plain CE of the MTP head
        ev["eval_mtp_ce"] = ev["eval_mtp_loss"] / args.mtp_weight if args.mtp_weight > 0 else float("nan")
        log({"step": step, **ev})
        plot_losses(rows, os.path.join(args.out, "loss.png"))
        return ev

    bar = tqdm(total=stop, initial=start, disable=args.no_progress, desc="mla-train", dynamic_ncols=True,
               file=sys.stderr)
    if args.no_progress:
        print(f"mla-train: {n_params / 1e6:.2f}M parameters, {len(train_ids)} train / {len(held_ids)} held-out "
              f"tokens, steps {start}->{stop}", file=sys.stderr)
    last_ev: dict[str, float] = {}
    train_ce = None
    tokens = args.batch_size * args.seq_len
    t_start = time.perf_counter()
    for step in range(start, stop):
        batch = {"input_ids": jnp.asarray(train_batch(train_ids, step, args.seed, args.batch_size, args.seq_len))}
        t0 = time.perf_counter()
        state, opt_state, m = train_step(graphdef, state, opt_state, batch)
        m = jax.device_get(m)
        # the step alone (not evaluation or checkpoints); a session's first step includes compiling it
        tps = tokens / (time.perf_counter() - t0) if step > start else float("nan")
        done = step + 1
        train_ce = float(m["ce"])
        mtp_ce = float(m["mtp_loss"]) / args.mtp_weight if args.mtp_weight > 0 else float("nan")
        bal = load_balance(m["expert_load"])
        if not math.isfinite(float(m["loss"])):
            bar.close()
            raise FloatingPointError(f"loss is {float(m['loss'])} at step {done}; try a lower --lr")
        log({"step": done, "loss": float(m["loss"]), "ce": train_ce, "mtp_ce": mtp_ce,
             "balance_loss": float(m["balance_loss"]), "load_max_over_mean": bal,
             "grad_norm": float(m["grad_norm"]), "lr": float(schedule(step)), "tokens_per_s": tps})
        bar.update(1)
        bar.set_postfix(loss=f"{train_ce:.3f}", mtp=f"{mtp_ce:.3f}", tok_s=f"{tps:.0f}", load=f"{bal:.2f}",
                        refresh=False)
        if args.eval_every and done % args.eval_every == 0 and done != stop:
            last_ev = run_eval(done)
            msg = f"step {done}: train CE {train_ce:.4f}, held-out CE {last_ev['eval_ce']:.4f} nats/token"
            if args.no_progress:
                print("mla-train: " + msg, file=sys.stderr)
            else:
                bar.write(msg, file=sys.stderr)
        if args.save_every and done % args.save_every == 0 and done != stop:
            save_checkpoint(mgr, done, state, opt_state, meta(done))
    bar.close()
    final = max(start, stop)
    if mgr.latest_step() != final:
        save_checkpoint(mgr, final, state, opt_state, meta(final))
    last_ev = run_eval(final)
    print(f"mla-train: step {final}/{args.steps}: train CE {train_ce if train_ce is not None else float('nan'):.4f}, "
          f"held-out CE {last_ev['eval_ce']:.4f} nats/token ({last_ev['eval_ce'] / math.log(2):.3f} bits), "
          f"held-out MTP CE {last_ev['eval_mtp_ce']:.4f}", file=sys.stderr)
    export_dir = None
    if final >= args.steps:  # an interrupted run (--stop-at) is not a finished model
        export_dir = args.export or os.path.join(args.out, "export")
        summary = {"step": final, "train_ce_last_step": train_ce, **last_ev,
                   "train_seconds_this_session": round(time.perf_counter() - t_start, 1),
                   "heldout_tokens_evaluated": int(windows.size), "parameters": n_params,
                   "corpus_sha256": fingerprint, "args": _portable_args(args)}
        export(graphdef, state, export_dir, summary)
        print(f"mla-train: exported to {export_dir}", file=sys.stderr)
    return RunResult(final, train_ce, last_ev, args.out, export_dir)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        train(args)
    except UsageError as e:
        print(f"mla-train: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # a diverged run: say so in one line, not a traceback
        print(f"mla-train: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mla-train: interrupted (resume from the last checkpoint with --resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
