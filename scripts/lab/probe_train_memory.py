"""Lab probe (one H200): where the memory of the training step goes, for the 4-layer DeepSeek-V2-Lite cut
(1 dense + 3 MoE layers, random weights, bf16 parameters and compute, AdamW, the step of `mla-train`).

For each cell (tokens a step B x T, remat policy, LM-head CE chunk), in order of interest and until the time
budget is spent: lower and compile the step against abstract shapes (nothing allocated), print
`memory_analysis()` and the largest buffers of the optimized HLO (`compiled.as_text()`: instruction, shape,
bytes, the jax op it came from), and when the step fits the GPU, run 3 steps with real weights and time them.
A cell that fails (out of memory at compile or at run time, anything else) is recorded and the next one runs.
The first cell (1 x 4096, no remat, no chunking; `--dump-cell` to choose another) is also compiled under
XLA's dump (`--xla_dump_to`, this cell's module only): its buffer assignment, memory-usage report and
optimized HLO go to `dump.tar.gz`, and `largest_buffers.txt` lists its biggest allocations by name.

    PYTHONPATH=. python3 scripts/lab/probe_train_memory.py --out $OUT/train [--budget 400]

Writes under --out (at most 5 files): results.json (every cell: memory, buffers, times, errors),
results.csv (one row a cell, `mla-bench train`'s columns), largest_buffers.txt, dump.tar.gz, log.txt.
"""

from __future__ import annotations

import argparse
import gc
import glob
import io
import json
import os
import re
import statistics
import sys
import tarfile
import tempfile
import time
import traceback

T0 = time.perf_counter()
DUMP_NAME = "train_step_dump"  # the jitted function of the dumped cell: XLA dumps only its module
_DUMP_DIR = tempfile.mkdtemp(prefix="xla_dump_")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP_DIR} --xla_dump_hlo_module_re=.*{DUMP_NAME}.*"
).strip()

# (B, T, remat, ce_chunk), most informative first: the baseline, its out-of-memory cell, then what
# chunking and remat buy at 4 K and 16 K sequences of 4096 tokens.
CELLS = [
    (1, 4096, "none", 0),
    (4, 4096, "none", 0),
    (1, 4096, "none", 2048),
    (4, 4096, "full", 2048),
    (16, 4096, "full", 2048),
    (4, 4096, "none", 2048),
    (4, 4096, "full", 0),
    (1, 4096, "full", 2048),
    (16, 4096, "dots_with_no_batch_dims_saveable", 2048),
    (16, 4096, "none", 2048),
    (16, 4096, "full", 0),
    (16, 4096, "none", 0),
    (1, 4096, "full", 0),
]

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_SKIP_OPS = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all", "partition-id"}

LOG = []


def log(msg: str) -> None:
    line = f"[{time.perf_counter() - T0:6.1f}s] {msg}"
    print(line, flush=True)
    LOG.append(line)


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:600]


# ------------------------------------------------------------------------------------------
# Buffers of an optimized HLO module
# ------------------------------------------------------------------------------------------
def _shape_bytes(shape_text: str) -> tuple[int, int, str]:
    """(largest array's bytes, all arrays' bytes, the largest array's shape) of an HLO shape (array or tuple)."""
    best, total, best_s = 0, 0, ""
    for dt, dims in _ARRAY.findall(shape_text):
        n = _DTYPE_BYTES[dt]
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n
        if n > best:
            best, best_s = n, f"{dt}[{dims}]"
    return best, total, best_s


def largest_instructions(hlo_text: str, top: int = 25) -> list[dict]:
    """The `top` largest results of instructions outside fused computations (those are buffers XLA must
    place), by their largest array: name, opcode, shape, bytes, the computation, the jax op_name and source."""
    # computations that are a fusion's (or a reducer's) body: their instructions are not buffers
    inner = set(re.findall(r"\b(?:calls|to_apply)=(%[\w.\-]+)", hlo_text))
    rows, comp = [], ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            comp = line.split("(")[0].replace("ENTRY", "").strip()
            continue
        if comp in inner or " = " not in line:
            continue
        lhs, rhs = line.split(" = ", 1)
        rhs = rhs.strip()
        if rhs.startswith("("):  # a tuple shape: up to its closing parenthesis
            depth = 0
            for i, ch in enumerate(rhs):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    break
            shape, rest = rhs[: i + 1], rhs[i + 1 :].strip()
        else:
            shape, _, rest = rhs.partition(" ")
        op = rest.split("(")[0].strip()
        if op in _SKIP_OPS:
            continue
        big, total, big_shape = _shape_bytes(shape)
        if big == 0:
            continue
        meta = re.search(r'op_name="([^"]*)"', rest)
        src = re.search(r'source_file="([^"]*)"\s+source_line=(\d+)', rest)
        rows.append(
            dict(
                name=lhs.replace("ROOT", "").strip(),
                op=op,
                shape=big_shape,
                gib=big / 2**30,
                tuple_gib=total / 2**30,
                computation=comp,
                op_name=meta.group(1)[-240:] if meta else "",
                source=f"{os.path.basename(src.group(1))}:{src.group(2)}" if src else "",
            )
        )
    rows.sort(key=lambda r: -r["gib"])
    return rows[:top]


