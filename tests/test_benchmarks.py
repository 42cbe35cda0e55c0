"""The benchmark scripts' CPU parts: the table and roofline redrawn from the committed H200 CSV."""

import csv
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "2026-11-30-h200"  # measured results: in the repository, not the wheel


def test_roofline_redraws_from_the_committed_csv(tmp_path):
    src = RESULTS / "mla_decode.csv"
    rows = list(csv.DictReader(src.open()))
    assert len(rows) > 50
    # bytes follow BENCHMARKING.md: (sum(seq_lens)*576 + B*s_q*H*576 + B*s_q*H*512) * 2, and GB/s = bytes / time
    for r in rows:
        if r.get("lengths") == "fixed" and r.get("us"):
            B, s_q, seq, H = (int(r[k]) for k in ("B", "s_q", "seq", "H"))
            nbytes = (B * seq * 576 + B * s_q * H * 576 + B * s_q * H * 512) * 2
            assert abs(float(r["gbytes"]) - nbytes / 1e9) < 1e-6 * nbytes / 1e9
            assert abs(float(r["gbps"]) - nbytes / float(r["us"]) / 1e3) < 1e-3 * float(r["gbps"])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "mla_decode",
            "--from-csv",
            str(src),
            "--bandwidth-gbps",
            "4176",
            "--matmul-tflops",
            "807",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    png = tmp_path / "mla_decode_roofline.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timing_on_a_cpu_is_a_one_line_error():
    for name in ("mla_decode", "paged_gather"):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks", name, "--quick"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
        )
        assert out.returncode != 0
        assert "timing needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr


def test_begin_run_makes_the_directory_and_prints_header_and_ceilings(tmp_path, monkeypatch, capsys):
    import benchmarks as bm

    ceil = dict(xla_copy_gbps=3000.0, torch_copy_gbps=None, matmul_tflops=800.0)
    monkeypatch.setattr(bm, "measure_ceilings", lambda iters: ceil)
    monkeypatch.setattr(bm, "run_header", lambda: dict(device="GPU X", jax="0.11.2", date="today"))
    out = tmp_path / "a" / "b"
    header, got = bm.begin_run("paged_gather", str(out), 30)
    assert out.is_dir() and got is ceil and header["device"] == "GPU X"
    text = capsys.readouterr().out
    assert "# paged_gather benchmark on GPU X, jax 0.11.2, today" in text
    assert "copy XLA 3000 GB/s, torch nan GB/s; bf16 matmul 800 TFLOP/s" in text


