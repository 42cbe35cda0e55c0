"""Serving benchmark: the engine online (`Engine.submit` / `Engine.step`) under Poisson arrivals, per rate.

Usage: ``mla-bench serve [--rates 1,2,4,8] [--requests 40] [--out DIR]`` (``--help`` for every option;
``--config tiny`` runs the whole path on a CPU in well under a minute: a tiny float32 V2-Lite-kind model,
small lengths and batch, two rates).

Model: DeepSeek-V2-Lite's shape with random bf16 weights, as ``mla-bench e2e`` builds it (no download).

Workload (one set of requests, ``--seed``; every rate serves the same requests, only their arrival times
differ):
* arrivals: a Poisson process of ``rate`` requests/s (exponential gaps), ``--requests`` N of them;
* prompt lengths: log-normal, median ``--prompt-median`` (512), sigma ``--prompt-sigma`` (1.0) of the log,
  rounded, clipped to [1, ``--prompt-max``] (8192); random token ids;
* output lengths (``max_new_tokens``, greedy, no stop ids, so each request makes exactly that many): log-normal,
  median ``--output-median`` (128), sigma ``--output-sigma`` (0.6), clipped to [1, ``--output-max``] (512).
The ``--config tiny`` defaults: prompts median 24 (max 96), outputs median 8 (max 24), max batch 4, 2 decode steps
a call, 12 requests per rate at 4 and 16 requests/s.

The engine: ``Engine(model, page_size, max_batch, prefill_chunk, decode_steps, max_context = prompt max +
output max, min_chunk_bucket = prefill_chunk, min_table_tokens, mixed_steps, prefill_budget)``: every prefill step
is one T bucket (a row's chunk of up to ``--prefill-chunk`` tokens, all rows padded to it), a mixed step one shape
(every decoding row's token and up to ``--prefill-budget`` prompt tokens; ``--no-mixed``: the alternating
scheduler, where a prefill step makes the decoding rows wait) and block tables come in a few power-of-two widths,
so the steps compile a handful of times. `Engine.warm_up` compiles every step shape the workload's
lengths can meet before the measured rates (a program per block-table width for prefill, and per width and
decode-loop length for decode; JAX's persistent compilation cache, ``--compile-cache``, keeps them for the next
run); the ``compiles`` column counts step compilations during a measured rate (0 expected).

The driver: one thread; at each turn it submits every request whose arrival time has passed, then runs one
engine step (or sleeps until the next arrival when nothing runs). Times are host wall clock; a token's time
is when its step's results reached the host.

Per rate (a row of serve.csv; serve.json holds the rows, the run's settings and every request's lengths,
TTFT and token count):
* ``req_s``: requests / (last token time - first arrival); ``out_tok_s``: output tokens over the same time;
* ``ttft_p50_s`` / ``ttft_p99_s``: first token time - the request's scheduled arrival;
* ``itl_p50_ms`` / ``itl_p99_ms``: the gaps between consecutive tokens of a request, over all requests. A
  decode call makes up to ``--decode-steps`` tokens a row that reach the host together, so most gaps are ~0
  and the p99 shows the stalls (a call's wall time, so at least ``--decode-steps`` steps; prefill steps that
  decode rows wait behind, with ``--no-mixed``; mixed steps, one token each);
* ``tpot_p50_ms`` / ``tpot_p99_ms``: per request, (last token time - first token time) / (tokens - 1);
* ``decode_ms_step``: the median over the rate's decode calls of wall time / model steps of the call;
* ``prefill_steps``, ``decode_calls``, ``max_running`` (requests in slots at once, sampled each turn); mixed
  steps are not in these columns (serve.json's rows and the log line have ``mixed_steps``);
* ``lost``: requests that did not end with exactly their ``max_new_tokens`` tokens (0 expected; the run
  exits with status 1 otherwise).
Greedy check: the first ``--check`` requests of the workload are run alone (``Engine.generate`` on the idle
engine) and their tokens compared with those each rate produced: ``alone_match`` (requests equal / checked)
and ``alone_agree`` (the fraction of tokens equal up to each request's first difference). In float32 (the
tiny config) they must be equal; with random bf16 weights the logits are nearly flat, so a different batch
make-up (another MoE grouping, another reduction order) may flip a near tie. Each difference is judged by
`NearTieJudge` (bf16 runs; `benchmarks.serve_check`): ``alone_ties`` counts those bf16 rounding explains (the two
tokens' float32 logit gap, computed from the model's own bf16 weights upcast a layer at a time, within twice the
bf16 pass's logit error at that position), ``alone_unexplained`` the others; serve.json's rows hold every
judgement. The run exits with status 1 when a difference is unexplained (always, in float32).
serve.png: latency (TTFT p50 / p99, TPOT p50) against output throughput, one point per rate.

Written as the run goes: serve.json and serve.csv after the warm-up (no rows), after each rate and after the
check (serve.json's ``check``: its requests and seconds; ``complete`` true at the end), serve.png after the rates.
A rate or a check that fails (out of device memory) is recorded in serve.json (the rate's row, or ``check``,
with an ``error``: the error's first line), and the run stops with exit status 1 and one line; the figures of
the rates before it stay on disk. A soak that fails leaves soak.json's last figures with its ``error``.

Soak (``--soak-steps N``, after the rates): N engine steps driven step by step, not by the clock: before each
step Poisson(``--soak-arrivals``) new requests of the same length distributions (fresh prompts) are submitted,
and each running request is cancelled with probability 1/500 a step (about one in four of the median output
length); then the running requests finish. soak.json holds the
step compilations after warm-up (0 expected), the device's bytes in use every 500 steps (flat expected: no pages,
buffers or handles kept), the requests lost (one that neither made its max_new_tokens nor was cancelled), and
``--soak-check`` requests drawn at random, run alone on the idle engine and compared as the rates' are; a
progress bar shows the steps, and soak.json is rewritten every 500 steps (``complete`` false until the end),
so a run stopped by a time limit keeps its figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from tqdm import tqdm

import benchmarks as bm
from benchmarks.bench_mla_decode import decode_config
from benchmarks.e2e_models import build_model, kv_dtype_arg, model_config
from benchmarks.serve_check import NearTieJudge, check_alone
from mla_jax.memory import DEFAULT_MEMORY_FRACTION, MemoryPlanError, check_fraction
from models import DeepSeekModel, Engine, compile_cache
from models.serving.engine import PREFILL_BUDGET, trace_counts

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CSV_NAME, JSON_NAME, PNG_NAME = "serve.csv", "serve.json", "serve.png"

# Options whose default differs with --config (full, tiny).
DEFAULTS = {
    "rates": ("1,2,4,8", "4,16"),
    "requests": (40, 12),
    "prompt_median": (512, 24),
    "prompt_max": (8192, 96),
    "output_median": (128, 8),
    "output_max": (512, 24),
    "max_batch": (32, 4),
    "page_size": (64, 16),
    "prefill_chunk": (512, 32),
    "min_table_tokens": (1024, 128),
    "decode_steps": (1, 2),
    "prefill_budget": (PREFILL_BUDGET, 32),
    "dtype": ("bf16", "fp32"),
    "kv_dtype": ("bf16", "fp32"),
}

COLUMNS = [
    "rate",
    "requests",
    "req_s",
    "out_tok_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_ms",
    "itl_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "decode_ms_step",
    "prefill_steps",
    "decode_calls",
    "max_running",
    "compiles",
    "lost",
    "alone_match",
    "alone_agree",
    "alone_ties",
    "alone_unexplained",
    "wall_s",
    "error",
]


# ------------------------------------------------------------------------------------------
# The workload
# ------------------------------------------------------------------------------------------
def lognormal_lengths(rng, n: int, median: float, sigma: float, cap: int) -> list[int]:
    """n lengths, log-normal with `median` and `sigma` (of the log), rounded, clipped to [1, cap]."""
    x = np.exp(rng.normal(math.log(median), sigma, n))
    return [int(v) for v in np.clip(np.rint(x), 1, cap)]


def workload(args, vocab: int) -> list[dict]:
    """The requests: [{"prompt": ids, "max_new_tokens": n}], one fixed set for every rate."""
    rng = np.random.default_rng(args.seed)
    prompts = lognormal_lengths(rng, args.requests, args.prompt_median, args.prompt_sigma, args.prompt_max)
    outputs = lognormal_lengths(rng, args.requests, args.output_median, args.output_sigma, args.output_max)
    return [
        dict(prompt=[int(t) for t in rng.integers(0, vocab, p)], max_new_tokens=o) for p, o in zip(prompts, outputs)
    ]


def arrival_offsets(rng, n: int, rate: float) -> np.ndarray:
    """Seconds from the start at which each of n requests arrives: a Poisson process of `rate` per second."""
    return np.cumsum(rng.exponential(1.0 / rate, n))


# ------------------------------------------------------------------------------------------
# Serving one rate
# ------------------------------------------------------------------------------------------
def pct(values, q: float):
    return float(np.percentile(values, q)) if len(values) else None


def serve(engine: Engine, reqs: list[dict], offsets: np.ndarray) -> tuple[list, dict]:
    """Serve `reqs`, request i submitted once `offsets[i]` seconds have passed -> (handles, counters)."""
    traces0 = sum(trace_counts().values())
    handles, i, max_running = [], 0, 0
    with engine.recording() as stats:
        t0 = time.perf_counter()
        arrive = t0 + offsets
        while i < len(reqs) or engine.num_requests:
            now = time.perf_counter()
            while i < len(reqs) and arrive[i] <= now:
                r = reqs[i]
                handles.append(engine.submit(r["prompt"], max_new_tokens=r["max_new_tokens"]))
                i += 1
            if engine.num_requests:
                engine.step()
                max_running = max(max_running, sum(s is not None for s in engine._sched.slots))
            elif i < len(reqs):
                time.sleep(max(0.0, arrive[i] - time.perf_counter()))
    counters = dict(
        t0=t0,
        arrive=arrive,
        prefill_steps=stats.prefill_steps,
        decode_calls=stats.decode_calls,
        mixed_steps=stats.mixed_steps,
        decode_ms_step=statistics.median(stats.decode_call_ms_per_step) if stats.decode_call_ms_per_step else None,
        max_running=max_running,
        compiles=sum(trace_counts().values()) - traces0,
    )
    return handles, counters


def summarize(rate: float, reqs, handles, c: dict) -> dict:
    """The row of one rate (see the module docstring for each column)."""
    ttft, itl, tpot = [], [], []
    lost = 0
    for h, r, a in zip(handles, reqs, c["arrive"]):
        t = h.token_times
        if h.finish_reason != "length" or len(t) != r["max_new_tokens"]:
            lost += 1
        if t:
            ttft.append(t[0] - a)
            itl += [(y - x) * 1e3 for x, y in zip(t, t[1:])]
            if len(t) > 1:
                tpot.append((t[-1] - t[0]) * 1e3 / (len(t) - 1))
    lost += len(reqs) - len(handles)
    ends = [h.token_times[-1] for h in handles if h.token_times]
    span = max(ends) - c["t0"] if ends else float("nan")
    out_tokens = sum(len(h.token_times) for h in handles)
    return dict(
        rate=rate,
        requests=len(reqs),
        req_s=len(handles) / span,
        out_tok_s=out_tokens / span,
        ttft_p50_s=pct(ttft, 50),
        ttft_p99_s=pct(ttft, 99),
        itl_p50_ms=pct(itl, 50),
        itl_p99_ms=pct(itl, 99),
        tpot_p50_ms=pct(tpot, 50),
        tpot_p99_ms=pct(tpot, 99),
        decode_ms_step=c["decode_ms_step"],
        prefill_steps=c["prefill_steps"],
        decode_calls=c["decode_calls"],
        mixed_steps=c["mixed_steps"],
        max_running=c["max_running"],
        compiles=c["compiles"],
        lost=lost,
        wall_s=span,
    )


def greedy_check(engine: Engine, reqs, outputs: dict, rows: list[dict], n: int, judge) -> dict:
    """The first `n` requests run alone on the idle engine; each rate's row gets `check_alone` of its tokens
    (outputs[rate]) against them -> the phase's record for serve.json."""
    t0 = time.perf_counter()
    alone = [engine.generate([r["prompt"]], max_new_tokens=r["max_new_tokens"]).tokens[0] for r in reqs[:n]]
    for row in rows:
        got = outputs[row["rate"]][:n]
        row.update(check_alone([(r["prompt"], g, a) for r, g, a in zip(reqs, got, alone)], judge))
    return dict(requests=n, judged=judge is not None, wall_s=time.perf_counter() - t0)


