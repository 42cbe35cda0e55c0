"""The engine plans its memory: the pool sized from the device's bytes, the weights and the measured step
temporaries (`mla_jax.memory`), refused in one line when nothing fits, one arithmetic with `mla-capacity`, and a
request short of pages waits or fails alone while the others are served.

On a CPU the device reports no memory, so these tests give the engine `device_memory` (bytes) to plan for.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import ModelConfig
from mla_jax.capacity import plan_kv_cache
from mla_jax.memory import MemoryPlanError, plan_pool, tree_device_bytes
from mla_jax.weights_plan import weight_bytes
from models import DeepSeekModel
from models.serving import Engine
from pallas_kernels.page_format import resolve_page_format

CFG = ModelConfig.tiny().replace(num_hidden_layers=2)  # one dense layer, one MoE layer, one MTP module
STD = dict(page_size=4, max_batch=4, prefill_chunk=8, kv_dtype=jnp.float32, max_context=64)
MiB = 1 << 20


@pytest.fixture(scope="module")
def model():
    return DeepSeekModel(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def planned(model):
    """An engine with room to spare, and the bytes its plan found."""
    e = Engine(model, device_memory=1 << 34, **STD)
    return e, e.memory_plan


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, CFG.vocab_size, n)] for n in lengths]


def test_plan_pool_arithmetic():
    """The pool is what the budget leaves after weights, temporaries and other bytes, in whole pages per rank
    (an off-by-a-page or a forgotten term, e.g. the temporaries, changes these counts)."""
    kw = dict(device_bytes=1000, fraction=0.5, weight_bytes=100, temp_bytes=50, page_bytes=10, pages_per_sequence=4)
    p = plan_pool(max_batch=8, **kw)  # budget 500, room 350: 35 pages, 32 wanted
    assert (p.budget_bytes, p.room_bytes, p.max_pages, p.num_pages) == (500, 350, 35, 32)
    p = plan_pool(max_batch=100, **kw)  # 400 wanted, 35 fit
    assert p.num_pages == 35
    p = plan_pool(max_batch=100, other_bytes=45, ranks=2, **kw)  # room 305: 30 a rank, 60 in all
    assert (p.max_pages, p.num_pages) == (60, 60)
    assert plan_pool(max_batch=1, num_pages=35, **kw).num_pages == 35
    with pytest.raises(MemoryPlanError, match=r"num_pages=36 needs .* 35 pages fit"):
        plan_pool(max_batch=1, num_pages=36, **kw)
    with pytest.raises(MemoryPlanError, match=r"one sequence of max_context=9 tokens needs .* lower max_context"):
        plan_pool(max_batch=1, max_context=9, **{**kw, "temp_bytes": 370})  # room 30: 3 pages < 4
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="memory_fraction must be a number in"):
            plan_pool(max_batch=1, **{**kw, "fraction": bad})


def test_the_engine_and_the_capacity_planner_agree_on_bytes(model, planned):
    """One arithmetic: the engine's page bytes are `plan_kv_cache`'s bytes a token (every cached layer, the MTP
    layer included) times the page size, and what the pool allocates; `weight_bytes` counts the bytes the
    model's variables hold, bf16 and FP8 alike (an MTP layer or a scale grid left out of either side fails)."""
    e, plan = planned
    fmt = resolve_page_format(jnp.float32, value_dim=CFG.latent_dim, rope_dim=CFG.qk_rope_head_dim)
    kv = plan_kv_cache(CFG, context_len=64, num_sequences=4, page_size=4, kv_dtype=fmt.name, include_mtp=True)
    assert plan.page_bytes == kv.mla.bytes_per_token * 4
    assert e.cache.pages.nbytes == e.num_pages * plan.page_bytes
    assert plan.weight_bytes == tree_device_bytes(nnx.state(model))
    bf16 = DeepSeekModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert tree_device_bytes(nnx.state(bf16)) == weight_bytes(CFG, "bf16")
    fp8 = nnx.eval_shape(
        lambda: DeepSeekModel(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, weights="fp8")
    )
    shapes = nnx.state(fp8)
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)) == weight_bytes(CFG, "fp8")


