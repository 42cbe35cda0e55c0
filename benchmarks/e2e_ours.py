"""Our side of `mla-bench e2e`, in a worker process: each cell through the public engine (a cold then a warm
`Engine.generate`, one device or a mesh) into a row, the worker over a run of cells (model built once per mesh,
rows appended as they finish), the ceilings the rows are measured against, and the TTFT worker of
``--ttft-subprocess`` (one fresh process, one generate)."""

from __future__ import annotations

import gc
import itertools
import json
import sys
import time

import jax
import jax.numpy as jnp

import benchmarks as bm
from benchmarks.bench_mla_decode import decode_config
from benchmarks.e2e_cells import (
    append_row,
    grid,
    lengths_label,
    make_prompts,
    mesh_label,
    parse_meshes,
    read_meta,
    stat,
    token_agreement,
    write_meta,
)
from benchmarks.e2e_floor import cpu_ceilings, derive, total_params
from benchmarks.e2e_kernels import kernel_profile
from benchmarks.e2e_models import (
    PAGE,
    build_model,
    kv_dtype_arg,
    kv_pages,
    model_config,
    model_weights,
    set_fp8_impl,
    sync_engine,
    weights_bytes,
    weights_label,
)
from benchmarks.e2e_report import summary
from mla_jax.memory import MemoryPlanError
from mla_jax.sharding import make_mesh
from models import Engine, SamplingParams, compile_cache
from models.serving.engine import trace_counts

EXIT_NO_GPU = 3  # a worker's exit status when it needs a GPU and has none


def worker_ceilings(args, tiny: bool) -> tuple[dict, dict]:
    """(header, ceilings): measured now (and stored in e2e_meta.json), or the ones an earlier worker of this run
    stored there (``--reuse-ceilings``)."""
    meta = read_meta(args.out)
    if args.reuse_ceilings and meta.get("ceilings"):
        return meta, meta["ceilings"]
    if tiny:
        header = bm.run_header()
        print(f"# e2e benchmark on {header['device']}, jax {header['jax']}, {header['date']}")
        ceil = cpu_ceilings()
    else:
        header, ceil = bm.begin_run("e2e", args.out, args.ceiling_iters)
    header["command"] = args.header_command or header["command"]
    # With the persistent cache on, a "cold" generate may load its executables from disk instead of compiling.
    header["compile_cache"] = jax.config.jax_compilation_cache_dir or ""
    meta.update(header, ceilings=ceil)
    write_meta(args.out, meta)
    return meta, ceil


