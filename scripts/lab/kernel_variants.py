"""Kernel variants by source transform, for the GPU diagnosis scripts beside it
(scripts/lab/decode_time_split.py). Lab code: not in the
wheel, and no test depends on it.

A variant is a list of (old, new) text replacements applied to the source of one kernel-building
function of `pallas_kernels.mla_decode`; `patched` swaps the rebuilt function in for as long as
a ``with`` block lasts, and `run` checks and times each variant beside the unmodified kernel.
The replacements must match the source of the day exactly (`build` asserts it): after a kernel
edit, a diagnosis fails when it is run, and is updated or dropped then; CI never pins the
kernel's source text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import time

md = importlib.import_module("pallas_kernels.mla_decode")
# the package's files, where a body or step lives
PARTS = [
    importlib.import_module(f"pallas_kernels.mla_decode.{n}") for n in ("bf16", "fp8", "steps", "schedule", "combine")
]


def home(fn_name: str):
    """The module of the package that defines `fn_name`."""
    return next(
        m for m in PARTS + [md] if fn_name in vars(m) and getattr(vars(m)[fn_name], "__module__", "") == m.__name__
    )


def build(fn_name: str, transforms, label: str = "variant"):
    """`<fn_name>` of the mla_decode package rebuilt from its source with the (old, new) replacements applied."""
    mod = home(fn_name)
    src = inspect.getsource(getattr(mod, fn_name))
    for old, new in transforms:
        assert old in src, (label, old)
        src = src.replace(old, new)
    namespace = dict(vars(mod))
    exec(compile(src, f"<{label}>", "exec"), namespace)  # noqa: S102 - our own source, transformed
    return namespace[fn_name]


@contextlib.contextmanager
def patched(fn_name: str, transforms, label: str = "variant"):
    """Within the block, `mla_decode` traces the variant (None: the unmodified function): every module of the
    package that holds the name gets it."""
    original = getattr(home(fn_name), fn_name)
    variant = original if transforms is None else build(fn_name, transforms, label)
    holders = [m for m in PARTS + [md] if vars(m).get(fn_name) is original]
    for m in holders:
        setattr(m, fn_name, variant)
    try:
        yield
    finally:
        for m in holders:
            setattr(m, fn_name, original)


def decode_cell(batch: int, seq: int, heads: int, seed: int = 0):
    """Random finite s_q=1 inputs: fixed lengths, a permuted block table."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    pages = seq // md.PAGE_SIZE
    kv = jnp.asarray(rng.standard_normal((batch * pages, md.PAGE_SIZE, md.KEY_DIM), np.float32), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, md.KEY_DIM), np.float32), jnp.bfloat16)
    return q, kv, table, jnp.full((batch,), seq, jnp.int32)


def wall_us(fn, args, calls: int = 20) -> float:
    """Wall-clock µs per call over ``calls`` calls after 3 warm-ups (dispatch included)."""
    import jax

    for _ in range(3):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e6


def cupti_us(fn, args) -> float:
    """CUPTI median of 30 calls, whole call (µs)."""
    import benchmarks as bm

    return bm.cupti_median_us(fn, *args, iterations=30)


def run(fn_name: str, variants, cells, timer, impl: str = "kernel"):
    """Checks and times each (name, transforms or None, MlaDecodeConfig) on each (B, seq, H) cell;
    prints one ``RESULT`` line per (variant, cell). Each variant gets a distinct jit cache entry
    (``target_ctas`` 200 + i, which leaves the split plan of these B=128 cells at one split)."""
    import jax
    import numpy as np

    data = {c: decode_cell(*c) for c in cells}
    refs = {c: np.asarray(md.mla_decode_reference(*data[c], softmax_scale=0.1)[0], np.float32) for c in cells}
    for i, (name, transforms, config) in enumerate(variants):
        print(f"### {name}", flush=True)
        config = dataclasses.replace(config, target_ctas=200 + i)
        try:
            with patched(fn_name, transforms, name):
                for c in cells:
                    f = jax.jit(
                        lambda *a, config=config: md.mla_decode(*a, softmax_scale=0.1, config=config, impl=impl)
                    )
                    out = np.asarray(f(*data[c])[0], np.float32)
                    err = float(np.linalg.norm(out - refs[c]) / np.linalg.norm(refs[c]))
                    print(f"RESULT {name} cell={c} rel_err={err:.2e} us={timer(f, data[c]):.1f}", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing variant must not end the diagnosis
            print(f"RESULT {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
