"""The engine's page pool: its size (the capacity planner's pages a sequence holds; where the device says how much
memory it has, the memory plan over the weights, the largest steps' measured temporaries and the pages) and its
placement on a mesh (`models.serving.engine.Engine`).

Dimension letters: N pages, G page size, D data ranks.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec

from mla_jax.capacity import plan_kv_cache
from mla_jax.kv_cache import PagedLatentCache, next_pow2
from mla_jax.memory import (
    MemoryPlan,
    MemoryPlanError,
    device_bytes_in_use,
    device_bytes_limit,
    plan_pool,
    tree_device_bytes,
)
from models.serving.launches import MIXED_TILE
from models.serving.scheduler import _Generation

MIN_PLANNED_CHUNK = 64  # the smallest prefill chunk the memory plan shrinks a default chunk to


def page_pool(
    engine,
    page_format,
    num_pages: int | None,
    cache_fill: float,
    fraction: float,
    device_memory: int | None,
    chunk_is_default: bool = False,
) -> tuple[PagedLatentCache, MemoryPlan | None, dict[str, int]]:
    """The pool of `engine` (its settings, model state and compiled steps set; `page_format` a `PageFormat`) ->
    (the `PagedLatentCache` over every cached layer, the MTP block's included, placed on the engine's mesh; the
    `MemoryPlan` that sized it or None; {step kind: temporary bytes} of the programs the plan measured).
    `num_pages`: the engine's argument (None: max_batch sequences of max_context tokens, or as many as fit).
    `chunk_is_default`: the engine's prefill chunk is its default, which the plan may lower (halving it, down to
    `MIN_PLANNED_CHUNK`) where the largest prefill step's temporaries leave no room for the pages; the engine's
    `prefill_chunk` (and `min_chunk_bucket`) are then set to the chunk that fits."""
    cfg, page_size, D = engine.cfg, engine.page_size, engine.data_ranks
    # The capacity planner's arithmetic: pages a sequence holds, bytes a token over every cached layer.
    kv_plan = plan_kv_cache(
        cfg,
        context_len=engine.max_context,
        num_sequences=engine.max_batch,
        page_size=page_size,
        kv_dtype=page_format.name,
        include_mtp=engine.has_mtp,
        draft_tokens=engine.draft_room,
    )
    make_cache = functools.partial(
        PagedLatentCache,
        num_layers=cfg.num_hidden_layers + (1 if engine.has_mtp else 0),
        page_size=page_size,
        latent_dim=cfg.latent_dim,
        max_seqs=engine.max_batch,
        # A block table also covers the padding queries a verify or mixed step's row has past its last
        # token (the decode kernel counts them in), up to MIXED_TILE - 1 = MAX_DRAFT_TOKENS past max_context.
        max_pages_per_seq=next_pow2(-(-(engine.max_context + MIXED_TILE - 1) // page_size)),
        page_format=page_format,
        fill_value=cache_fill,
        rope_dim=cfg.qk_rope_head_dim,
        ranks=D,
    )
    wanted = engine.max_batch * kv_plan.pages_per_sequence if num_pages is None else num_pages
    temporaries: dict[str, int] = {}
    memory_plan = _plan_memory(
        engine, make_cache, kv_plan, wanted, num_pages, fraction, device_memory, temporaries, chunk_is_default
    )
    cache = make_cache(num_pages=wanted if memory_plan is None else memory_plan.num_pages)
    if engine.mesh is not None:
        # The latent has no head axis to split: every device of a data rank holds all of that rank's
        # pages (the whole pool when data = 1); the pool's N axis is split over the data ranks.
        pool = PartitionSpec(None, engine.data_axes) if D > 1 else PartitionSpec()
        cache.pages = jax.device_put(cache.pages, NamedSharding(engine.mesh, pool))
    return cache, memory_plan, temporaries


def _plan_memory(engine, make_cache, kv_plan, wanted, num_pages, fraction, device_memory, temporaries, adapt):
    """The pool that fits the device (`mla_jax.memory.plan_pool`) -> a `MemoryPlan`, or None where the device
    reports no memory and none was given (a CPU). The largest steps are compiled over an abstract pool of
    `wanted` pages to measure their temporaries (`_Generation.step_temporaries`, into `temporaries`); those
    programs are the ones the engine runs when the plan keeps `wanted` pages. With `adapt` (a default prefill
    chunk), a plan that fails while the prefill step's temporaries are the largest, or a prefill step that cannot
    even compile within the device's memory, is tried again at half the chunk."""
    mesh = engine.mesh
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    limit = device_memory if device_memory is not None else device_bytes_limit(device)
    if limit is None:
        return None
    weights = tree_device_bytes(engine.state)
    in_use = device_bytes_in_use(device) if device_memory is None else weights
    while True:
        shrink = adapt and engine.prefill_chunk // 2 >= MIN_PLANNED_CHUNK
        engine.cache = make_cache(num_pages=wanted, allocate=False)
        try:
            measured = _Generation(engine).step_temporaries()
        except jax.errors.JaxRuntimeError as e:  # XLA could not even compile it in the device's memory
            if not shrink or "RESOURCE_EXHAUSTED" not in str(e) and "Out of memory" not in str(e):
                raise MemoryPlanError(
                    f"the engine's largest steps (prefill chunks of {engine.prefill_chunk} tokens in "
                    f"{engine.max_batch} rows over tables of {engine.max_context} tokens) do not compile within the "
                    f"device's memory ({one_line(e)}): lower max_context, max_batch or prefill_chunk"
                ) from None
            _halve_chunk(engine)
            continue
        finally:
            del engine.cache
        temporaries.clear()
        temporaries.update(measured)
        try:
            return plan_pool(
                device_bytes=limit,
                fraction=fraction,
                weight_bytes=weights,
                other_bytes=max(0, in_use - weights),
                temp_bytes=max(measured.values()),
                page_bytes=kv_plan.mla.bytes_per_token * engine.page_size,
                pages_per_sequence=kv_plan.pages_per_sequence,
                max_batch=engine.max_batch,
                num_pages=num_pages,
                ranks=engine.data_ranks,
                max_context=engine.max_context,
            )
        except MemoryPlanError:
            if not shrink or measured.get("prefill", 0) < max(measured.values()):
                raise
            _halve_chunk(engine)


def _halve_chunk(engine) -> None:
    engine.prefill_chunk //= 2
    engine.min_chunk_bucket = min(engine.min_chunk_bucket, engine.prefill_chunk)


def one_line(e: BaseException) -> str:
    """An error's first line."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
