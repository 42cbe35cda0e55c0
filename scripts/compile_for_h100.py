"""An engine step compiled for an H100 on a host without a GPU: its temporaries, as the engine's memory plan reads
them on the card (`compiled.memory_analysis()`), and the kernels it launches, estimated from the compiled program
(each fusion, custom call and copy once, times the trip counts of the loops it is in); with ``--dump DIR`` XLA's
dump, whose `*memory-usage-report.txt` names the largest arrays live at the peak.

Needs the CUDA extra (``pip install -e ".[cuda]"``: jax's CUDA plugin compiles for a described GPU without one:
`jax.experimental.topologies.get_topology_desc` with an H100's device description, `H100`); no GPU, no driver.
The steps take the Hopper paths (the Mosaic GPU and Triton kernels) as on the card. Checked against an H100
(2026-12-05): the V3 cut's (FP8 weights) prefill at 32 rows x 512 tokens held 30.98 GiB of temporaries here and
there, V2-Lite's serve engine's 9.76 GiB; V2-Lite's decode step at B = 1 launches 951 kernels by this count, 961
by CUPTI's.

    PYTHONPATH=. python3 scripts/compile_for_h100.py --model v3-cut --weights fp8 --batch 32 --context 1216
    PYTHONPATH=. python3 scripts/compile_for_h100.py --model v2-lite --batch 1 --step decode
    PYTHONPATH=. python3 scripts/compile_for_h100.py --model builtin --batch 1 --step verify --draft-tokens 1

``--step decode`` is one plain decode step (`Steps.decode`); ``--step verify`` one MTP verify step of
``--draft-tokens`` drafts with its draft (`Steps.verify_call`, one step a call: the lane's bookkeeping included);
``--steps-a-call N`` compiles the call of N steps the engine runs at ``decode_steps=N`` (its launches the call's).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
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
    p.add_argument("--model", default="v3-cut", help="v2-lite | v3-cut (benchmarks.e2e_models) | builtin")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--batch", type=int, default=32, help="the engine's max_batch (the step's rows)")
    p.add_argument("--context", type=int, default=1216, help="the engine's max_context (the widest table)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: the engine's")
    p.add_argument("--step", choices=("prefill", "decode", "verify"), default="prefill")
    p.add_argument("--draft-tokens", type=int, default=1, help="with --step verify: drafts a step verifies")
    p.add_argument(
        "--steps-a-call",
        type=int,
        default=1,
        help="with --step decode / verify: model steps in the call (decode: > 1 compiles the lane's decode_call, "
        "as an engine of that many decode_steps runs it; the launches are then the call's)",
    )
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
    from models.serving.steps import StepInputs, new_lane

    topology = get_topology_desc("h100", "cuda", target_config=H100, topology="1x1x1")
    one = NamedSharding(jax.sharding.Mesh(topology.devices, ("x",)), PartitionSpec())
    if args.model == "builtin":
        from mla_jax.config import ModelConfig
        from models.builtin import BUILTIN_DIR

        cfg = ModelConfig.from_hf(BUILTIN_DIR)
    else:
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
    T = next_pow2(max(e.min_chunk_bucket, e.prefill_chunk)) if args.step == "prefill" else 1
    T = args.draft_tokens + 1 if args.step == "verify" else T
    P = e.cache.max_pages_per_seq
    start = max(0, P * 64 - T - 64)  # late in the widest table: a prefill chunk takes the decompressed path
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
    with jax.sharding.use_abstract_mesh(one.mesh.abstract_mesh):  # the Triton kernels' lowering reads the device
        if args.step == "decode":
            if args.steps_a_call > 1:  # the lane's call of that many plain steps (`Steps.decode_call`)
                lane, steps_B, stop_ids = (
                    new_lane(B),
                    jnp.full((B,), args.steps_a_call, jnp.int32),
                    jnp.full((B, 1), -1, jnp.int32),
                )
                lane, steps_B, stop_ids = (jax.tree.map(on_h100, t) for t in (lane, steps_B, stop_ids))
                traced = e.steps.decode_call.trace(
                    state, cache, inp, lane, steps_B, stop_ids, sampler="greedy", num_steps=args.steps_a_call
                )
            else:
                traced = e.steps.decode.trace(state, cache, inp, sampler="greedy")
        elif args.step == "verify":
            k, vocab = args.draft_tokens, cfg.vocab_size
            lane = new_lane(B)
            drafts, draft_probs = jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k, vocab), jnp.float32)
            steps_B = spec_B = jnp.ones((B,), jnp.int32) * k
            end_B, stop_ids = jnp.full((B,), P * 64 - 1, jnp.int32), jnp.full((B, 1), -1, jnp.int32)
            lane, drafts, draft_probs, steps_B, spec_B, end_B, stop_ids = (
                jax.tree.map(on_h100, t) for t in (lane, drafts, draft_probs, steps_B, spec_B, end_B, stop_ids)
            )
            loop = (steps_B, spec_B, end_B, stop_ids, None)
            call = e.steps.verify_call
            traced = call.trace(
                state, cache, inp, lane, drafts, draft_probs, *loop, sampler="greedy", num_steps=args.steps_a_call
            )
        else:
            args_mtp = (None, None, None, None)
            traced = e.steps.prefill.trace(state, cache, inp, *args_mtp, use_mtp=False, sampler="greedy")
        lowered = traced.lower()
    compiled = lowered.compile()
    m = compiled.memory_analysis()
    gib = 2.0**30
    print(
        f"{args.model} ({args.weights} weights) {args.step} of {B} rows x {T} tokens over {P * 64}-token tables, "
        f"compiled for an H100 in {time.perf_counter() - t0:.0f} s: temporaries {m.temp_size_in_bytes / gib:.2f} "
        f"GiB, arguments {m.argument_size_in_bytes / gib:.2f} GiB"
    )
    launches = kernel_launches(compiled.as_text())
    print(f"kernel launches a call (estimated): {sum(launches.values())}")
    for kind, n in launches.most_common():
        print(f"  {n:6d}  {kind}")


# Instructions of a compiled GPU module that launch nothing of their own.
_NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency"}
_NO_LAUNCH |= {"opt-barrier", "partition-id", "replica-id", "copy-done"}
_NO_LAUNCH |= {"async-done", "fusion-done"}  # the wait for an async fusion's stream: its start launched the work


def kernel_launches(text: str) -> collections.Counter:
    """{kind: launches} of a compiled GPU module's text: every instruction of the entry computation and of the
    loops and calls it runs (fused computations are inside their fusion) that is not a free one (`_NO_LAUNCH`),
    times the known trip counts of its loops (1 where XLA knows none). Kinds: the fusion's kind, the custom
    call's target, else the opcode. An estimate: a conditional counts its first branch."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?(%[\w.\-]+) \(", line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
        elif current is not None and " = " in line:
            comps[current].append(line)
    counts: collections.Counter = collections.Counter()

    def walk(comp: str, times: int) -> None:
        for line in comps.get(comp, []):
            rhs = line.split(" = ", 1)[1]
            op = re.search(r"\s([a-z][\w\-]*)\(", rhs)
            op = op.group(1) if op else "?"
            if op in _NO_LAUNCH:
                continue
            if op == "while":
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                walk(re.search(r"body=(%[\w.\-]+)", line).group(1), times * (int(n.group(1)) if n else 1))
            elif op == "call":
                walk(re.search(r"to_apply=(%[\w.\-]+)", line).group(1), times)
            elif op == "conditional":
                walk(re.findall(r"%[\w.\-]+", line.split("branch_computations=")[-1])[0], times)
            elif op == "fusion":
                counts["fusion " + re.search(r"kind=(\w+)", line).group(1)] += times
            elif op == "custom-call":
                counts[re.search(r'custom_call_target="([^"]+)"', line).group(1)] += times
            else:
                counts[op] += times

    walk(entry, 1)
    return counts


if __name__ == "__main__":
    main()
