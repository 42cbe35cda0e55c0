"""End-to-end generation benchmark: a DeepSeek-V2-Lite-shaped and a DeepSeek-V3-shaped model (random bf16
weights) through the public engine, against its weight-read floor, with Hugging Face transformers as a peer.

Usage: ``python -m benchmarks e2e [--quick] [--model v2-lite,v3-cut] [--batch 1,8] [--prompt 1024] [--out DIR]``
(``--help`` for every option; ``--config tiny`` runs the whole path on a CPU in under a minute: its cells are
`tiny_cells`, from the tiny models' context, unless ``--batch`` / ``--prompt`` / ``--cells`` name others).

Models (no download; `DeepSeekModel` with its default init, std 0.02, so routing is roughly uniform):
* ``v2-lite``: `ModelConfig.deepseek_v2_lite()` (27 layers, 64 experts top-6, 15.7B parameters, 31 GB bf16).
* ``v3-cut``: `ModelConfig.deepseek_v3()` cut to ``--layers`` layers (default 5: 3 dense + 2 MoE) with its
  MTP layer; a V3 MoE layer is ~22.5 GB of experts, so 5 layers + MTP are ~76 GB.
``--weights fp8``: the projections and routed experts in FP8 as DeepSeek-V3 releases them (e4m3 + 128x128 block
scales, `mla_jax.fp8_weights`; random e4m3 values of the init's spread), the rest in ``--dtype``; the decode
floor then counts those weights at 1 byte (+ their scales). One device only (no FP8 placement on a mesh yet).

Per cell (model, batch B, prompt T; random prompt ids, ``--new-tokens`` N = 128 greedy tokens) through
``Engine(model, page_size=64, num_pages=B * ceil((T + N + draft room) / 64), max_batch=B).generate``:
* cold: the first generate of these shapes in this process = tracing + compilation + one run. Reported:
  ``cold_compile_s`` = cold wall - warm wall, the engine's ``compile_s`` (wall of the steps that compiled)
  and, when the engine keeps one, its ``compile_log`` (seconds per compiled step bucket);
* warm: a second, identical generate: ``ttft_s`` (generate start -> the first streamed token; with B rows
  prefilled together that is the whole batch's prefill), prefill and decode seconds from the engine's stats
  (warm steps; host-driven, so wall clock), ``decode_ms_step`` = decode seconds / decode steps;
* prefill MFU = prefill FLOPs / prefill seconds / the bf16 matmul rate measured in the same run, with
    FLOPs = 2 * (matmul parameters a token passes through) * B * T  + 2 * D * V * B  + attention,
    parameters a token passes through = attention projections, dense MLPs, shared experts, its top-K routed
    experts and the routers (the LM head is counted once per sequence: generation needs only the last
    position's logits, and that is what the engine computes);
    attention = 2 * layers * H * (qk_head_dim + v_head_dim) * B * T(T+1)/2 (causal, decompressed path);
* decode x floor = decode ms/step / floor ms, floor = `decode_floor_bytes` / the copy bandwidth measured in
  the same run: every weight the step must read (attention, dense MLPs, shared experts, routers, norms,
  LM head, the B embedding rows) plus the routed experts the batch is expected to touch,
  E * (1 - (1 - K/E)^B) per MoE layer, plus the latent cache read, sum(seq_lens) * layers * the planner's
  bytes a token of ``--kv-dtype`` (`mla_jax.capacity.latent_bytes_per_token_layer`: 576 * 2 B in bf16,
  656 B in fp8).
  The context is the mean over the decode steps, T + N/2.
* ``--ragged``: each cell's B prompts have lengths drawn uniformly from [T // 16, T] (`prompt_lengths`, seeded
  by the cell), the mix continuous batching decodes; the row's ``lengths`` and ``prompt_mean`` say so, prefill
  FLOPs and tok/s count the rows' own lengths, the floor's context is their mean + N/2; no HF peer.
Other columns: ``compiles`` (step compilations of the cold generate), ``ttft_stats_s`` (the engine's own
TTFT when its stats carry one), ``same_tokens`` (the warm generate reproduced the cold one's tokens),
``experts_touched`` (the expected distinct experts per MoE layer of a decode step), ``peak_mem_gb`` (the
process's peak device memory so far: JAX never resets it, so it is the cell's own only in a run of growing
cells), ``build_s`` / ``weights_gb`` (the model's construction). ``e2e.jsonl`` holds every row with the
engine's full compile log.
HF peer (``--no-hf`` to skip): `transformers`' DeepseekV2ForCausalLM (V3: DeepseekV3ForCausalLM, with
``--hf-models``) from `cfg.to_hf_dict()`, bf16 random weights on the GPU, same prompts: one forward over the
prompt (logits of the last position only, as ours) timed as prefill, then N-1 cached greedy steps timed as
decode. A cell that would not fit (estimated) or whose prefill is estimated above ``--hf-cell-limit`` seconds
is "skipped (reason)"; the decode loop stops at that limit and reports the steps it ran.

On a device mesh (``--mesh SPEC``, repeatable; ``1`` is one device): each mesh in turn builds the model
straight into its shardings (`mla_jax.sharding.model_shardings`; the same random weights as one device) and
runs the cells through ``Engine(..., mesh=...)``: tensor parallelism over heads, expert parallelism over the
routed experts, ``data`` = D > 1 a page pool a data rank (data-parallel attention). Its rows are
``impl`` = ``ours@SPEC`` with ``devices`` and ``pool_devices`` (the devices holding the engine's page
pool); ``agree_one_device`` is the fraction of greedy tokens equal to the one-device run of the same cell
(earlier in the same run), counted per request up to its first difference (random models' logits are
nearly flat, so a reduction order may flip one; a wrong layout flips them all). The floor columns stay
one device's: on a mesh ``x_floor`` < 1 is possible, and ``decode_ms_step`` beside the one-device row's is
the comparison. A cell whose B the data ranks do not divide is a "skipped" row.

Processes: the driver never touches the GPU. Our cells run in one fresh worker process per run of
consecutive same-model cells (clean memory, cold compiles), then the HF peer in its own process, so JAX's
preallocation and torch never share the GPU. Every finished cell is appended to ``e2e.csv`` at once (a
killed run keeps its rows); a failing cell becomes a row with the error's first line (its ``error``), the run
goes on to the next cell and ends with exit status 1 and one line naming the first failure. ``--time-budget``
stops starting cells (ours stop ``--hf-reserve`` seconds early so the peer gets its turn) and stops a worker
still running ``--cell-grace`` seconds past it: its cells are rows noted "cut by the time budget", not failures.
``--ttft-subprocess`` instead runs the first cell twice in fresh processes with JAX's persistent compilation
cache on (``--compile-cache DIR``, default a fresh temporary folder) and reports, per process, the
time from generate to the first token, from process launch to the first token, and the process wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import benchmarks as bm
from benchmarks.e2e_cells import (
    CSV_NAME,
    DEFAULT_BATCHES,
    DEFAULT_PROMPTS,
    JSONL_NAME,
    META_NAME,
    QUICK_CELLS,
    RAGGED_SHORTEST,
    TINY_CELLS_TEXT,
    append_row,
    format_cells,
    grid,
    lengths_label,
    make_prompts,
    mesh_label,
    parse_cells,
    parse_meshes,
    prompt_lengths,
    read_meta,
    segments,
    token_agreement,
)
from benchmarks.e2e_floor import (
    decode_floor_bytes,
    derive,
    expected_experts_touched,
    layer_counts,
    param_counts,
    prefill_flops,
    total_params,
)
from benchmarks.e2e_kernels import KERNEL_TOKENS, kernel_profile
from benchmarks.e2e_models import KV_DTYPES, MODELS, build_model, kv_dtype_arg, kv_pages, model_config
from benchmarks.e2e_ours import EXIT_NO_GPU, run_ours_worker, run_ttft_worker, warm_prefill_seconds
from benchmarks.e2e_report import report
from benchmarks.hf_peer import run_hf_worker
from mla_jax import fp8_weights
from models import DeepSeekModel

# The command's parts live in benchmarks.e2e_models (the models), e2e_cells (cells, prompts, rows), e2e_floor (the
# floor and FLOPs arithmetic), e2e_ours (our engine's worker), e2e_kernels (--kernels), hf_peer (the HF peer) and
# e2e_report (table and plot); the names the benchmarks and the tests use stay importable here.
__all__ = [
    "DeepSeekModel",
    "EXIT_NO_GPU",
    "QUICK_CELLS",
    "build_model",
    "decode_floor_bytes",
    "derive",
    "drive",
    "expected_experts_touched",
    "format_cells",
    "grid",
    "kernel_profile",
    "kv_dtype_arg",
    "kv_pages",
    "layer_counts",
    "lengths_label",
    "main",
    "make_prompts",
    "mesh_label",
    "model_config",
    "param_counts",
    "parse_cells",
    "parse_meshes",
    "parser",
    "prefill_flops",
    "prompt_lengths",
    "read_meta",
    "report",
    "run_worker",
    "segments",
    "token_agreement",
    "total_params",
    "warm_prefill_seconds",
]

TTFT_CSV = "e2e_ttft.csv"


# ------------------------------------------------------------------------------------------
# Time to first token of fresh processes with the persistent compilation cache
# ------------------------------------------------------------------------------------------
def _cache_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path)) if os.path.isdir(path) else 0


def run_ttft(args, argv) -> list[dict]:
    """--ttft-subprocess: the first cell twice, each in a fresh process with the persistent cache on."""
    os.makedirs(args.out, exist_ok=True)
    # Not under --out by default: a GPU run's $OUT comes back to the caller, and the cache can be large.
    cache = args.compile_cache or tempfile.mkdtemp(prefix="mla_e2e_jax_cache_")
    name, b, t = grid(args)[0]
    rows = []
    for run in (1, 2):
        files0 = _cache_files(cache)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result = f.name
        cmd = worker_command(
            argv, "ttft", cells=f"{name}:{b}x{t}", extra=["--compile-cache", cache, "--result-file", result]
        )
        bm.log(f"# TTFT run {run}: fresh process, compilation cache {files0} files")
        t_launch = time.time()
        rc = subprocess.run(cmd, env=worker_env(args)).returncode
        t_exit = time.time()
        row = dict(
            model=name,
            B=b,
            prompt=t,
            new_tokens=args.new_tokens,
            run=run,
            cache_files_before=files0,
            cache_files_after=_cache_files(cache),
            process_wall_s=t_exit - t_launch,
        )
        try:
            with open(result) as f:
                r = json.load(f)
            row.update(
                ttft_s=r["t_first_token"] - r["t_generate"],
                launch_to_first_token_s=r["t_first_token"] - t_launch,
                startup_s=r["t_start"] - t_launch,
                build_s=r["build_s"],
                compile_s=r["compile_s"],
            )
        except (OSError, ValueError, KeyError) as e:
            row["error"] = f"worker exited with code {rc}: {bm.one_line(e)}"
        finally:
            if os.path.exists(result):
                os.remove(result)
        rows.append(row)
        bm.write_csv(os.path.join(args.out, TTFT_CSV), rows)
        bm.log("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print()
    bm.print_table(
        rows,
        [
            ("model", "model", "{}"),
            ("B", "B", "{}"),
            ("prompt", "prompt", "{}"),
            ("run", "run", "{}"),
            ("cache_files_before", "cache files", "{}"),
            ("ttft_s", "generate->1st tok s", "{:.2f}"),
            ("launch_to_first_token_s", "launch->1st tok s", "{:.2f}"),
            ("process_wall_s", "process s", "{:.2f}"),
            ("error", "error", "{}"),
        ],
    )
    print(f"# compilation cache: {cache}")
    bm.exit_if_failed("e2e", rows, os.path.join(args.out, TTFT_CSV), name=lambda r: f"run {r['run']}")
    return rows


# ------------------------------------------------------------------------------------------
# The driver: workers in order, then the report
# ------------------------------------------------------------------------------------------
def worker_env(args) -> dict:
    """The workers' environment: the project importable; JAX may take most of the GPU (the V3 cut needs
    ~76 GB of weights; more than 0.9 leaves too little to cuBLAS and the torch copy ceiling) unless the
    caller chose otherwise."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    return env