def test_mla_decode_fp8_cells_on_a_cpu():
    """`mla-bench mla_decode --kv-dtype fp8` builds fp8 pages (quantised random latents) and its XLA
    baseline reads them dequantised: it agrees with mla_decode_reference on those pages (a bad
    --kv-dtype: tests/test_bad_inputs.py)."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import bench_mla_decode as bench
    from pallas_kernels import mla_decode_reference

    q, kv, table, lens, total = bench.make_cell(2, 2, 100, 16, True, kv_dtype="fp8")
    assert kv.dtype == jnp.uint8 and kv.shape[1:] == (64, 656)
    assert bench.token_bytes("fp8") == 656 and bench.token_bytes("bf16") == 1152
    out, lse = bench.xla_absorbed(q, kv, table, lens, causal=True)
    ref, ref_lse = mla_decode_reference(q, kv, table, lens, softmax_scale=bench.SCALE, causal=True)
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.linalg.norm(o - r) / np.linalg.norm(r) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-3)


def test_mla_bench_help_lists_the_benchmarks(capsys):
    """`mla-bench --help` printed one usage line on stderr and exited 2; it now lists every benchmark with
    what it measures on stdout and exits 0. No name, or an unknown one, is one error line naming the
    choices, exit 2 (docs/ERRORS.md)."""
    from benchmarks.__main__ import BENCHMARKS, main

    assert main(["--help"]) == 0 and main(["-h"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("usage: mla-bench {mla_decode,")
    for name in BENCHMARKS:
        assert f"\n  {name} " in out
    assert "--config tiny" in out
    for argv, what in (([], "no benchmark named"), (["mla_decod"], "unknown benchmark 'mla_decod'")):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (
            f"mla-bench: error: {what}; choose from mla_decode, paged_gather, moe, e2e, compile_depth, train, serve "
            "(see --help)\n"
        )


def test_mla_decode_default_cells_hold_ragged_batches():
    """Issue 29: the quick cells, the full grid and --only-flashmla's cells include ragged batches of several
    length distributions (normal around seq, uniform draws of three ranges), s_q 1 and 2, H 64 and 128: what
    continuous batching feeds the kernel, reported beside the peers by default."""
    from benchmarks import bench_mla_decode as bench

    for cells in (bench.grid(True), bench.grid(False)):
        ragged = [c for c in cells if c[4]]
        assert {c[1] for c in ragged} == {1, 2} and {64, 128} <= {c[3] for c in ragged}
        assert len({bench.lengths_name(c[4]) for c in ragged}) >= 4
    assert set(bench.RAGGED_CELLS) <= set(bench.grid(True))


class _FakeCupti:
    """The Mosaic GPU extension's CUPTI hooks as `benchmarks._cupti_record` calls them: each call of the timed
    callable appends its (name, ms) kernels; `_cupti_get_timings` hands the record back."""

    def __init__(self, per_call):
        self.per_call, self.record, self.on = per_call, [], False

    def _cupti_init(self):
        self.on, self.record = True, []

    def _cupti_get_timings(self, finalize):
        self.on = False
        return self.record

    def call(self):
        if self.on:
            self.record += self.per_call(len(self.record))


def _record(monkeypatch, per_call, iterations=4):
    import types

    from jax._src import lib

    import benchmarks as bm

    fake = _FakeCupti(per_call)
    monkeypatch.setattr(lib, "mosaic_gpu", types.SimpleNamespace(_mosaic_gpu_ext=fake), raising=False)
    monkeypatch.setitem(sys.modules, "jax._src.lib.mosaic_gpu", lib.mosaic_gpu)
    return bm._cupti_record(fake.call, lambda: None, iterations, warmup=1)


def test_cupti_record_splits_calls_by_their_kernels_and_sums_a_conditional_whole(monkeypatch):
    """Calls that launch the same kernels in the same order: the median of the calls' sums and each kernel's
    median, in µs. Calls whose kernels the device recorded in other orders (XLA's conditional, the "auto"
    decode schedule: jax's profiler.measure raised "Kernel names are not consistent across iterations" on the
    H200 and the cell went untimed): the record's mean a call and no parts (a per-call split would give a call
    its neighbour's kernels). A record the calls do not divide is refused."""
    times = iter([1.0, 2.0, 1.0, 2.0, 1.0, 8.0, 1.0, 2.0])
    us, parts = _record(monkeypatch, lambda n: [("a", next(times)), ("b", next(times))])
    assert us == 3000.0 and parts == {"0:a": 1000.0, "1:b": 2000.0}
    # two kernels a call, recorded in another order on every other call
    order = iter(
        [[("a", 1.0), ("b", 2.0)], [("b", 2.5), ("a", 0.5)], [("a", 1.0), ("b", 2.0)], [("b", 2.0), ("a", 1.0)]]
    )
    us, parts = _record(monkeypatch, lambda n: next(order))
    assert parts is None and us == (1.0 + 2.0 + 2.5 + 0.5 + 1.0 + 2.0 + 2.0 + 1.0) / 4 * 1e3
    with pytest.raises(RuntimeError, match="not the same number each call"):
        _record(monkeypatch, lambda n: [("a", 1.0)] * (1 + n % 2), iterations=3)


# ------------------------------------------------------------------------------------------
# A failure late in a run: the rows before it stay on disk, one line says it, the exit status is 1
# ------------------------------------------------------------------------------------------
OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.90GiB.\nthe allocator's details"


def _no_gpu_timing(monkeypatch):
    """The GPU-only parts of a kernel benchmark replaced: no GPU check, fixed ceilings, every timing 10 µs."""
    import os

    import benchmarks as bm

    def begin_run(name, out_dir, iters):
        os.makedirs(out_dir, exist_ok=True)
        return dict(device="test", jax="test", date="test", command="test"), dict(
            bandwidth_gbps=1000.0, matmul_tflops=100.0, xla_copy_gbps=1000.0, torch_copy_gbps=None
        )

    monkeypatch.setattr(bm, "require_gpu", lambda prog: None)
    monkeypatch.setattr(bm, "begin_run", begin_run)
    monkeypatch.setattr(
        bm,
        "cupti_median_us",
        lambda fn, *a, iterations=30, per_kernel=False: (10.0, {"0:k": 10.0}) if per_kernel else 10.0,
    )


