"""The suite's two tiers.

The quick tier is the default run: the README's test command, the first thing `.ci/run` runs. It holds every
public behaviour at least once. The full tier, `pytest --full` (or MLA_JAX_FULL_TESTS=1), adds the tests marked
`full`: the matrices over which the quick tier takes representatives (each mesh shape alone beside the eight-way
meshes and the mixed mesh that has every axis at once; each decode body at every head count beside the default
body's cases), further k values of tests the quick tier runs at one, and slow tests whose behaviour faster ones
cover. `.ci/run` runs the full tier after the quick one. A `full` mark's reason names what covers it in the
quick tier.
"""

from __future__ import annotations

import os

import pytest

FULL_ENV = "MLA_JAX_FULL_TESTS"


def full_tier(config) -> bool:
    """Whether this run includes the tests marked `full`."""
    return bool(config.getoption("--full", default=False) or os.environ.get(FULL_ENV))


def full(values, default, why: str):
    """`values` for a parametrize, those not in `default` marked `full` (reason `why`); a tuple is the
    arguments of a case of several names."""

    def param(v):
        return pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.full(why))

    return [v if v in default else param(v) for v in values]


def gpu_full(values, default):
    """`full` for a GPU test's matrix: the GPU quick tier (`pytest -m gpu`) runs `default`, `--full` all of it."""
    return full(values, default, "the GPU quick tier runs representatives of this matrix; --full runs all of it")
