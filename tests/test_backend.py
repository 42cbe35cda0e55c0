"""`pallas_kernels.backend`: the one "which implementation" vocabulary, and the interpreter on small machines.

The Pallas GPU interpreter runs each warpgroup of a kernel as an XLA program whose callbacks block on simulated
barriers; XLA:CPU sizes its thread pool by the schedulable cores. On two cores, with NPROC unset, an fp8 decode
kernel whose CTA reads several pages never returned (a user had to know to set NPROC; the test suite did it in
conftest.py). These tests run a process pinned to two cores with NPROC unset, as a user's would be."""

import os
import subprocess
import sys

import pytest

from pallas_kernels import backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import os, sys
os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:2]))   # a 2-core machine
if sys.argv[1] == "jax-first":
    import jax
    jax.devices()                       # jax's CPU backend (and its thread pool) starts before the library
import jax.numpy as jnp
import numpy as np
from pallas_kernels import MlaDecodeConfig, mla_decode, quantize_latent_fp8

rng = np.random.default_rng(0)
pages = quantize_latent_fp8(jnp.asarray(rng.standard_normal((3, 64, 576)), jnp.float32))
q = jnp.asarray(rng.standard_normal((1, 1, 16, 576)), jnp.bfloat16)
try:
    out, _ = mla_decode(q, pages, jnp.asarray([[2, 0, 1]], jnp.int32), jnp.asarray([150], jnp.int32),
                        softmax_scale=0.1, config=MlaDecodeConfig(num_splits=1), impl="interpret")
    print("finished", out.shape)
except ValueError as e:
    print("refused:", e)
"""


def _run(mode: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "NPROC"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to")
def test_interpreter_finishes_on_two_cores_without_nproc():
    """The library raises NPROC before jax starts its CPU backend: an interpreted fp8 decode kernel whose one
    CTA reads three pages finishes (it hung: the subprocess would time out and fail the test)."""
    assert _run("library-first") == "finished (1, 1, 16, 512)"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to")
def test_interpreter_refuses_in_one_line_when_the_pool_is_too_small():
    """jax's backend already started with two pool threads: "interpret" is refused in one line naming the fix,
    instead of hanging."""
    line = _run("jax-first")
    assert line.startswith("refused: impl='interpret': the Pallas interpreter needs 8 XLA:CPU pool threads")
    assert "set NPROC=8" in line


def test_resolve_spells_auto_one_way():
    """None (the kernels' earlier default) and "auto" are one choice; anything else is named in the error."""
    assert backend.resolve(None) == backend.resolve("auto") == ("kernel" if backend.on_hopper() else "reference")
    assert backend.resolve("reference") == "reference"
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'kernel', 'interpret', 'reference'\)"):
        backend.resolve("fast")
    assert backend.choose("auto", ["a limit"]) == "reference"
    with pytest.raises(ValueError, match=r"^attention_impl='kernel': the kernels cannot serve this: a; b$"):
        backend.choose("kernel", ["a", "b"], name="attention_impl")
