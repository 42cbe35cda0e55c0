"""Training a small DeepSeek-style model (MLA + MoE + MTP) on a text corpus: the loop. `mla-train` is the
command line over this module.

    from models.training.loop import TrainSettings, train
    result = train(TrainSettings(steps=200, seq_len=128), out="runs/small")      # -> RunResult
    result = train(TrainSettings(steps=400, seq_len=128), out="runs/small", resume=True)   # on to 400 steps

What one step is: `models.training.step.make_train_step` (CE + λ·MTP + α·sequence-wise balance loss,
AdamW on the Params, then the aux-loss-free router-bias update outside the gradient). `Trainer` holds one
run's pieces and `TrainState` its state between steps, so a caller can drive the steps itself
(`Trainer.init`, `.restore`, `.step`, `.evaluate`, `.save`); `train` drives them with evaluation, logging,
checkpoints and export. The pieces around the loop, one module each (every public name is also importable
from here):

    models.training.settings    TrainSettings, the model presets, TrainerError / SettingError
    models.training.data        the corpus split, the token streams, the batches (a function of seed and step)
    models.training.setup       the model, the optimizer and schedule, the jitted steps, the mesh, the memory check
    models.training.evaluation  held-out evaluation, metrics.jsonl, loss.png
    models.training.checkpoints  orbax checkpoints with checksums, exact restore, the HF-layout export
    models.training.signals     SIGINT / SIGTERM: stop after the step, with a checkpoint

Resuming refuses different settings, another corpus or another model config, and a damaged checkpoint
(`models.training.checkpoints`): each is one `TrainerError` naming the checkpoint directory.
SIGINT / SIGTERM during `train`: the current step ends, its checkpoint is saved (even before the first
periodic one), then `Interrupted` (a KeyboardInterrupt) says where; `resume=True` continues from it.

A device mesh (`TrainSettings.mesh`, `mla-train --mesh data=2,tensor=2`): fully sharded data parallelism
on top of the tensor / expert rules (`mla_jax.sharding`, `fsdp=True`): every variable and its AdamW
moments sharded over `data` as well, the batch split over `data`, the donated state returned with the
shardings it came with (`models.training.step.make_train_step(shardings=...)`). Checkpoints hold the global
arrays, so a run may resume on another mesh, or on one device (restored onto the run's own placement).
Several processes (`jax.distributed`, `models.distributed`): every process runs the same loop on the
same batches (the data order is a function of the step) and holds its devices' shards; process 0 alone
writes the metrics, the plot and the export, and orbax writes the checkpoints of all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from mla_jax.sharding import shard_batch
from models.training.checkpoints import (
    checkpoint_manager,
    checkpoint_record,
    export,
    host_array,
    recorded_steps,
    restore_checkpoint,
    save_checkpoint,
    tree_sha256,
)
from models.training.data import (
    HELDOUT_FRACTION,
    CorpusData,
    corpus_fingerprint,
    eval_windows,
    load_corpus,
    split_corpus,
    token_stream,
    train_batch,
)
from models.training.evaluation import MetricsLog, evaluate, load_balance, plot_losses
from models.training.settings import (
    AUTO_WARMUP,
    DEFAULT_CORPUS,
    DTYPES,
    PRESETS,
    SettingError,
    TrainerError,
    TrainSettings,
    load_config,
)
from models.training.setup import (
    available_memory,
    build_model,
    check_memory,
    compiled_mesh_steps,
    compiled_steps,
    compute_dtype,
    initial_state,
    make_eval_step,
    make_optimizer,
    make_train_mesh,
    resolve_attn_impl,
    train_config,
    training_memory,
)
from models.training.signals import Interrupted, StopRequest, interrupted_at_once

__all__ = [
    "AUTO_WARMUP",
    "DEFAULT_CORPUS",
    "DTYPES",
    "HELDOUT_FRACTION",
    "PRESETS",
    "CorpusData",
    "Interrupted",
    "MetricsLog",
    "RunResult",
    "SettingError",
    "TrainSettings",
    "TrainState",
    "Trainer",
    "TrainerError",
    "available_memory",
    "build_model",
    "check_memory",
    "checkpoint_manager",
    "checkpoint_record",
    "compute_dtype",
    "corpus_fingerprint",
    "eval_windows",
    "evaluate",
    "export",
    "host_array",
    "initial_state",
    "load_balance",
    "load_config",
    "load_corpus",
    "make_eval_step",
    "make_optimizer",
    "make_train_mesh",
    "plot_losses",
    "recorded_steps",
    "resolve_attn_impl",
    "restore_checkpoint",
    "run_problems",
    "save_checkpoint",
    "split_corpus",
    "token_stream",
    "train",
    "train_batch",
    "train_config",
    "training_memory",
    "tree_sha256",
]

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above models/


@dataclasses.dataclass
class TrainState:
    """A run between two steps: the model (graphdef + state: Params and router biases), the optax state,
    and the steps done, which is also the data-order RNG state (batch `step` is drawn next)."""

    graphdef: Any
    state: Any
    opt_state: Any
    step: int = 0


def _portable(value):
    """A path inside the package's root (the repository, in a checkout) made relative to it: an exported
    model must not carry this machine's absolute paths."""
    if isinstance(value, str) and os.path.isabs(value) and os.path.commonpath([_PACKAGE_ROOT, value]) == _PACKAGE_ROOT:
        return os.path.relpath(value, _PACKAGE_ROOT)
    return value


