"""Compile time against depth: a narrow DeepSeek-V2-Lite-shaped model (1 dense + MoE layers, 64
experts top-6, narrow widths) generating through `Engine` at several depths, each in a fresh process.

Usage: ``python -m benchmarks compile_depth [--layers 4,27] [--out DIR]`` (CPU or GPU)

Reports (first `generate` - warm `generate`) per depth, which is compilation (and tracing), and its
ratio to the shallowest depth (the shallowest that ran). With the layers scanned it stays about flat; with a
Python loop over layers it grew ~5x from 4 to 27 layers. compile_depth.csv is rewritten after each depth; a
depth whose process fails is a row with its last stderr line (``error``), and the run ends with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax

import benchmarks as bm

_CHILD = r"""
import json, sys, time
import jax.numpy as jnp
from flax import nnx
from mla_jax import ModelConfig
from models import DeepSeekModel, Engine
layers = int(sys.argv[1])
cfg = ModelConfig.deepseek_v2_lite().replace(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=layers,
    num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    max_position_embeddings=4096)
model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
engine = Engine(model, page_size=16, num_pages=64, max_batch=2, prefill_chunk=32, kv_dtype=jnp.float32)
prompts = [[1, 2, 3, 4, 5], [6, 7]]
t = time.perf_counter(); engine.generate(prompts, max_new_tokens=8); first = time.perf_counter() - t
t = time.perf_counter(); engine.generate(prompts, max_new_tokens=8); warm = time.perf_counter() - t
print(json.dumps(dict(layers=layers, first_s=first, warm_s=warm, compile_s=first - warm,
                      compiles=len(engine.compile_log))))
"""


class DepthFailed(RuntimeError):
    """A depth's child process exited non-zero (its stderr's last line is the message)."""


def measure(layers: int) -> dict:
    """One depth in a fresh process -> its row; DepthFailed when the child fails."""
    env = dict(os.environ, MLA_JAX_COMPILE_CACHE="off")
    res = subprocess.run([sys.executable, "-c", _CHILD, str(layers)], capture_output=True, text=True, env=env)
    if res.returncode:
        lines = res.stderr.strip().splitlines() or [f"exit status {res.returncode}"]
        raise DepthFailed(lines[-1])
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(args):
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "compile_depth.csv")
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        try:
            row = measure(layers)
        except Exception as e:  # noqa: BLE001 - a depth that fails must not cost the others
            row = bm.record_failure(dict(layers=layers), f"the {layers}-layer run", e)
        rows.append(row)
        done = [r for r in rows if not r.get("error")]
        for r in done:
            r["x_shallowest"] = r["compile_s"] / done[0]["compile_s"]
        bm.write_csv(csv_path, rows)
    print(f"# compile_depth on {jax.devices()[0].device_kind}, jax {jax.__version__}")
    bm.print_table(
        rows,
        [
            ("layers", "layers", "{}"),
            ("first_s", "first generate s", "{:.2f}"),
            ("warm_s", "warm generate s", "{:.3f}"),
            ("compile_s", "first - warm s", "{:.2f}"),
            ("x_shallowest", "x shallowest", "{:.2f}"),
            ("compiles", "compiled steps", "{}"),
            ("error", "error", "{}"),
        ],
    )
    bm.exit_if_failed("compile_depth", rows, csv_path, name=lambda r: f"{r['layers']} layers")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks compile_depth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--layers", default="4,27", help="depths, shallowest first (comma-separated)")
    p.add_argument("--out", default="runs/bench_compile_depth", help="directory for the CSV")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
