"""Two processes on 127.0.0.1 joined into one JAX runtime by `models.distributed` from mla-train's own flags
(`--coordinator --num-processes --process-id`): one CPU device each, a mesh over both, a batch split
across them as `mla-train --mesh` splits it, and `models.training.loop.host_array` gathering it back (what
the checkpoints' checksums and the export read). The flag checks and the call itself are tested in
tests/test_train_cli.py and tests/test_generate_cli.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json, sys
from models import distributed
from models.training.cli import build_parser
distributed.initialize(build_parser().parse_args(sys.argv[1:]))   # before any other use of jax
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from mla_jax.sharding import make_mesh, shard_batch
from models.training.loop import host_array
mesh = make_mesh(data=2)
ids = shard_batch(np.arange(8, dtype=np.int32).reshape(4, 2), mesh)
total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))(ids)
print(json.dumps(dict(process=jax.process_index(), processes=jax.process_count(), devices=jax.device_count(),
                      local_rows=[s.data.shape[0] for s in ids.addressable_shards], total=int(total),
                      gathered=host_array(ids).tolist())))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_make_one_runtime():
    """Guards: the flags not reaching jax.distributed (each process would see its own single device and
    `make_mesh(data=2)` would fail), a batch placement or a gather that only works within one process
    (device_put of a global batch, np.asarray of an array whose other half is on the other host)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_JAX_") or k == "MLA_JAX_COMPILE_CACHE"}
    env.update(
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f),
    )  # one CPU device a process
    flags = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2", "--process-id"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, *flags, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for i in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, r in enumerate(results):
        assert r == dict(
            process=i, processes=2, devices=2, local_rows=[2], total=28, gathered=[[0, 1], [2, 3], [4, 5], [6, 7]]
        ), r
