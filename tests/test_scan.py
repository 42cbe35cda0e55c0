"""Scanned layers: the compiled step does not grow with depth, and a decode step updates the
stacked page pools in place (no copy of the cache).

Guards against: a Python loop over layers coming back (every layer traced and compiled anew: the
27-layer step would be ~7x the 4-layer one); a scan that takes the pools as per-layer inputs and
returns them as outputs, or any other path that copies the whole cache each step; the step's
cache not being donated (no input/output alias: XLA would write a second pool every step).
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from micro_configs import narrow_v2_lite

from mla_jax.kv_cache import KVCache
from models import DeepSeekModel
from models.serving.engine import Engine
from models.serving.sampling import SamplingArrays, SamplingParams
from models.serving.steps import StepInputs, new_lane
from tests import hlo as hlo_text

B, P = 2, 4


def _decode_step(layers: int, compile: bool = True):
    """(engine, lowered, compiled or None) of the decode step of a narrow V2-Lite-shaped model; a step
    only lowered needs the weights' shapes alone (no initialisation)."""
    make = lambda: DeepSeekModel(narrow_v2_lite(layers), rngs=nnx.Rngs(0))  # noqa: E731
    model = make() if compile else nnx.eval_shape(make)
    e = Engine(model, page_size=16, num_pages=64, max_batch=B, kv_dtype=jnp.float32)
    inp = StepInputs(
        np.zeros((B, 1), np.int32),
        np.zeros((B, 1), np.int32),
        np.zeros((B, P), np.int32),
        np.ones((B,), np.int32),
        np.zeros((B,), np.int32),
        np.zeros((B, 2), np.uint32),
        SamplingArrays.from_params([SamplingParams()] * B),
    )
    cache = KVCache.create(e.cache.pages, inp.block_table, inp.lengths)
    lowered = e.steps.decode.lower(e.state, cache, inp, sampler="greedy")
    return e, lowered, lowered.compile() if compile else None


def test_decode_step_does_not_grow_with_depth_and_updates_the_pools_in_place():
    steps = {4: _decode_step(4), 27: _decode_step(27, compile=False)}
    lowered = {n: len(lo.as_text().splitlines()) for n, (_, lo, _) in steps.items()}
    # Same program at any depth: only the stacked parameters' leading axis differs (an unrolled
    # 27-layer step would be ~7x the 4-layer one). Lowering shows it; compiling the 27-layer one too
    # (CPU seconds) adds nothing: the compiled program is the lowered one optimised.
    assert lowered[27] == lowered[4], lowered
    for n, (engine, _, c) in [(4, steps[4])]:
        hlo = c.as_text()
        pool = "f32[" + ",".join(map(str, engine.cache.pages.shape)) + "]"
        assert pool.startswith(f"f32[{n},")
        module = hlo.splitlines()[0]
        # The pools are a donated input aliased to the first output (the updated pools) ...
        assert "input_output_alias={ {0}:" in module, module[:300]
        # ... and nothing in the step copies them.
        copies = [line for line in hlo.splitlines() if pool in line and ("copy(" in line or "copy-start" in line)]
        assert not copies, copies[:3]


@pytest.mark.gpu
def test_gpu_decode_step_through_the_kernels_copies_no_pool_and_no_experts():
    """The same on a Hopper GPU, with the decode kernel reading the stacked pools in place (bf16
    pages of 64 x 576, a kernel-shaped narrow model), and the MoE decode kernel reading each
    layer's experts out of the whole stack (no per-layer slice of the [L, E, D, I] weights)."""
    from pallas_kernels.backend import on_hopper

    if not on_hopper():
        pytest.skip("needs a Hopper GPU")
    cfg = narrow_v2_lite(6).replace(
        kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16, hidden_size=128, moe_intermediate_size=64
    )
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    e = Engine(model, page_size=64, num_pages=256, max_batch=B, attention_impl="kernel")
    inp = StepInputs(
        np.zeros((B, 1), np.int32),
        np.zeros((B, 1), np.int32),
        np.zeros((B, P), np.int32),
        np.ones((B,), np.int32),
        np.zeros((B,), np.int32),
        np.zeros((B, 2), np.uint32),
        SamplingArrays.from_params([SamplingParams()] * B),
    )
    cache = KVCache.create(e.cache.pages, inp.block_table, inp.lengths, impl="kernel")
    hlo = e.steps.decode.lower(e.state, cache, inp, sampler="greedy").compile().as_text()
    pool = "bf16[" + ",".join(map(str, e.cache.pages.shape)) + "]"
    assert "input_output_alias={ {0}:" in hlo.splitlines()[0]
    copies = [line for line in hlo.splitlines() if pool in line and ("copy(" in line or "copy-start" in line)]
    assert not copies, copies[:3]
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    one_layer = (f"bf16[{E},{D},{I}]", f"bf16[{E},{I},{D}]")  # a layer's gate/up or down weights
    made = [
        line for line in hlo.splitlines() if " = " in line and line.split(" = ", 1)[1].lstrip().startswith(one_layer)
    ]
    assert not made, made[:3]
    # The multi-step decode program: no copy over 1 MB (pools, weights) and no host round trip inside it.
    steps, stops = np.full((B,), 8, np.int32), np.full((B, 1), -1, np.int32)
    loop = e.steps.decode_call.lower(
        e.state, cache, inp, new_lane(B), steps, stops, sampler="greedy", num_steps=8
    ).compile()
    assert hlo_text.big_copies(loop.as_text()) == []
    assert hlo_text.host_round_trips(loop.as_text()) == []


def test_a_decode_step_on_the_kernels_scans_two_layers_an_iteration():
    """A decode-sized call on a kernel backend scans an even stack two layers an iteration (the loop's counter and
    its per-layer row are a launch each an iteration: V2-Lite's step had 26 of each), an odd one (the dense layer)
    one; the reference backend, which launches per operation anyway, one. Catches `DECODE_UNROLL` dropped, or applied
    to an odd stack (its remainder layer cost the built-in model's verify step launches)."""
    import jax
    from micro_configs import narrow_v2_lite

    from models.deepseek import DECODE_UNROLL

    model = DeepSeekModel(narrow_v2_lite(3), rngs=nnx.Rngs(0))  # a dense layer, then a stack of 2 MoE layers
    e = Engine(model, page_size=16, num_pages=8, max_batch=2, kv_dtype=jnp.float32)
    fwd = lambda ids, positions, cache: model(ids, positions, cache=cache)  # noqa: E731
    args = (jnp.zeros((2, 1), jnp.int32), jnp.full((2, 1), 3, jnp.int32))
    table, lengths = jnp.asarray([[0], [1]], jnp.int32), jnp.full((2,), 3, jnp.int32)
    unrolls = {}
    for impl in ("interpret", "reference"):
        cache = KVCache.create(e.cache.pages, table, lengths, impl=impl)
        text = str(jax.make_jaxpr(fwd)(*args, cache))
        unrolls[impl] = re.findall(r"unroll=(\d+)", text)  # the interpreted kernels have loops of their own, at 1
    assert DECODE_UNROLL == 2
    assert unrolls["interpret"].count("2") == 1 and unrolls["reference"] == ["1", "1"], unrolls