def portable_command(argv) -> str:
    """This run's command line, with the GPU machine's $OUT spelt as $OUT (as `benchmarks.run_header`)."""
    cmd = shlex.join(["python", "-m", "benchmarks", "e2e", *argv])
    out = os.environ.get("OUT")
    return cmd.replace(out, "$OUT") if out else cmd


def worker_command(argv, kind: str, *, cells: str, extra=()) -> list[str]:
    """This command line again, as a worker of `kind` over `cells` (later flags override earlier ones)."""
    return [
        sys.executable,
        "-m",
        "benchmarks",
        "e2e",
        *argv,
        "--worker",
        kind,
        "--cells",
        cells,
        "--header-command",
        portable_command(argv),
        *extra,
    ]


def _cells_with_rows(out_dir: str) -> set:
    path = os.path.join(out_dir, CSV_NAME)
    return {(r["model"], r["impl"], r["B"], r["prompt"]) for r in (bm.read_csv(path) if os.path.exists(path) else [])}


def drive(args, argv) -> list[dict]:
    """Our cells (a worker process per run of same-model cells), then the HF peer (a process per model), then
    the report."""
    os.makedirs(args.out, exist_ok=True)
    for f in (CSV_NAME, JSONL_NAME, META_NAME):  # this run's rows only
        if os.path.exists(os.path.join(args.out, f)):
            os.remove(os.path.join(args.out, f))
    cells = grid(args)
    # the HF peer runs equal-length batches only (its generate pads nothing here)
    hf_models = (
        [] if args.no_hf or args.ragged else [m for m in args.hf_models.split(",") if any(c[0] == m for c in cells)]
    )
    deadline = time.time() + args.time_budget if args.time_budget else None
    ours_deadline = deadline - (args.hf_reserve if hf_models else 0) if deadline else None
    print(f"# e2e: {len(cells)} cells ({format_cells(cells)}); HF peer: {', '.join(hf_models) or 'off'}", flush=True)
    # A worker per run of same-model cells (clean GPU memory); the tiny models share one (each start costs seconds).
    for i, seg in enumerate([cells] if args.config == "tiny" else segments(cells)):
        extra = ["--reuse-ceilings"] if i else []
        rc = run_worker(args, argv, "ours", format_cells(seg), extra, ours_deadline)
        if rc == EXIT_NO_GPU:
            raise SystemExit(EXIT_NO_GPU)
        have = _cells_with_rows(args.out)
        # A worker that died leaves its cells without a row: an error, unless the budget's deadline stopped it
        # (the cell in flight and those after it are then cut, as the budget asked, not failed).
        why = (
            dict(note=f"cut by the time budget (its worker stopped {args.cell_grace:.0f} s past it)")
            if rc == EXIT_CUT
            else dict(error=f"worker exited with code {rc} before this cell")
        )
        for m, b, t in seg:
            for label in map(mesh_label, parse_meshes(args.mesh)):
                if (m, label, b, t) not in have:
                    append_row(args.out, dict(model=m, impl=label, B=b, prompt=t, new_tokens=args.new_tokens, **why))
    for m in hf_models:
        rc = run_worker(args, argv, "hf", format_cells([c for c in cells if c[0] == m]), [], deadline)
        if rc not in (0, EXIT_CUT):
            bm.log(f"# HF peer {m}: worker exited with code {rc}")
    rows = report(os.path.join(args.out, CSV_NAME), args.out)
    bm.exit_if_failed("e2e", rows, os.path.join(args.out, CSV_NAME), name=cell_name)
    return rows