def test_the_temporaries_are_measured_from_the_compiled_steps(model, planned):
    """The plan's temporaries are the largest of the compiled steps' (`memory_analysis`), and they grow with the
    step's rows: a guessed constant, or a probe that compiled a small step, fails this."""
    e, plan = planned
    assert set(e.step_temporaries) >= {"prefill", "decode"} and plan.temp_bytes == max(e.step_temporaries.values())
    assert plan.temp_bytes > 0
    wide = Engine(model, device_memory=1 << 34, **{**STD, "max_batch": 16, "prefill_chunk": 32})
    assert wide.step_temporaries["prefill"] > 2 * e.step_temporaries["prefill"]


def test_the_default_pool_is_what_fits(model, planned):
    """With room for fewer than max_batch sequences the pool holds what fits (not max_batch x max_context);
    with ample room, max_batch sequences' worth (not the whole device)."""
    e, plan = planned
    assert e.num_pages == 4 * plan.pages_per_sequence
    tight = plan.weight_bytes + plan.temp_bytes + 3 * plan.pages_per_sequence * plan.page_bytes + plan.page_bytes
    small = Engine(model, device_memory=int(tight / 0.9) + 1, **STD)
    assert small.num_pages == 3 * plan.pages_per_sequence + 1


def test_an_engine_that_cannot_hold_one_sequence_is_refused_in_one_line(model, planned):
    """No engine that would die out of memory mid-run: construction refuses, naming the bytes and what to change."""
    e, plan = planned
    short = int((plan.weight_bytes + plan.temp_bytes + plan.page_bytes) / 0.9)
    with pytest.raises(MemoryPlanError) as err:
        Engine(model, device_memory=short, **STD)
    msg = str(err.value)
    assert "\n" not in msg and "one sequence of max_context=64 tokens needs" in msg and "lower max_context" in msg
    # room for one page fewer than asked (the planned engine's pool: its steps, measured over that many pages,
    # are compiled; another pool size would compile its largest steps again to measure them)
    n = e.num_pages
    one_short = int((plan.weight_bytes + plan.temp_bytes + (n - 0.5) * plan.page_bytes) / 0.9)
    with pytest.raises(MemoryPlanError, match=rf"num_pages={n} needs .* {n - 1} pages fit"):
        Engine(model, device_memory=one_short, num_pages=n, **STD)
    with pytest.raises(ValueError, match=r"Engine memory_fraction must be a number in \(0, 1\], got 2"):
        Engine(model, memory_fraction=2, **STD)
    with pytest.raises(ValueError, match="Engine device_memory must be a positive number of bytes"):
        Engine(model, device_memory=-1, **STD)


def test_no_plan_where_the_device_reports_no_memory(model):
    """A CPU reports no allocator limit: the pool is max_batch sequences' worth, as before, and nothing compiles
    at construction."""
    e = Engine(model, **STD)
    assert e.memory_plan is None and e.step_temporaries == {} and e.num_pages == 4 * 17 and e.compile_log == []


def test_a_request_short_of_pages_fails_alone_and_the_others_are_served(model, planned):
    """A pool planned for two sequences of max_context, four requests that grow past it together: a request
    that cannot get its next pages fails alone in one line ("KV cache full"), every other one makes the tokens it
    makes alone, every page comes back, and the engine serves the next call in full."""
    _, plan = planned
    room = plan.weight_bytes + plan.temp_bytes + 2 * plan.pages_per_sequence * plan.page_bytes
    e = Engine(model, device_memory=int(room / 0.9) + 1, **STD)
    assert e.num_pages == 2 * plan.pages_per_sequence
    prompts = _prompts(0, (40, 33, 45, 38))
    res = e.generate(prompts, max_new_tokens=20)
    failed = [i for i, err in enumerate(res.errors) if err is not None]
    assert 0 < len(failed) < 4
    for i, (p, got) in enumerate(zip(prompts, res.tokens)):
        if i in failed:
            assert res.finish_reasons[i] == "error" and "KV cache full" in res.errors[i]
            assert "\n" not in res.errors[i]
        else:  # alone, on the same engine (one request fits its pool): no other pool's steps to compile
            assert res.finish_reasons[i] == "length" and e.generate([p], max_new_tokens=20).tokens[0] == got
    assert e.cache.pages_used == 0
    assert e.generate(prompts[:2], max_new_tokens=20).errors == [None, None]