def _config_record(cfg) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _directory_problem(path: str) -> str | None:
    """Why `path` cannot be a directory to write in (it, or a folder on the way to it, is a file, or the
    nearest existing folder is not writable); None when it is a directory or can be made one. Writable means
    a folder can be made there (made and removed at once): permission bits do not bind root, while a read-only
    or virtual file system (/proc, /sys) refuses everyone."""
    p = os.path.normpath(path)
    while p and not os.path.exists(p):
        p = os.path.dirname(p)
    where = "" if p == os.path.normpath(path) else f"{p!r} "
    if p and not os.path.isdir(p):
        return f"{where}is a file, not a directory"
    if not os.access(p or os.curdir, os.W_OK | os.X_OK) or not _can_make_folder_in(p or os.curdir):
        return f"{where or repr(p or os.curdir) + ' '}is not writable"
    return None


def _can_make_folder_in(directory: str) -> bool:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mla-train-probe-", dir=directory))
    except OSError:
        return False
    return True


def run_problems(
    out: str,
    *,
    export_dir: str | None = None,
    stop_at: int | None = None,
    config: str | None = None,
    corpus: str | None = None,
    attn_impl: str | None = None,
) -> list[SettingError]:
    """Every problem `train` can see in its arguments before it reads or writes anything, each a SettingError:
    the run and export directories, `stop_at`, and those given of the config, the corpus path and an attention
    this machine lacks. The command line joins them with the settings' own (`TrainSettings.problems`), so one
    bad argument does not hide another."""
    found = []
    if stop_at is not None and stop_at < 1:
        found.append(SettingError("{0} must be >= 1, got {v}", "stop_at", v=stop_at))
    for name, d in (("out", out), ("export", export_dir)):
        why = None if d is None else _directory_problem(d)
        if why:
            found.append(SettingError("{0} {d!r}: {why}", name, d=d, why=why))
    if config is not None:
        try:
            load_config(config)
        except SettingError as e:
            found.append(e)
    if corpus is not None and os.path.isdir(corpus):
        found.append(SettingError("{0} {p!r} is a directory, not a text file", "corpus", p=corpus))
    elif corpus is not None and not os.path.isfile(corpus):
        found.append(SettingError("{0} {p!r}: no such file", "corpus", p=corpus))
    needs = {
        "cudnn": "a CUDA GPU (cuDNN's flash attention)",
        "mgpu": "a Hopper GPU (the Mosaic GPU flash attention kernel)",
    }
    if attn_impl in needs and jax.default_backend() != "gpu":
        found.append(
            SettingError(
                "{0} {a} needs {n}; this machine's backend is {b}",
                "attn_impl",
                a=attn_impl,
                n=needs[attn_impl],
                b=jax.default_backend(),
            )
        )
    return found