def buffer_assignment_allocations(text: str, top: int = 12, values: int = 15) -> list[str]:
    """The `top` largest `allocation N: size S, ...` entries of an XLA buffer-assignment dump, each with its
    `values` largest values (XLA packs every temporary into one "preallocated-temp" allocation: its values
    name what the temp bytes hold)."""
    allocs, cur = [], None
    for line in text.splitlines():
        m = re.match(r"allocation (\d+): size (\d+)(.*)", line.strip())
        if m:
            cur = [int(m.group(2)), f"allocation {m.group(1)}: {int(m.group(2)) / 2**30:.3f} GiB{m.group(3)[:160]}", []]
            allocs.append(cur)
        elif cur is not None and line.strip().startswith("value:"):
            size = re.search(r"size=(\d+)", line)
            cur[2].append((int(size.group(1)) if size else 0, line.strip()[:300]))
    allocs.sort(key=lambda a: -a[0])
    out = []
    for size, head, vals in allocs[:top]:
        vals.sort(key=lambda v: -v[0])
        out.append(
            "\n".join(
                [head + f" ({len(vals)} values; the largest:)"]
                + [f"    {v / 2**30:9.3f} GiB  {t}" for v, t in vals[:values]]
            )
        )
    return out


def collect_dump(out_dir: str) -> list[str]:
    """Tars the dumped cell's buffer assignment, memory-usage report and optimized HLO into dump.tar.gz (the
    HLO left out past 15 MiB) -> the largest allocations of its buffer assignment."""
    files = sorted(glob.glob(os.path.join(_DUMP_DIR, "*")))
    keep = [f for f in files if re.search(r"buffer[-_]assignment|memory[-_]usage|after_optimizations\.txt$", f)]
    lines = []
    for f in keep:
        if re.search(r"buffer[-_]assignment", f):
            with open(f, errors="replace") as fh:
                lines += [f"# {os.path.basename(f)}"] + buffer_assignment_allocations(fh.read())
    for with_hlo in (True, False):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for f in keep:
                if with_hlo or "after_optimizations" not in f:
                    tar.add(f, arcname=os.path.basename(f))
        if buf.tell() < 15 * 2**20:
            break
    with open(os.path.join(out_dir, "dump.tar.gz"), "wb") as fh:
        fh.write(buf.getvalue())
    log(f"dump: {len(files)} files in the XLA dump, {len(keep)} kept ({buf.tell() / 2**20:.1f} MiB tar.gz)")
    return lines