def test_a_benchmark_model_too_large_for_the_device_is_refused_before_it_is_built(monkeypatch):
    """`mla-bench e2e --quick`'s V3 cut in bf16 on an 80 GB card: refused in one line naming the bytes, before a
    single weight is allocated (it died out of memory while building); FP8 weights priced as the release's."""
    from benchmarks import e2e_models
    from mla_jax.memory import check_weights_fit

    with pytest.raises(MemoryPlanError, match=r"the bf16 weights need 1.0 MiB; the device offers 0.9 MiB"):
        check_weights_fit(1 << 20, 1 << 20, what="the bf16 weights")
    check_weights_fit(1 << 40, None)  # a CPU: nothing to check
    cfg = ModelConfig.tiny()
    monkeypatch.setattr(e2e_models, "device_bytes_limit", lambda: weight_bytes(cfg, "bf16"))
    built = []
    monkeypatch.setattr(e2e_models, "DeepSeekModel", lambda *a, **k: built.append(1))
    with pytest.raises(MemoryPlanError, match="the bf16 weights need") as err:
        e2e_models.build_model(cfg, jnp.bfloat16)
    assert "\n" not in str(err.value) and not built
    fp8 = cfg.replace(kv_lora_rank=128)
    monkeypatch.setattr(e2e_models, "device_bytes_limit", lambda: weight_bytes(fp8, "fp8"))
    with pytest.raises(MemoryPlanError, match="the fp8 weights need"):
        e2e_models.build_model(fp8, jnp.bfloat16, weights="fp8")


def test_a_default_prefill_chunk_shrinks_until_the_pool_fits(model, planned):
    """Where the largest prefill step's temporaries leave no room for the pages, a default chunk is halved until
    they do (the V3 cut at 32 rows: 31 GiB of temporaries at 512 tokens a row refused every pool of an 80 GB
    card); an explicit chunk is kept and the engine refused."""
    _, plan = planned
    default = {k: v for k, v in STD.items() if k != "prefill_chunk"}
    big = Engine(model, device_memory=1 << 34, **default)  # the default chunk on a CPU: 512 tokens
    assert big.prefill_chunk == 512
    temps = big.step_temporaries
    allowed = max(temps["mixed"], temps["decode"], int(temps["prefill"] * 0.6))  # not a 512-token prefill's
    assert allowed < temps["prefill"]
    room = plan.weight_bytes + 4 * plan.pages_per_sequence * plan.page_bytes + allowed
    pages = 4 * plan.pages_per_sequence
    e = Engine(model, device_memory=int(room / 0.9) + 1, num_pages=pages, **default)
    assert 64 <= e.prefill_chunk < 512 and e.min_chunk_bucket <= e.prefill_chunk
    assert max(e.step_temporaries.values()) <= allowed
    assert e.generate(_prompts(3, (60,)), max_new_tokens=4).errors == [None]
    with pytest.raises(MemoryPlanError, match="num_pages="):
        Engine(model, device_memory=int(room / 0.9) + 1, num_pages=pages, prefill_chunk=512, **default)


def test_a_prefill_step_that_cannot_compile_in_the_device_shrinks_or_is_refused(model, monkeypatch):
    """XLA failing to compile the largest prefill in the device's memory (its autotuner asked 128 GiB for the V3
    cut's 65 536-token tables at 32 rows): a default chunk is halved and tried again; an explicit one is refused in
    one line naming the step, not an XLA traceback."""
    from models.serving import pool

    real = pool._Generation.step_temporaries

    def fake(self, *a, **k):
        if self.e.prefill_chunk > 128:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 128.02GiB\nmore"
            )
        return real(self, *a, **k)

    monkeypatch.setattr(pool._Generation, "step_temporaries", fake)
    default = {k: v for k, v in STD.items() if k != "prefill_chunk"}
    assert Engine(model, device_memory=1 << 34, **default).prefill_chunk == 128
    with pytest.raises(MemoryPlanError) as err:
        Engine(model, device_memory=1 << 34, prefill_chunk=512, **default)
    msg = str(err.value)
    assert "\n" not in msg and "prefill chunks of 512 tokens in 4 rows" in msg and "128.02GiB" in msg
