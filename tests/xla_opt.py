"""`optimized()`: XLA's optimisations on for what compiles inside it (the suite compiles without most of
them on a CPU machine: tests/conftest.py). For programs a test runs for long; the `xla_optimized` marker
wraps a whole test in it."""

import contextlib

import jax


@contextlib.contextmanager
def optimized():
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
