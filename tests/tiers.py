"""The suite's two tiers.

The default run (the README's command, what CI runs) holds every behaviour at least once; `pytest --full` (or
MLA_JAX_FULL_TESTS=1) adds the tests marked `full`: the matrices over which the default tier takes representatives
(each mesh shape alone beside the mixed mesh that has every axis at once; each decode body at every head count
beside the default body's cases) and further k values of tests the default tier runs at one. A `full` mark's
reason names what covers it by default.
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
