"""A decode step's cost follows the tokens in the cache, not the room reserved for them; the multi-step decode
program has no host round trip inside it.

An engine sized for 1 500 new tokens took 3.7x (up to 7x on the 2-core machine) the time per decode step of
one sized for 48, at the same positions: the cache write went through a flattened view of the stacked page
pools, and XLA copied every pool of the stack at every layer of the step. These tests pin the fix two ways:
the compiled step holds no copy of a pool-sized array, and the measured step time does not grow with the pool.
"""

import re
import time

import numpy as np
import pytest

from mla_jax.kv_cache import KVCache
from models import Engine, load_hf_checkpoint
from models.builtin import BUILTIN_DIR
from models.sampling import SamplingArrays, SamplingParams
from models.steps import StepInputs


@pytest.fixture(scope="module")
def builtin():
    return load_hf_checkpoint(BUILTIN_DIR)


def _decode_call(engine, position: int):
    """(the engine's jitted decode step, its arguments) for one row at `position`, a one-page table."""
    B, P = engine.max_batch, 1
    inp = StepInputs(
        np.zeros((B, 1), np.int32),
        np.full((B, 1), position, np.int32),
        np.zeros((B, P), np.int32),
        np.full((B,), position + 1, np.int32),
        np.zeros((B,), np.int32),
        np.zeros((B, 2), np.uint32),
        SamplingArrays.from_params([SamplingParams(temperature=0.0)] * B),
    )

    def cache(pages):
        return KVCache.create(
            pages, inp.block_table, inp.lengths, impl=engine.backend, page_format=engine.cache.page_format
        )

    return cache, inp


def test_compiled_decode_step_copies_no_pool(builtin):
    """The compiled decode step of an engine with a large pool (25 pages a layer) holds no `copy` of an array of
    the pools' shape, flat or stacked (there were five: two before the layer scan, three in its body)."""
    e = Engine(builtin, page_size=64, max_batch=1, max_context=1536, kv_dtype="fp32")
    cache, inp = _decode_call(e, 30)
    text = e.steps.decode.lower(e.state, cache(e.cache.pages), inp, sampler="greedy").compile().as_text()
    L, N, G, C = e.cache.pages.shape
    pool_shapes = {f"[{L},{N},{G},{C}]", f"[{L * N},{G},{C}]"}
    copies = [line for line in text.splitlines() if re.search(r"\]\{[0-9,]*\} copy\(", line)]
    assert not [c for c in copies if any(s in c for s in pool_shapes)], "a pool is copied in the decode step"


def test_decode_step_time_follows_the_tokens_not_the_pool(builtin):
    """Per-step decode time at the same position, an engine sized for 48 new tokens against one sized for
    1 500: within 1.3x (the fastest of several steps each, so that a busy machine does not decide)."""

    def fastest_step_ms(new_tokens: int) -> float:
        e = Engine(builtin, page_size=64, max_batch=1, max_context=16 + new_tokens, kv_dtype="fp32")
        cache, inp = _decode_call(e, 15)
        pages, times = e.cache.pages, []
        for _ in range(12):
            t0 = time.perf_counter()
            out, tok = e.steps.decode(e.state, cache(pages), inp, sampler="greedy")
            np.asarray(tok)
            times.append(time.perf_counter() - t0)
            pages = out.pages
        return 1e3 * min(times[2:])

    small, large = fastest_step_ms(48), fastest_step_ms(1500)
    assert large <= 1.3 * small, f"decode step {large:.1f} ms with room for 1500 tokens, {small:.1f} ms for 48"


def _bytes(shape: str) -> int:
    """Bytes of an HLO shape like `f32[5,25,64,576]`."""
    dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", shape).groups()
    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    return n * {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "u8": 1, "s8": 1, "pred": 1}.get(dtype, 8)


@pytest.mark.parametrize("sampler", ["greedy", "filtered"])
def test_decode_loop_program_has_static_loops_no_conditional_and_no_big_copy(builtin, sampler):
    """The compiled multi-step decode program (`models.steps.decode_loop`, 8 steps): every while loop has a
    trip count known at compile time (XLA's GPU while thunk copies the predicate of any other to the host on
    every iteration, blocking the launch stream), no conditional (its predicate goes to the host too), and
    no copy over 1 MB (the pools were copied at every layer; the weights must be read where they are)."""
    B = 2
    e = Engine(builtin, page_size=64, max_batch=B, max_context=1536, kv_dtype="fp32")
    cache, inp = _decode_call(e, 30)
    params = SamplingParams(temperature=0.7, top_p=0.9) if sampler == "filtered" else SamplingParams(temperature=0.0)
    inp = inp._replace(sampling=SamplingArrays.from_params([params] * B))
    lowered = e.steps.decode_loop.lower(
        e.state,
        cache(e.cache.pages),
        inp,
        np.full((B,), 8, np.int32),
        np.full((B, 1), -1, np.int32),
        sampler=sampler,
        num_steps=8,
    )
    text = lowered.compile().as_text()
    whiles = [line for line in text.splitlines() if re.search(r" while\(", line)]
    assert len(whiles) >= 2  # the decode loop and the layer scan, at least
    assert all('known_trip_count":{"n":"' in w for w in whiles), [w[:120] for w in whiles]
    assert " conditional(" not in text
    copies = re.findall(r"= (\w+\[[\d,]*\])\{[\d,]*\} copy\(", text)
    assert not [c for c in copies if _bytes(c) > 1 << 20], copies