@dataclasses.dataclass
class RunResult:
    """What `train` ended with: the step reached, the last step's train CE and the last held-out evaluation
    (of a run already complete: those its metrics.jsonl holds), the run and export directories."""

    step: int
    train_ce: float | None
    eval: dict[str, float]
    out: str
    export_dir: str | None


class Trainer:
    """One run's fixed pieces: settings, model config (memory-checked), corpus, optimizer and compiled
    steps. Its methods take and return the `TrainState`; `train` below drives them.

        trainer = Trainer(TrainSettings(steps=100))
        ts = trainer.init()
        ts, row = trainer.step(ts)              # one optimizer step; row: loss, ce, mtp_ce, ..., tokens_per_s
        trainer.evaluate(ts)                    # {"eval_ce", "eval_mtp_loss", "eval_mtp_ce"}
    """

    def __init__(self, settings: TrainSettings, cfg=None):
        self.settings = settings
        self.cfg = load_config(settings.config) if cfg is None else cfg
        self.layout = make_train_mesh(settings, self.cfg)  # before the memory check: it reads the mesh's shapes
        self.mesh = None if self.layout is None else self.layout[0]
        check_memory(self.cfg, settings)
        self.data = load_corpus(settings.corpus, settings.seq_len, settings.eval_windows)
        self._build_steps()

    def _build_steps(self) -> None:
        """The optimizer, its schedule and the jitted steps of `self.settings`."""
        s = self.settings
        self.tx, self.schedule = make_optimizer(s)
        if self.layout is None:
            self.train_step, self.eval_step = compiled_steps(self.tx, train_config(s))
        else:
            params = nnx.state(nnx.eval_shape(lambda: build_model(self.cfg, s)), nnx.Param)
            self.train_step, self.eval_step = compiled_mesh_steps(self.tx, train_config(s), self.layout[1], params)

    def init(self) -> TrainState:
        return TrainState(*initial_state(self.settings, self.cfg, self.mesh), step=0)

    def place(self, ids: np.ndarray):
        """int32 [B, T] ids where the steps want them: on the mesh split over `data` (replicated when
        B does not divide, e.g. the last held-out chunk), else as a plain array."""

        if self.mesh is None:
            return jnp.asarray(ids)

        if len(ids) % self.mesh.shape["data"] == 0:
            return shard_batch(ids, self.mesh)
        return jax.device_put(ids, NamedSharding(self.mesh, PartitionSpec()))

    def record(self, step: int) -> dict[str, Any]:
        """The JSON record saved with a checkpoint of `step` (what `restore` checks)."""
        return {
            "step": step,
            "data_seed": self.settings.seed,
            "corpus_sha256": self.data.fingerprint,
            "trajectory": self.settings.trajectory(),
            "model_config": _config_record(self.cfg),
        }

    def save(self, mgr, ts: TrainState) -> None:
        save_checkpoint(mgr, ts.step, ts.state, ts.opt_state, self.record(ts.step))

    def restore(self, mgr) -> TrainState:
        """The latest checkpoint of `mgr`, refused (TrainerError) unless it was written by a run of the same
        corpus, trajectory settings and model config, and reads back exactly as it was saved.

        `steps` may differ (SettingError when it is below the checkpoint's step): the run goes on to the new
        total, the schedule (warm-up, cosine decay) being the new total's from the checkpoint's step on, as if
        the run had been started with it. A warm-up left out (`warmup=None`) is the checkpoint's: the
        settings become those with it (`self.settings` is replaced, the steps rebuilt when it differs)."""
        step, where, saved = checkpoint_record(mgr)
        if saved["corpus_sha256"] != self.data.fingerprint:
            raise TrainerError(f"checkpoint {where} was trained on another corpus than {self.settings.corpus!r}")
        if step > self.settings.steps:
            raise SettingError(
                "{0} {n}: checkpoint {where} is at step {k}, past it; pass {0} {k} or more to continue that run",
                "steps",
                n=self.settings.steps,
                where=where,
                k=step,
            )
        was = saved["trajectory"]
        if self.settings.warmup is None and isinstance(was.get("warmup"), int):
            if was["warmup"] != self.settings.warmup_steps:
                self.settings = dataclasses.replace(self.settings, warmup=was["warmup"])
                self._build_steps()
        given = self.settings.trajectory()
        diff = {k: (v, given[k]) for k, v in was.items() if k in given and k != "steps" and given[k] != v}
        if diff:
            raise TrainerError(
                f"checkpoint {where} was trained with other settings (saved/given): "
                + ", ".join(f"{k}={a!r}/{b!r}" for k, (a, b) in diff.items())
            )
        now = _config_record(self.cfg)
        diff = {k: (v, now[k]) for k, v in saved.get("model_config", {}).items() if k in now and now[k] != v}
        if diff:
            raise TrainerError(
                f"checkpoint {where} holds a model of another config than {self.settings.config!r} "
                "(saved/given): " + ", ".join(f"{k}={a!r}/{b!r}" for k, (a, b) in diff.items())
            )
        fresh = self.init()
        state, opt_state, _ = restore_checkpoint(mgr, fresh.state, fresh.opt_state, step)
        return TrainState(fresh.graphdef, state, opt_state, step)

    def step(self, ts: TrainState) -> tuple[TrainState, dict[str, float]]:
        """One optimizer step on batch `ts.step` -> (the next state, its metrics row). FloatingPointError when
        the loss is not finite."""

        s = self.settings
        batch = {"input_ids": self.place(train_batch(self.data.train_ids, ts.step, s.seed, s.batch_size, s.seq_len))}
        t0 = time.perf_counter()
        state, opt_state, m = self.train_step(ts.graphdef, ts.state, ts.opt_state, batch)
        m = jax.device_get(m)
        seconds = time.perf_counter() - t0
        if not math.isfinite(float(m["loss"])):
            raise FloatingPointError(f"loss is {float(m['loss'])} at step {ts.step + 1}; try a lower learning rate")
        row = {
            "step": ts.step + 1,
            "loss": float(m["loss"]),
            "ce": float(m["ce"]),
            "mtp_ce": float(m["mtp_loss"]) / s.mtp_weight if s.mtp_weight > 0 else float("nan"),
            "balance_loss": float(m["balance_loss"]),
            "load_max_over_mean": load_balance(m["expert_load"]),
            "grad_norm": float(m["grad_norm"]),
            "lr": float(self.schedule(ts.step)),
            "tokens_per_s": s.batch_size * s.seq_len / seconds,
        }
        return TrainState(ts.graphdef, state, opt_state, ts.step + 1), row

    def evaluate(self, ts: TrainState) -> dict[str, float]:
        """Held-out CE and MTP loss, and the MTP head's plain CE (the step's "mtp_loss" carries λ)."""
        ev = evaluate(self.eval_step, ts.graphdef, ts.state, self.data.windows, self.settings.batch_size, self.place)
        w = self.settings.mtp_weight
        ev["eval_mtp_ce"] = ev["eval_mtp_loss"] / w if w > 0 else float("nan")
        return ev