def _one_line_failure(exc, prog: str, first: str) -> str:
    msg = exc.value.code
    assert isinstance(msg, str) and "\n" not in msg, msg  # a string: exit status 1 and the line on stderr
    assert msg.startswith(f"{prog}: error: "), msg
    assert f"(the first, {first}: RuntimeError: RESOURCE_EXHAUSTED: Out of memory" in msg, msg
    return msg


def test_paged_gather_cell_that_fails_keeps_the_rows_before(tmp_path, monkeypatch):
    """`mla-bench paged_gather` whose second cell fails (out of memory): paged_gather.csv holds the first cell's
    timed row and the second's with its error, the ceilings' meta JSON is written, and the run exits with one line
    and status 1. Catches a run that wrote its CSV only at the end, or exited 0 with a failed cell in a note."""
    from benchmarks import bench_paged_gather as pg

    _no_gpu_timing(monkeypatch)
    monkeypatch.setattr(pg, "grid", lambda quick: [(1, 64), (2, 100)])
    real = pg.paged_gather

    def gather(kv, bt, **kw):
        if bt.shape[0] == 2:
            raise RuntimeError(OOM)
        return real(kv, bt, **dict(kw, impl="reference"))

    monkeypatch.setattr(pg, "paged_gather", gather)
    with pytest.raises(SystemExit) as exc:
        pg.main(["--out", str(tmp_path)])
    _one_line_failure(exc, "paged_gather", "B=2 T=100 default")
    import benchmarks as bm

    rows = bm.read_csv(str(tmp_path / "paged_gather.csv"))
    assert [(r["B"], r["us"], r["exact"], r["error"]) for r in rows[:1]] == [(1, 10.0, True, "")]
    assert rows[1]["B"] == 2 and rows[1]["error"].startswith("RuntimeError: RESOURCE_EXHAUSTED") and rows[1]["us"] == ""
    assert (tmp_path / "paged_gather_meta.json").exists()


def test_moe_cell_that_fails_keeps_the_rows_before(tmp_path, monkeypatch):
    """`mla-bench moe` (a tiny layer's shape) whose mgpu call at the second token count fails: moe_<model>.csv
    holds every other row, timed, and that one with its error; the run exits with one line and status 1 (it exited
    0 with the failure in a note)."""
    from types import SimpleNamespace

    from benchmarks import bench_moe
    from mla_jax import ModelConfig

    _no_gpu_timing(monkeypatch)
    monkeypatch.setattr(bench_moe, "ModelConfig", SimpleNamespace(deepseek_v2_lite=ModelConfig.tiny))
    real = bench_moe.moe_grouped

    def grouped(x, *a, impl, **kw):
        if impl == "mgpu" and x.shape[0] == 8:
            raise RuntimeError(OOM)
        return real(x, *a, impl="ragged_dot")

    monkeypatch.setattr(bench_moe, "moe_grouped", grouped)
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(["--tokens", "1,8", "--out", str(tmp_path)])
    _one_line_failure(exc, "moe", "T=8 mgpu")
    import benchmarks as bm

    rows = bm.read_csv(str(tmp_path / "moe_v2-lite.csv"))
    assert [(r["T"], r["impl"], bool(r["error"]), r["us"]) for r in rows] == [
        (1, "decode", False, 10.0),
        (1, "mgpu", False, 10.0),
        (1, "ragged_dot", False, 10.0),
        (8, "decode", False, 10.0),
        (8, "mgpu", True, ""),
        (8, "ragged_dot", False, 10.0),
    ]


