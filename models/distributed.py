"""Several processes (one a host, or one a GPU) as one JAX runtime: `jax.distributed.initialize` for the
command-line tools (`mla-train`, `mla-generate`).

    mla-train --mesh data=16 --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0   # host 0
    mla-train --mesh data=16 --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 1   # host 1

Each flag defaults to an environment variable (`MLA_JAX_COORDINATOR`, `MLA_JAX_NUM_PROCESSES`,
`MLA_JAX_PROCESS_ID`), so a launcher can set them once a host; with none of them given nothing happens
(one process). The tools call `initialize` before any other use of jax, as jax requires: the backends
must start knowing the other processes' devices. Then `jax.devices()` lists every process's devices and
a mesh (`--mesh`) spans them; `jax.local_devices()` are this process's.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import jax

# field -> (flag, environment variable)
SOURCES = {
    "coordinator": ("--coordinator", "MLA_JAX_COORDINATOR"),
    "num_processes": ("--num-processes", "MLA_JAX_NUM_PROCESSES"),
    "process_id": ("--process-id", "MLA_JAX_PROCESS_ID"),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What `jax.distributed.initialize` is called with."""

    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int  # >= 1
    process_id: int  # in [0, num_processes)


def add_arguments(parser) -> None:
    """The three options, the same in every tool (strings: `resolve` checks flags and variables alike)."""
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=None,
        help="several processes as one JAX runtime (jax.distributed): process 0's address "
        "(default: $MLA_JAX_COORDINATOR; none = one process)",
    )
    parser.add_argument(
        "--num-processes",
        metavar="N",
        default=None,
        help="processes in the run, with --coordinator (default: $MLA_JAX_NUM_PROCESSES)",
    )
    parser.add_argument(
        "--process-id",
        metavar="I",
        default=None,
        help="this process, 0..N-1, with --coordinator (default: $MLA_JAX_PROCESS_ID)",
    )


def resolve(args, environ: Mapping[str, str] | None = None) -> Cluster | None:
    """The Cluster the flags (else the environment) ask for, or None when none is given. ValueError, one
    line naming the flag or variable, for an incomplete or inconsistent set: a process id or count
    without a coordinator, a coordinator without either, an address that is not HOST:PORT, a count < 1,
    an id outside [0, N)."""
    environ = os.environ if environ is None else environ
    given: dict[str, tuple[str, str]] = {}  # field -> (value, how to name it in a message)
    for field, (flag, var) in SOURCES.items():
        value = getattr(args, field, None)
        if value is not None:
            given[field] = (str(value).strip(), f"{flag} {value}")
        elif environ.get(var, "").strip():
            given[field] = (environ[var].strip(), f"{var}={environ[var].strip()}")
    if not given:
        return None
    if "coordinator" not in given:
        named = " and ".join(label for _, label in given.values())
        raise ValueError(f"{named}: several processes need --coordinator HOST:PORT (or $MLA_JAX_COORDINATOR)")
    address, label = given["coordinator"]
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{label}: not HOST:PORT (process 0's address and a free port, e.g. 10.0.0.1:1234)")
    for field in ("num_processes", "process_id"):
        if field not in given:
            flag, var = SOURCES[field]
            raise ValueError(f"{label} needs {flag} (or ${var})")
    (n, n_label), (i, i_label) = given["num_processes"], given["process_id"]
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"{n_label}: must be an integer >= 1")
    if not i.isdigit() or int(i) >= int(n):
        raise ValueError(f"{i_label}: must be an integer in [0, {n}) ({n_label})")
    return Cluster(address, int(n), int(i))


def initialize(args, environ: Mapping[str, str] | None = None) -> Cluster | None:
    """`resolve`, then `jax.distributed.initialize` when it names a cluster (call it before any other use
    of jax). ValueError as `resolve`; RuntimeError (one line) when jax cannot join the cluster."""
    cluster = resolve(args, environ)
    if cluster is None:
        return None

    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator, num_processes=cluster.num_processes, process_id=cluster.process_id
        )
    except (RuntimeError, ValueError) as e:  # jax's own: unreachable, timed out, already initialised
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RuntimeError(
            f"--coordinator {cluster.coordinator}: jax.distributed.initialize failed "
            f"(process {cluster.process_id} of {cluster.num_processes}): {reason}"
        ) from None
    return cluster