def enable_compile_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path`, for every compilation, as the CLIs turn it on."""
    compile_cache.enable(path)


def _trace_total():
    return sum(trace_counts().values())


def _peak_mem_gb():
    try:
        s = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        return None
    peak = s.get("peak_bytes_in_use")
    return peak / 1e9 if peak else None


def _check_result(res, batch: int, new_tokens: int) -> None:
    errors = [e for e in (getattr(res, "errors", None) or []) if e]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]}")
    short = [len(t) for t in res.tokens if len(t) != new_tokens]
    if len(res.tokens) != batch or short:
        raise RuntimeError(f"expected {batch} x {new_tokens} new tokens, got lengths {short[:4]}")


def _compile_buckets(entries) -> str:
    return "; ".join(f"{e.get('step')}[{e.get('bucket')}] {float(e.get('seconds', 0)):.2f}s" for e in entries)


def warm_seconds(stats, kind: str):
    """Warm wall seconds of the prefill / decode steps: stats[kind_s] when the engine reports it, else
    tokens / the warm rate."""
    s = stat(stats, f"{kind}_s")
    if s:
        return float(s)
    rate, n = stat(stats, f"{kind}_tok_s"), stat(stats, f"{kind}_tokens")
    return n / rate if rate and n else None


def warm_prefill_seconds(stats):
    """The warm seconds a cell's prompt tokens took: the prefill steps', plus the mixed steps' when there were
    warm prefill steps to time. A ragged batch's long prompts finish in mixed steps beside the short ones'
    decode rows, and their tokens count in the cell's prompt tokens; without their steps' time the rate credited
    them for free (a ragged cell's prefill MFU could then exceed 100 %)."""
    seconds = warm_seconds(stats, "prefill")
    if stat(stats, "prefill_s") and stat(stats, "mixed_s"):
        seconds += stat(stats, "mixed_s")
    return seconds


def run_cell(model, cfg, name: str, batch: int, prompt: int, args, ceil, *, mtp: bool, mesh=None, sizes=None) -> dict:
    """One cell through the public engine API: a cold then a warm generate -> a row (see
    `benchmarks.e2e_cells.COLUMNS`); on `mesh` (`sizes` its {axis: size}) when given. The row keeps the warm
    tokens under "tokens"."""
    N = args.new_tokens
    row = dict(
        model=name,
        impl=mesh_label(sizes),
        B=batch,
        prompt=prompt,
        new_tokens=N,
        mtp="on" if mtp else "off",
        layers=cfg.num_hidden_layers,
        kv_dtype=args.kv_dtype,
        weights=weights_label(args),
        mesh=mesh_label(sizes)[5:] or "one device",
        devices=mesh.size if mesh is not None else 1,
    )
    ragged = getattr(args, "ragged", False)
    prompts = make_prompts(cfg.vocab_size, batch, prompt, args.seed, ragged=ragged)
    row["lengths"] = lengths_label(prompt, ragged)
    if ragged:
        row["prompt_lens"] = [len(p) for p in prompts]
        row["prompt_mean"] = sum(row["prompt_lens"]) / batch
    # A pool per data rank splits the pages too: each rank gets num_pages / D (kv_pages counts whole sequences).
    engine = Engine(
        model,
        page_size=PAGE,
        num_pages=kv_pages(cfg, batch, prompt, N),
        max_batch=batch,
        # what the cell's requests reach: the default (the whole pool's tokens) sizes the widest step's
        # tables, and so its temporaries, for one sequence holding every page
        max_context=min(cfg.max_position_embeddings, prompt + N),
        prefill_chunk=args.prefill_chunk or None,
        attention_impl=args.attention_impl,
        kv_dtype=kv_dtype_arg(args.kv_dtype),
        mesh=mesh,
        decode_steps=args.decode_steps,
        decode_config=decode_config(getattr(args, "decode_config", "")),
    )
    kw = dict(max_new_tokens=N, sampling=SamplingParams(temperature=0.0))
    oracle = getattr(args, "mtp_oracle", None)
    if mtp:
        kw["use_mtp"] = True
        if oracle is not None:  # drafts right at the chosen rate: the plain greedy sequences, known first
            bm.log(f"  {name} B={batch} T={prompt}: plain generate for the draft oracle ...")
            plain = engine.generate(prompts, max_new_tokens=N, sampling=SamplingParams(temperature=0.0))
            engine.draft_oracle([p + t for p, t in zip(prompts, plain.tokens)], accept=oracle)
            row["mtp_oracle"] = oracle
    log = getattr(engine, "compile_log", None)
    log0 = len(log) if log is not None else 0
    traces0 = _trace_total()

    bm.log(f"  {name} B={batch} T={prompt} ({row['lengths']}): cold generate (compiles) ...")
    t0 = time.perf_counter()
    cold = engine.generate(prompts, **kw)
    sync_engine(engine)
    row["cold_wall_s"] = time.perf_counter() - t0
    _check_result(cold, batch, N)
    row["compile_s"] = stat(cold.stats, "compile_s")
    traces1 = _trace_total()
    row["compiles"] = traces1 - traces0
    log = getattr(engine, "compile_log", None)
    if log is not None:
        row["compile_log"] = [dict(e) for e in log[log0:]]
        row["compile_buckets"] = _compile_buckets(row["compile_log"])
        row["compiles"] = len(row["compile_log"])

    bm.log(f"  {name} B={batch} T={prompt}: warm generate ...")
    first = []

    def stream(_request, _token):
        if not first:
            first.append(time.perf_counter())

    t0 = time.perf_counter()
    warm = engine.generate(prompts, stream=stream, **kw)
    sync_engine(engine)
    row["warm_wall_s"] = time.perf_counter() - t0
    _check_result(warm, batch, N)
    row["cold_compile_s"] = row["cold_wall_s"] - row["warm_wall_s"]
    row["ttft_s"] = first[0] - t0 if first else None
    row["ttft_stats_s"] = stat(warm.stats, "ttft_s")
    if _trace_total() != traces1:
        row["note"] = "the warm generate compiled again"
    row["same_tokens"] = warm.tokens == cold.tokens
    st = warm.stats
    row["prefill_s"] = warm_prefill_seconds(st)
    row["prefill_chunk"] = engine.prefill_chunk
    decode_s = warm_seconds(st, "decode")
    steps = stat(st, "decode_steps")
    row["decode_steps"] = steps
    row["decode_calls"] = stat(st, "decode_calls")
    row["steps_per_call"] = args.decode_steps
    if decode_s and steps:
        row["decode_ms_step"] = decode_s / steps * 1e3
        row["decode_tok_s"] = stat(st, "decode_tokens") / decode_s
    if mtp:
        row["mtp_acceptance"] = stat(st, "mtp_acceptance")
    row["pages_used_peak"] = stat(st, "pages_used_peak")
    row["peak_mem_gb"] = _peak_mem_gb()
    row["tokens"] = warm.tokens
    row["pool_devices"] = len(engine.cache.pages.sharding.device_set)
    if args.kernels:
        if jax.default_backend() != "gpu":
            row["note"] = "--kernels: CUPTI needs a CUDA GPU"
        else:
            bm.log(f"  {name} B={batch} T={prompt}: --kernels: two recorded generations ...")
            label = f"{name}_B{batch}_T{prompt}{'_ragged' if ragged else ''}_{mesh_label(sizes)}_{args.kv_dtype}"
            label += f"_k{args.decode_steps}"
            row.update(kernel_profile(engine, prompts, kw, args.out, label.replace("=", "").replace(",", "-")))
    del engine
    dtype_bytes = 4 if args.dtype == "fp32" else 2
    return derive(row, cfg, ceil, dtype_bytes=dtype_bytes, kv_dtype=args.kv_dtype, mtp=mtp, weights=args.weights)


def run_ours_worker(args) -> None:
    """Our cells (one model's run of cells, usually) in this process; rows appended as they finish."""
    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    tiny = args.config == "tiny"
    if not tiny:
        try:
            bm.require_gpu("e2e")
        except SystemExit as e:
            print(e, file=sys.stderr)
            raise SystemExit(EXIT_NO_GPU) from None
    _, ceil = worker_ceilings(args, tiny)
    dtype = jnp.float32 if args.dtype == "fp32" else jnp.bfloat16
    deadline = args.deadline
    for name, group in itertools.groupby(grid(args), key=lambda c: c[0]):
        group = list(group)
        cfg = model_config(name, config=args.config, layers=args.layers, kv_dtype=args.kv_dtype)
        variants = {"off": [False], "on": [True], "both": [False, True]}[args.mtp]
        variants = [v for v in variants if not v or cfg.num_mtp_layers] or [False]  # no MTP head: plain decode
        base = dict(
            model=name,
            impl="ours",
            new_tokens=args.new_tokens,
            layers=cfg.num_hidden_layers,
            kv_dtype=args.kv_dtype,
            weights=weights_label(args),
        )
        if deadline and time.time() > deadline:
            for _, b, t in group:
                append_row(args.out, dict(base, B=b, prompt=t, note="skipped (time budget)"))
            continue
        one_device_tokens = {}  # (B, prompt, mtp) -> the one-device run's warm tokens, for agree_one_device
        for sizes in parse_meshes(args.mesh):
            mesh = None
            if sizes:
                mesh = make_mesh(**sizes)
            base = dict(base, impl=mesh_label(sizes))
            where = f" on {mesh_label(sizes)[5:]}" if sizes else ""
            what = args.dtype if args.weights == "bf16" else f"fp8 weights, {args.dtype} compute"
            bm.log(f"# {name}: building {bm.count(total_params(cfg))} parameters ({what}){where} ...")
            try:
                model, build_s = build_model(cfg, dtype, mesh, weights=model_weights(args))
            except MemoryPlanError as e:  # its weights alone exceed the device: skipped, as the peer's cells
                for _, b, t in group:
                    append_row(args.out, dict(base, B=b, prompt=t, note=f"skipped ({str(e).splitlines()[0]})"))
                continue
            except Exception as e:  # noqa: BLE001 - an OOM while building must not end the run
                for _, b, t in group:
                    append_row(args.out, dict(base, B=b, prompt=t, error=f"model build failed: {bm.one_line(e)}"))
                continue
            if args.weights == "fp8":
                set_fp8_impl(model, args.fp8_impl)
            wgb = weights_bytes(model) / 1e9
            bm.log(f"# {name}: built in {build_s:.1f} s, {wgb:.1f} GB of weights{where}")
            for _, b, t in bm.progress(group, desc=f"e2e {name}{where}"):
                for mtp in variants:
                    data = (sizes or {}).get("data", 1)
                    if deadline and time.time() > deadline:
                        row = dict(base, B=b, prompt=t, mtp="on" if mtp else "off", note="skipped (time budget)")
                    elif b % data:
                        row = dict(
                            base,
                            B=b,
                            prompt=t,
                            mtp="on" if mtp else "off",
                            note=f"skipped (B={b} is not divisible by data={data}: "
                            "the slots are split over the data ranks)",
                        )
                    else:
                        try:
                            row = run_cell(model, cfg, name, b, t, args, ceil, mtp=mtp, mesh=mesh, sizes=sizes)
                        except Exception as e:  # noqa: BLE001 - one cell's OOM must not cost the others
                            row = dict(base, B=b, prompt=t, mtp="on" if mtp else "off", error=bm.one_line(e))
                        row.update(build_s=build_s, weights_gb=wgb)
                        tokens = row.pop("tokens", None)
                        if tokens is not None and not sizes:
                            one_device_tokens[b, t, mtp] = tokens
                        elif tokens is not None and (b, t, mtp) in one_device_tokens:
                            row["agree_one_device"] = token_agreement(tokens, one_device_tokens[b, t, mtp])
                    append_row(args.out, row)
                    bm.log("  " + summary(row))
                    gc.collect()
            del model
            gc.collect()
            if not tiny:  # the tiny models' runs keep the eager build's compiled initializers
                jax.clear_caches()


# ------------------------------------------------------------------------------------------
# Time to first token of a fresh process
# ------------------------------------------------------------------------------------------
def run_ttft_worker(args) -> None:
    """One fresh process: build the model, one generate of the first cell; the epochs of its milestones go to
    --result-file as JSON."""
    t_start = time.time()
    enable_compile_cache(args.compile_cache)
    name, b, t = grid(args)[0]
    cfg = model_config(name, config=args.config, layers=args.layers, kv_dtype=args.kv_dtype)
    model, build_s = build_model(
        cfg, jnp.float32 if args.dtype == "fp32" else jnp.bfloat16, weights=model_weights(args)
    )
    engine = Engine(
        model,
        page_size=PAGE,
        num_pages=kv_pages(cfg, b, t, args.new_tokens),
        max_batch=b,
        max_context=min(cfg.max_position_embeddings, t + args.new_tokens),
        prefill_chunk=args.prefill_chunk or None,
        attention_impl=args.attention_impl,
        kv_dtype=kv_dtype_arg(args.kv_dtype),
    )
    first = []

    def stream(_request, _token):
        if not first:
            first.append(time.time())

    t_gen = time.time()
    res = engine.generate(
        make_prompts(cfg.vocab_size, b, t, args.seed),
        max_new_tokens=args.new_tokens,
        sampling=SamplingParams(temperature=0.0),
        stream=stream,
    )
    _check_result(res, b, args.new_tokens)
    out = dict(
        t_start=t_start,
        t_generate=t_gen,
        t_first_token=first[0],
        t_end=time.time(),
        build_s=build_s,
        compile_s=stat(res.stats, "compile_s"),
    )
    with open(args.result_file, "w") as f:
        json.dump(out, f)
