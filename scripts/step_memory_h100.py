"""The engine's largest prefill step compiled for an H100 on a host without a GPU: its temporaries, as the engine's
memory plan reads them on the card (`compiled.memory_analysis()`), and with ``--dump DIR`` XLA's buffer report
(`*memory-usage-report.txt`: the largest arrays live at the peak).

Needs the CUDA extra (``pip install -e ".[cuda]"``: jax's CUDA plugin compiles for a described GPU without one:
`jax.experimental.topologies.get_topology_desc` with an H100's device description, `H100`); no GPU, no driver.
The steps take the Hopper paths (the Mosaic GPU kernels) as on the card. Checked against the card: the V3 cut
(FP8 weights) at 32 rows x 512 tokens gave 30.98 GiB here and on an H100 (2026-12-05).

    PYTHONPATH=. python3 scripts/step_memory_h100.py --model v3-cut --weights fp8 --batch 32 --context 1216
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["JAX_PLATFORMS"] = "cpu"  # the host's backend; the program is compiled for the described H100

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental.topologies import get_topology_desc  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

# An H100 SXM 80 GB as XLA's GPU compiler sees it (the CUDA 13 runtime and cuDNN 9 of the cuda extra).
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
runtime_version: { major: 13 minor: 0 patch: 0 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 28 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v3-cut", help="v2-lite | v3-cut (benchmarks.e2e_models)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--batch", type=int, default=32, help="the engine's max_batch (the step's rows)")
    p.add_argument("--context", type=int, default=1216, help="the engine's max_context (the widest table)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: the engine's")
    p.add_argument("--dump", default=None, help="a folder for XLA's dump of the compiled step")
    args = p.parse_args(argv)
    if args.dump:
        os.environ["XLA_FLAGS"] = f"--xla_dump_to={args.dump} --xla_dump_hlo_module_re=.*traced.*"

    from pallas_kernels import backend, fp8_gemm

    backend.on_hopper = lambda: True  # the paths a Hopper GPU takes
    fp8_gemm._num_sms = lambda: 132
    from benchmarks.e2e_models import model_config
    from mla_jax.kv_cache import KVCache, next_pow2
    from models import DeepSeekModel
    from models.serving.engine import Engine
    from models.serving.sampling import SamplingArrays, SamplingParams
    from models.serving.steps import StepInputs

    topology = get_topology_desc("h100", "cuda", target_config=H100, topology="1x1x1")
    one = NamedSharding(jax.sharding.Mesh(topology.devices, ("x",)), PartitionSpec())
    cfg = model_config(args.model, config="full", layers=args.layers)
    weights = "fp8" if args.weights == "fp8" else None
    make = lambda: DeepSeekModel(  # noqa: E731
        cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, weights=weights
    )
    B = args.batch
    e = Engine(
        nnx.eval_shape(make),
        page_size=64,
        num_pages=B * -(-args.context // 64),
        max_batch=B,
        max_context=args.context,
        prefill_chunk=args.prefill_chunk,
        kv_dtype=jnp.bfloat16,
    )
    T, P = next_pow2(max(e.min_chunk_bucket, e.prefill_chunk)), e.cache.max_pages_per_seq
    start = max(0, P * 64 - T - 64)  # a chunk late in the widest table: the decompressed path over its prefix
    inp = StepInputs(
        np.zeros((B, T), np.int32),
        np.tile(start + np.arange(T, dtype=np.int32)[None], (B, 1)),
        np.tile(np.arange(P, dtype=np.int32)[None], (B, 1)),
        np.full((B,), start + T, np.int32),
        np.full((B,), T - 1, np.int32),
        np.zeros((B, 2), np.uint32),
        SamplingArrays.from_params([SamplingParams()] * B),
    )
    cache = KVCache.create(
        e.cache.pages,
        inp.block_table,
        inp.lengths,
        impl=e.backend,
        decompressed_threshold=e.decompressed_threshold,
        page_format=e.cache.page_format,
    )
    on_h100 = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)  # noqa: E731
    state, cache, inp = (jax.tree.map(on_h100, t) for t in (e.state, cache, inp))
    t0 = time.perf_counter()
    traced = e.steps.prefill.trace(state, cache, inp, None, None, None, None, use_mtp=False, sampler="greedy")
    m = traced.lower().compile().memory_analysis()
    gib = 2.0**30
    print(
        f"{args.model} ({args.weights} weights) prefill of {B} rows x {T} tokens over {P * 64}-token tables, "
        f"compiled for an H100 in {time.perf_counter() - t0:.0f} s: temporaries {m.temp_size_in_bytes / gib:.2f} GiB, "
        f"arguments {m.argument_size_in_bytes / gib:.2f} GiB"
    )


if __name__ == "__main__":
    main()
