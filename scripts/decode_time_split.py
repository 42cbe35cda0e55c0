"""What the warp-specialised split-QK decode kernel's time splits into (GPU only; NOTES.md).

Ablations of `_decode_partials` built by source transforms, each timed with CUPTI (median of 30,
whole call) on two cells beside the unmodified kernel. The ablated kernels compute wrong
results on purpose (their rel_err is printed, not checked); the point is the time each part
costs:
  no_pv      P·V skipped (loads + Q·Kᵀ + softmax + exchanges)
  no_qk      Q·Kᵀ skipped, scores = 0 (loads + softmax + exchanges + P·V)
  no_mma     both skipped (loads + softmax + exchanges: the non-tensor floor)
  l2_pages   every step of a split re-reads the split's first page (L2-resident): the kernel
             with DRAM traffic taken out

  PYTHONPATH=. python3 scripts/decode_time_split.py
"""
import importlib
import inspect

import numpy as np
import jax
import jax.numpy as jnp

import benchmarks as bm
from pallas_kernels import MlaDecodeConfig

md = importlib.import_module("pallas_kernels.mla_decode")
SRC = inspect.getsource(md._decode_partials)
_NO_QK = ("      sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE // 2), jnp.float32)) * scale_log2",
          "      sc = plgpu.layout_cast(jnp.zeros((ROWS, PAGE_SIZE // 2), jnp.float32), wgmma_layout)")
_NO_PV = ("      return pv_update(acc, p16, kv.at[:, cols]), m_new, l",
          "      return acc, m_new, l")
T = {
    "no_pv": [_NO_PV],
    "no_qk": [_NO_QK],
    "no_mma": [_NO_QK, _NO_PV],
    "l2_pages": [("lambda i: (table[first_page + i], 0, 0)", "lambda i: (table[first_page + jnp.minimum(i, 0)], 0, 0)")],
}


def build(name):
  src = SRC
  for a, b in T[name]:
    assert a in src, (name, a)
    src = src.replace(a, b)
  ns = dict(vars(md))
  exec(compile(src, f"<{name}>", "exec"), ns)
  return ns["_decode_partials"]


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
  orig = md._decode_partials
  for i, name in enumerate(["default"] + list(T)):
    md._decode_partials = orig if name == "default" else build(name)
    cfg = MlaDecodeConfig(split_qk=True, target_ctas=300 + i)   # a distinct jit cache entry
    try:
      for c in cells:
        f = jax.jit(lambda *a, cfg=cfg: md.mla_decode(*a, softmax_scale=0.1, config=cfg,
                                                       impl="kernel"))
        out, _ = f(*data[c])
        r = np.asarray(refs[c][0], np.float32)
        err = float(np.linalg.norm(np.asarray(out, np.float32) - r) / np.linalg.norm(r))
        us = bm.cupti_median_us(f, *data[c], iterations=30)
        print(f"RESULT {name} cell={c} us={us:.1f} rel_err={err:.2e}", flush=True)
    except Exception as e:  # noqa: BLE001
      print(f"RESULT {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
  md._decode_partials = orig


if __name__ == "__main__":
  main()