def device_bytes() -> int | None:
    """Bytes in use on the first device; on XLA:CPU, which does not say, the process's resident set (the CPU
    device's buffers live there), from /proc (None without it)."""
    stats = jax.devices()[0].memory_stats()
    if stats:
        return stats.get("bytes_in_use")
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def soak(engine: Engine, args, vocab: int, judge: NearTieJudge | None = None, partial=None) -> dict:
    """`--soak-steps` engine steps with requests arriving and leaving (module docstring) -> soak.json's dict.
    `partial(dict)` (optional) is called with the figures so far every 500 steps (a run stopped by a time limit
    keeps them)."""
    rng = np.random.default_rng(args.seed + 2)
    traces0, log0 = sum(trace_counts().values()), len(engine.compile_log)
    runs, memory, steps = [], [], 0  # runs: (handle, prompt, max_new_tokens)
    t0 = time.perf_counter()
    bar = tqdm(total=args.soak_steps, desc="soak", unit="step", mininterval=5)
    with engine.recording() as stats:
        while steps < args.soak_steps or engine.num_requests:
            if steps < args.soak_steps:
                for _ in range(rng.poisson(args.soak_arrivals)):
                    p = lognormal_lengths(rng, 1, args.prompt_median, args.prompt_sigma, args.prompt_max)[0]
                    n = lognormal_lengths(rng, 1, args.output_median, args.output_sigma, args.output_max)[0]
                    prompt = [int(t) for t in rng.integers(0, vocab, p)]
                    runs.append((engine.submit(prompt, max_new_tokens=n), prompt, n))
                running = [h for h, _, _ in runs if not h.done]
                if running and rng.random() < 0.002 * len(running):
                    running[int(rng.integers(len(running)))].cancel()
            engine.step()
            steps += 1
            bar.update(1 if steps <= args.soak_steps else 0)
            if steps % 500 == 0 or steps == 1:
                memory.append(dict(step=steps, bytes_in_use=device_bytes()))
                if partial is not None:
                    partial(
                        dict(
                            engine_steps=steps,
                            requests=len(runs),
                            compiles=sum(trace_counts().values()) - traces0,
                            memory=memory,
                            wall_s=time.perf_counter() - t0,
                            complete=False,
                        )
                    )
    bar.close()
    memory.append(dict(step=steps, bytes_in_use=device_bytes()))
    compiles = sum(trace_counts().values()) - traces0
    compiled = engine.compile_log[log0:]
    cancelled = sum(h.finish_reason == "cancelled" for h, _, _ in runs)
    lost = sum(h.finish_reason != "cancelled" and len(h.output) != n for h, _, n in runs)
    checked = [runs[i] for i in sorted(rng.choice(len(runs), min(args.soak_check, len(runs)), replace=False))]
    pairs = []
    for h, prompt, n in tqdm(checked, desc="soak: checked requests alone", disable=not checked, leave=False):
        ref = engine.generate([prompt], max_new_tokens=n).tokens[0]
        got = h.output
        pairs.append((prompt, got, ref[: len(got)] if h.finish_reason == "cancelled" else ref))
    used = [m["bytes_in_use"] for m in memory if m["bytes_in_use"] is not None]
    return dict(
        engine_steps=steps,
        decode_model_steps=stats.decode_steps,
        mixed_steps=stats.mixed_steps,
        prefill_steps=stats.prefill_steps,
        requests=len(runs),
        cancelled=cancelled,
        lost=lost,
        compiles=compiles,
        compiled=compiled,
        pages_in_use_after=engine.cache.pages_used,
        memory=memory,
        memory_growth_bytes=(used[-1] - used[0]) if used else None,
        **check_alone(pairs, judge),
        wall_s=time.perf_counter() - t0,
    )


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------
def plot(rows: list[dict], path: str, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [r["out_tok_s"] for r in rows]
    for key, label, scale, style in (
        ("ttft_p50_s", "TTFT p50", 1e3, "o-"),
        ("ttft_p99_s", "TTFT p99", 1e3, "o--"),
        ("tpot_p50_ms", "TPOT p50", 1.0, "s-"),
        ("itl_p99_ms", "ITL p99", 1.0, "^:"),
    ):
        pts = [(x, r[key] * scale) for x, r in zip(xs, rows) if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    for x, r in zip(xs, rows):
        if r.get("ttft_p50_s") is not None:
            ax.annotate(
                f"{r['rate']:g}/s", (x, r["ttft_p50_s"] * 1e3), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    ax.set_yscale("log")
    ax.set_xlabel("output tokens / s")
    ax.set_ylabel("ms")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = bm.OneLineParser(
        prog="mla-bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", choices=("full", "tiny"), default="full", help="tiny: a CPU-sized run")
    p.add_argument("--model", choices=("v2-lite", "v3-cut"), default="v2-lite")
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    p.add_argument("--rates", help="comma-separated arrival rates, requests/s (full 1,2,4,8; tiny 4,16)")
    p.add_argument("--requests", type=int, help="requests per rate (full 40; tiny 12)")
    p.add_argument("--prompt-median", type=float, help="median prompt length (full 512; tiny 24)")
    p.add_argument("--prompt-sigma", type=float, default=1.0, help="sigma of the log of the prompt length")
    p.add_argument("--prompt-max", type=int, help="longest prompt (full 8192; tiny 96)")
    p.add_argument("--output-median", type=float, help="median max_new_tokens (full 128; tiny 8)")
    p.add_argument("--output-sigma", type=float, default=0.6, help="sigma of the log of max_new_tokens")
    p.add_argument("--output-max", type=int, help="largest max_new_tokens (full 512; tiny 24)")
    p.add_argument("--max-batch", type=int, help="the engine's slots (full 32; tiny 4)")
    p.add_argument("--page-size", type=int, help="tokens a page (full 64; tiny 16)")
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens a row prefills per step (full 512; tiny 32)")
    p.add_argument("--min-table-tokens", type=int, help="the smallest block-table width (full 1024; tiny 128)")
    p.add_argument("--decode-steps", type=int, help="decode steps a device call (full 1; tiny 2)")
    p.add_argument("--prefill-budget", type=int, help="prompt tokens a mixed step carries (full 256; tiny 32)")
    p.add_argument(
        "--no-mixed", action="store_true", help="no mixed steps: the decoding rows wait for each prefill step (A/B)"
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="weights and compute (full bf16; tiny fp32)")
    p.add_argument("--kv-dtype", help="page format (full bf16; tiny fp32)")
    p.add_argument("--attention-impl", default="auto", help="the engine's attention_impl")
    p.add_argument(
        "--decode-config",
        default="",
        help="the engine's decode-kernel config, by a name of `mla-bench mla_decode --variants` (e.g. pieces, "
        "auto; default: the engine's, per sequence or in pieces chosen each step from the rows' lengths)",
    )
    p.add_argument("--check", type=int, default=4, help="requests checked against their runs alone")
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=DEFAULT_MEMORY_FRACTION,
        metavar="F",
        help="share of the GPU's memory the engine plans for (weights, the largest step's temporaries, the page "
        f"pool; `Engine(memory_fraction=)`) (default: {DEFAULT_MEMORY_FRACTION})",
    )
    p.add_argument("--soak-steps", type=int, default=0, help="after the rates, a soak of this many engine steps")
    p.add_argument("--soak-arrivals", type=float, default=0.15, help="mean new requests a soak step (Poisson)")
    p.add_argument("--soak-check", type=int, default=16, help="soak requests, drawn at random, checked alone")
    p.add_argument("--no-warmup", action="store_true", help="no Engine.warm_up: the first rates compile")
    p.add_argument("--compile-cache", default=None, help="JAX's persistent compilation cache DIR ('off': none)")
    p.add_argument("--seed", type=int, default=0, help="of the workload and the arrivals")
    p.add_argument("--out", default="runs/bench_serve", help="directory for serve.csv / serve.json / serve.png")
    return p


def resolve(args) -> argparse.Namespace:
    """Fill the options left unset with their --config default; exit with one line on a bad value."""
    tiny = args.config == "tiny"
    for name, pair in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, pair[tiny])
    try:
        args.rate_list = [float(x) for x in str(args.rates).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"serve: error: --rates must be comma-separated numbers, got {args.rates!r}") from None
    if not args.rate_list or any(r <= 0 for r in args.rate_list):
        raise SystemExit(f"serve: error: --rates must be positive, got {args.rates!r}")
    for name in (
        "requests",
        "prompt_max",
        "output_max",
        "max_batch",
        "page_size",
        "prefill_chunk",
        "decode_steps",
        "prefill_budget",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(f"serve: error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.soak_steps < 0 or args.soak_arrivals <= 0 or args.soak_check < 0:
        raise SystemExit(
            f"serve: error: --soak-steps and --soak-check must be >= 0 and --soak-arrivals > 0, got "
            f"{args.soak_steps}, {args.soak_check} and {args.soak_arrivals}"
        )
    try:
        check_fraction(args.memory_fraction, "--memory-fraction")
    except ValueError as e:
        raise SystemExit(f"serve: error: {e}") from None
    if args.check < 0 or args.check > args.requests:
        raise SystemExit(f"serve: error: --check must be in [0, --requests={args.requests}], got {args.check}")
    return args


def build_engine(args, cache_fill: float = 0.0) -> tuple[Engine, object, float, DeepSeekModel]:
    """The model (random weights) and the engine the run serves with -> (engine, its ModelConfig, build seconds,
    the model: the greedy check's `NearTieJudge` reads it); `cache_fill`: the value of never-written cache rows
    (tests poison them with NaN)."""
    cfg = model_config(args.model, config=args.config, layers=args.layers, kv_dtype=args.kv_dtype)
    model, build_s = build_model(cfg, jnp.bfloat16 if args.dtype == "bf16" else jnp.float32)
    engine = Engine(
        model,
        page_size=args.page_size,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        decode_steps=args.decode_steps,
        max_context=min(cfg.max_position_embeddings, args.prompt_max + args.output_max),
        min_chunk_bucket=args.prefill_chunk,
        min_table_tokens=args.min_table_tokens,
        kv_dtype=kv_dtype_arg(args.kv_dtype),
        attention_impl=args.attention_impl,
        cache_fill=cache_fill,
        mixed_steps=not args.no_mixed,
        prefill_budget=args.prefill_budget,
        decode_config=decode_config(args.decode_config),
        memory_fraction=args.memory_fraction,
    )
    return engine, cfg, build_s, model


def main(argv=None):
    args = resolve(parser().parse_args(argv))
    os.makedirs(args.out, exist_ok=True)
    compile_cache.enable(args.compile_cache)
    header = dict(bm.run_header() if jax.default_backend() == "gpu" else {}, backend=jax.default_backend())
    try:
        engine, cfg, build_s, model = build_engine(args)
    except MemoryPlanError as e:  # the weights, or one sequence beside them, do not fit: said before anything runs
        raise SystemExit(f"serve: error: {e}") from None
    reqs = workload(args, cfg.vocab_size)
    bm.log(
        f"# serve: {args.model} ({args.config}, {args.dtype}), {len(reqs)} requests a rate, prompts "
        f"{min(len(r['prompt']) for r in reqs)}..{max(len(r['prompt']) for r in reqs)} tokens, outputs "
        f"{min(r['max_new_tokens'] for r in reqs)}..{max(r['max_new_tokens'] for r in reqs)}; engine B="
        f"{args.max_batch}, {engine.num_pages} pages of {args.page_size}, backend {engine.backend}, "
        f"{'alternating steps' if args.no_mixed else f'mixed steps of {engine.prefill_budget} prompt tokens'}; "
        f"model built in {build_s:.1f} s"
    )
    rng = np.random.default_rng(args.seed + 1)
    offsets = {rate: arrival_offsets(rng, len(reqs), rate) for rate in args.rate_list}
    t_warm = time.perf_counter()
    warm_compiles, warm_s = 0, 0.0
    if not args.no_warmup:
        longest = max(len(r["prompt"]) + r["max_new_tokens"] for r in reqs)
        if args.soak_steps:  # the soak draws fresh requests, up to the longest the distributions allow
            longest = max(longest, args.prompt_max + args.output_max)
        warm_compiles = engine.warm_up(min(longest, engine.max_context), progress=True)
        warm_s = time.perf_counter() - t_warm
        bm.log(f"# warm-up: {warm_compiles} step compilations, {warm_s:.1f} s")
    judge = NearTieJudge(model) if args.dtype != "fp32" else None
    settings = {k: v for k, v in vars(args).items() if k != "rate_list"}
    rows, outputs = [], {}
    report = dict(
        header=header,
        settings=settings,
        engine=dict(
            num_pages=engine.num_pages,
            max_context=engine.max_context,
            backend=engine.backend,
            mixed_steps=engine.mixed_steps,
            prefill_budget=engine.prefill_budget,
            memory_plan=None if engine.memory_plan is None else dataclasses.asdict(engine.memory_plan),
            step_temporaries=engine.step_temporaries,
        ),
        build_s=build_s,
        warm_up=dict(compiles=warm_compiles, seconds=warm_s),
        requests=[dict(prompt=len(r["prompt"]), max_new_tokens=r["max_new_tokens"]) for r in reqs],
        rows=rows,
        check=None,
        complete=False,
        compile_log=engine.compile_log,
    )
    json_path = os.path.join(args.out, JSON_NAME)

    def save():  # after each phase: a failure later keeps what came before
        bm.write_csv(os.path.join(args.out, CSV_NAME), [{k: r.get(k, "") for k in COLUMNS} for r in rows])
        bm.write_json(json_path, dict(report, compile_log=engine.compile_log))

    def failed(what: str, at: dict):
        save()
        raise SystemExit(f"serve: error: {what} failed: {at['error']}; what came before is in {json_path}")

    save()
    for rate in args.rate_list:
        try:
            handles, counters = serve(engine, reqs, offsets[rate])
        except Exception as e:  # noqa: BLE001 - the rates before keep their figures; the engine's state is unknown
            rows.append(dict(rate=rate, requests=len(reqs), error=bm.one_line(e)))
            failed(f"rate {rate:g}/s", rows[-1])
        row = summarize(rate, reqs, handles, counters)
        outputs[rate] = [h.output for h in handles]
        rows.append(row)
        save()
        bm.log(
            f"rate {rate:g}/s: {row['req_s']:.2f} req/s, {row['out_tok_s']:.0f} tok/s, TTFT p50 "
            f"{row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.3f} s, ITL p99 {row['itl_p99_ms']:.1f} ms, TPOT p50 "
            f"{row['tpot_p50_ms']:.1f} ms, decode {row['decode_ms_step'] or float('nan'):.2f} ms/step, "
            f"{row['prefill_steps']} prefill / {row['mixed_steps']} mixed steps, {row['compiles']} compiles, "
            f"{row['lost']} lost"
        )
    title = (
        f"serve: {args.model} ({args.config}), B={args.max_batch}, {len(reqs)} requests a rate, "
        f"{header.get('device', jax.default_backend())}"
    )
    plot(rows, os.path.join(args.out, PNG_NAME), title)
    try:
        report["check"] = greedy_check(engine, reqs, outputs, rows, args.check, judge)
    except Exception as e:  # noqa: BLE001 - the rates keep their figures
        report["check"] = dict(requests=args.check, error=bm.one_line(e))
    bm.print_table(rows, [(k, k, "{:.4g}" if k not in ("rate", "alone_match") else "{}") for k in COLUMNS])
    if report["check"].get("error"):
        failed("the greedy check against runs alone", report["check"])
    report["complete"] = not args.soak_steps
    save()
    bm.log(f"# wrote {CSV_NAME}, {JSON_NAME}, {PNG_NAME} in {args.out}")
    soaked = None
    if args.soak_steps:
        soak_json = os.path.join(args.out, "soak.json")
        last = {}

        def partial(d):
            last.update(d)
            bm.write_json(soak_json, dict(header=header, settings=settings, **d))

        try:
            soaked = soak(engine, args, cfg.vocab_size, judge, partial=partial)
        except Exception as e:  # noqa: BLE001 - soak.json keeps its last figures, with the error
            bm.write_json(soak_json, dict(header=header, settings=settings, **last, error=bm.one_line(e)))
            raise SystemExit(f"serve: error: the soak failed: {bm.one_line(e)}; its figures so far are in {soak_json}")
        bm.write_json(soak_json, dict(header=header, settings=settings, complete=True, **soaked))
        report["complete"] = True
        save()
        bm.log(
            f"# soak: {soaked['engine_steps']} engine steps ({soaked['decode_model_steps']} decode model steps, "
            f"{soaked['mixed_steps']} mixed), {soaked['requests']} requests ({soaked['cancelled']} cancelled), "
            f"{soaked['lost']} lost, {soaked['compiles']} compiles, {soaked['pages_in_use_after']} pages left, "
            f"device memory growth {soaked['memory_growth_bytes']} B, alone {soaked['alone_match']} "
            f"(agree {soaked['alone_agree']}, near ties {soaked['alone_ties']}, unexplained "
            f"{soaked['alone_unexplained']}), {soaked['wall_s']:.0f} s"
        )
    tied = [r["rate"] for r in rows if r["alone_ties"]]
    if tied:
        bm.log(f"# NOTE: at rates {tied} some checked requests differ from their runs alone at a near tie (alone_ties)")
    if any(r["lost"] for r in rows) or (soaked and (soaked["lost"] or soaked["pages_in_use_after"])):
        bm.log("# ERROR: requests lost (the lost column, or the soak's lost / pages left)")
        sys.exit(1)
    if any(r["alone_unexplained"] for r in rows) or (soaked and soaked["alone_unexplained"]):
        bm.log("# ERROR: requests differ from their runs alone beyond a near tie (alone_unexplained, 'differences')")
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
