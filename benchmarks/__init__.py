"""Benchmarks' shared helpers: timing, ceilings, reporting, and the rows written as they come.

Method (shared/BENCHMARKING.md): CUPTI kernel time, recorded as jax's ``profiler.measure`` records it
(`cupti_median_us`: median over >= 30 iterations after a warm-up), a correctness check before every timed
cell, and ceilings measured in the same run.

Every benchmark writes what it measured as it goes (`write_csv` / `append_row` after each row, `write_json` after
each phase, each through a temporary file): a failure late in a run keeps what came before. A row or phase that
fails gets an ``error`` field (`record_failure`: the error's first line, also logged), and the run ends with exit
status 1 and one line (`exit_if_failed`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
from tqdm import tqdm


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line on stderr and exit status 2 (as mla-capacity does)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def require_gpu(prog: str) -> None:
    """Exit with one line, not a CUPTI traceback, when there is no CUDA GPU to time on."""
    if jax.default_backend() != "gpu":
        raise SystemExit(
            f"{prog}: error: timing needs a CUDA GPU (jax backend is {jax.default_backend()!r}); "
            "on a CPU, --from-csv re-reports an earlier run where the benchmark offers it"
        )


def gpu_name() -> str:
    return jax.devices()[0].device_kind


def _portable_command() -> str:
    """The benchmark's command line with the $OUT directory (the GPU machine's) spelt as $OUT."""
    cmd = " ".join(["python", "-m", "benchmarks"] + sys.argv[1:])
    out = os.environ.get("OUT")
    return cmd.replace(out, "$OUT") if out else cmd


def begin_run(name: str, out_dir: str, iters: int):
    """Creates ``out_dir``, prints the run header and the ceilings measured now; returns both."""
    os.makedirs(out_dir, exist_ok=True)
    header = run_header()
    print(f"# {name} benchmark on {header['device']}, jax {header['jax']}, {header['date']}")
    ceil = measure_ceilings(iters)
    print(
        f"# ceilings: copy XLA {ceil['xla_copy_gbps']:.0f} GB/s, torch "
        f"{ceil['torch_copy_gbps'] or float('nan'):.0f} GB/s; bf16 matmul "
        f"{figure(ceil['matmul_tflops'])} TFLOP/s"
    )
    return header, ceil


def run_header() -> dict:
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        device=gpu_name(),
        jax=jax.__version__,
        # no interpreter path: results are committed, and machine paths do not belong there
        command=_portable_command(),
    )


def cupti_median_us(fn, *args, iterations=30, per_kernel=False):
    """Median CUPTI time of ``fn(*args)`` in µs (sum over its kernels), after one warm-up call.

    With ``per_kernel`` also returns {"<i>:<kernel name>": median µs} for the parts of the call,
    keyed by the kernel's index within the call (two kernels of one call may share a name).
    A call whose kernels the device records in another order from call to call (an XLA conditional:
    ``MlaDecodeConfig(schedule="auto")``) has no per-call split of the record: its time is then the
    whole record's sum over ``iterations`` (the mean), and its parts None.
    """
    outs = [fn(*args)]  # every call's results kept until the sync waits for them (as profiler.measure does)

    def sync():
        jax.block_until_ready(outs)
        outs.clear()

    us, parts = _cupti_record(lambda: outs.append(fn(*args)), sync, iterations, warmup=0)
    return (us, parts) if per_kernel else us


def cupti_call_us(call, *, sync, iterations=30, warmup=2):
    """(median µs, kernels a call): CUPTI kernel-time sum of one call of a callable that is not a JAX
    function (a torch peer in ``mla_decode --peers``), median over ``iterations`` calls; `_cupti_record`
    says how."""
    us, parts = _cupti_record(call, sync, iterations, warmup)
    return us, len(parts) if parts is not None else None


def _cupti_record(call, sync, iterations, warmup):
    """(µs a call, {"<i>:<kernel name>": median µs} or None) of ``iterations`` calls of ``call`` recorded by
    the Mosaic GPU extension's CUPTI kernel-activity hooks (they see every kernel of the process, whichever
    library launched it): the same arguments every call, L2 not flushed; ``sync`` waits for the calls'
    device work (e.g. ``torch.cuda.synchronize``). Every call must launch the same number of kernels. The
    µs are the median of the calls' kernel-time sums; where the record's names do not repeat call after
    call (the device recorded a call's kernels in another order), a per-call split would mix calls: the
    µs are then the record's sum over ``iterations`` and the parts None."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # noqa: PLC0415 (optional: GPU only, fails on a CPU)

    ext = mosaic_gpu_lib._mosaic_gpu_ext
    for _ in range(warmup):
        call()
    sync()
    ext._cupti_init()
    try:
        for _ in range(iterations):
            call()
        sync()
    finally:
        timings = ext._cupti_get_timings(True)
    if not timings or len(timings) % iterations:
        raise RuntimeError(f"{len(timings or [])} kernels in {iterations} calls: not the same number each call")
    per = len(timings) // iterations
    runs = [timings[i * per : (i + 1) * per] for i in range(iterations)]
    if any([n for n, _ in r] != [n for n, _ in runs[0]] for r in runs):
        return sum(t for _, t in timings) / iterations * 1e3, None
    parts = {f"{i}:{name}": statistics.median(r[i][1] for r in runs) * 1e3 for i, (name, _) in enumerate(runs[0])}
    return statistics.median(sum(t for _, t in r) for r in runs) * 1e3, parts


def cupti_kernels(call, *, sync) -> list[tuple[str, float]]:
    """(kernel name, ms) of every kernel the device ran during ``call()`` (in launch order), by the Mosaic GPU
    extension's CUPTI activity hooks (every kernel of the process, whichever library launched it); ``sync``
    waits for the call's device work. A GPU only."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # noqa: PLC0415 (optional: GPU only, fails on a CPU)

    ext = mosaic_gpu_lib._mosaic_gpu_ext
    sync()
    ext._cupti_init()
    try:
        call()
        sync()
    finally:
        timings = ext._cupti_get_timings(True)
    return list(timings or [])


def measure_ceilings(iterations=30) -> dict:
    """Bandwidth and matrix-rate ceilings measured now, on this GPU.

    * ``xla_copy_gbps``: XLA ``x * 2`` over 1 GiB of bf16, read + write bytes (a copy XLA cannot
      elide).
    * ``torch_copy_gbps``: ``torch`` device-to-device copy of 2 GiB when torch with CUDA is
      importable (measured in a subprocess so the two allocators do not fight).
    * ``xla_matmul_tflops``: XLA bf16 8192^3 matmul.
    ``bandwidth_gbps`` = the larger copy figure; ``matmul_tflops`` = the matmul figure.
    """
    # 1 GiB of bf16, 20x the L2; CUPTI timing keeps each call's output until it syncs (30 GiB here: 30 copies of
    # 2 GiB ran an 80 GB card's allocator out of memory)
    n = 1 << 29
    x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), jnp.bfloat16)
    t = cupti_median_us(jax.jit(lambda a: a * 2), x, iterations=iterations)
    out = dict(xla_copy_gbps=2 * 2 * n / t / 1e3)
    del x
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    t = cupti_median_us(jax.jit(lambda p, q: p @ q), a, b, iterations=iterations)
    out["xla_matmul_tflops"] = 2 * 8192**3 / t / 1e6
    out["torch_copy_gbps"] = _torch_copy_gbps()
    out["bandwidth_gbps"] = max(v for v in (out["xla_copy_gbps"], out["torch_copy_gbps"]) if v)
    out["matmul_tflops"] = out["xla_matmul_tflops"]
    return out


def _torch_copy_gbps():
    script = textwrap.dedent("""
      import torch
      x = torch.randn(1 << 29, device="cuda", dtype=torch.float32)   # 2 GiB
      y = torch.empty_like(x)
      for _ in range(3): y.copy_(x)
      s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      times = []
      for _ in range(30):
          s.record(); y.copy_(x); e.record(); torch.cuda.synchronize(); times.append(s.elapsed_time(e))
      times.sort(); print(2 * x.numel() * 4 / (times[len(times) // 2] * 1e-3) / 1e9)
  """)
    try:
        env = dict(os.environ, CUDA_MODULE_LOADING="LAZY")
        res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
        return float(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def progress(iterable, **kwargs):
    return tqdm(iterable, **kwargs)


def count(n: float) -> str:
    """A count in three significant digits with K / M / B / T: 1_431_936 -> "1.43M", 15_706_000_000 ->
    "15.7B" (the tiny model's parameters printed as "0.00B")."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def figure(x: float) -> str:
    """A measured rate for a log line: whole above 100, else three significant digits (a CPU's 0.3 TFLOP/s
    printed as "0")."""
    return f"{x:.0f}" if abs(x) >= 100 or x != x else f"{x:.3g}"


def log(msg: str) -> None:
    """Prints a line without tearing an active tqdm progress bar."""
    tqdm.write(msg)
    sys.stdout.flush()


def read_csv(path):
    """Rows of a CSV written by `write_csv`, with numeric-looking fields as int/float."""

    def conv(v):
        for t in (int, float):
            try:
                return t(v)
            except ValueError:
                pass
        return {"True": True, "False": False}.get(v, v)

    with open(path, newline="") as f:
        return [{k: conv(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _replace(path, write) -> None:
    """Writes `path` through a temporary file beside it, then renames it in place: a run killed mid-write keeps
    the file's last whole version."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline="") as f:
        write(f)
    os.replace(tmp, path)


def write_csv(path, rows):
    """`rows` (dicts) as a CSV with the union of their keys as columns (the first row's first), written whole
    through a temporary file (`_replace`); nothing for no rows."""
    if not rows:
        return
    fields = list(rows[0].keys())
    for r in rows:
        fields += [k for k in r if k not in fields]

    def write(f):
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)

    _replace(path, write)


def write_json(path, obj):
    """`obj` as indented JSON (dataclasses as dicts, anything else unknown as its str), written whole through a
    temporary file (`_replace`): a benchmark rewrites its JSON after each phase."""
    _replace(
        path,
        lambda f: json.dump(
            obj, f, indent=1, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)
        ),
    )


def append_row(path, row: dict, *, columns=None, jsonl=None) -> None:
    """Adds `row` to the CSV at `path` as it comes (the rows already there read back, the file rewritten whole by
    `write_csv`), so that a run that fails or is killed later keeps it. `columns`: the CSV's columns in order (a
    row may leave any empty; `row`'s other scalar fields follow them); `jsonl`: a file that gets `row` whole,
    lists and dicts included, as one JSON line."""
    rows = read_csv(path) if os.path.exists(path) else []
    flat = {k: row.get(k, "") for k in columns} if columns else {}
    flat.update({k: v for k, v in row.items() if k not in flat and not isinstance(v, (list, dict))})
    write_csv(path, rows + [flat])
    if jsonl:
        with open(jsonl, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


# ------------------------------------------------------------------------------------------
# Failures: one line, recorded, and the exit status
# ------------------------------------------------------------------------------------------
def one_line(e: BaseException) -> str:
    """An exception in one line: its type and its message's first line (an XLA error's first line says what
    failed, e.g. RESOURCE_EXHAUSTED and the allocation)."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def record_failure(row: dict, what: str, e: BaseException) -> dict:
    """Marks `row` (a row or a phase of a run) failed: its ``error`` field is `e` in one line (`one_line`),
    logged after `what` (the cell or the phase); the run goes on to what does not depend on it. -> `row`."""
    row["error"] = one_line(e)
    log(f"# FAILED {what}: {row['error']}")
    return row


def exit_if_failed(prog: str, rows, where: str, name=lambda r: "") -> None:
    """Ends the run with exit status 1 and one line on stderr when any of `rows` failed (has an ``error``): how
    many, the first one (`name(row)` and its error) and `where` its rows are on disk."""
    failed = [r for r in rows if r.get("error")]
    if failed:
        first = f"{name(failed[0])}: " if name(failed[0]) else ""
        raise SystemExit(
            f"{prog}: error: {len(failed)} of {len(rows)} rows failed (the first, {first}{failed[0]['error']}); "
            f"the rows are in {where}"
        )


def print_table(rows, columns):
    """Prints ``rows`` (dicts) as an aligned text table of ``columns`` [(key, header, fmt)]."""

    def cell(r, key, fmt):
        v = r.get(key)
        if v is None or v == "":
            return "-"
        return fmt.format(v) if isinstance(v, (int, float)) else str(v)

    table = [[h for _, h, _ in columns]] + [[cell(r, k, f) for k, _, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for i, row in enumerate(table):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()