# ------------------------------------------------------------------------------------------
# Cells
# ------------------------------------------------------------------------------------------
def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="v2-lite", help="a `mla-bench train` model (tiny: a CPU smoke run)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget", type=float, default=400, help="seconds after which no new cell starts")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--moe-impl", default="auto")
    p.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--dump-cell", default="1x4096:none:0", help="BxT:remat:ce_chunk of the cell XLA dumps")
    p.add_argument("--attn-q-block", type=int, default=0, help="TrainConfig.attn_q_block of every cell")
    p.add_argument("--cells", default="", help="BxT:remat:ce_chunk,... instead of the built-in list")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)

    import jax

    from benchmarks import bench_train as bt

    def parse(spec):
        bt_, remat, chunk = spec.split(":")
        b, t = bt_.split("x")
        return int(b), int(t), remat, int(chunk)

    cells = [parse(c) for c in a.cells.split(",")] if a.cells else list(CELLS)
    dump_cell = parse(a.dump_cell)
    dev = jax.devices()[0]
    limit = (dev.memory_stats() or {}).get("bytes_limit", 0)
    log(
        f"{dev.device_kind}, jax {jax.__version__}, allocator limit {limit / 2**30:.1f} GiB; "
        f"{a.model} cut to {a.layers} layers, params {a.param_dtype}, moe {a.moe_impl}"
    )
    cfg = bt.model_config(a.model, a.layers)
    results, rows, real = [], [], {}
    dump_lines = []

    def real_state(tx):
        """The real (graphdef, state, opt_state), built once and rebuilt when a failed run deleted it."""
        s = real.get("s")
        if s is None or any(x.is_deleted() for x in jax.tree.leaves(s[1:])):
            real.pop("s", None)
            gc.collect()
            t = time.perf_counter()
            s = bt.build_state(cfg, tx, dtype="bf16", param_dtype=a.param_dtype, moe_impl=a.moe_impl)
            jax.block_until_ready(s[1:])
            log(f"built the weights and AdamW state in {time.perf_counter() - t:.1f} s")
            real["s"] = s
        return s

    for B, T, remat, chunk in cells:
        cell = dict(B=B, T=T, remat=remat, ce_chunk=chunk, tokens=B * T)
        name = f"{B}x{T} remat={remat} ce_chunk={chunk}"
        if time.perf_counter() - T0 > a.budget:
            cell["error"] = "skipped: time budget"
            log(f"{name}: skipped (time budget)")
            results.append(cell)
            rows.append(_row(cell))
            continue
        flops = bt.train_flops(cfg, B, T)
        cell["train_tflop"] = flops / 1e12
        try:
            step, tx = bt.make_step(dict(remat=remat, ce_chunk=chunk, attn_q_block=a.attn_q_block))
            if (B, T, remat, chunk) == dump_cell:
                inner = step.__wrapped__
                fn = lambda *args: inner(*args)  # noqa: E731
                fn.__name__ = fn.__qualname__ = DUMP_NAME
                step = jax.jit(fn, static_argnums=(0,), donate_argnums=(1, 2))
            graphdef, abs_state, abs_opt = bt.build_state(
                cfg, tx, dtype="bf16", param_dtype=a.param_dtype, moe_impl=a.moe_impl, abstract=True
            )
            batch_abs = bt.random_batch(cfg, B, T, abstract=True)
            compiled, cell["lower_s"], cell["compile_s"] = bt.lower_and_compile(
                step, graphdef, abs_state, abs_opt, batch_abs
            )
            cell.update(bt.memory_columns(compiled))
            log(f"{name}: compiled in {cell['compile_s']:.1f} s; memory_analysis {compiled.memory_analysis()}")
            cell["largest"] = largest_instructions(compiled.as_text())
            for r in cell["largest"][:8]:
                log(
                    f"    {r['gib']:8.2f} GiB  {r['op']:<14} {r['shape']:<28} {r['name'][:40]:<40} "
                    f"{r['op_name'][-110:]}"
                )
            if (B, T, remat, chunk) == dump_cell:
                dump_lines = collect_dump(a.out)
            fits = not limit or cell["peak_gb"] * 1e9 < 0.97 * limit  # no limit known (a CPU): run it
            if not fits:
                cell["error"] = (
                    f"does not fit: memory_analysis peak {cell['peak_gb'] / 1.073741824:.1f} GiB > "
                    f"0.97 x the allocator's {limit / 2**30:.1f} GiB (not run)"
                )
                log(f"{name}: {cell['error']}")
            else:
                graphdef_r, state, opt_state = real_state(tx)
                batch = bt.random_batch(cfg, B, T)
                times, cell["loss_first"], cell["loss_last"], state, opt_state = bt.time_steps(
                    compiled, state, opt_state, batch, 0, a.steps
                )
                real["s"] = (graphdef_r, state, opt_state)
                med = statistics.median(times[1:] or times)  # the first run also pays for autotuning and allocation
                cell.update(
                    step_s=times,
                    step_ms=med * 1e3,
                    tok_s=B * T / med,
                    mfu=flops / med / 790e12,
                    peak_in_use_gb=(dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9,
                )
                log(
                    f"{name}: steps {[round(x * 1e3, 1) for x in times]} ms -> {med * 1e3:.1f} ms, "
                    f"{B * T / med:.0f} tok/s, MFU {cell['mfu']:.1%}"
                )
            del compiled
        except Exception as e:  # noqa: BLE001 - an out-of-memory cell is recorded, the next one runs
            cell["error"] = one_line(e)
            cell["traceback"] = traceback.format_exc()[-3000:]
            log(f"{name}: FAILED {cell['error']}")
        gc.collect()
        results.append(cell)
        rows.append(_row(cell))
        _write(a.out, results, rows, dump_lines)
    _write(a.out, results, rows, dump_lines)
    log(f"done in {time.perf_counter() - T0:.0f} s")
    _write(a.out, results, rows, dump_lines)


def _row(cell: dict) -> dict:
    return {
        k: cell.get(k, "")
        for k in (
            "B",
            "T",
            "tokens",
            "remat",
            "ce_chunk",
            "train_tflop",
            "lower_s",
            "compile_s",
            "peak_gb",
            "argument_gb",
            "output_gb",
            "temp_gb",
            "alias_gb",
            "step_ms",
            "tok_s",
            "mfu",
            "error",
        )
    }


def _write(out, results, rows, dump_lines):
    import benchmarks as bm

    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    if rows:
        bm.write_csv(os.path.join(out, "results.csv"), rows)
    with open(os.path.join(out, "largest_buffers.txt"), "w") as f:
        f.write("# largest results of instructions outside fusions (compiled.as_text()), per cell\n")
        for c in results:
            f.write(
                f"\n## {c['B']}x{c['T']} remat={c['remat']} ce_chunk={c['ce_chunk']}: peak "
                f"{c.get('peak_gb', float('nan')):.2f} GB, temp {c.get('temp_gb', float('nan')):.2f} GB"
                f"{'; ' + c['error'] if c.get('error') else ''}\n"
            )
            for r in c.get("largest", []):
                f.write(
                    f"{r['gib']:9.3f} GiB  {r['op']:<16} {r['shape']:<32} {r['name']}  [{r['computation']}] "
                    f"{r['source']}  {r['op_name']}\n"
                )
        if dump_lines:
            f.write(
                "\n# XLA buffer assignment of the dumped cell: largest allocations\n" + "\n".join(dump_lines) + "\n"
            )
    with open(os.path.join(out, "log.txt"), "w") as f:
        f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    sys.exit(main())
