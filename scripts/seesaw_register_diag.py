"""Diagnosis of the seesaw kernel's register use (GPU only; what NOTES.md quotes).

Builds variants of `_decode_partials_seesaw` by source transforms (P·V through run_scoped instead
of run_state, no barrier wait inside the P·V scope, no V-tail zeroing, Q·Kᵀ into the whole
accumulator), then for each: compiles it (ptxas prints registers and spills with
MOSAIC_GPU_DUMP_PTXAS=1), checks it against the reference and times it on two cells with
wall-clock time per call over 20 calls (dispatch included: for comparing variants only; the
benchmark's CUPTI figures are the ones to quote). "no_zero" is only valid on inputs without NaN
page tails, which these cells have.

  MOSAIC_GPU_DUMP_PTXAS=1 XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=. \
      python3 scripts/seesaw_register_diag.py 2>&1 | grep -E "###|RESULT|Used|spill stores|injected"
"""
import inspect, sys, time, textwrap
import numpy as np
import jax, jax.numpy as jnp
import importlib; md = importlib.import_module("pallas_kernels.mla_decode")
from pallas_kernels import MlaDecodeConfig

SRC = inspect.getsource(md._decode_partials_seesaw)
T = {
  "scoped_pv": [("      if interp:   # the interpreter has no run_state", "      if True:")],
  "no_then": [("acc = pv(acc * bcast(alpha0, acc), 0, 0, then=lambda: plgpu.barrier_wait(s1_bar))",
               "acc = pv(acc * bcast(alpha0, acc), 0, 0); plgpu.barrier_wait(s1_bar)")],
  "no_zero": [("        zero_v(0, j0, 0)\n", ""), ("        zero_v(1, j1, 0)\n", ""),
              ("        zero_v(0, j0, half)\n", ""), ("        zero_v(1, j1, half)\n", "")],
  "whole_acc_qk": [("plgpu.wgmma(acc_ref.at[:, ts], q_smem", "plgpu.wgmma(acc_ref, q_smem")],
}
T["scoped_nozero"] = T["scoped_pv"] + T["no_zero"]
T["all"] = T["scoped_pv"] + T["no_zero"] + T["no_then"] + T["whole_acc_qk"]

def build(name):
  src = SRC
  for a, b in T.get(name, []):
    assert a in src, (name, a)
    src = src.replace(a, b)
  ns = dict(vars(md))
  exec(compile(src, f"<{name}>", "exec"), ns)
  return ns["_decode_partials_seesaw"]

def cell(B, seq, H, seed=0):
  rng = np.random.default_rng(seed)
  P = seq // 64
  kv = jnp.asarray(rng.standard_normal((B * P, 64, 576), np.float32), jnp.bfloat16)
  bt = jnp.asarray(rng.permutation(B * P).reshape(B, P).astype(np.int32))
  q = jnp.asarray(rng.standard_normal((B, 1, H, 576), np.float32), jnp.bfloat16)
  return q, kv, bt, jnp.full((B,), seq, jnp.int32)

def main():
  cells = [(128, 4096, 128), (128, 8192, 64)]
  data = {c: cell(*c) for c in cells}
  refs = {c: md.mla_decode_reference(*data[c], softmax_scale=0.1) for c in cells}
  orig = md._decode_partials_seesaw
  for i, name in enumerate(["default", "v2"] + list(T)):
    print(f"### {name}", flush=True)
    cfg = MlaDecodeConfig(seesaw=name != "default", target_ctas=200 + i)
    md._decode_partials_seesaw = orig if name in ("default", "v2") else build(name)
    try:
      for c in cells:
        f = jax.jit(lambda *a: md.mla_decode(*a, softmax_scale=0.1, config=cfg, impl="kernel"))
        out, _ = f(*data[c]); jax.block_until_ready(out)
        r = np.asarray(refs[c][0], np.float32)
        err = float(np.linalg.norm(np.asarray(out, np.float32) - r) / np.linalg.norm(r))
        for _ in range(3): jax.block_until_ready(f(*data[c]))
        t = time.perf_counter(); n = 20
        for _ in range(n): o = f(*data[c])
        jax.block_until_ready(o)
        us = (time.perf_counter() - t) / n * 1e6
        print(f"RESULT {name} cell={c} rel_err={err:.2e} wall_us={us:.1f}", flush=True)
    except Exception as e:
      print(f"RESULT {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
  main()
