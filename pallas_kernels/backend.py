"""Which implementation of a kernel runs: the one vocabulary of this project, from the command line down.

Every public kernel entry point, the MLA layer's cached attention and the engine take ``impl`` in `IMPLS`:

* ``"auto"``: the Mosaic GPU kernel when jax's default backend is a Hopper GPU (compute capability 9.x)
  and the kernel serves the inputs, the plain-jnp reference everywhere else.
* ``"kernel"``: the Mosaic GPU kernel (also what cross-lowering for ``cuda`` on a CPU host uses: the
  kernel is traced and lowered there, never run).
* ``"interpret"``: the kernel under the Pallas Mosaic GPU interpreter (CPU; slow; for tests).
* ``"reference"``: the plain-jnp reference.

``None`` is read as ``"auto"``.

The Pallas GPU interpreter runs each warpgroup of a kernel as an XLA program whose callbacks block on the
simulated barriers; XLA:CPU sizes its client's thread pool by the schedulable cores (the ``NPROC``
environment variable overrides it). With fewer pool threads than a kernel has warpgroups the kernel never
finishes. So this module, imported before jax has started its CPU backend, raises ``NPROC`` to
`INTERPRETER_THREADS` on a smaller machine (unless the user set it), and `resolve` refuses ``"interpret"``
in one line when the pool jax started with is too small.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import jax
from jax._src import xla_bridge

IMPLS = ("auto", "kernel", "interpret", "reference")
RESOLVED = IMPLS[1:]  # what `resolve` returns
INTERPRETER_THREADS = 8  # XLA:CPU pool threads the interpreted kernels need (4 warpgroups + the callers)


def _schedulable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _pool_threads_from_env() -> int:
    """The XLA:CPU pool size a backend started now would get (NPROC, else the schedulable cores)."""
    try:
        return max(1, int(os.environ["NPROC"]))
    except (KeyError, ValueError):
        return _schedulable_cores()


# Whether jax's backends were up before this module was imported (then the pool size is fixed already: the
# environment of that moment decided it); if not, raise NPROC for the pool jax has yet to create.
_STARTED_BEFORE_IMPORT = bool(xla_bridge._backends)
if not _STARTED_BEFORE_IMPORT and "NPROC" not in os.environ and _schedulable_cores() < INTERPRETER_THREADS:
    os.environ["NPROC"] = str(INTERPRETER_THREADS)
_POOL_AT_IMPORT = _pool_threads_from_env()


@functools.cache
def on_hopper() -> bool:
    """True when jax's default backend is a CUDA GPU of compute capability 9.x (H100, H200)."""
    try:
        if jax.default_backend() != "gpu":
            return False
        device = jax.devices()[0]
    except RuntimeError:  # no backend initialised at all
        return False
    return str(getattr(device, "compute_capability", "")).split(".")[0] == "9"


def interpreter_threads() -> int:
    """XLA:CPU pool threads the interpreter can use in this process (best knowledge: the environment
    when jax started its backend)."""
    return _POOL_AT_IMPORT if _STARTED_BEFORE_IMPORT else _pool_threads_from_env()


def check_interpreter() -> None:
    """Raises ValueError (one line, naming the fix) when the interpreter would hang in this process."""
    threads = interpreter_threads()
    if threads < INTERPRETER_THREADS:
        raise ValueError(
            f"impl='interpret': the Pallas interpreter needs {INTERPRETER_THREADS} XLA:CPU pool threads and this "
            f"process has {threads} (its cores), so a kernel would hang; set NPROC={INTERPRETER_THREADS} in the "
            "environment before jax starts, or import pallas_kernels before the first jax computation"
        )


def resolve(impl: str | None) -> str:
    """`impl` (one of `IMPLS`, None = "auto") -> "kernel" | "interpret" | "reference"; ValueError otherwise.

    "auto" here is the platform rule alone; a kernel whose limits an input breaks is refused by the kernel
    (its `*_problems` function says which), and callers that want "auto" to fall back ask it first.
    """
    if impl is None:
        impl = "auto"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "kernel" if on_hopper() else "reference"
    if impl == "interpret":
        check_interpreter()
    return impl


def triton_offset_problems(name: str, shape: Sequence[int], dtype) -> list[str]:
    """Why a Pallas Triton kernel cannot index an array of this size (empty when it can).

    jax 0.11.2's Triton lowering (`_compute_offsets_from_indices`) computes element offsets in 32 bits for an
    array of at most 2**32 bytes and in 64 bits above; signed 32-bit offsets wrap for more than 2**31 elements,
    which only an array of 1-byte elements (e4m3) of 2**31..2**32 bytes has: the kernel then reads an illegal
    address (found on an H200 with V3's 256 experts x 2048 x 7168 e4m3 = 3.76e9 bytes)."""
    elements = 1
    for d in shape:
        elements *= int(d)
    if elements > 2**31 - 1 and elements * jax.numpy.dtype(dtype).itemsize <= 2**32:
        return [
            f"{name} has {elements} elements of 1 byte ({tuple(shape)}): Pallas' Triton lowering indexes arrays "
            "of at most 4 GiB with 32-bit offsets, which wrap past 2**31 elements"
        ]
    return []


def choose(impl: str | None, problems: Sequence[str], *, name: str = "impl") -> str:
    """`resolve(impl)` for a kernel that reports `problems` (its `*_problems` lines for these inputs, [] when
    it serves them): "auto" falls back to the reference where the kernel cannot serve; "kernel" and
    "interpret" raise ValueError naming every problem (and the argument, `name`)."""
    resolved = resolve(impl)
    if resolved == "reference" or not problems:
        return resolved
    if impl in (None, "auto"):
        return "reference"
    raise ValueError(f"{name}={impl!r}: the kernels cannot serve this: " + "; ".join(problems))