def test_moe_row_tiles_time_the_decode_kernel_once_a_tile(tmp_path, monkeypatch, capsys):
    """`mla-bench moe --row-tiles 16,32`: a decode row per tile, each call given the default config with that row
    tile (the kernel's reads of an expert's weights are once a tile, so the two must really differ in the config the
    kernel gets); the other impls once; a tile the kernel refuses is one line before anything runs."""
    from types import SimpleNamespace

    from benchmarks import bench_moe
    from mla_jax import ModelConfig

    _no_gpu_timing(monkeypatch)
    monkeypatch.setattr(bench_moe, "ModelConfig", SimpleNamespace(deepseek_v2_lite=ModelConfig.tiny))
    real, seen = bench_moe.moe_grouped, []

    def grouped(x, *a, impl, **kw):
        seen.append((impl, kw.get("decode_config")))
        return real(x, *a, impl="decode_interpret" if impl == "decode" else "ragged_dot", **kw)

    monkeypatch.setattr(bench_moe, "moe_grouped", grouped)
    bench_moe.main(["--tokens", "8", "--row-tiles", "16,32", "--out", str(tmp_path)])
    import benchmarks as bm

    rows = bm.read_csv(str(tmp_path / "moe_v2-lite.csv"))
    assert [(r["impl"], r["row_tile"], r.get("error", "")) for r in rows] == [
        ("decode", 16, ""),
        ("decode", 32, ""),
        ("mgpu", "", ""),
        ("ragged_dot", "", ""),
    ]
    assert all(r["rel_err"] < 1e-2 for r in rows)
    tiles = {c.row_tile for impl, c in seen if impl == "decode"}
    assert tiles == {16, 32} and all(c is None for impl, c in seen if impl != "decode")
    with pytest.raises(SystemExit) as exc:
        bench_moe.main(["--row-tiles", "16,24", "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m benchmarks moe: error: --row-tiles 16,24: ") and err.endswith("got 24"), err


def test_mla_decode_cell_that_fails_keeps_the_rows_before(tmp_path, monkeypatch):
    """`mla-bench mla_decode` over two small cells whose second cell's kernel fails: mla_decode.csv holds the first
    cell's timed row and the second's with its error (it was a note), and the run exits with one line and status 1
    (it exited 0)."""
    from benchmarks import bench_mla_decode as md

    _no_gpu_timing(monkeypatch)

    def kernel(q, kv, table, lens, *, causal, **kw):
        if table.shape[1] > 1:
            raise RuntimeError(OOM)
        return md.xla_absorbed(q, kv, table, lens, causal=causal)

    monkeypatch.setattr(md, "mla_decode", kernel)
    with pytest.raises(SystemExit) as exc:
        md.main(["--cell-list", "1,1,64,16;1,1,128,16", "--no-decompressed", "--out", str(tmp_path)])
    _one_line_failure(exc, "mla_decode", "B=1 s_q=1 seq=128 H=16 fixed default")
    import benchmarks as bm

    rows = bm.read_csv(str(tmp_path / "mla_decode.csv"))
    assert [(r["seq"], r["us"], r["error"]) for r in rows[:1]] == [(64, 10.0, "")]
    assert rows[1]["seq"] == 128 and rows[1]["error"].startswith("RuntimeError: RESOURCE_EXHAUSTED")
    assert (tmp_path / "mla_decode_meta.json").exists()


def test_compile_depth_that_fails_keeps_the_other_depths(tmp_path, monkeypatch):
    """`mla-bench compile_depth --layers 4,27,8` whose 27-layer process fails: compile_depth.csv holds the 4- and
    8-layer rows (the ratio against the shallowest that ran) and the 27-layer one with the process's last stderr
    line; the run exits with one line and status 1. It exited at the failure, before writing any row."""
    import json

    from benchmarks import bench_compile_depth as cd

    def child(cmd, **kw):
        layers = int(cmd[-1])
        if layers == 27:
            return subprocess.CompletedProcess(cmd, 1, "", f"Traceback ...\nRuntimeError: {OOM.splitlines()[0]}\n")
        row = dict(layers=layers, first_s=1.0 + layers / 4, warm_s=1.0, compile_s=layers / 4, compiles=4)
        return subprocess.CompletedProcess(cmd, 0, json.dumps(row) + "\n", "")

    monkeypatch.setattr(cd.subprocess, "run", child)
    with pytest.raises(SystemExit) as exc:
        cd.main(["--layers", "4,27,8", "--out", str(tmp_path)])
    msg = exc.value.code
    assert isinstance(msg, str) and "\n" not in msg and msg.startswith("compile_depth: error: 1 of 3 rows failed"), msg
    assert "27 layers: DepthFailed: RuntimeError: RESOURCE_EXHAUSTED: Out of memory" in msg, msg
    import benchmarks as bm

    rows = bm.read_csv(str(tmp_path / "compile_depth.csv"))
    assert [(r["layers"], r["x_shallowest"], bool(r["error"])) for r in rows] == [
        (4, 1.0, False),
        (27, "", True),
        (8, 2.0, False),
    ]