def train(
    settings: TrainSettings,
    out: str,
    *,
    resume: bool = False,
    stop_at: int | None = None,
    export_dir: str | None = None,
    progress: bool = True,
    cfg=None,
) -> RunResult:
    """Train per `settings` in the run directory `out` (checkpoints/, metrics.jsonl, loss.png, export/).

    resume: continue from the latest checkpoint in `out` (without it, `out` must hold none) to
        `settings.steps`: the run's own total (`recorded_steps(out)`; `mla-train --resume` without `--steps`
        takes it) continues it as it was; a larger one trains it on to the new total (`Trainer.restore` says how
        the schedule follows); a run already at `settings.steps`, evaluated and exported, is left as it is: one
        line says so, and the result is what its metrics.jsonl holds.
    stop_at: stop after this step with a checkpoint, as if interrupted (an unfinished run is not exported).
    export_dir: where the finished model goes in HF layout (default `<out>/export`).
    progress: a tqdm bar on stderr (steps done, time left); without it, a log line at each evaluation. Either
        way a first line says the model's size, the tokens of each split and the steps to train.
    Raises TrainerError on a bad input, setting or checkpoint (or a checkpoint that cannot be saved; every
    problem `run_problems` finds, joined in one SettingError),
    FloatingPointError on a diverged loss, and `Interrupted` on SIGINT / SIGTERM: called from the main thread,
    the first signal ends the current step, saves its checkpoint and then raises it (`--resume` continues from
    there); a second one stops at once. Of several processes, each must receive the signal (as launchers send
    it): the processes stop together only then.
    """

    s = settings
    problems = run_problems(
        out, export_dir=export_dir, stop_at=stop_at, config=s.config, corpus=s.corpus, attn_impl=s.attn_impl
    )
    if problems:
        raise SettingError.joined(problems)
    trainer = Trainer(settings, cfg)  # config, memory and corpus are checked before anything is written
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise SettingError("{0} {d!r}: cannot create it: {e}", "out", d=out, e=e.strerror or e) from None
    mgr = checkpoint_manager(out, tidy=True)
    primary = jax.process_index() == 0  # of several processes, one writes the log, the plot and the export
    # SIGINT / SIGTERM: stop after the current step, with a checkpoint
    stop_request = StopRequest(speak=primary, bar=progress and primary)
    stop_request.install()
    ts = None

    def save(ts: TrainState) -> None:
        stop_request.saving = ts.step
        try:
            trainer.save(mgr, ts)
        finally:
            stop_request.saving = None

    try:
        if resume:
            ts = trainer.restore(mgr)
        elif mgr.latest_step() is not None:
            raise SettingError(
                "{0} {out!r} already holds checkpoints: pass {1}, or choose another {0}", "out", "resume", out=out
            )
        else:
            ts = trainer.init()
        s = trainer.settings  # on resume, with the checkpoint's warm-up when none was given
        say = functools.partial(print, file=sys.stderr) if primary else lambda *a: None
        metrics = os.path.join(out, "metrics.jsonl")
        done_dir = export_dir or os.path.join(out, "export")
        if resume and ts.step >= s.steps:  # a finished run: nothing to train, nothing to write
            ended = _ending(MetricsLog(metrics, upto_step=ts.step, write=False).rows, ts.step)
            if ended is not None and os.path.isfile(os.path.join(done_dir, "config.json")):
                train_ce, ev = ended
                say(
                    f"mla-train: the run in {out} is already complete at step {ts.step}/{s.steps} (held-out CE "
                    f"{ev['eval_ce']:.4f} nats/token; its model: {done_dir}); nothing to do: a larger --steps "
                    "with --resume continues it"
                )
                return RunResult(ts.step, train_ce, ev, out, done_dir)
        log = MetricsLog(metrics, upto_step=ts.step if resume else None, write=primary)
        start = ts.step
        stop = s.steps if stop_at is None else min(stop_at, s.steps)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ts.state))

        def run_eval(ts: TrainState) -> dict[str, float]:
            ev = trainer.evaluate(ts)
            log.append({"step": ts.step, **ev})
            if primary:
                plot_losses(log.rows, os.path.join(out, "loss.png"))
            return ev

        on = "" if trainer.mesh is None else f" on the mesh {s.mesh} ({trainer.mesh.size} devices)"
        say(
            f"mla-train: {n_params / 1e6:.2f}M parameters{on}, {len(trainer.data.train_ids)} train / "
            f"{len(trainer.data.heldout_ids)} held-out tokens, steps {start}->{stop}, attention "
            f"{resolve_attn_impl(s)}"
        )
        bar = tqdm(
            total=stop,
            initial=start,
            disable=not (progress and primary) or start >= stop,
            desc="mla-train",
            dynamic_ncols=True,
            file=sys.stderr,
        )
        train_ce = None
        t_start = time.perf_counter()
        try:
            while ts.step < stop and stop_request.signal is None:
                first = ts.step == start
                ts, row = trainer.step(ts)
                # the step alone (not evaluation or checkpoints); the first step of a call includes compiling it
                if first:
                    row["tokens_per_s"] = float("nan")
                log.append(row)
                train_ce = row["ce"]
                bar.update(1)
                bar.set_postfix(_postfix(row), refresh=False)
                if stop_request.signal is not None:  # no evaluation, no export: the checkpoint below, then stop
                    break
                if s.eval_every and ts.step % s.eval_every == 0 and ts.step != stop:
                    ev = run_eval(ts)
                    msg = f"step {ts.step}: train CE {train_ce:.4f}, held-out CE {ev['eval_ce']:.4f} nats/token"
                    if progress and primary:
                        bar.write(msg, file=sys.stderr)
                    elif not progress:
                        say("mla-train: " + msg)
                if s.save_every and ts.step % s.save_every == 0 and ts.step != stop:
                    save(ts)
        finally:
            bar.close()
        if mgr.latest_step() != ts.step and ts.step > 0:
            save(ts)
        stop_request.restore()  # from here on (evaluation, export) a signal interrupts as it would anywhere
        if stop_request.signal is not None:
            if ts.step == 0:
                raise Interrupted("interrupted before the first step: nothing to save", 0, None)
            where = os.path.join(str(mgr.directory), str(ts.step))
            raise Interrupted(
                f"interrupted at step {ts.step}: checkpoint saved to {where}; continue with --resume", ts.step, where
            )
        ended = _ending(log.rows, ts.step)  # a step without a new one (a resumed end): its logged evaluation
        if ended is None:
            ev = run_eval(ts)
        else:
            train_ce, ev = (train_ce if train_ce is not None else ended[0]), ended[1]
        last_ce = float("nan") if train_ce is None else train_ce
        say(
            f"mla-train: step {ts.step}/{s.steps}: train CE {last_ce:.4f}, "
            f"held-out CE {ev['eval_ce']:.4f} nats/token ({ev['eval_ce'] / math.log(2):.3f} bits), "
            f"held-out MTP CE {ev['eval_mtp_ce']:.4f}"
        )
        if ts.step < s.steps:  # an interrupted run (stop_at) is not a finished model
            return RunResult(ts.step, train_ce, ev, out, None)
        run_args = {
            "out": out,
            **dataclasses.asdict(s),
            "warmup": s.warmup_steps,
            "stop_at": stop_at,
            "resume": resume,
            "export": export_dir,
            "attn_impl_used": resolve_attn_impl(s),
        }
        summary = {
            "step": ts.step,
            "train_ce_last_step": train_ce,
            **{k: v if math.isfinite(v) else None for k, v in ev.items()},  # strict JSON: null where not measured
            "train_seconds_this_call": round(time.perf_counter() - t_start, 1),
            "heldout_tokens_evaluated": int(trainer.data.windows.size),
            "parameters": n_params,
            "corpus_sha256": trainer.data.fingerprint,
            "args": {k: _portable(v) for k, v in run_args.items()},
        }
        try:
            export(ts.graphdef, ts.state, done_dir, summary)
        except OSError as e:  # a full disk: the checkpoint of the last step is saved
            raise SettingError(
                "{0} {d!r}: cannot write the exported model: {e} (the checkpoint of step {n} is saved)",
                "export",
                d=done_dir,
                e=e.strerror or e,
                n=ts.step,
            ) from None
        say(f"mla-train: exported to {done_dir}")
        return RunResult(ts.step, train_ce, ev, out, done_dir)
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted):
            raise
        raise interrupted_at_once(mgr, None if ts is None else ts.step, stop_request.forced) from None
    finally:
        stop_request.restore()
        mgr.close()


def _postfix(row: dict) -> dict[str, str]:
    """The progress bar's figures of a step's metrics row, those measured (not the first step's tokens/s, which
    includes compiling, nor an MTP CE without MTP loss)."""
    shown = (
        ("loss", "ce", ".3f"),
        ("mtp", "mtp_ce", ".3f"),
        ("tok_s", "tokens_per_s", ".0f"),
        ("load", "load_max_over_mean", ".2f"),
    )
    return {name: format(row[key], spec) for name, key, spec in shown if math.isfinite(row[key])}


def _ending(rows: list[dict], step: int) -> tuple[float | None, dict[str, float]] | None:
    """(the train CE of `step`, its held-out evaluation) as metrics.jsonl `rows` hold them; None when they hold
    no evaluation of `step`."""
    evals = [r for r in rows if r["step"] == step and "eval_ce" in r]
    if not evals:
        return None
    ces = [r["ce"] for r in rows if r["step"] == step and "ce" in r]
    return (ces[-1] if ces else None), {k: v for k, v in evals[-1].items() if k != "step"}
