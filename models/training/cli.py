"""`mla-train`: train a small DeepSeek-style model (MLA + MoE + MTP) on a text corpus, on CPU or GPU.

    mla-train --out runs/tiny                        # shipped corpus, tiny config (the built-in model's
                                                     # recipe: models/builtin/training.json)
    mla-train --out runs/tiny --resume               # continue an interrupted run to its own total, bit for bit
    mla-train --out runs/tiny --resume --steps 1600  # train a finished run further, to 1600 steps in all
    mla-train --out runs/small --steps 200 --seq-len 128 --dtype bf16 --export runs/small-hf
    mla-train --out runs/fsdp --mesh data=2,tensor=2     # four devices: FSDP over data, heads over tensor

The command line over `models.training.loop` (the loop; the data, evaluation, checkpoints, resume and export in
the modules of `models.training` beside it; the flags are `TrainSettings`' fields; `--coordinator/--num-processes/
--process-id` join several processes first, `models.distributed`). Errors in arguments, inputs or checkpoints
(also a checkpoint that cannot be saved: a full disk): one line on stderr, exit status 2, with every bad
argument in it (`TrainSettings.problems` and `models.training.loop.run_problems` joined by "; "); a diverged run: one
line, exit status 1. Ctrl-C (SIGINT) or SIGTERM: the current step ends, its checkpoint is saved, one line says
where, exit status 130 (`--resume` continues from it); a second one stops at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from mla_jax.attention import DECOMPRESSED_IMPLS
from models import compile_cache, distributed
from models.experts import MOE_TRAINING_IMPLS
from models.training.checkpoints import recorded_steps
from models.training.loop import (
    AUTO_WARMUP,
    DTYPES,
    PRESETS,
    Interrupted,
    SettingError,
    TrainerError,
    TrainSettings,
    run_problems,
    train,
)


class UsageError(TrainerError):
    """A bad command line: reported as one line on stderr, exit status 2."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # show real defaults only, not None / False
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    d = TrainSettings()
    p = _Parser(
        prog="mla-train",
        description="Train a small DeepSeek-style model (MLA + MoE + MTP) on a corpus. "
        f"The defaults train ModelConfig.tiny() on 256-token windows for {d.steps} steps: about 10 minutes on a "
        "2-core CPU (--steps 50 for a first try); a progress bar shows the steps done and "
        "the time left. The built-in model's recipe is in models/builtin/training.json.",
        formatter_class=_Formatter,
    )
    a = p.add_argument
    a("--out", default=os.path.join("runs", "mla-train"), help="run directory: checkpoints, metrics.jsonl, loss.png")
    a(
        "--corpus",
        default=None,
        help="UTF-8 text file, paragraphs separated by blank lines (default: the shipped models/data/corpus.txt)",
    )
    a("--config", default=d.config, help=f"preset ({', '.join(PRESETS)}) or a config.json path")
    a(
        "--steps",
        type=int,
        default=None,
        help=f"total optimizer steps (default: {d.steps}; with --resume, the run's own total, and a larger one "
        "trains a finished run further)",
    )
    a("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per training window")
    a("--lr", type=float, default=d.lr, help="peak learning rate")
    a("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr of the cosine decay, relative to --lr")
    a(
        "--warmup",
        type=int,
        default=None,
        help=f"linear warm-up steps (default: min({AUTO_WARMUP}, steps / 10), at least 1 and below --steps; "
        "with --resume, the run's own)",
    )
    a("--weight-decay", type=float, default=d.weight_decay, help="AdamW decay on matrices (not norms, biases)")
    a("--clip", type=float, default=d.clip, help="global gradient-norm clip (0 = off)")
    a("--dtype", choices=DTYPES, default=d.dtype, help="compute dtype; parameters stay fp32")
    a("--mtp-weight", type=float, default=d.mtp_weight, help="λ of the MTP loss")
    a("--balance-alpha", type=float, default=d.balance_alpha, help="α of the sequence-wise balance loss")
    a(
        "--bias-update-rate",
        type=float,
        default=d.bias_update_rate,
        help="γ of the aux-loss-free router-bias update (V3 uses 1e-3 over ~10^5 steps; a run of a few hundred "
        "steps needs a larger one to balance the experts in time)",
    )
    a(
        "--moe-impl",
        default=d.moe_impl,
        choices=MOE_TRAINING_IMPLS,
        help="expert computation; auto = dense on CPU (faster for a few small experts), else models.experts' auto",
    )
    a(
        "--remat",
        default=d.remat,
        help="rematerialisation of each scanned layer: none, full, dots_saveable, "
        "dots_with_no_batch_dims_saveable (less memory, more compute; the same gradients)",
    )
    a(
        "--ce-chunk",
        type=int,
        default=d.ce_chunk,
        help="tokens per LM-head cross-entropy chunk: the fp32 [tokens, vocab] logits never exist whole (0 = off)",
    )
    a(
        "--attn-q-block",
        type=int,
        default=d.attn_q_block,
        help="queries per block of the decompressed attention: no pass holds the whole fp32 scores (0 = off)",
    )
    a(
        "--attn-impl",
        default=d.attn_impl,
        choices=DECOMPRESSED_IMPLS,
        help="the decompressed attention: xla (jnp), cudnn (cuDNN flash attention, forward and backward; a GPU "
        "only; the trainer's windows are unpadded, as it needs) or mgpu (this project's Mosaic GPU flash attention "
        "kernels; a Hopper GPU only, the same contract); auto (default) = mgpu with --dtype bf16 on one Hopper GPU "
        "and no --mesh, else xla",
    )
    a(
        "--mesh",
        metavar="SPEC",
        default=None,
        help="train on a device mesh, e.g. data=2,tensor=2 (axes data, expert, tensor; left out = 1): fully sharded "
        "data parallelism (weights, gradients and AdamW moments split over data, each batch split over data) on "
        "top of mla_jax.sharding's tensor and expert layout; --batch-size must divide by data (default: one device)",
    )
    a("--eval-every", type=int, default=d.eval_every, help="held-out evaluation period in steps (0 = only at the end)")
    a(
        "--eval-windows",
        type=int,
        default=d.eval_windows,
        help="held-out windows per evaluation (at most what the split holds)",
    )
    a("--save-every", type=int, default=d.save_every, help="checkpoint period in steps (0 = only at the end)")
    a("--stop-at", type=int, default=None, help="stop (with a checkpoint) after this step, as if interrupted")
    a("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    a("--seed", type=int, default=d.seed, help="initialisation and data-order seed")
    a(
        "--export",
        default=None,
        help="write an HF-layout checkpoint (config.json, model.safetensors, tokenizer "
        "marker) here at the end (by default <out>/export)",
    )
    a("--no-progress", action="store_true", help="no progress bar (log lines at each evaluation instead)")

    compile_cache.add_argument(p)
    distributed.add_arguments(p)
    return p


def settings(args: argparse.Namespace) -> TrainSettings:
    """The TrainSettings of parsed arguments (SettingError on a bad value). Without `--steps`, a run resumed
    keeps its own total (its latest checkpoint's record) and a new run trains `TrainSettings.steps`."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)}
    for name in ("corpus", "steps"):
        if given[name] is None:
            del given[name]
    if args.steps is None and args.resume:
        steps = recorded_steps(args.out)
        if steps is not None:
            given["steps"] = steps
    return TrainSettings(**given)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def checked_settings(args: argparse.Namespace) -> TrainSettings:
    """`settings(args)`, with every problem of the arguments (the settings', the directories', --stop-at's,
    the config's and the corpus's) in one SettingError, so one bad flag does not hide another."""
    try:
        s, problems = settings(args), []
    except SettingError as e:
        s, problems = None, [e, *e.more]
        e.more = ()
    corpus = args.corpus if args.corpus is not None else TrainSettings.corpus
    problems += run_problems(
        args.out,
        export_dir=args.export,
        stop_at=args.stop_at,
        config=args.config,
        corpus=corpus,
        attn_impl=args.attn_impl,
    )
    if problems:
        raise SettingError.joined(problems)
    return s


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        try:
            distributed.initialize(args)  # before anything else touches jax
        except (ValueError, RuntimeError) as e:  # a bad flag set, or jax could not join the other processes
            raise UsageError(str(e)) from None
        compile_cache.enable(args.compile_cache)
        train(
            checked_settings(args),
            args.out,
            resume=args.resume,
            stop_at=args.stop_at,
            export_dir=args.export,
            progress=not args.no_progress,
        )
    except SettingError as e:
        print(f"mla-train: error: {e.message(_flag)}", file=sys.stderr)
        return 2
    except TrainerError as e:
        print(f"mla-train: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # a diverged run: say so in one line, not a traceback
        print(f"mla-train: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. a compile-cache or output directory that cannot be created
        print(f"mla-train: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:  # "interrupted at step N: checkpoint saved to DIR; continue with --resume"
        print(f"mla-train: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # before `train` began: nothing was written
        print("mla-train: interrupted before training started; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