def cell_name(row: dict) -> str:
    return f"{row['model']} {row['impl']} B={row['B']} prompt={row['prompt']}"


EXIT_CUT = -124  # run_worker's code for a worker it stopped at the budget's deadline (no process exits with it)


def run_worker(args, argv, kind: str, cells: str, extra, deadline) -> int:
    """Runs a worker in a fresh process (in this one with --in-process) -> its exit code, or ``EXIT_CUT``. With a
    deadline, the worker starts no cell after it and is stopped --cell-grace seconds after it."""
    extra = list(extra) + (["--deadline", repr(deadline)] if deadline else [])
    cmd = worker_command(argv, kind, cells=cells, extra=extra)
    if args.in_process:
        try:
            main(cmd[4:])
            return 0
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
    timeout = max(60.0, deadline - time.time() + args.cell_grace) if deadline else None
    try:
        return subprocess.run(cmd, env=worker_env(args), timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        bm.log(f"# {kind} worker ({cells}) stopped by the time budget after {timeout:.0f} s")
        return EXIT_CUT


# ------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = bm.OneLineParser(
        prog="python -m benchmarks e2e", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="v2-lite,v3-cut", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument(
        "--batch", help=f"comma-separated batch sizes (default: {DEFAULT_BATCHES}; --config tiny: its cells)"
    )
    p.add_argument(
        "--prompt",
        help=f"comma-separated prompt lengths in tokens (default: {DEFAULT_PROMPTS}; --config tiny: its cells)",
    )
    p.add_argument(
        "--cells",
        default="",
        help='explicit cells in order, e.g. "v2-lite:1x1024,8x1024;v3-cut:1x1024" (overrides --batch/--prompt/--quick)',
    )
    p.add_argument("--quick", action="store_true", help="the reference cells: " + format_cells(QUICK_CELLS))
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (greedy)")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="main layers of every model (the V3 cut's default 5: 3 dense + 2 MoE; V2-Lite's 27)",
    )
    p.add_argument(
        "--config",
        choices=("full", "tiny"),
        default="full",
        help="tiny: ModelConfig.tiny()-sized models on a CPU (no GPU ceilings), in one worker process; without "
        f"--batch / --prompt / --cells its cells are {TINY_CELLS_TEXT}",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights and compute")
    p.add_argument(
        "--weights",
        choices=("bf16", "fp8"),
        default="bf16",
        help="bf16: every weight dense in --dtype; fp8: the projections and routed experts in FP8 as DeepSeek-V3 "
        "releases them (e4m3 + 128x128 block scales), compute in --dtype; one device",
    )
    p.add_argument(
        "--fp8-impl",
        choices=fp8_weights.FP8_GEMM_IMPLS,
        default="auto",
        help="--weights fp8: how FP8 projections called as modules compute (prefill-sized calls; auto: the Mosaic "
        "GPU FP8 GEMM on a Hopper GPU; reference: dequantize + XLA dot); decode reads the stacks by the kernels",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="bf16",
        help="the engine's page format; fp8: 656-byte tokens, fp4: 416-byte tokens, and the decode floor "
        "reads the planner's bytes a token of that format (default: bf16)",
    )
    p.add_argument(
        "--mtp",
        choices=("off", "on", "both"),
        default="off",
        help="speculative decoding with the MTP head, for models that have one",
    )
    p.add_argument(
        "--mtp-oracle",
        type=float,
        default=None,
        metavar="RATE",
        help="MTP cells draft the tokens plain greedy decoding makes, each right with probability RATE "
        "(random weights draft noise; this times the verify path at a chosen acceptance)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        help="prompt tokens a row prefills per step (0: the engine default, models.serving.options."
        "default_prefill_chunk)",
    )
    p.add_argument(
        "--decode-steps", type=int, default=1, help="the engine's decode_steps: model steps a device call runs"
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help=f"per decode step: kernels, CUPTI device time, host gap and the top kernels (a GPU; two more "
        f"generations of {KERNEL_TOKENS[0]} and {KERNEL_TOKENS[1]} new tokens a cell; kernels_<cell>.json)",
    )
    p.add_argument("--attention-impl", default="auto", help="the engine's attention_impl")
    p.add_argument(
        "--decode-config",
        default="",
        help="the engine's decode-kernel config, by a name of `mla-bench mla_decode --variants` (e.g. pieces, "
        "auto; default: the engine's, per sequence or in pieces chosen each step from the rows' lengths)",
    )
    p.add_argument(
        "--mesh",
        action="append",
        metavar="SPEC",
        help="run our cells on this device mesh (mla_jax.sharding.parse_mesh: e.g. tensor=2, expert=2, "
        "data=2 (a page pool a data rank), data=2,tensor=2), or 1 for one device; repeat it to run "
        "several in order, each with the model built straight into its shardings. Rows: impl "
        "ours@SPEC, agree_one_device = the greedy tokens' agreement with a one-device run of the "
        "same cell given before it (default: one device only)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    p.add_argument("--out", default="runs/bench_e2e", help="directory for e2e.csv / e2e.png / e2e_meta.json")
    p.add_argument("--ceiling-iters", type=int, default=30, help="CUPTI iterations of the ceiling measurements")
    p.add_argument("--time-budget", type=float, default=0, help="seconds after which no new cell starts (0: none)")
    p.add_argument("--hf-reserve", type=float, default=120, help="seconds of the budget kept for the HF peer")
    p.add_argument(
        "--cell-grace",
        type=float,
        default=300,
        help="seconds past the budget before a worker still running is stopped (its cells: rows noted cut)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers peer")
    p.add_argument(
        "--ragged",
        action="store_true",
        help=f"each cell's B prompts of lengths uniform in [T // {RAGGED_SHORTEST}, T] (a continuous-batching "
        "step's mix; the floor counts their mean; no HF peer)",
    )
    p.add_argument("--hf-models", default="v2-lite", help="models the HF peer runs (v3-cut: DeepseekV3ForCausalLM)")
    p.add_argument("--hf-attn", default="sdpa", help="HF attn_implementation (sdpa, eager, ...)")
    p.add_argument("--hf-cell-limit", type=float, default=60, help="seconds an HF cell may take")
    p.add_argument("--compile-cache", default="", help="enable JAX's persistent compilation cache in DIR")
    p.add_argument(
        "--ttft-subprocess",
        action="store_true",
        help="run the first cell twice in fresh processes with the persistent cache; report TTFT",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the workers in this process (debugging; JAX and torch then share the GPU)",
    )
    p.add_argument("--from-csv", help="no run: re-report an e2e.csv (with the e2e_meta.json beside it) into --out")
    # Set by the driver for its workers.
    for flag, kw in (
        ("--worker", dict(choices=("ours", "hf", "ttft"))),
        ("--deadline", dict(type=float)),
        ("--reuse-ceilings", dict(action="store_true")),
        ("--header-command", dict(default="")),
        ("--result-file", dict(default="")),
    ):
        p.add_argument(flag, help=argparse.SUPPRESS, **kw)
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.new_tokens < 2:
        raise SystemExit("e2e: error: --new-tokens must be >= 2 (one prefill token and at least one decode step)")
    try:
        parse_meshes(args.mesh)
    except ValueError as e:
        raise SystemExit(f"e2e: error: --mesh: {e}") from None
    if args.worker == "ours":
        return run_ours_worker(args)
    if args.worker == "hf":
        return run_hf_worker(args)
    if args.worker == "ttft":
        return run_ttft_worker(args)
    if args.from_csv:
        return report(args.from_csv, args.out)
    if args.ttft_subprocess:
        return run_ttft(args, argv)
    return drive(args, argv)


if __name__ == "__main__":
    main()
