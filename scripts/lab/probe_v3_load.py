"""Issue 32's load bullet: a V3-shaped cut written as an FP8 checkpoint the way the release is (e4m3 projections and
experts with 128x128 `weight_scale_inv`, `quantization_config` in config.json, sharded safetensors), then loaded in
a fresh process with `load_hf_checkpoint(path, weights="fp8")`, its peak host memory against the largest shard.

Two measures of host memory while loading, each against 2x the largest shard:
- the Python allocations' peak (tracemalloc: numpy buffers; the shards themselves are memory-mapped), the tests'
  measure (`tests/test_checkpoint.py`);
- the anonymous resident memory's peak above its level before the load (RssAnon of /proc/self/status, sampled every
  5 ms by a thread): every host allocation, numpy's, XLA's and the device runtime's, and not the mapped files.

    python scripts/lab/probe_v3_load.py --dir /tmp/v3cut --out $OUT/v3_load.json [--layers 4] [--shard-gb 4]
    python scripts/lab/probe_v3_load.py --config tiny --dir /tmp/tiny --out /tmp/tiny.json   # a CPU check

`--config tiny`: `ModelConfig.tiny()` in FP8 (the script's own check on a CPU). The write runs in this process, the
loads in a child process (nothing of the write's memory counted): a first load traces and compiles the loader's
programs, the second is measured (as the test does). Lab script: not part of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def rss_anon() -> int:
    """Anonymous resident bytes of this process (0 where /proc is not there)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def load_child(path: str) -> dict:
    """In the child: load the checkpoint in FP8 and report the peaks, the dtypes kept and the time."""
    import tracemalloc

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mla_jax import fp8_weights
    from models import load_hf_checkpoint

    shards = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    largest = max(os.path.getsize(f) for f in shards)
    t0 = time.perf_counter()
    first = load_hf_checkpoint(path, weights="fp8", dtype=jnp.bfloat16)  # traced and compiled: not measured
    jax.block_until_ready(nnx.state(first))
    cold = time.perf_counter() - t0
    del first
    base = rss_anon()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    tracemalloc.start()
    t0 = time.perf_counter()
    model = load_hf_checkpoint(path, weights="fp8", dtype=jnp.bfloat16)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - t0
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    done.set()
    t.join()
    state = nnx.state(model)
    fp8 = [
        v
        for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, fp8_weights.Fp8Weight))
        if isinstance(v, fp8_weights.Fp8Weight)
    ]
    return dict(
        shards=len(shards),
        largest_shard_bytes=largest,
        checkpoint_bytes=sum(os.path.getsize(f) for f in shards),
        load_seconds=seconds,
        first_load_seconds=cold,
        traced_peak_bytes=traced,
        rss_anon_growth_bytes=peak[0] - base,
        traced_over_2x_largest=traced / (2 * largest),
        rss_anon_over_2x_largest=(peak[0] - base) / (2 * largest),
        fp8_variables=len(fp8),
        fp8_dtypes=sorted({str(v[...].dtype) for v in fp8}),
        device=str(jax.devices()[0]),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="where the checkpoint is written (emptied first)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--config", choices=("full", "tiny"), default="full")
    p.add_argument("--layers", type=int, default=4, help="main layers of the V3 cut (3 dense at most, then MoE)")
    p.add_argument("--shard-gb", type=float, default=4.0, help="largest safetensors file, GB (the release: ~4.3)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(load_child(args.dir)))
        return

    import shutil

    import jax.numpy as jnp

    from benchmarks.bench_e2e import build_model, model_config
    from models import save_hf_checkpoint

    cfg = model_config("v3-cut", config=args.config, layers=args.layers)
    t0 = time.perf_counter()
    model, _ = build_model(cfg, jnp.bfloat16, weights="fp8")
    shutil.rmtree(args.dir, ignore_errors=True)
    shard_bytes = int(args.shard_gb * 1e9) if args.config == "full" else 200_000
    save_hf_checkpoint(model, args.dir, max_shard_bytes=shard_bytes)
    write_s = time.perf_counter() - t0
    del model
    child = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", "--dir", args.dir, "--out", args.out],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    if child.returncode:
        sys.exit(f"the load failed:\n{child.stderr[-3000:]}")
    r = json.loads(child.stdout.strip().splitlines()[-1])
    r.update(
        model="v3-cut" if args.config == "full" else "tiny",
        layers=cfg.num_hidden_layers,
        mtp_layers=cfg.num_mtp_layers,
        build_and_write_seconds=write_s,
        command=" ".join(["python", "scripts/lab/probe_v3_load.py", *sys.argv[1:]]),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(r, f, indent=1)
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
