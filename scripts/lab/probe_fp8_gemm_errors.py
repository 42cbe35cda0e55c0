"""Where the FP8 GEMM differs from its same-recipe reference on the GPU (a bisect of a mismatch the GPU tests found):
per variant (tile configs, pipeline depths, uniform scales, one K block alone) the fraction of elements off by more
than the tests' tolerance and where they sit (rows, 16-column scale groups, CTA column tiles). JSON to --out.

    PYTHONPATH=. python scripts/lab/probe_fp8_gemm_errors.py --out $OUT/fp8_errors.json
"""

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_gemm import Fp8MatmulConfig, default_config, fp8_matmul, fp8_matmul_reference
from tests.test_fp8_gemm import make_inputs


def where(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    bad = np.abs(got - want) > 1e-2 * np.abs(want).max() + 1e-2 * np.abs(want)
    r, c = np.nonzero(bad)
    return dict(
        frac=float(bad.mean()),
        rel=float(np.linalg.norm(got - want) / np.linalg.norm(want)),
        rows=sorted(set(r.tolist()))[:20],
        col16_mod8=np.bincount((c // 16) % 8, minlength=8).tolist(),
        col_tiles=np.bincount(c // 128, minlength=-(-got.shape[1] // 128)).tolist()[:48],
        n_bad=int(bad.sum()),
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    M, N, K = 32, 1536, 7168
    x, w, s = make_inputs(M, N, K, seed=M)
    base = default_config(M, N, K)
    variants = {
        "default": (base, x, s),
        "stages2": (dataclasses.replace(base, max_concurrent_steps=2), x, s),
        "split_m_64x64": (Fp8MatmulConfig(block_m=64, block_n=64, wg_split="m", max_concurrent_steps=4), x, s),
        "unit_w_scales": (base, x, jnp.ones_like(s)),
        "x_equal_blocks": (base, jnp.asarray(np.random.default_rng(1).standard_normal((M, K)), jnp.bfloat16), s),
        "x_one_k_block": (base, x.at[:, 128:].set(0), s),
        "M4096_default": (None, *make_inputs(4096, N, K, seed=1)[::2]),
    }
    rows = []
    for name, (config, xx, ss) in variants.items():
        t = time.time()
        try:
            ww = w if name != "M4096_default" else make_inputs(4096, N, K, seed=1)[1]
            got = jax.jit(lambda *a: fp8_matmul(*a, impl="kernel", config=config))(xx, ww, ss)
            want = jax.jit(fp8_matmul_reference)(xx, ww, ss)
            row = dict(variant=name, config=str(config), **where(got, want))
            again = jax.jit(lambda *a: fp8_matmul(*a, impl="kernel", config=config))(xx, ww, ss)
            row["repeatable"] = bool(np.array_equal(np.asarray(got), np.asarray(again)))
        except Exception as e:  # noqa: BLE001 - a variant that fails is a row
            row = dict(variant=name, error=f"{type(e).__name__}: {str(e)[:300]}")
        row["s"] = round(time.time() - t, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
