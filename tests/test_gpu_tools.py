"""The command-line tools on a Hopper GPU, each once, as a user starts them (a subprocess of this Python): the
GPU quick tier's share of the tools. Each run must end with status 0 and print what a user reads; the engine's
memory plan must have sized the pool from the device (`mla-bench serve`)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path, timeout=600):
    # The subprocess runs in tmp_path: the checkout goes on its path whether or not it is installed.
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_gpu_mla_generate_with_mtp(tmp_path):
    """`mla-generate --mtp` (the README's main job) on the GPU: the built-in model through the kernels, a stats line
    whose decode rate is a warm rate (a compilation charged to the timed run read as ~10 tok/s)."""
    p = _run(["models.serving.cli", "--mtp", "--max-new-tokens", "64", "--compile-cache", "off"], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    stats = [ln for ln in p.stdout.splitlines() + p.stderr.splitlines() if ln.startswith("[stats]")]
    assert stats, p.stdout[-1000:]
    decode = float(stats[-1].split("decode ")[1].split(" tok/s")[0])
    assert decode > 100, stats[-1]


def test_gpu_mla_train_a_few_steps(tmp_path):
    """`mla-train` on the GPU (bf16, the flash attention kernels of training): three steps, a checkpoint, an export."""
    out = tmp_path / "run"
    p = _run(
        ["models.training.cli", "--out", str(out), "--steps", "3", "--warmup", "1", "--batch-size", "2"]
        + ["--seq-len", "128", "--dtype", "bf16", "--eval-windows", "2", "--no-progress", "--compile-cache", "off"],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((out / "export" / "training.json").read_text())["step"] == 3


def test_gpu_mla_bench_serve_plans_its_pool(tmp_path):
    """`mla-bench serve` on a small V2-Lite cut on the GPU: every request served, the greedy check run, serve.json
    written with the engine's memory plan (the device's bytes, the measured temporaries)."""
    out = tmp_path / "serve"
    p = _run(
        ["benchmarks", "serve", "--layers", "2", "--rates", "8", "--requests", "6", "--check", "2"]
        + ["--out", str(out), "--compile-cache", "off"],
        tmp_path,
    )
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    report = json.loads((out / "serve.json").read_text())
    plan = report["engine"]["memory_plan"]
    assert plan is not None and plan["device_bytes"] > 10 * 2**30 and plan["temp_bytes"] > 0
    assert report["complete"] and report["rows"][0]["lost"] == 0


def test_gpu_mla_bench_e2e_one_cell(tmp_path):
    """`mla-bench e2e` on a 2-layer V2-Lite cut on the GPU: one cell timed, a CSV row without an error."""
    out = tmp_path / "e2e"
    p = _run(
        ["benchmarks", "e2e", "--cells", "v2-lite:1x256", "--layers", "2", "--new-tokens", "16", "--no-hf"]
        + ["--ceiling-iters", "3"]
        + ["--out", str(out)],
        tmp_path,
    )
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    import benchmarks as bm

    rows = bm.read_csv(str(out / "e2e.csv"))
    assert rows and not any(r.get("error") for r in rows), rows
